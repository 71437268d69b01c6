//! Running an agent once it is assembled: its gateway listeners (the HTTP API and, when given, the
//! gRPC services Envoy calls) and its background loops (reports, renewals, policy), until
//! shutdown. The `region-agent` binary and `allot dev` both run agents through [`run`].

use std::sync::Arc;
use std::time::Duration;

use crate::http::AgentApi;
use crate::service::Agent;

/// How often the agent reports to the ledger.
pub const REPORT_EVERY: Duration = Duration::from_secs(1);
/// How often the agent asks for its region's policy bundle.
pub const POLICY_EVERY: Duration = Duration::from_secs(5);

/// Where the agent serves gateways: TCP, or Unix domain sockets for gateways on its host.
pub struct Listeners {
    /// The HTTP API.
    pub http: allot_net::Listener,
    /// Envoy's rate limit service and rate limit quota service (none: not served).
    pub grpc: Option<allot_net::Listener>,
}

/// How the agent serves them.
pub struct Serving {
    /// The gateway bearer tokens accepted.
    pub gateway_tokens: Vec<String>,
    /// TLS on both listeners (none: plain TCP).
    pub tls: Option<allot_net::TlsServing>,
    /// What `/metrics` renders (none: 503).
    pub metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
}

/// Serves `agent` on `listeners` and runs its background loops until `shutdown` resolves; then
/// stops taking requests, finishes those in flight, and stops the loops after the servers (so
/// the last admissions are still reported). `Err` names the listener that failed.
pub async fn run(
    agent: Arc<Agent>,
    listeners: Listeners,
    serving: Serving,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let (stop_servers, servers_stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_servers.send(true);
    });
    let until = move |mut stopped: tokio::sync::watch::Receiver<bool>| async move {
        let _ = stopped.wait_for(|s| *s).await;
    };
    let (stop_background, background_stopped) = tokio::sync::watch::channel(false);
    let background = tokio::spawn(agent.clone().run_background(
        REPORT_EVERY,
        POLICY_EVERY,
        until(background_stopped),
    ));
    let api = AgentApi {
        agent,
        gateway_tokens: Arc::new(serving.gateway_tokens),
        metrics: serving.metrics,
    };
    let http = crate::http::serve(
        listeners.http,
        api.clone(),
        serving.tls.clone(),
        until(servers_stopped.clone()),
    );
    let grpc = async {
        match listeners.grpc {
            Some(listener) => {
                crate::grpc::serve_grpc(
                    listener,
                    api.clone(),
                    serving.tls.clone(),
                    until(servers_stopped.clone()),
                )
                .await
            }
            None => Ok(()),
        }
    };
    let served = tokio::try_join!(
        async { http.await.map_err(|e| format!("http: {e}")) },
        async { grpc.await.map_err(|e| format!("grpc: {e}")) },
    );
    let _ = stop_background.send(true);
    let _ = background.await;
    served.map(|_| ())
}
