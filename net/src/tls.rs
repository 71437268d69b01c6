//! TLS with rustls: server configs from PEM files, optional mutual TLS, and client settings.
//!
//! aws-lc-rs is the only crypto provider compiled into the workspace, so rustls and reqwest select
//! it without being told. Errors name the file at fault.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// A TLS setup that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or holds no usable PEM.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// rustls refused the combination (key does not match the certificate, bad CA...).
    #[error("TLS configuration: {0}")]
    Config(String),
}

fn file_error(path: &Path, message: impl ToString) -> TlsError {
    TlsError::File {
        path: path.to_owned(),
        message: message.to_string(),
    }
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(path, e))?;
    if certs.is_empty() {
        return Err(file_error(path, "no PEM certificate in the file"));
    }
    Ok(certs)
}

fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| file_error(path, format!("no usable PEM private key: {e}")))
}

/// Where a server's TLS material is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTls {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key of the leaf.
    pub key: PathBuf,
    /// PEM CA certificates; when set, every request but the probe paths must come over a
    /// connection whose client presented a certificate signed by one of them (mutual TLS).
    pub client_ca: Option<PathBuf>,
}

/// What [`serve`](fn@crate::serve) needs to terminate TLS.
#[derive(Clone)]
pub struct TlsServing {
    /// The handshake.
    pub acceptor: tokio_rustls::TlsAcceptor,
    /// Whether requests other than the probe paths need a client certificate.
    pub require_client_certificate: bool,
}

impl ServerTls {
    /// The settings from the `--tls-cert`, `--tls-key` and `--tls-client-ca` flags both services
    /// take: none, or a checked configuration (files read now, so a bad one stops the start naming
    /// it), or a one-line error.
    pub fn from_flags(
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        client_ca: Option<PathBuf>,
    ) -> Result<Option<Self>, String> {
        let tls = match (cert, key, client_ca) {
            (None, None, None) => return Ok(None),
            (Some(cert), Some(key), client_ca) => Self {
                cert,
                key,
                client_ca,
            },
            _ => {
                return Err(
                    "--tls-cert and --tls-key go together (and --tls-client-ca needs both)"
                        .to_owned(),
                );
            }
        };
        tls.server_config().map_err(|e| format!("TLS: {e}"))?;
        Ok(Some(tls))
    }

    /// Builds the rustls server config: TLS 1.2 and 1.3, ALPN `h2` then `http/1.1`.
    pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let certs = certificates(&self.cert)?;
        let key = private_key(&self.key)?;
        let builder = rustls::ServerConfig::builder();
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(path) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in certificates(path)? {
                    roots.add(cert).map_err(|e| file_error(path, e))?;
                }
                // Optional in the handshake (probes need none); required per request by serve.
                let verifier = WebPkiClientVerifier::builder(Arc::new(roots))
                    .allow_unauthenticated()
                    .build()
                    .map_err(|e| file_error(path, e))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder
            .with_single_cert(certs, key)
            .map_err(|e| TlsError::Config(e.to_string()))?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    /// What [`serve`](fn@crate::serve) takes to terminate TLS with these files.
    pub fn acceptor(&self) -> Result<TlsServing, TlsError> {
        Ok(TlsServing {
            acceptor: tokio_rustls::TlsAcceptor::from(self.server_config()?),
            require_client_certificate: self.client_ca.is_some(),
        })
    }
}

/// How a client reaches a TLS server: which CAs it trusts and the certificate it presents.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientTls {
    /// PEM CA certificates to trust instead of the system's roots.
    pub ca: Option<PathBuf>,
    /// PEM certificate chain to present (mutual TLS); needs `key`.
    pub cert: Option<PathBuf>,
    /// PEM private key of `cert`.
    pub key: Option<PathBuf>,
}

impl ClientTls {
    /// Applies these settings to a `reqwest` client builder.
    pub fn configure(
        &self,
        mut builder: reqwest::ClientBuilder,
    ) -> Result<reqwest::ClientBuilder, TlsError> {
        if let Some(path) = &self.ca {
            let pem = std::fs::read(path).map_err(|e| file_error(path, e))?;
            let certs =
                reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| file_error(path, e))?;
            if certs.is_empty() {
                return Err(file_error(path, "no PEM certificate in the file"));
            }
            builder = builder.tls_certs_only(certs);
        }
        match (&self.cert, &self.key) {
            (None, None) => {}
            (Some(cert), Some(key)) => {
                // Checked with rustls first, so a bad file is named.
                certificates(cert)?;
                private_key(key)?;
                let mut pem = std::fs::read(cert).map_err(|e| file_error(cert, e))?;
                pem.push(b'\n');
                pem.extend(std::fs::read(key).map_err(|e| file_error(key, e))?);
                let identity =
                    reqwest::Identity::from_pem(&pem).map_err(|e| file_error(cert, e))?;
                builder = builder.identity(identity);
            }
            _ => {
                return Err(TlsError::Config(
                    "a client certificate needs both its certificate and its key".to_owned(),
                ));
            }
        }
        Ok(builder)
    }
}
