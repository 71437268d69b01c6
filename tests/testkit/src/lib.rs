//! Real etcd and Redis servers for Allot's integration tests.
//!
//! Allot's correctness lives in what etcd transactions and Redis scripts do under
//! failover, so its integration tests run against the real servers, not fakes.
//! This crate starts them from the binaries on `PATH` and stops them:
//!
//! - [`EtcdCluster`]: one etcd member ([`EtcdCluster::single`]) or a cluster
//!   ([`EtcdCluster::start`]) whose members can be stopped and restarted.
//! - [`RedisServer`]: one `redis-server`.
//! - [`RedisCluster`]: a Redis Cluster of masters whose nodes can be stopped and
//!   restarted.
//! - [`FaultProxy`]: a TCP proxy that passes, refuses or holds traffic and adds
//!   latency, for partitions between real processes.
//! - [`ChromeDriver`]: `chromedriver` and the headless `chromium` it drives, for the operator
//!   console's browser tests.
//! - [`Nginx`]: a real `nginx` in the foreground, for the tests of Allot as nginx's
//!   `auth_request` service.
//! - [`validate_openapi`] and [`schemathesis`]: outside tools (PyPI) that judge a service's
//!   OpenAPI document and the running service against it.
//! - [`workspace_binary`]: this workspace's own binaries, to run as processes.
//!
//! # Guarantees
//!
//! - **Isolated.** Every server listens on kernel-chosen free loopback ports and
//!   keeps its files in its own temp dir, so tests run in parallel (cargo nextest
//!   runs each in its own process) and never touch the machine's own services.
//! - **Ready when returned.** Constructors and restarts return only once the
//!   servers answer (etcd `/health`, Redis `PING` / `CLUSTER INFO`), polling
//!   against a deadline; they never sleep a fixed time and hope.
//! - **Loud.** A missing binary panics with the Debian package to install
//!   ([`MissingBinary`]); a server that fails to come up panics with the tail of
//!   its log. Nothing is ever skipped.
//! - **Cleaned up.** Dropping a topology kills (SIGKILL) and reaps its processes,
//!   then deletes its temp dir. `Drop` runs when a test panics, too; and if the
//!   test process is killed outright, the kernel kills the servers
//!   (`PR_SET_PDEATHSIG`).
//!
//! # Using it
//!
//! The API is synchronous (plain `std`), so sync tests and `#[tokio::test]`s use
//! it alike. It blocks while waiting for servers; in an async test that briefly
//! blocks the runtime thread, which is harmless for a test.
//!
//! Start servers on the test's own thread and own them for the test's duration.
//! Linux delivers `PR_SET_PDEATHSIG` when the *thread* that spawned a server
//! exits, so a server started on a short-lived thread (a `spawn_blocking`
//! worker, a helper thread) or kept in a `static` shared by tests dies early.
//!
//! Binaries come from `PATH`, or from `ALLOT_ETCD_BIN`, `ALLOT_REDIS_SERVER_BIN`
//! and `ALLOT_REDIS_CLI_BIN` (and so on, one per [`Binary`]) when set ([`Binary::override_var`]).

mod api_checks;
mod binary;
mod browser;
mod etcd;
mod net;
mod nginx;
mod pki;
mod process;
mod proxy;
mod redis;
mod workspace;

pub use api_checks::{
    SchemathesisRun, check_openapi_document, documented_operations, routed_operations,
    schemathesis, validate_openapi,
};
pub use binary::{Binary, MissingBinary};
pub use browser::ChromeDriver;
pub use etcd::EtcdCluster;
pub use nginx::Nginx;
pub use pki::{TEST_SERVER_NAME, TestPki};
pub use process::{log_tail, process_cpu_seconds, resident_bytes, threads_cpu_seconds};
pub use proxy::{FaultProxy, MAX_CONNECTIONS, ProxyMode};
pub use redis::{RedisCluster, RedisServer};
pub use workspace::workspace_binary;
