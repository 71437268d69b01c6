//! The accept loop both services serve through, with a bound on everything a client can hold.
//!
//! `axum::serve` has no bound on connections and no deadline for a client that connects and then
//! says nothing, or sends its headers a byte at a time (slow loris): each such client holds a task
//! and a socket for ever. Here every connection holds a permit (at most
//! [`ServeLimits::max_connections`]; past it, new connections wait in the kernel's backlog), a TLS
//! handshake must finish within [`ServeLimits::tls_handshake_timeout`], the first bytes and every
//! request's headers must arrive within [`ServeLimits::header_read_timeout`], and a connection with
//! no traffic either way for [`ServeLimits::idle_timeout`] is closed (HTTP/1 keep-alive and HTTP/2
//! alike; the server sends no HTTP/2 pings, so an idle connection is one nobody uses). At shutdown,
//! requests in flight get [`ServeLimits::shutdown_grace`], then every connection is dropped.
//!
//! With mutual TLS ([`ServerTls::client_ca`](crate::ServerTls::client_ca)) a certificate is optional
//! in the handshake but required for every request except the probe paths ([`PROBE_PATHS`]), so
//! orchestrators' health checks and Prometheus need none. A presented certificate the CA did not
//! sign fails the handshake.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::response::IntoResponse;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Semaphore;
use tokio::time::{Instant, Sleep};

use crate::listen::Listener;
use crate::tls::TlsServing;

/// Paths served without a client certificate under mutual TLS: liveness, readiness, metrics.
pub const PROBE_PATHS: [&str; 3] = ["/healthz", "/readyz", "/metrics"];

/// Bounds on what clients can hold open (I10).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeLimits {
    /// Most connections open at once; more wait in the listen backlog.
    pub max_connections: usize,
    /// Longest a TLS handshake may take.
    pub tls_handshake_timeout: Duration,
    /// Longest a client may take to send its first bytes, and (HTTP/1) each request's headers.
    pub header_read_timeout: Duration,
    /// A connection with no bytes read or written for this long is closed.
    pub idle_timeout: Duration,
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
            idle_timeout: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

/// A stream that fails with `TimedOut` once it has carried no bytes for its deadline: the first
/// deadline until the first byte arrives, the idle one after.
///
/// Every read and write only notes the time (this is on every admit's path); the timer is moved
/// only when it fires early, so the timer wheel is touched about once per idle period, not per I/O.
struct Deadlined<S> {
    inner: S,
    deadline: Pin<Box<Sleep>>,
    idle: Duration,
    /// When bytes last moved; `None` until the first.
    last_activity: Option<Instant>,
}

impl<S> Deadlined<S> {
    fn new(inner: S, first_bytes: Duration, idle: Duration) -> Self {
        Self {
            inner,
            deadline: Box::pin(tokio::time::sleep(first_bytes)),
            idle,
            last_activity: None,
        }
    }

    // Connection deadlines are transport timing on tokio's clock, not decision time (architecture
    // invariant 1 is about the latter).
    #[allow(clippy::disallowed_methods)]
    fn touched(&mut self) {
        self.last_activity = Some(Instant::now());
    }

    /// Whether the deadline has passed; re-arms the timer when activity since its start moved it.
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        loop {
            if self.deadline.as_mut().poll(cx).is_pending() {
                return false;
            }
            let Some(last) = self.last_activity else {
                return true;
            };
            let due = last + self.idle;
            if due <= self.deadline.deadline() {
                return true;
            }
            // Polled again on the next turn of the loop, so the waker is registered.
            self.deadline.as_mut().reset(due);
        }
    }
}

fn timed_out() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::TimedOut, "connection deadline passed")
}

impl<S: AsyncRead + Unpin> AsyncRead for Deadlined<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    self.touched();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
            Poll::Pending if self.expired(cx) => Poll::Ready(Err(timed_out())),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Deadlined<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match Pin::new(&mut self.inner).poll_write(cx, data) {
            Poll::Ready(Ok(written)) => {
                if written > 0 {
                    self.touched();
                }
                Poll::Ready(Ok(written))
            }
            Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
            Poll::Pending if self.expired(cx) => Poll::Ready(Err(timed_out())),
            Poll::Pending => Poll::Pending,
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// `app`, refusing every request but the probe paths (mutual TLS without a client certificate).
fn certificate_required(app: Router) -> Router {
    app.layer(axum::middleware::from_fn(
        |request: axum::extract::Request, next: axum::middleware::Next| async move {
            if PROBE_PATHS.contains(&request.uri().path()) {
                return next.run(request).await;
            }
            let body = r#"{"type":"about:blank","title":"Unauthorized","status":401,"detail":"a client certificate signed by the configured CA is required"}"#;
            (
                axum::http::StatusCode::UNAUTHORIZED,
                [(
                    axum::http::header::CONTENT_TYPE,
                    crate::problem::PROBLEM_CONTENT_TYPE,
                )],
                body,
            )
                .into_response()
        },
    ))
}

/// Serves `app` on `listener` (TCP or a Unix domain socket; through TLS when `tls` is given) until
/// `shutdown` resolves; then stops
/// accepting, lets requests in flight finish for up to [`ServeLimits::shutdown_grace`], drops every
/// connection left and returns. HTTP/1.1 and HTTP/2 (prior knowledge, or ALPN over TLS) are served.
/// Long by design: the accept loop and its shutdown together, so every bound it applies is seen in
/// one place.
pub async fn serve(
    listener: impl Into<Listener>,
    app: Router,
    tls: Option<TlsServing>,
    limits: ServeLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    debug_assert!(limits.max_connections > 0);
    let listener = listener.into();
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut connections = tokio::task::JoinSet::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    // Only the certificate-less variant differs; build both once.
    let restricted = certificate_required(app.clone());
    tokio::pin!(shutdown);
    loop {
        while connections.try_join_next().is_some() {}
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
                Ok(stream) => stream,
                Err(error) => {
                    // Out of descriptors, or a connection reset before it was accepted: back off
                    // briefly rather than spin.
                    tracing::debug!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let builder = builder.clone();
        let watcher = graceful.watcher();
        let tls = tls.clone();
        let (app, restricted) = (app.clone(), restricted.clone());
        connections.spawn(async move {
            let _permit = permit;
            match tls {
                None => {
                    let stream =
                        Deadlined::new(stream, limits.header_read_timeout, limits.idle_timeout);
                    let connection = builder
                        .serve_connection_with_upgrades(
                            TokioIo::new(stream),
                            TowerToHyperService::new(app),
                        )
                        .into_owned();
                    if let Err(error) = watcher.watch(connection).await {
                        tracing::debug!(%error, "connection ended with an error");
                    }
                }
                Some(tls) => {
                    let handshake = tls.acceptor.accept(stream);
                    let stream =
                        match tokio::time::timeout(limits.tls_handshake_timeout, handshake).await {
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
                    let certified = stream
                        .get_ref()
                        .1
                        .peer_certificates()
                        .is_some_and(|certificates| !certificates.is_empty());
                    let app = if tls.require_client_certificate && !certified {
                        restricted
                    } else {
                        app
                    };
                    let stream =
                        Deadlined::new(stream, limits.header_read_timeout, limits.idle_timeout);
                    let connection = builder
                        .serve_connection_with_upgrades(
                            TokioIo::new(stream),
                            TowerToHyperService::new(app),
                        )
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
            tracing::warn!(grace = ?limits.shutdown_grace, "connections still open at the end of the shutdown grace; dropping them");
        }
    }
    connections.abort_all();
    while connections.join_next().await.is_some() {}
    Ok(())
}
