//! A throwaway PKI for TLS tests: a CA, a server certificate for `allot.test`, `localhost` and
//! 127.0.0.1, and a client certificate, all signed by the CA and written as PEM files in a temp dir.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// The host name the server certificate is for (resolve it to the server's address).
pub const TEST_SERVER_NAME: &str = "allot.test";

/// PEM files of a test PKI; removed with the value.
pub struct TestPki {
    dir: tempfile::TempDir,
}

impl TestPki {
    /// Generates the CA, server and client certificates. A second, unrelated CA signs
    /// [`TestPki::stranger_cert`], a client certificate the first CA does not vouch for.
    pub fn generate() -> Self {
        let dir = tempfile::tempdir().expect("temp dir for the PKI");
        let write = |name: &str, text: String| {
            std::fs::write(dir.path().join(name), text).expect("write PEM file");
        };
        let (ca_pem, ca) = authority("Allot test CA");
        write("ca.pem", ca_pem);
        let server_key = KeyPair::generate().expect("key");
        let mut server = CertificateParams::new(vec![
            TEST_SERVER_NAME.to_owned(),
            "localhost".to_owned(),
            "127.0.0.1".to_owned(),
        ])
        .expect("server params");
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server_cert = server.signed_by(&server_key, &ca).expect("sign server");
        write("server.pem", server_cert.pem());
        write("server-key.pem", server_key.serialize_pem());
        let client_key = KeyPair::generate().expect("key");
        let client_cert = client_params("agent-eu")
            .signed_by(&client_key, &ca)
            .expect("sign client");
        write("client.pem", client_cert.pem());
        write("client-key.pem", client_key.serialize_pem());
        let (_, stranger_ca) = authority("Someone else's CA");
        let stranger_key = KeyPair::generate().expect("key");
        let stranger = client_params("stranger")
            .signed_by(&stranger_key, &stranger_ca)
            .expect("sign stranger");
        write("stranger.pem", stranger.pem());
        write("stranger-key.pem", stranger_key.serialize_pem());
        Self { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The folder holding the files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
    /// The CA certificate.
    pub fn ca(&self) -> PathBuf {
        self.path("ca.pem")
    }
    /// The server certificate.
    pub fn server_cert(&self) -> PathBuf {
        self.path("server.pem")
    }
    /// The server key.
    pub fn server_key(&self) -> PathBuf {
        self.path("server-key.pem")
    }
    /// A client certificate signed by the CA.
    pub fn client_cert(&self) -> PathBuf {
        self.path("client.pem")
    }
    /// Its key.
    pub fn client_key(&self) -> PathBuf {
        self.path("client-key.pem")
    }
    /// A client certificate signed by another CA.
    pub fn stranger_cert(&self) -> PathBuf {
        self.path("stranger.pem")
    }
    /// Its key.
    pub fn stranger_key(&self) -> PathBuf {
        self.path("stranger-key.pem")
    }
}

fn authority(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let key = KeyPair::generate().expect("CA key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let cert = params.self_signed(&key).expect("self-sign CA");
    (cert.pem(), Issuer::new(params, key))
}

fn client_params(name: &str) -> CertificateParams {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("client params");
    params.distinguished_name.push(DnType::CommonName, name);
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    params
}
