//! Hostile input against every allocator endpoint, as a table: malformed JSON, wrong types, unknown
//! fields, huge and negative numbers, NaN-like values, empty and 10 MB bodies, unicode and reserved
//! characters in ids, duplicate and unknown query parameters. Each must get a 4xx problem+json (never
//! a 5xx, never a panic) and change nothing: the store, the ledger's audit log and the live windows
//! read the same before and after.

use reqwest::Method;
use serde_json::{Value, json};

use crate::common::{AGENT, OPERATOR, Server, start};

/// One hostile request and the status it must get.
struct Case {
    method: Method,
    path: String,
    token: &'static str,
    content_type: Option<&'static str>,
    body: Vec<u8>,
    status: u16,
    /// The field the problem must name, when it names one.
    field: Option<&'static str>,
}

fn case(method: Method, path: &str, token: &'static str, body: &str, status: u16) -> Case {
    Case {
        method,
        path: path.to_owned(),
        token,
        content_type: Some("application/json"),
        body: body.as_bytes().to_vec(),
        status,
        field: None,
    }
}

impl Case {
    fn naming(mut self, field: &'static str) -> Self {
        self.field = Some(field);
        self
    }

    fn content_type(mut self, content_type: Option<&'static str>) -> Self {
        self.content_type = content_type;
        self
    }
}

/// Everything a request could have changed.
async fn fingerprint(server: &Server) -> Value {
    let mut snapshot = serde_json::Map::new();
    for path in [
        "/v1/pools",
        "/v1/pools/atlas/api",
        "/v1/policies/status",
        "/v1/policies/current",
        "/v1/tokens",
        "/v1/audit?last=1000",
        "/v1/pools/atlas/api/windows?last=1000",
    ] {
        let response = server
            .client
            .get(format!("{}{path}", server.url))
            .bearer_auth(OPERATOR)
            .send()
            .await
            .expect("send");
        let mut value: Value = response.json().await.unwrap_or(Value::Null);
        // The live window's clock-derived fields move on their own.
        if let Some(window) = value.get_mut("window").and_then(Value::as_object_mut) {
            window.remove("windowStartMs");
            window.remove("windowEndMs");
        }
        snapshot.insert(path.to_owned(), value);
    }
    Value::Object(snapshot)
}

/// Bodies every JSON endpoint must refuse, with the field they must name (if any).
fn hostile_bodies() -> Vec<(&'static str, String, u16, Option<&'static str>)> {
    vec![
        ("empty", String::new(), 400, Some("body")),
        ("malformed", "{\"limit\": ".to_owned(), 400, None),
        ("not an object", "[1, 2, 3]".to_owned(), 400, None),
        ("a string", "\"hello\"".to_owned(), 400, None),
        ("null", "null".to_owned(), 400, None),
        ("NaN", "{\"want\": NaN}".to_owned(), 400, None),
        ("trailing garbage", "{} {}".to_owned(), 400, None),
        (
            "deep nesting",
            format!("{}{}", "[".repeat(10_000), "]".repeat(10_000)),
            400,
            None,
        ),
        (
            "invalid UTF-8",
            String::from_utf8_lossy(&[0x7b, 0xff, 0xfe, 0x7d]).into_owned(),
            400,
            None,
        ),
    ]
}

fn pool_body() -> Value {
    json!({ "limit": 1000, "windowMs": 60000, "chunk": 100, "leaseTtlMs": 15000,
            "fallbackPerRegion": 100, "regions": ["eu", "us"] })
}

fn with(base: &Value, field: &str, value: Value) -> String {
    let mut body = base.clone();
    body[field] = value;
    body.to_string()
}

fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    let grant = json!({ "leaseId": allot_shared::ids::LeaseId::from_parts(1, 7), "tenant": "atlas",
                        "pool": "api", "region": "eu", "want": 5 });
    let report = json!({ "reportId": "r-1", "region": "eu", "tenant": "atlas", "pool": "api",
                         "windowStartMs": 0, "leases": [], "fallbackAdmitted": 0 });
    let status = json!({ "region": "eu", "agentId": "eu-1", "version": 1 });
    let mint = json!({ "role": "viewer", "name": "n" });
    let json_endpoints: [(Method, &str, &'static str); 9] = [
        (Method::PUT, "/v1/pools/atlas/api", OPERATOR),
        (Method::POST, "/v1/terms/batch", AGENT),
        (Method::POST, "/v1/grants", AGENT),
        (Method::POST, "/v1/grants/batch", AGENT),
        (Method::POST, "/v1/reports", AGENT),
        (Method::POST, "/v1/reports/batch", AGENT),
        (Method::POST, "/v1/policies/status", AGENT),
        (Method::POST, "/v1/tokens", OPERATOR),
        (Method::PUT, "/v1/policies", OPERATOR),
    ];
    for (method, path, token) in &json_endpoints {
        for (_, body, status, field) in hostile_bodies() {
            let mut c = case(method.clone(), path, token, &body, status);
            c.field = field;
            cases.push(c);
        }
        // 10 MB: refused by the body limit before anything parses it.
        cases.push(case(
            method.clone(),
            path,
            token,
            &"x".repeat(10 << 20),
            413,
        ));
        if *path != "/v1/policies" {
            cases.push(
                case(method.clone(), path, token, "{}", 415).content_type(Some("text/plain")),
            );
            cases.push(case(method.clone(), path, token, "{}", 415).content_type(None));
        }
    }
    // Field by field: wrong types, unknown fields, huge, negative, fractional and NaN-like numbers,
    // unicode and reserved characters in ids.
    let pools = "/v1/pools/atlas/api";
    let p = pool_body();
    for (field, value) in [
        ("limit", json!("1000")),
        ("limit", json!(-1)),
        ("limit", json!(1.5)),
        ("limit", json!("NaN")),
        ("limit", json!(null)),
        ("windowMs", json!(18_446_744_073_709_551_615u64)),
        ("chunk", json!(0)),
        ("chunk", json!(1_000_000)),
        ("regions", json!("eu")),
        ("regions", json!(["EU"])),
        ("regions", json!(["eu}"])),
        ("regions", json!(["e:u"])),
        ("regions", json!(["ëu"])),
        ("regions", json!([])),
        ("regions", json!(["eu", "eu"])),
    ] {
        cases.push(case(Method::PUT, pools, OPERATOR, &with(&p, field, value), 400).naming(field));
    }
    cases.push(case(
        Method::PUT,
        pools,
        OPERATOR,
        &with(&p, "owner", json!("x")),
        400,
    ));
    // Number literals no u64 holds.
    for literal in ["18446744073709551616", "1e400", "-0", "0x10", "1_000"] {
        let body = p.to_string().replacen("1000,", &format!("{literal},"), 1);
        cases.push(case(Method::PUT, pools, OPERATOR, &body, 400));
    }
    for (field, value) in [
        ("want", json!(0)),
        ("want", json!(-5)),
        ("want", json!("5")),
        ("want", json!(1e30)),
        ("leaseId", json!("not-a-uuid")),
        ("leaseId", json!(7)),
        ("tenant", json!("Atlas")),
        ("tenant", json!("atlas}")),
        ("tenant", json!("at:las")),
        ("tenant", json!("ätlas")),
        ("tenant", json!("a".repeat(33))),
        ("tenant", json!("")),
        ("pool", json!("api\u{0000}")),
        ("region", json!("\u{202e}ue")),
    ] {
        cases.push(
            case(
                Method::POST,
                "/v1/grants",
                AGENT,
                &with(&grant, field, value),
                400,
            )
            .naming(field),
        );
    }
    cases.push(case(
        Method::POST,
        "/v1/grants",
        AGENT,
        &with(&grant, "extra", json!(1)),
        400,
    ));
    for (field, value) in [
        ("reportId", json!("")),
        ("reportId", json!("r".repeat(65))),
        ("fallbackAdmitted", json!(-1)),
        ("windowStartMs", json!("0")),
        (
            "leases",
            json!([{ "leaseId": "x", "spent": 1, "final": false }]),
        ),
        ("leases", json!({})),
    ] {
        cases.push(case(
            Method::POST,
            "/v1/reports",
            AGENT,
            &with(&report, field, value),
            400,
        ));
    }
    for (field, value) in [
        ("agentId", json!("")),
        ("agentId", json!("a b")),
        ("agentId", json!("ü".repeat(10))),
        ("version", json!(-1)),
        ("region", json!("")),
        ("pepperFingerprint", json!("XYZ")),
        ("pepperFingerprint", json!("0A1B2C3D")),
        ("pepperFingerprint", json!("0a1b2c3d0")),
        ("pepperFingerprint", json!(7)),
    ] {
        cases.push(
            case(
                Method::POST,
                "/v1/policies/status",
                AGENT,
                &with(&status, field, value),
                400,
            )
            .naming(field),
        );
    }
    for (field, value) in [
        ("role", json!("superuser")),
        ("role", json!(["admin"])),
        ("name", json!("a\u{0007}b")),
        ("name", json!("n".repeat(65))),
        ("region", json!("eu")),
    ] {
        cases.push(
            case(
                Method::POST,
                "/v1/tokens",
                OPERATOR,
                &with(&mint, field, value),
                400,
            )
            .naming(field),
        );
    }
    // Policy bundles: invalid JSON shapes and invalid rules.
    for bundle in [
        json!({ "rules": "none" }),
        json!({ "rules": [{ "id": "x" }] }),
        json!({ "rules": [{ "id": "a}b", "scope": "user", "algorithm": "token_bucket",
                            "capacityMillis": 1000, "refillMillis": 1000, "periodMs": 1000 }] }),
        json!({ "rules": [{ "id": "r", "scope": "user", "algorithm": "token_bucket",
                            "capacityMillis": -1, "refillMillis": 1000, "periodMs": 1000 }] }),
        json!({ "rules": [], "surprise": true }),
    ] {
        cases.push(case(
            Method::PUT,
            "/v1/policies",
            OPERATOR,
            &bundle.to_string(),
            400,
        ));
    }
    // Paths and queries.
    for (method, path, token, status, field) in [
        (
            Method::GET,
            "/v1/pools/%C3%A4tlas/api",
            OPERATOR,
            400,
            Some("tenant"),
        ),
        (
            Method::GET,
            "/v1/pools/atlas%7D/api",
            OPERATOR,
            400,
            Some("tenant"),
        ),
        (
            Method::GET,
            "/v1/pools/at:las/api",
            OPERATOR,
            400,
            Some("tenant"),
        ),
        (
            Method::PUT,
            "/v1/pools/atlas/%F0%9F%92%A5",
            OPERATOR,
            400,
            Some("pool"),
        ),
        (
            Method::DELETE,
            "/v1/pools/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa/api",
            OPERATOR,
            400,
            Some("tenant"),
        ),
        (
            Method::GET,
            "/v1/pools/atlas/api/windows?last=1&last=2",
            OPERATOR,
            400,
            Some("last"),
        ),
        (
            Method::GET,
            "/v1/pools/atlas/api/windows?last=-1",
            OPERATOR,
            400,
            Some("last"),
        ),
        (
            Method::GET,
            "/v1/pools/atlas/api/windows?last=abc",
            OPERATOR,
            400,
            Some("last"),
        ),
        (
            Method::GET,
            "/v1/pools/atlas/api/windows?last=99999999999999999999",
            OPERATOR,
            400,
            Some("last"),
        ),
        (
            Method::GET,
            "/v1/pools/atlas/api/windows?last=0",
            OPERATOR,
            400,
            Some("last"),
        ),
        (
            Method::GET,
            "/v1/pools/atlas/api/windows?since=1",
            OPERATOR,
            400,
            Some("last"),
        ),
        (
            Method::GET,
            "/v1/pools/atlas/api/terms?region=EU",
            AGENT,
            400,
            Some("region"),
        ),
        (
            Method::GET,
            "/v1/pools/atlas/api/terms?region=eu&region=us",
            AGENT,
            400,
            Some("region"),
        ),
        (
            Method::GET,
            "/v1/policies/current?region=%00",
            AGENT,
            400,
            Some("region"),
        ),
        (
            Method::GET,
            "/v1/policies/0",
            OPERATOR,
            400,
            Some("version"),
        ),
        (
            Method::GET,
            "/v1/policies/-1",
            OPERATOR,
            400,
            Some("version"),
        ),
        (
            Method::GET,
            "/v1/policies/18446744073709551616",
            OPERATOR,
            400,
            Some("version"),
        ),
        // Beyond 2^53, as the document's maximum says.
        (
            Method::GET,
            "/v1/policies/9007199254740993",
            OPERATOR,
            400,
            Some("version"),
        ),
        (
            Method::POST,
            "/v1/policies/9223372036854775808/promote",
            OPERATOR,
            400,
            Some("version"),
        ),
        (
            Method::POST,
            "/v1/policies/1e3/promote",
            OPERATOR,
            400,
            Some("version"),
        ),
        (
            Method::POST,
            "/v1/policies/0/rollback",
            OPERATOR,
            400,
            Some("version"),
        ),
        (
            Method::GET,
            "/v1/audit?last=1&last=1",
            OPERATOR,
            400,
            Some("last"),
        ),
        (
            Method::DELETE,
            "/v1/tokens/tok-%F0%9F%92%A5",
            OPERATOR,
            400,
            Some("id"),
        ),
        (Method::PATCH, "/v1/pools/atlas/api", OPERATOR, 405, None),
        (Method::GET, "/v1/nothing-here", OPERATOR, 404, None),
    ] {
        let mut c = case(method, path, token, "", status).content_type(None);
        c.field = field;
        cases.push(c);
    }
    let canary = "/v1/policies?canary=eu,,us";
    cases.push(case(Method::PUT, canary, OPERATOR, "{\"rules\": []}", 400).naming("canary"));
    cases
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_input_gets_a_problem_and_changes_nothing() {
    let server = start().await;
    // Some state to protect: a pool with a live window, a bundle, an audit trail.
    let put = server
        .client
        .put(format!("{}/v1/pools/atlas/api", server.url))
        .bearer_auth(OPERATOR)
        .json(&pool_body())
        .send()
        .await
        .expect("pool");
    assert_eq!(put.status(), 200);
    let bundle = include_str!("../../../deploy/examples/northstar-bundle.json");
    let published = server
        .client
        .put(format!("{}/v1/policies", server.url))
        .bearer_auth(OPERATOR)
        .header("content-type", "application/json")
        .body(bundle)
        .send()
        .await
        .expect("bundle");
    assert_eq!(published.status(), 200);
    let before = fingerprint(&server).await;

    let cases = cases();
    assert!(
        cases.len() > 120,
        "the table covers every endpoint: {}",
        cases.len()
    );
    let mut failures = Vec::new();
    for c in &cases {
        let mut request = server
            .client
            .request(c.method.clone(), format!("{}{}", server.url, c.path))
            .bearer_auth(c.token)
            .body(c.body.clone());
        if let Some(content_type) = c.content_type {
            request = request.header("content-type", content_type);
        }
        let label = format!(
            "{} {} ({} body bytes: {:?})",
            c.method,
            c.path,
            c.body.len(),
            String::from_utf8_lossy(&c.body[..c.body.len().min(80)])
        );
        let response = match request.send().await {
            Ok(response) => response,
            // An oversize body is refused from its Content-Length, before it is read: the
            // connection may close while the client is still sending.
            Err(_) if c.status == 413 => continue,
            Err(error) => {
                failures.push(format!("{label}: no answer: {error}"));
                continue;
            }
        };
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let problem: Value = response.json().await.unwrap_or(Value::Null);
        if status != c.status {
            failures.push(format!(
                "{label}: status {status}, expected {}: {problem}",
                c.status
            ));
            continue;
        }
        if content_type != "application/problem+json" || problem["status"] != status {
            failures.push(format!(
                "{label}: not a problem+json body: {content_type} {problem}"
            ));
            continue;
        }
        // A field inside the one named counts (`regions[0]` for `regions`).
        if let Some(field) = c.field
            && problem["field"]
                .as_str()
                .is_none_or(|f| !f.starts_with(field))
        {
            failures.push(format!(
                "{label}: names {:?}, expected {field}",
                problem["field"]
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    assert_eq!(
        fingerprint(&server).await,
        before,
        "a refused request changed state"
    );
    // And the server still serves.
    let health = server
        .client
        .get(format!("{}/healthz", server.url))
        .send()
        .await
        .expect("health");
    assert_eq!(health.status(), 200);
}
