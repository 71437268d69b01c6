//! An axum service whose every request the region agent admits first, through `AllotLayer`.
//!
//! ```sh
//! ALLOT_AGENT_URL=https://agent.eu.internal:7701 ALLOT_AGENT_CA=/etc/allot/ca.pem \
//! ALLOT_GATEWAY_TOKEN_FILE=/run/secrets/allot-gateway-token \
//! ALLOT_API_KEYS='key-one=client-1,key-two=client-2' ALLOT_TENANT=atlas \
//!   cargo run -p allot-client --example service -- 127.0.0.1:3000
//! ```
//!
//! Callers present `X-Api-Key`; a listed key is the verified client (principal `api_key`), any
//! other caller is anonymous (principal `ip`, its address). `GET /reports` is a `read`,
//! `POST /exports` holds a concurrency slot until its response ends, and `POST /summaries` is
//! metered: it charges 1 up front and states its actual cost (the length of its answer) at the
//! end.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use allot_client::{
    Admission, AgentClient, AllotLayer, FailMode, MeteredCost, Principal, PrincipalType,
    RouteGroup, TenantId,
};
use axum::extract::{ConnectInfo, Extension};
use axum::routing::{get, post};

/// Reads a setting from the environment, or says which one is missing.
fn setting(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|_| format!("set {name}"))
}

/// The verified identity: the client an API key names, else the caller's address.
fn identify(
    keys: &HashMap<String, String>,
    tenant: &TenantId,
    parts: &http::request::Parts,
) -> Option<Admission> {
    let client = parts
        .headers
        .get("x-api-key")
        .and_then(|key| key.to_str().ok())
        .and_then(|key| keys.get(key));
    let principal = match client {
        Some(client) => Principal {
            kind: PrincipalType::ApiKey,
            id: client.clone(),
            api_key_id: None,
        },
        None => Principal {
            kind: PrincipalType::Ip,
            id: parts
                .extensions
                .get::<ConnectInfo<SocketAddr>>()?
                .0
                .ip()
                .to_string(),
            api_key_id: None,
        },
    };
    let route = match parts.uri.path() {
        "/exports" => "export",
        "/summaries" => "summarize",
        _ => "read",
    };
    let admission = Admission::new(tenant.clone(), principal, RouteGroup::parse(route).ok()?);
    Some(match route {
        "export" => admission.releases_slots(),
        "summarize" => admission.metered(1),
        _ => admission,
    })
}

async fn reports() -> &'static str {
    "reports\n"
}

async fn exports() -> &'static str {
    "export started\n"
}

async fn summaries(Extension(cost): Extension<MeteredCost>, body: String) -> String {
    let answer = format!("{} words\n", body.split_whitespace().count());
    // The actual cost, settled when the response ends.
    cost.set(answer.len() as u64);
    answer
}

#[tokio::main]
async fn main() -> Result<(), String> {
    let listen: SocketAddr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:3000".to_owned())
        .parse()
        .map_err(|e| format!("listen address: {e}"))?;
    let token = std::fs::read_to_string(setting("ALLOT_GATEWAY_TOKEN_FILE")?)
        .map_err(|e| format!("ALLOT_GATEWAY_TOKEN_FILE: {e}"))?;
    let mut builder = AgentClient::builder(setting("ALLOT_AGENT_URL")?, token.trim());
    if let Ok(ca) = std::env::var("ALLOT_AGENT_CA") {
        builder = builder.ca_file(ca);
    }
    let client = builder.build().map_err(|e| e.to_string())?;
    let tenant = TenantId::parse(&setting("ALLOT_TENANT")?).map_err(|e| e.to_string())?;
    let keys: HashMap<String, String> = setting("ALLOT_API_KEYS")?
        .split(',')
        .filter_map(|pair| pair.split_once('='))
        .map(|(key, client)| (key.to_owned(), client.to_owned()))
        .collect();
    let keys = Arc::new(keys);
    let layer = AllotLayer::new(client, move |parts: &http::request::Parts| {
        identify(&keys, &tenant, parts)
    })
    .when_undecided(FailMode::Closed);
    let app = axum::Router::new()
        .route("/reports", get(reports))
        .route("/exports", post(exports))
        .route("/summaries", post(summaries))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("{listen}: {e}"))?;
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
    .map_err(|e| e.to_string())
}
