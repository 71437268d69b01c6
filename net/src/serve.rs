//! The accept loop both services serve through, with a bound on everything a client can hold.
//!
//! `axum::serve` has no bound on connections and no deadline for a client that opens a connection
//! and sends its headers a byte at a time (slow loris): each such client holds a task and a socket
//! for ever. Here every connection holds a permit (at most [`ServeLimits::max_connections`]; past it,
//! new connections wait in the kernel's backlog), a TLS handshake must finish within
//! [`ServeLimits::tls_handshake_timeout`], and request headers must arrive within
//! [`ServeLimits::header_read_timeout`] (the connection is closed otherwise). Request bodies, request
//! time and request concurrency stay with each router's own tower layers.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Bounds on what clients can hold open (I10).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeLimits {
    /// Most connections open at once; more wait in the listen backlog.
    pub max_connections: usize,
    /// Longest a TLS handshake may take.
    pub tls_handshake_timeout: Duration,
    /// Longest a client may take to send a request's headers (HTTP/1), including the first request
    /// of a connection and every later one on a kept-alive connection.
    pub header_read_timeout: Duration,
    /// How long in-flight requests get to finish at shutdown.
    pub shutdown_grace: Duration,
}

/// Default [`ServeLimits::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 4_096;

impl Default for ServeLimits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            tls_handshake_timeout: Duration::from_secs(10),
            header_read_timeout: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

/// Serves `app` on `listener` (through TLS when `tls` is given) until `shutdown` resolves; then stops
/// accepting, lets requests in flight finish for up to [`ServeLimits::shutdown_grace`], and returns.
/// HTTP/1.1 and HTTP/2 (prior knowledge, or ALPN over TLS) are both served.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<tokio_rustls::TlsAcceptor>,
    limits: ServeLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    debug_assert!(limits.max_connections > 0);
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(Duration::from_secs(20)))
        .keep_alive_timeout(Duration::from_secs(20));
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            () = &mut shutdown => break,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    // Out of descriptors, or a connection reset before it was accepted: back off
                    // briefly rather than spin.
                    tracing::debug!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let builder = builder.clone();
        let watcher = graceful.watcher();
        let tls = tls.clone();
        let handshake_timeout = limits.tls_handshake_timeout;
        tokio::spawn(async move {
            let _permit = permit;
            match tls {
                None => {
                    let connection = builder
                        .serve_connection_with_upgrades(TokioIo::new(stream), service)
                        .into_owned();
                    if let Err(error) = watcher.watch(connection).await {
                        tracing::debug!(%error, "connection ended with an error");
                    }
                }
                Some(acceptor) => {
                    let stream = match tokio::time::timeout(
                        handshake_timeout,
                        acceptor.accept(stream),
                    )
                    .await
                    {
                        Ok(Ok(stream)) => stream,
                        Ok(Err(error)) => {
                            tracing::debug!(%error, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!("TLS handshake timed out");
                            return;
                        }
                    };
                    let connection = builder
                        .serve_connection_with_upgrades(TokioIo::new(stream), service)
                        .into_owned();
                    if let Err(error) = watcher.watch(connection).await {
                        tracing::debug!(%error, "connection ended with an error");
                    }
                }
            }
        });
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(limits.shutdown_grace) => {
            tracing::warn!(grace = ?limits.shutdown_grace, "connections still open at the end of the shutdown grace");
        }
    }
    Ok(())
}
