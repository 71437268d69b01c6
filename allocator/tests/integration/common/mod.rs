//! Shared test support: the real allocator server, in-process, on the embedded store and a temporary
//! SQLite ledger.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use allot_allocator::clock::{Clock, SystemClock};
use allot_allocator::http::Tokens;
use allot_allocator::kv::memory::MemoryKv;
use allot_allocator::ledger::Ledger;
use allot_allocator::server::{Settings, run};

pub const OPERATOR: &str = "operator-token-for-tests-0001";
pub const AGENT: &str = "agent-token-for-tests-000001";
/// An operator token with the viewer role.
pub const VIEWER: &str = "viewer-token-for-tests-00001";
/// An operator token with the author role.
pub const AUTHOR: &str = "author-token-for-tests-00001";
/// An agent token scoped to region `eu`.
pub const AGENT_EU: &str = "agent-eu-token-for-tests-001";

pub struct Server {
    pub url: String,
    pub client: reqwest::Client,
    /// The allocator's ledger, to write what agents would have reported.
    #[allow(dead_code)]
    pub ledger: Ledger,
    _stop: tokio::sync::oneshot::Sender<()>,
    _dir: tempfile::TempDir,
}

/// What a test changes of the allocator's settings.
#[derive(Default)]
pub struct Options {
    /// The CAs webhook deliveries trust.
    pub webhook_ca: Option<std::path::PathBuf>,
    /// Whether webhooks may reach this machine's loopback receivers.
    pub webhook_allow_private: bool,
    /// etcd endpoints to run on (none: the embedded store).
    pub etcd: Vec<String>,
    /// The agents' pepper, to hash principals overrides name.
    pub pepper: Option<allot_shared::keys::Pepper>,
}

pub async fn start() -> Server {
    start_with(Options::default()).await
}

pub async fn start_with(options: Options) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let tokens = Tokens {
        operator: vec![
            OPERATOR.to_owned(),
            format!("viewer {VIEWER}"),
            format!("author {AUTHOR}"),
        ],
        agent: vec![AGENT.to_owned(), format!("eu {AGENT_EU}")],
    };
    let settings = Settings {
        etcd: options.etcd.clone(),
        webhook_ca: options.webhook_ca,
        webhook_allow_private: options.webhook_allow_private,
        pepper: options.pepper,
        ..Settings::local(addr, tokens, "test")
    };
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let kv: Arc<dyn allot_allocator::kv::Kv> = if options.etcd.is_empty() {
        Arc::new(MemoryKv::new(clock.clone()))
    } else {
        Arc::new(
            allot_allocator::kv::etcd::EtcdKv::connect(&options.etcd)
                .await
                .expect("etcd"),
        )
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = Ledger::connect(&format!(
        "sqlite://{}",
        dir.path().join("ledger.db").display()
    ))
    .await
    .expect("ledger");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(run(
        settings,
        kv,
        ledger.clone(),
        clock,
        listener,
        async move {
            let _ = stopped.await;
        },
    ));
    let server = Server {
        url: format!("http://{addr}"),
        client: reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(5))
            .build()
            .expect("http client"),
        ledger,
        _stop: stop,
        _dir: dir,
    };
    for _ in 0..200 {
        if let Ok(r) = server
            .client
            .get(format!("{}/readyz", server.url))
            .send()
            .await
            && r.status() == 200
        {
            return server;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the allocator never became ready");
}
