//! Who may do what: token roles on every endpoint, agent tokens scoped to their region, tokens minted
//! and revoked through the API (stored as digests only), and the audit log of every change.

use reqwest::Method;
use serde_json::{Value, json};

use crate::common::{AGENT, AGENT_EU, AUTHOR, OPERATOR, Server, VIEWER, start};

const UNKNOWN: &str = "not-a-token-anyone-holds-01";

fn pool_body() -> Value {
    json!({ "limit": 1000, "windowMs": 60000, "chunk": 100, "leaseTtlMs": 15000,
            "fallbackPerRegion": 100, "regions": ["eu", "us"] })
}

async fn call(
    server: &Server,
    method: Method,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (u16, Value) {
    let mut request = server
        .client
        .request(method, format!("{}{path}", server.url));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("send");
    let status = response.status().as_u16();
    let text = response.text().await.expect("body");
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

fn grant(region: &str) -> Value {
    json!({ "leaseId": allot_shared::ids::LeaseId::from_parts(1_000, rand_u128()),
            "tenant": "atlas", "pool": "api", "region": region, "want": 5 })
}

fn rand_u128() -> u128 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    u128::from(NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Every endpoint against every kind of caller: allowed ones do not get 401/403, others get exactly
/// 401 (unknown or missing token) or 403 (known token, wrong role).
#[tokio::test]
async fn every_endpoint_checks_the_role() {
    let server = start().await;
    let (status, _) = call(
        &server,
        Method::PUT,
        "/v1/pools/atlas/api",
        Some(OPERATOR),
        Some(pool_body()),
    )
    .await;
    assert_eq!(status, 200);
    let bundle: Value = serde_json::from_str(include_str!(
        "../../../deploy/examples/northstar-bundle.json"
    ))
    .expect("example bundle");

    // (method, path, body, the least operator role, whether agents may call it)
    type Case = (
        Method,
        &'static str,
        Option<Value>,
        Option<&'static str>,
        bool,
    );
    let cases: Vec<Case> = vec![
        (Method::GET, "/v1/pools", None, Some("viewer"), false),
        (
            Method::GET,
            "/v1/pools/atlas/api",
            None,
            Some("viewer"),
            false,
        ),
        (
            Method::PUT,
            "/v1/pools/atlas/api",
            Some(pool_body()),
            Some("author"),
            false,
        ),
        (
            Method::GET,
            "/v1/pools/atlas/api/windows",
            None,
            Some("viewer"),
            false,
        ),
        (
            Method::GET,
            "/v1/pools/atlas/api/terms",
            None,
            Some("viewer"),
            true,
        ),
        (
            Method::POST,
            "/v1/terms/batch",
            Some(json!({ "pools": [{ "tenant": "atlas", "pool": "api" }] })),
            Some("viewer"),
            true,
        ),
        (Method::POST, "/v1/grants", Some(grant("eu")), None, true),
        (
            Method::POST,
            "/v1/grants/batch",
            Some(json!({ "grants": [grant("eu")] })),
            None,
            true,
        ),
        (
            Method::POST,
            "/v1/reports/batch",
            Some(json!({ "reports": [] })),
            None,
            true,
        ),
        (
            Method::PUT,
            "/v1/policies",
            Some(bundle),
            Some("author"),
            false,
        ),
        (
            Method::GET,
            "/v1/policies/current",
            None,
            Some("viewer"),
            true,
        ),
        (Method::GET, "/v1/policies/1", None, Some("viewer"), true),
        (
            Method::POST,
            "/v1/policies/1/promote",
            None,
            Some("author"),
            false,
        ),
        (
            Method::POST,
            "/v1/policies/1/rollback",
            None,
            Some("author"),
            false,
        ),
        (
            Method::GET,
            "/v1/policies/status",
            None,
            Some("viewer"),
            false,
        ),
        (
            Method::POST,
            "/v1/policies/status",
            Some(json!({ "region": "eu", "agentId": "eu-1", "version": 1 })),
            None,
            true,
        ),
        (Method::GET, "/v1/tokens", None, Some("admin"), false),
        (Method::GET, "/v1/audit", None, Some("viewer"), false),
        (Method::GET, "/v1/bound-checks", None, Some("viewer"), false),
        (Method::GET, "/v1/regions", None, Some("viewer"), false),
        (Method::GET, "/v1/shards", None, Some("viewer"), true),
        (
            Method::DELETE,
            "/v1/pools/atlas/gone",
            None,
            Some("author"),
            false,
        ),
    ];
    let rank = |role: &str| {
        ["viewer", "author", "admin"]
            .iter()
            .position(|r| *r == role)
    };
    let callers: [(&str, Option<&str>, Option<&str>); 7] = [
        ("none", None, None),
        ("unknown", Some(UNKNOWN), None),
        ("viewer", Some(VIEWER), Some("viewer")),
        ("author", Some(AUTHOR), Some("author")),
        ("admin", Some(OPERATOR), Some("admin")),
        ("agent", Some(AGENT), Some("agent")),
        ("agent-eu", Some(AGENT_EU), Some("agent")),
    ];
    for (method, path, body, least, agents) in &cases {
        for (name, token, kind) in callers {
            let (status, problem) = call(&server, method.clone(), path, token, body.clone()).await;
            let expected_refusal = match kind {
                None => Some(401),
                Some("agent") => (!agents).then_some(403),
                Some(role) => match least {
                    Some(least) if rank(role) >= rank(least) => None,
                    _ => Some(403),
                },
            };
            match expected_refusal {
                Some(code) => {
                    assert_eq!(status, code, "{method} {path} as {name}: {problem}");
                    assert_eq!(problem["status"], code, "problem+json body");
                }
                None => assert!(
                    status != 401 && status != 403,
                    "{method} {path} as {name} was refused: {status} {problem}"
                ),
            }
        }
    }
}

/// A missing token, an unknown token and a malformed header all get the same answer.
#[tokio::test]
async fn unknown_and_missing_tokens_look_the_same() {
    let server = start().await;
    let (missing_status, missing) = call(&server, Method::GET, "/v1/pools", None, None).await;
    let (unknown_status, unknown) =
        call(&server, Method::GET, "/v1/pools", Some(UNKNOWN), None).await;
    let (short_status, short) = call(&server, Method::GET, "/v1/pools", Some("x"), None).await;
    let near = format!("{}x", &OPERATOR[..OPERATOR.len() - 1]);
    let (near_status, near_miss) = call(&server, Method::GET, "/v1/pools", Some(&near), None).await;
    assert_eq!(
        [missing_status, unknown_status, short_status, near_status],
        [401; 4]
    );
    assert_eq!(missing, unknown);
    assert_eq!(missing, short);
    assert_eq!(missing, near_miss);
}

/// An agent token scoped to `eu` may act for `eu` only; unscoped agent tokens for any region.
#[tokio::test]
async fn agent_tokens_act_for_their_region_only() {
    let server = start().await;
    call(
        &server,
        Method::PUT,
        "/v1/pools/atlas/api",
        Some(OPERATOR),
        Some(pool_body()),
    )
    .await;
    let (status, answer) = call(
        &server,
        Method::POST,
        "/v1/grants",
        Some(AGENT_EU),
        Some(grant("eu")),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let refused = [
        (Method::POST, "/v1/grants", Some(grant("us"))),
        (
            Method::POST,
            "/v1/reports",
            Some(
                json!({ "reportId": "r-1", "region": "us", "tenant": "atlas", "pool": "api",
                         "windowStartMs": 0, "fallbackAdmitted": 1 }),
            ),
        ),
        (
            Method::POST,
            "/v1/policies/status",
            Some(json!({ "region": "us", "agentId": "us-1", "version": 0 })),
        ),
        (Method::GET, "/v1/pools/atlas/api/terms?region=us", None),
        (Method::GET, "/v1/policies/current?region=us", None),
    ];
    for (method, path, body) in refused {
        let (status, problem) =
            call(&server, method.clone(), path, Some(AGENT_EU), body.clone()).await;
        assert_eq!(status, 403, "{method} {path}: {problem}");
        assert_eq!(problem["field"], "region", "{problem}");
        // The unscoped token may.
        let (status, problem) = call(&server, method.clone(), path, Some(AGENT), body).await;
        assert!(
            status != 403 && status != 401,
            "{method} {path}: {status} {problem}"
        );
    }
    // us holds only the unscoped agent's grant: the refused one took nothing.
    let (_, pool) = call(
        &server,
        Method::GET,
        "/v1/pools/atlas/api",
        Some(VIEWER),
        None,
    )
    .await;
    assert_eq!(pool["window"]["grantedByRegion"]["eu"], 5);
    assert_eq!(pool["window"]["grantedByRegion"]["us"], 5, "{pool}");
}

/// Tokens minted by an admin work at once, are listed without secrets, and stop working when
/// revoked; every change is in the audit log with its actor and version, never a token.
#[tokio::test]
async fn minted_tokens_and_the_audit_log() {
    let server = start().await;
    // Only admins mint.
    let mint = |token: &'static str, body: Value| {
        call(&server, Method::POST, "/v1/tokens", Some(token), Some(body))
    };
    assert_eq!(mint(AUTHOR, json!({ "role": "viewer" })).await.0, 403);
    let bad: [(Value, &str); 5] = [
        (json!({ "role": "root" }), "role"),
        (json!({ "role": "agent" }), "region"),
        (json!({ "role": "author", "region": "eu" }), "region"),
        (json!({ "role": "agent", "region": "EU!" }), "region"),
        (json!({ "role": "viewer", "name": "x".repeat(65) }), "name"),
    ];
    for (body, field) in bad {
        let (status, problem) = mint(OPERATOR, body.clone()).await;
        assert_eq!(
            (status, problem["field"].as_str()),
            (400, Some(field)),
            "{body}: {problem}"
        );
    }
    let (status, minted) = mint(OPERATOR, json!({ "role": "author", "name": "ci deploys" })).await;
    assert_eq!(status, 201, "{minted}");
    let token = minted["token"].as_str().expect("token").to_owned();
    let id = minted["id"].as_str().expect("id").to_owned();
    assert!(
        token.starts_with("allot_") && id.starts_with("tok-"),
        "{minted}"
    );
    let (status, agent) = mint(OPERATOR, json!({ "role": "agent", "region": "us" })).await;
    assert_eq!(status, 201);
    let agent_token = agent["token"].as_str().expect("token").to_owned();

    // The minted author token configures pools; the minted agent token is scoped to us.
    let (status, _) = call(
        &server,
        Method::PUT,
        "/v1/pools/atlas/api",
        Some(&token),
        Some(pool_body()),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        call(
            &server,
            Method::POST,
            "/v1/grants",
            Some(&agent_token),
            Some(grant("us"))
        )
        .await
        .0,
        200
    );
    assert_eq!(
        call(
            &server,
            Method::POST,
            "/v1/grants",
            Some(&agent_token),
            Some(grant("eu"))
        )
        .await
        .0,
        403
    );

    // Listings never show a token or a digest.
    let (status, list) = call(&server, Method::GET, "/v1/tokens", Some(OPERATOR), None).await;
    assert_eq!(status, 200);
    let text = list.to_string();
    assert!(
        !text.contains(&token) && !text.contains("sha256") && !text.contains(OPERATOR),
        "{text}"
    );
    let ids: Vec<&str> = list["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .filter_map(|t| t["id"].as_str())
        .collect();
    assert!(ids.contains(&id.as_str()), "{list}");
    assert_eq!(
        list["tokens"].as_array().map(Vec::len),
        Some(7),
        "5 file tokens and 2 minted: {list}"
    );

    // Revoked: refused at once. File tokens cannot be revoked through the API.
    assert_eq!(
        call(
            &server,
            Method::DELETE,
            &format!("/v1/tokens/{id}"),
            Some(OPERATOR),
            None
        )
        .await
        .0,
        204
    );
    assert_eq!(
        call(&server, Method::GET, "/v1/pools", Some(&token), None)
            .await
            .0,
        401
    );
    assert_eq!(
        call(
            &server,
            Method::DELETE,
            &format!("/v1/tokens/{id}"),
            Some(OPERATOR),
            None
        )
        .await
        .0,
        404
    );
    let file_id = ids
        .iter()
        .find(|i| i.starts_with("file-"))
        .expect("file token");
    assert_eq!(
        call(
            &server,
            Method::DELETE,
            &format!("/v1/tokens/{file_id}"),
            Some(OPERATOR),
            None
        )
        .await
        .0,
        409
    );
    let (status, problem) = call(
        &server,
        Method::DELETE,
        "/v1/tokens/tok-zz",
        Some(OPERATOR),
        None,
    )
    .await;
    assert_eq!((status, problem["field"].as_str()), (400, Some("id")));

    // Publish and promote a bundle, delete the pool: all audited, newest first.
    let bundle: Value = serde_json::from_str(include_str!(
        "../../../deploy/examples/northstar-bundle.json"
    ))
    .expect("bundle");
    assert_eq!(
        call(
            &server,
            Method::PUT,
            "/v1/policies",
            Some(AUTHOR),
            Some(bundle)
        )
        .await
        .0,
        200
    );
    assert_eq!(
        call(
            &server,
            Method::POST,
            "/v1/policies/1/promote",
            Some(AUTHOR),
            None
        )
        .await
        .0,
        200
    );
    assert_eq!(
        call(
            &server,
            Method::DELETE,
            "/v1/pools/atlas/api",
            Some(OPERATOR),
            None
        )
        .await
        .0,
        204
    );
    let (status, audit) = call(
        &server,
        Method::GET,
        "/v1/audit?last=20",
        Some(VIEWER),
        None,
    )
    .await;
    assert_eq!(status, 200, "{audit}");
    let entries = audit["entries"].as_array().expect("entries");
    let actions: Vec<&str> = entries
        .iter()
        .filter_map(|e| e["action"].as_str())
        .collect();
    assert_eq!(
        actions,
        [
            "pool.delete",
            "policy.promote",
            "policy.publish",
            "token.revoke",
            "pool.put",
            "token.mint",
            "token.mint"
        ],
        "{audit}"
    );
    let put = &entries[4];
    assert_eq!(put["actor"], format!("author:{id}"));
    assert_eq!(
        (put["target"].as_str(), put["version"].as_u64()),
        (Some("atlas/api"), Some(1))
    );
    assert_eq!(entries[2]["version"], 1, "the published version");
    assert!(
        entries[0]["actor"]
            .as_str()
            .is_some_and(|a| a.starts_with("admin:file-"))
    );
    let text = audit.to_string();
    for secret in [
        OPERATOR,
        AUTHOR,
        VIEWER,
        token.as_str(),
        agent_token.as_str(),
    ] {
        assert!(!text.contains(secret), "a token is in the audit log");
    }
    assert_eq!(
        call(&server, Method::GET, "/v1/audit?last=0", Some(VIEWER), None)
            .await
            .0,
        400
    );
    assert_eq!(
        call(
            &server,
            Method::GET,
            "/v1/audit?last=1001",
            Some(VIEWER),
            None
        )
        .await
        .0,
        400
    );
    let (status, checks) = call(&server, Method::GET, "/v1/bound-checks", Some(VIEWER), None).await;
    assert_eq!(status, 200, "{checks}");
    assert_eq!(checks["violations"], 0, "{checks}");
    assert!(checks["windowsChecked"].is_u64(), "{checks}");
    let (status, refused) = call(
        &server,
        Method::GET,
        "/v1/bound-checks?recent=101",
        Some(VIEWER),
        None,
    )
    .await;
    assert_eq!(status, 400, "{refused}");
    assert!(refused.to_string().contains("recent"), "{refused}");
}
