//! The HTTP API's contract: names, status codes, problem+json bodies that name the field, token roles,
//! and bad input that changes nothing. Runs the real server in-process on the embedded store.

use serde_json::{Value, json};

use crate::common;

use crate::common::{AGENT, AGENT_EU, AUTHOR, OPERATOR, Server, VIEWER, start};

fn pool_body() -> Value {
    json!({ "limit": 1000, "windowMs": 60000, "chunk": 100, "leaseTtlMs": 15000,
            "fallbackPerRegion": 100, "regions": ["eu", "us"] })
}

/// An answer's status and JSON body; an error must be problem+json.
async fn status_and_body(response: reqwest::Response) -> (u16, Value) {
    let status = response.status().as_u16();
    if status != 200 {
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json",
            "errors are problem+json"
        );
    }
    (status, response.json().await.unwrap_or(Value::Null))
}

impl Server {
    async fn put_pool(&self, path: &str, token: &str, body: String) -> (u16, Value) {
        let response = self
            .client
            .put(format!("{}/v1/pools/{path}", self.url))
            .bearer_auth(token)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("send");
        status_and_body(response).await
    }

    async fn post(&self, path: &str, token: &str, body: &Value) -> (u16, Value) {
        let response = self
            .client
            .post(format!("{}{path}", self.url))
            .bearer_auth(token)
            .json(body)
            .send()
            .await
            .expect("send");
        status_and_body(response).await
    }

    async fn get(&self, path: &str, token: &str) -> (u16, Value) {
        let response = self
            .client
            .get(format!("{}{path}", self.url))
            .bearer_auth(token)
            .send()
            .await
            .expect("send");
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }
}

#[tokio::test]
async fn pools_round_trip_with_versions() {
    let server = start().await;
    let (status, body) = server
        .put_pool("atlas/api", OPERATOR, pool_body().to_string())
        .await;
    assert_eq!(status, 200);
    assert_eq!(body["version"], 1);
    assert_eq!(body["limit"], 1000);
    let (_, body) = server
        .put_pool("atlas/api", OPERATOR, pool_body().to_string())
        .await;
    assert_eq!(body["version"], 2, "every update bumps the version");
    let (status, body) = server.get("/v1/pools/atlas/api", OPERATOR).await;
    assert_eq!(status, 200);
    assert_eq!(body["window"]["remaining"], 1000);
    assert_eq!(body["window"]["leasesOutstanding"], 0);
    let (_, list) = server.get("/v1/pools", OPERATOR).await;
    assert_eq!(list["pools"].as_array().map(Vec::len), Some(1));
    let deleted = server
        .client
        .delete(format!("{}/v1/pools/atlas/api", server.url))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .expect("delete");
    assert_eq!(deleted.status(), 204);
    assert_eq!(server.get("/v1/pools/atlas/api", OPERATOR).await.0, 404);
}

/// The pool list pages: `limit` pools at a time in (tenant, pool) order, each page after the last
/// one's `next`, until a page without one; without `limit`, every pool at once.
#[tokio::test]
async fn the_pool_list_pages_in_order() {
    let server = start().await;
    let names = [
        "zeta/a",
        "atlas/b",
        "atlas/a",
        "beta/x",
        "atlas/c",
        "atlas-2/q",
    ];
    for name in names {
        let (status, _) = server
            .put_pool(name, OPERATOR, pool_body().to_string())
            .await;
        assert_eq!(status, 200, "{name}");
    }
    let listed = |page: &Value| -> Vec<String> {
        page["pools"]
            .as_array()
            .expect("pools")
            .iter()
            .map(|p| {
                format!(
                    "{}/{}",
                    p["tenant"].as_str().expect("tenant"),
                    p["pool"].as_str().expect("pool")
                )
            })
            .collect()
    };
    let mut paged = Vec::new();
    let mut path = "/v1/pools?limit=2".to_owned();
    let mut pages = 0;
    loop {
        let (status, page) = server.get(&path, OPERATOR).await;
        assert_eq!(status, 200, "{page}");
        pages += 1;
        paged.extend(listed(&page));
        let Some(next) = page["next"].as_str() else {
            break;
        };
        path = format!("/v1/pools?limit=2&after={next}");
    }
    // Key order: `-` sorts before `/`.
    let every = [
        "atlas-2/q",
        "atlas/a",
        "atlas/b",
        "atlas/c",
        "beta/x",
        "zeta/a",
    ];
    assert_eq!(paged, every);
    assert_eq!(
        pages, 4,
        "2 + 2 + 2, and an empty last page after a full one"
    );
    let (_, all) = server.get("/v1/pools", OPERATOR).await;
    assert_eq!(listed(&all), paged, "without limit, every pool");
    assert!(all.get("next").is_none());
    for (prefix, expected) in [
        ("atlas", &every[..4]),
        ("atlas/", &every[1..4]),
        ("atlas/b", &every[2..3]),
        ("atlas-2/", &every[..1]),
        ("z", &every[5..]),
        ("nomatch", &[][..]),
        ("", &every[..]),
    ] {
        let (status, page) = server
            .get(&format!("/v1/pools?prefix={prefix}"), OPERATOR)
            .await;
        assert_eq!(status, 200, "{prefix}: {page}");
        assert_eq!(
            listed(&page),
            expected,
            "prefix {prefix:?}, every page at once"
        );
        let (_, first) = server
            .get(&format!("/v1/pools?prefix={prefix}&limit=1"), OPERATOR)
            .await;
        assert_eq!(
            listed(&first),
            expected[..expected.len().min(1)],
            "{prefix:?}"
        );
        if let Some(next) = first["next"].as_str() {
            let (_, second) = server
                .get(
                    &format!("/v1/pools?prefix={prefix}&limit=1&after={next}"),
                    OPERATOR,
                )
                .await;
            assert_eq!(
                listed(&second),
                expected[1..expected.len().min(2)],
                "{prefix:?}"
            );
        }
    }
    for (query, field) in [
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=x", "limit"),
        ("limit=2&after=nopool", "after"),
        ("limit=2&after=Bad%20Tenant/x", "after"),
        ("after=atlas/a", "after"),
        ("prefix=Atlas", "prefix"),
        ("prefix=atlas/b/c", "prefix"),
        ("prefix=/a", "prefix"),
        ("limit=2&prefix=a%20b", "prefix"),
    ] {
        let (status, problem) = server.get(&format!("/v1/pools?{query}"), OPERATOR).await;
        assert_eq!(status, 400, "{query}: {problem}");
        assert_eq!(problem["field"], field, "{query}: {problem}");
    }
}

#[tokio::test]
async fn pools_are_written_in_bulk_idempotently_and_bad_entries_change_nothing() {
    let server = start().await;
    let entry = |n: usize, limit: u64| {
        let mut spec = pool_body();
        spec["limit"] = json!(limit);
        json!({ "tenant": format!("bulk{}", n % 7), "pool": format!("p{n:04}"), "spec": spec })
    };
    let body = |entries: Vec<Value>| json!({ "pools": entries });
    // 1,000 pools: past the API's usual 64 KiB body and across many store transactions.
    let thousand: Vec<Value> = (0..1_000).map(|n| entry(n, 1_000)).collect();
    assert!(body(thousand.clone()).to_string().len() > 64 * 1024);
    let (status, first) = server
        .post("/v1/pools/bulk", OPERATOR, &body(thousand.clone()))
        .await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(
        (first["created"].as_u64(), first["unchanged"].as_u64()),
        (Some(1_000), Some(0))
    );
    assert_eq!(
        first["pools"][999]["pool"], "p0999",
        "answers in the body's order"
    );
    assert_eq!(first["pools"][999]["outcome"], "created");
    let (_, again) = server
        .post("/v1/pools/bulk", OPERATOR, &body(thousand.clone()))
        .await;
    assert_eq!(again["unchanged"], 1_000, "{again}");
    assert!(
        again["pools"]
            .as_array()
            .expect("pools")
            .iter()
            .all(|p| p["version"] == 1)
    );
    let mut changed = thousand.clone();
    changed[3] = entry(3, 2_000);
    let (_, update) = server
        .post("/v1/pools/bulk", OPERATOR, &body(changed))
        .await;
    assert_eq!(
        (update["updated"].as_u64(), update["unchanged"].as_u64()),
        (Some(1), Some(999))
    );
    let (_, pool) = server.get("/v1/pools/bulk3/p0003", OPERATOR).await;
    assert_eq!(
        (pool["version"].as_u64(), pool["limit"].as_u64()),
        (Some(2), Some(2_000))
    );
    let (_, audit) = server.get("/v1/audit?last=5", OPERATOR).await;
    assert!(audit.to_string().contains("pool.bulk"), "{audit}");

    let mut bad_spec: Vec<Value> = (1_000..1_010).map(|n| entry(n, 1_000)).collect();
    bad_spec[5]["spec"]["chunk"] = json!(0);
    let mut twice: Vec<Value> = (1_000..1_003).map(|n| entry(n, 1_000)).collect();
    twice.push(entry(1_001, 2_000));
    let mut unknown = entry(1_000, 1_000);
    unknown["color"] = json!("red");
    let too_many: Vec<Value> = (0..1_001).map(|n| entry(n, 1_000)).collect();
    for (bad, field) in [
        (body(bad_spec), "pools[5].spec.chunk"),
        (body(twice), "pools[3].pool"),
        (body(vec![unknown]), "pools[0]"),
        (body(vec![]), "pools"),
        (body(too_many), "pools"),
        (
            body(vec![
                json!({ "tenant": "Bad Tenant", "pool": "p", "spec": pool_body() }),
            ]),
            "pools[0].tenant",
        ),
    ] {
        let (status, problem) = server.post("/v1/pools/bulk", OPERATOR, &bad).await;
        assert_eq!(status, 400, "{problem}");
        assert!(
            problem["field"]
                .as_str()
                .is_some_and(|f| f.starts_with(field)),
            "{field}: {problem}"
        );
    }
    let (_, listed) = server.get("/v1/pools?prefix=bulk", OPERATOR).await;
    assert_eq!(
        listed["pools"].as_array().map(Vec::len),
        Some(1_000),
        "a refused body writes nothing"
    );
    let (status, _) = server
        .post("/v1/pools/bulk", VIEWER, &body(vec![entry(2_000, 1_000)]))
        .await;
    assert_eq!(status, 403, "viewers cannot write pools");
}

#[tokio::test]
async fn bad_pools_are_refused_naming_the_field_and_change_nothing() {
    let server = start().await;
    let with = |field: &str, value: Value| {
        let mut body = pool_body();
        body[field] = value;
        body.to_string()
    };
    let cases: Vec<(String, &str)> = vec![
        (with("limit", json!(0)), "limit"),
        (with("limit", json!(1u64 << 41)), "limit"),
        (with("limit", json!(-1)), "limit"),
        (with("limit", json!("1000")), "limit"),
        (with("limit", json!(1.5)), "limit"),
        (with("windowMs", json!(999)), "windowMs"),
        (with("chunk", json!(0)), "chunk"),
        (with("chunk", json!(1001)), "chunk"),
        (with("leaseTtlMs", json!(99)), "leaseTtlMs"),
        (with("leaseTtlMs", json!(60001)), "leaseTtlMs"),
        (with("fallbackPerRegion", json!(-1)), "fallbackPerRegion"),
        (with("regions", json!([])), "regions"),
        (with("regions", json!(["eu", "eu"])), "regions"),
        (with("regions", json!(["EU"])), "regions[0]"),
        (with("surprise", json!(1)), "surprise"),
        ("{".to_owned(), "body"),
        ("[]".to_owned(), "body"),
        (format!("{} trailing", pool_body()), "body"),
    ];
    for (body, field) in cases {
        let (status, problem) = server.put_pool("atlas/api", OPERATOR, body.clone()).await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(problem["field"], field, "{body}: {problem}");
        assert_eq!(problem["status"], 400);
    }
    let (status, problem) = server
        .put_pool("At}las/api", OPERATOR, pool_body().to_string())
        .await;
    assert_eq!((status, problem["field"].as_str()), (400, Some("tenant")));
    assert_eq!(
        server.get("/v1/pools/atlas/api", OPERATOR).await.0,
        404,
        "nothing was stored"
    );

    // A 10 MB body is refused before it is read.
    let huge = format!("{{\"limit\":1,\"pad\":\"{}\"}}", "x".repeat(10 << 20));
    let (status, _) = server.put_pool("atlas/api", OPERATOR, huge).await;
    assert_eq!(status, 413);
    // Not JSON at all.
    let response = server
        .client
        .put(format!("{}/v1/pools/atlas/api", server.url))
        .bearer_auth(OPERATOR)
        .header("content-type", "text/plain")
        .body(pool_body().to_string())
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 415);
}

#[tokio::test]
async fn tokens_have_roles() {
    let server = start().await;
    let body = pool_body().to_string();
    assert_eq!(server.put_pool("atlas/api", "", body.clone()).await.0, 401);
    assert_eq!(
        server
            .put_pool("atlas/api", "not-a-known-token-000", body.clone())
            .await
            .0,
        401
    );
    assert_eq!(
        server.put_pool("atlas/api", AGENT, body.clone()).await.0,
        403
    );
    let grant = json!({ "leaseId": allot_shared::ids::LeaseId::from_parts(1, 1), "tenant": "atlas",
                        "pool": "api", "region": "eu", "want": 1 });
    let as_operator = server
        .client
        .post(format!("{}/v1/grants", server.url))
        .bearer_auth(OPERATOR)
        .json(&grant)
        .send()
        .await
        .expect("send");
    assert_eq!(as_operator.status(), 403);
    let missing = server
        .client
        .post(format!("{}/v1/grants", server.url))
        .json(&grant)
        .send()
        .await
        .expect("send");
    assert_eq!(missing.status(), 401);
}

#[tokio::test]
async fn grants_over_http() {
    let server = start().await;
    assert_eq!(
        server
            .put_pool("atlas/api", OPERATOR, pool_body().to_string())
            .await
            .0,
        200
    );
    let post = |body: Value| {
        server
            .client
            .post(format!("{}/v1/grants", server.url))
            .bearer_auth(AGENT)
            .json(&body)
            .send()
    };
    let lease = allot_shared::ids::LeaseId::from_parts(1, 42);
    let body =
        json!({ "leaseId": lease, "tenant": "atlas", "pool": "api", "region": "eu", "want": 150 });
    let first: Value = post(body.clone())
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    for field in [
        "leaseId",
        "granted",
        "epoch",
        "windowStartMs",
        "windowEndMs",
        "expiresAtMs",
        "retryAfterMs",
    ] {
        assert!(first.get(field).is_some(), "{field} in {first}");
    }
    assert_eq!(first["granted"], 100);
    assert_eq!(
        first["ungranted"], 900,
        "what the window had left to grant after this grant: {first}"
    );
    let mut again: Value = post(body).await.expect("send").json().await.expect("json");
    // The same grant again, answered later: only the answer's own instant differs.
    let answered = |v: &Value| v["answeredAtMs"].as_u64().expect("answeredAtMs");
    assert!(answered(&again) >= answered(&first));
    again["answeredAtMs"] = first["answeredAtMs"].clone();
    assert_eq!(again, first);
    let status = |body: Value| async { post(body).await.expect("send").status().as_u16() };
    let bad_lease = json!({ "leaseId": "9f3a61c2-e07b-4d18-8a2b-0c1d2e3f4a5b", "tenant": "atlas", "pool": "api", "region": "eu", "want": 1 });
    assert_eq!(status(bad_lease).await, 400, "a v4 UUID is not a lease id");
    let zero =
        json!({ "leaseId": lease, "tenant": "atlas", "pool": "api", "region": "eu", "want": 0 });
    assert_eq!(status(zero).await, 400);
    let foreign = json!({ "leaseId": allot_shared::ids::LeaseId::from_parts(1, 43), "tenant": "atlas", "pool": "api", "region": "ap", "want": 1 });
    assert_eq!(status(foreign).await, 403);
    let unknown = json!({ "leaseId": allot_shared::ids::LeaseId::from_parts(1, 44), "tenant": "atlas", "pool": "nope", "region": "eu", "want": 1 });
    assert_eq!(status(unknown).await, 404);
    let (_, view) = server.get("/v1/pools/atlas/api", OPERATOR).await;
    assert_eq!(view["window"]["remaining"], 900);
    assert_eq!(view["window"]["grantedByRegion"]["eu"], 100);
    assert_eq!(view["window"]["leasesOutstanding"], 1);
    assert_eq!(
        view["window"]["leasesOutstandingByRegion"],
        json!({ "eu": 1 })
    );

    // Grants say the version of the terms they were made under: a pool update shows in the next.
    assert_eq!(first["termsVersion"], 1, "{first}");
    let mut raised = pool_body();
    raised["limit"] = json!(2_000);
    assert_eq!(
        server
            .put_pool("atlas/api", OPERATOR, raised.to_string())
            .await
            .0,
        200
    );
    let next = json!({ "leaseId": allot_shared::ids::LeaseId::from_parts(2, 42), "tenant": "atlas", "pool": "api", "region": "eu", "want": 1 });
    let next: Value = post(next).await.expect("send").json().await.expect("json");
    let (_, terms) = server.get("/v1/pools/atlas/api/terms", AGENT).await;
    assert_eq!(terms["version"], 2);
    assert_eq!(next["termsVersion"], terms["version"], "{next}");

    let metrics = server
        .client
        .get(format!("{}/metrics", server.url))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    assert!(
        metrics.contains("allot_grants_total{outcome=\"partial\"} 2"),
        "{metrics}"
    );
    assert!(metrics.contains("allot_tokens_granted_total"), "{metrics}");
    assert!(metrics.contains("allot_is_leader 1"), "{metrics}");
    assert!(
        metrics.contains("allot_pool_remaining_tokens{tenant=\"atlas\",pool=\"api\"}"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_round_of_reports_in_one_call_is_taken_report_by_report() {
    let server = start().await;
    for pool in ["atlas/api", "birch/api"] {
        assert_eq!(
            server
                .put_pool(pool, OPERATOR, pool_body().to_string())
                .await
                .0,
            200
        );
    }
    let grant = async |tenant: &str, lease: allot_shared::ids::LeaseId| -> Value {
        server
            .client
            .post(format!("{}/v1/grants", server.url))
            .bearer_auth(AGENT_EU)
            .json(&json!({ "leaseId": lease, "tenant": tenant, "pool": "api", "region": "eu", "want": 100 }))
            .send()
            .await
            .expect("grant")
            .json()
            .await
            .expect("json")
    };
    let (atlas_lease, birch_lease) = (
        allot_shared::ids::LeaseId::from_parts(1, 11),
        allot_shared::ids::LeaseId::from_parts(1, 12),
    );
    let window_start = grant("atlas", atlas_lease).await["windowStartMs"].clone();
    grant("birch", birch_lease).await;
    let report = |id: &str, tenant: &str, region: &str, lease, spent: u64| {
        json!({ "reportId": id, "region": region, "tenant": tenant, "pool": "api",
                "windowStartMs": window_start, "leases": [{ "leaseId": lease, "spent": spent }],
                "fallbackAdmitted": 2 })
    };
    let post = async |token: &str, reports: Vec<Value>| {
        let answer = server
            .client
            .post(format!("{}/v1/reports/batch", server.url))
            .bearer_auth(token)
            .json(&json!({ "reports": reports }))
            .send()
            .await
            .expect("batch");
        status_and_body(answer).await
    };
    let (status, answer) = post(
        AGENT_EU,
        vec![
            report("round-1-atlas", "atlas", "eu", atlas_lease, 40),
            report("round-1-atlas", "atlas", "eu", atlas_lease, 40),
            report("round-1-birch", "birch", "eu", birch_lease, 70),
            report("round-1-over", "birch", "eu", birch_lease, 101),
            report("round-1-us", "birch", "us", birch_lease, 1),
        ],
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let results = answer["results"].as_array().expect("results");
    assert_eq!(
        results.len(),
        5,
        "one result per report, in order: {answer}"
    );
    assert_eq!(results[0], json!({ "receipt": { "duplicate": false } }));
    assert_eq!(
        results[1],
        json!({ "receipt": { "duplicate": true } }),
        "the same id again in the call"
    );
    assert_eq!(results[2], json!({ "receipt": { "duplicate": false } }));
    assert_eq!(results[3]["problem"]["status"], 400);
    assert_eq!(results[3]["problem"]["field"], "reports[3].leases[0].spent");
    assert_eq!(
        results[4]["problem"]["status"], 403,
        "an EU token may not report for US"
    );
    assert_eq!(results[4]["problem"]["field"], "reports[4].region");

    // Each pool as if its report had come alone: refused reports changed nothing.
    for (pool, spent) in [("atlas/api", 40), ("birch/api", 70)] {
        let (status, windows) = server
            .get(&format!("/v1/pools/{pool}/windows?last=1"), OPERATOR)
            .await;
        assert_eq!(status, 200, "{windows}");
        let row = &windows["windows"][0];
        assert_eq!(
            (row["spent"].as_u64(), row["fallbackAdmitted"].as_u64()),
            (Some(spent), Some(2)),
            "{pool}: {row}"
        );
    }
    // The one-at-a-time route knows the batch's report ids.
    let again: Value = server
        .client
        .post(format!("{}/v1/reports", server.url))
        .bearer_auth(AGENT_EU)
        .json(&report("round-1-birch", "birch", "eu", birch_lease, 70))
        .send()
        .await
        .expect("report")
        .json()
        .await
        .expect("json");
    assert_eq!(again["duplicate"], true);

    // Bounded: reports per call.
    let too_many = (0..=allot_shared::wire::MAX_REPORTS_PER_BATCH)
        .map(|i| report(&format!("many-{i}"), "atlas", "eu", atlas_lease, 40))
        .collect();
    let (status, problem) = post(AGENT_EU, too_many).await;
    assert_eq!(
        (status, problem["field"].as_str()),
        (400, Some("reports")),
        "{problem}"
    );
}

#[tokio::test]
async fn a_round_of_renewals_in_one_call_is_decided_ask_by_ask() {
    let server = start().await;
    for pool in ["atlas/api", "birch/api"] {
        assert_eq!(
            server
                .put_pool(pool, OPERATOR, pool_body().to_string())
                .await
                .0,
            200
        );
    }
    let ask = |lease: allot_shared::ids::LeaseId, tenant: &str, region: &str, want: u64| json!({ "leaseId": lease, "tenant": tenant, "pool": "api", "region": region, "want": want });
    let post = async |asks: Vec<Value>| {
        let answer = server
            .client
            .post(format!("{}/v1/grants/batch", server.url))
            .bearer_auth(AGENT_EU)
            .json(&json!({ "grants": asks }))
            .send()
            .await
            .expect("batch");
        status_and_body(answer).await
    };
    let lease = |n: u128| allot_shared::ids::LeaseId::from_parts(1, n);
    let (status, answer) = post(vec![
        ask(lease(1), "atlas", "eu", 100),
        ask(lease(2), "birch", "eu", 60),
        ask(lease(1), "atlas", "eu", 100),
        ask(lease(3), "nobody", "eu", 100),
        ask(lease(4), "birch", "us", 100),
    ])
    .await;
    assert_eq!(status, 200, "{answer}");
    let results = answer["results"].as_array().expect("results");
    assert_eq!(results.len(), 5, "one result per ask, in order: {answer}");
    assert_eq!(results[0]["grant"]["leaseId"], json!(lease(1)));
    assert_eq!(results[0]["grant"]["granted"], 100);
    assert_eq!(results[1]["grant"]["leaseId"], json!(lease(2)));
    assert_eq!(results[1]["grant"]["granted"], 60);
    assert_eq!(
        results[2]["grant"]["granted"], 100,
        "the same lease id again in the call: the same grant"
    );
    assert_eq!(
        results[2]["grant"]["issuedAtMs"],
        results[0]["grant"]["issuedAtMs"]
    );
    assert_eq!(
        (
            &results[3]["problem"]["status"],
            &results[3]["problem"]["field"]
        ),
        (&json!(404), &json!("grants[3]")),
        "no such pool: {answer}"
    );
    assert_eq!(
        (
            &results[4]["problem"]["status"],
            &results[4]["problem"]["field"]
        ),
        (&json!(403), &json!("grants[4].region")),
        "an EU token may not ask for US: {answer}"
    );
    // A field that breaks the schema refuses the call: nothing in it is granted.
    let (status, problem) = post(vec![
        ask(lease(5), "birch", "eu", 10),
        ask(lease(6), "birch", "eu", 0),
    ])
    .await;
    assert_eq!(
        (status, problem["field"].as_str()),
        (400, Some("grants[1].want")),
        "{problem}"
    );

    // Each pool as if its asks had come alone: refused asks took nothing.
    for (pool, granted) in [("atlas/api", 100), ("birch/api", 60)] {
        let (status, view) = server.get(&format!("/v1/pools/{pool}"), OPERATOR).await;
        assert_eq!(status, 200, "{view}");
        assert_eq!(
            view["window"]["remaining"],
            1_000 - granted,
            "{pool}: {view}"
        );
    }
    // The one-at-a-time route knows the batch's lease ids.
    let again: Value = server
        .client
        .post(format!("{}/v1/grants", server.url))
        .bearer_auth(AGENT_EU)
        .json(&ask(lease(2), "birch", "eu", 60))
        .send()
        .await
        .expect("grant")
        .json()
        .await
        .expect("json");
    let without_answer_time = |mut grant: Value| {
        grant
            .as_object_mut()
            .map(|fields| fields.remove("answeredAtMs"));
        grant
    };
    assert_eq!(
        without_answer_time(again),
        without_answer_time(results[1]["grant"].clone()),
        "the grant the batch made, answered again"
    );

    // Bounded: asks per call.
    let too_many = (0..=allot_shared::wire::MAX_GRANTS_PER_BATCH)
        .map(|n| ask(lease(100 + n as u128), "atlas", "eu", 1))
        .collect();
    let (status, problem) = post(too_many).await;
    assert_eq!(
        (status, problem["field"].as_str()),
        (400, Some("grants")),
        "{problem}"
    );
}

#[tokio::test]
async fn reports_reach_the_windows_view() {
    let server = start().await;
    assert_eq!(
        server
            .put_pool("atlas/api", OPERATOR, pool_body().to_string())
            .await
            .0,
        200
    );
    let lease = allot_shared::ids::LeaseId::from_parts(1, 7);
    let grant: Value = server
        .client
        .post(format!("{}/v1/grants", server.url))
        .bearer_auth(AGENT)
        .json(&json!({ "leaseId": lease, "tenant": "atlas", "pool": "api", "region": "eu", "want": 100 }))
        .send()
        .await
        .expect("grant")
        .json()
        .await
        .expect("json");
    let window_start = grant["windowStartMs"].clone();
    let report = |id: &str, spent: u64| {
        json!({ "reportId": id, "region": "eu", "tenant": "atlas", "pool": "api",
                "windowStartMs": window_start, "leases": [{ "leaseId": lease, "spent": spent }],
                "fallbackAdmitted": 3 })
    };
    let post = |body: Value| {
        server
            .client
            .post(format!("{}/v1/reports", server.url))
            .bearer_auth(AGENT)
            .json(&body)
            .send()
    };
    // The report may overtake the grant's copy into the ledger: it is fetched from the store.
    let first = post(report("rep-1", 60)).await.expect("report");
    assert_eq!(first.status(), 200);
    assert_eq!(
        first.json::<Value>().await.expect("json")["duplicate"],
        false
    );
    let again: Value = post(report("rep-1", 60))
        .await
        .expect("report")
        .json()
        .await
        .expect("json");
    assert_eq!(again["duplicate"], true);
    let too_much = post(report("rep-2", 101)).await.expect("report");
    assert_eq!(too_much.status(), 400);
    assert_eq!(
        too_much.json::<Value>().await.expect("json")["field"],
        "leases[0].spent"
    );

    let (status, windows) = server
        .get("/v1/pools/atlas/api/windows?last=5", OPERATOR)
        .await;
    assert_eq!(status, 200, "{windows}");
    let row = &windows["windows"][0];
    assert_eq!(row["granted"], 100);
    assert_eq!(row["spent"], 60);
    assert_eq!(row["fallbackAdmitted"], 3);
    assert_eq!(row["admitted"], 63);
    assert_eq!(row["spentByRegion"], json!({ "eu": 60 }));
    assert_eq!(row["admittedByRegion"], json!({ "eu": 63 }));
    assert_eq!(row["limit"], 1000);
    assert_eq!(row["bound"], 1200);

    // The regions view: EU reported and admits in fallback this window; US is configured, quiet.
    let (status, regions) = server.get("/v1/regions", OPERATOR).await;
    assert_eq!(status, 200, "{regions}");
    let eu = &regions["regions"][0];
    assert_eq!(
        (eu["region"].as_str(), eu["pools"].as_u64()),
        (Some("eu"), Some(1))
    );
    assert!(eu["lastReportAtMs"].as_u64().is_some(), "{regions}");
    assert_eq!(
        (
            eu["poolsInFallback"].as_u64(),
            eu["fallbackAdmitted"].as_u64()
        ),
        (Some(1), Some(3))
    );
    let us = &regions["regions"][1];
    assert_eq!(us["region"], "us");
    assert_eq!(us["poolsInFallback"], 0);
    assert!(us.get("lastReportAtMs").is_none(), "{regions}");
    assert_eq!(
        server.get("/v1/regions", AGENT).await.0,
        403,
        "operators only"
    );
    assert_eq!(
        server
            .get("/v1/pools/atlas/api/windows?last=0", OPERATOR)
            .await
            .0,
        400
    );
    assert_eq!(
        server
            .get("/v1/pools/atlas/api/windows?last=x", OPERATOR)
            .await
            .0,
        400
    );
    assert_eq!(
        server.get("/v1/pools/atlas/none/windows", OPERATOR).await.0,
        404
    );

    // A restarting agent asks for the terms with its region: the window's reported fallback comes
    // with them, so it does not admit the allowance twice.
    let (status, terms) = server
        .get("/v1/pools/atlas/api/terms?region=eu", AGENT)
        .await;
    assert_eq!(status, 200, "{terms}");
    assert_eq!(terms["fallbackInWindow"]["admitted"], 3, "{terms}");
    assert_eq!(terms["fallbackInWindow"]["windowStartMs"], window_start);
    let (_, us) = server
        .get("/v1/pools/atlas/api/terms?region=us", AGENT)
        .await;
    assert_eq!(us["fallbackInWindow"]["admitted"], 0, "{us}");
    let (_, plain) = server.get("/v1/pools/atlas/api/terms", AGENT).await;
    assert!(plain.get("fallbackInWindow").is_none(), "{plain}");
    let (status, problem) = server
        .get("/v1/pools/atlas/api/terms?region=Europe!", AGENT)
        .await;
    assert_eq!(status, 400);
    assert_eq!(problem["field"], "region", "{problem}");
    let (status, problem) = server.get("/v1/pools/atlas/api/terms?zone=eu", AGENT).await;
    assert_eq!(status, 400, "{problem}");

    // Many pools' terms in one call: each as the single route answers it, in order; a missing
    // pool is refused alone, naming its place.
    let pools = json!([{ "tenant": "atlas", "pool": "api" }, { "tenant": "atlas", "pool": "none" },
                       { "tenant": "atlas", "pool": "api" }]);
    let (status, batch) = server
        .post(
            "/v1/terms/batch",
            AGENT,
            &json!({ "region": "eu", "pools": pools }),
        )
        .await;
    assert_eq!(status, 200, "{batch}");
    let results = batch["results"].as_array().expect("results");
    assert_eq!(results.len(), 3, "{batch}");
    assert_eq!(results[0]["terms"], terms, "{batch}");
    assert_eq!(results[2]["terms"], terms, "{batch}");
    assert_eq!(results[1]["problem"]["status"], 404, "{batch}");
    assert_eq!(results[1]["problem"]["field"], "pools[1]", "{batch}");
    assert!(results[1].get("terms").is_none(), "{batch}");
    let (_, without_region) = server
        .post("/v1/terms/batch", AGENT, &json!({ "pools": pools }))
        .await;
    assert_eq!(without_region["results"][0]["terms"], plain);
    // More pools than one store read takes: every one still answered at its place.
    let mut many: Vec<Value> = (0..255)
        .map(|n| json!({ "tenant": "atlas", "pool": format!("none{n}") }))
        .collect();
    many.push(json!({ "tenant": "atlas", "pool": "api" }));
    let (status, batch) = server
        .post(
            "/v1/terms/batch",
            AGENT,
            &json!({ "region": "eu", "pools": many }),
        )
        .await;
    assert_eq!(status, 200, "{batch}");
    assert_eq!(batch["results"][255]["terms"], terms);
    assert_eq!(batch["results"][128]["problem"]["field"], "pools[128]");
    // Bounds and fields refuse the whole call, naming the field.
    let too_many: Vec<Value> = (0..257)
        .map(|_| json!({ "tenant": "atlas", "pool": "api" }))
        .collect();
    for (body, field) in [
        (json!({ "pools": too_many }), "pools"),
        (json!({ "agentId": "eu-1", "pools": [] }), "agentId"),
        (json!({ "region": "Europe!", "pools": [] }), "region"),
    ] {
        let (status, problem) = server.post("/v1/terms/batch", AGENT, &body).await;
        assert_eq!(status, 400, "{problem}");
        assert_eq!(problem["field"], field, "{problem}");
    }
}

/// A final report's unspent tokens come back to the window through the API: the receipt says how
/// many, asking again changes nothing, a line that gives back more than the lease holds or before
/// it ended is refused naming the field, and the windows view counts what came back.
#[tokio::test]
async fn unspent_tokens_given_back_are_granted_again_once() {
    let server = start().await;
    let body = json!({ "limit": 100, "windowMs": 60000, "chunk": 100, "leaseTtlMs": 15000,
                       "fallbackPerRegion": 10, "regions": ["eu", "us"] });
    assert_eq!(
        server
            .put_pool("atlas/api", OPERATOR, body.to_string())
            .await
            .0,
        200
    );
    let grant = |n: u128, region: &'static str, want: u64| {
        let lease = allot_shared::ids::LeaseId::from_parts(1, n);
        let request = server
            .client
            .post(format!("{}/v1/grants", server.url))
            .bearer_auth(AGENT)
            .json(&json!({ "leaseId": lease, "tenant": "atlas", "pool": "api",
                           "region": region, "want": want }));
        async move {
            (
                lease,
                status_and_body(request.send().await.expect("grant"))
                    .await
                    .1,
            )
        }
    };
    let (lease, first) = grant(1, "eu", 100).await;
    assert_eq!(
        (first["granted"].as_u64(), first["returnable"].as_bool()),
        (Some(100), Some(true)),
        "{first}"
    );
    assert_eq!(grant(2, "us", 10).await.1["granted"], 0, "used up");
    let report = |id: &str, spent: u64, unspent: u64, last: bool| {
        json!({ "reportId": id, "region": "eu", "tenant": "atlas", "pool": "api",
                "windowStartMs": first["windowStartMs"],
                "leases": [{ "leaseId": lease, "spent": spent, "final": last, "unspent": unspent }] })
    };
    let post = |body: Value| {
        let request = server
            .client
            .post(format!("{}/v1/reports", server.url))
            .bearer_auth(AGENT)
            .json(&body);
        async move { status_and_body(request.send().await.expect("report")).await }
    };
    let (status, problem) = post(report("early", 40, 60, false)).await;
    assert_eq!(
        (status, problem["field"].as_str()),
        (400, Some("leases[0].unspent")),
        "{problem}"
    );
    let (status, problem) = post(report("too-much", 50, 60, true)).await;
    assert_eq!(
        (status, problem["field"].as_str()),
        (400, Some("leases[0].unspent")),
        "{problem}"
    );
    let (status, receipt) = post(report("last", 40, 60, true)).await;
    assert_eq!(status, 200, "{receipt}");
    assert_eq!(
        (receipt["duplicate"].as_bool(), receipt["returned"].as_u64()),
        (Some(false), Some(60))
    );
    let (_, again) = post(report("last", 40, 60, true)).await;
    assert_eq!(
        (again["duplicate"].as_bool(), again["returned"].as_u64()),
        (Some(true), Some(60))
    );
    assert_eq!(
        grant(3, "us", 100).await.1["granted"],
        60,
        "granted again, once"
    );
    assert_eq!(grant(4, "us", 100).await.1["granted"], 0);
    let (status, windows) = server
        .get("/v1/pools/atlas/api/windows?last=1", OPERATOR)
        .await;
    assert_eq!(status, 200, "{windows}");
    let row = &windows["windows"][0];
    assert_eq!(
        (
            row["granted"].as_u64(),
            row["returned"].as_u64(),
            row["spent"].as_u64()
        ),
        (Some(160), Some(60), Some(40)),
        "{row}"
    );
}

#[tokio::test]
async fn policies_publish_stage_promote_and_report() {
    let server = start().await;
    let bundle = include_str!("../../../deploy/examples/northstar-bundle.json");
    let publish = |query: &'static str, body: String| {
        server
            .client
            .put(format!("{}/v1/policies{query}", server.url))
            .bearer_auth(OPERATOR)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let current = |region: &'static str| {
        server
            .client
            .get(format!(
                "{}/v1/policies/current?region={region}",
                server.url
            ))
            .bearer_auth(AGENT)
            .send()
    };
    assert_eq!(
        current("eu").await.expect("get").status(),
        404,
        "nothing current yet"
    );

    // The example's own bundleVersion (42) is ignored: the control plane assigns versions.
    let first: Value = publish("", bundle.to_owned())
        .await
        .expect("publish")
        .json()
        .await
        .expect("json");
    assert_eq!(first["bundleVersion"], 1);
    assert!(
        first["checksum"]
            .as_str()
            .is_some_and(|c| c.starts_with("sha256:"))
    );
    let staged = publish("?canary=eu", bundle.replace("20000", "30000"))
        .await
        .expect("publish");
    assert_eq!(staged.status(), 200);
    let eu: Value = current("eu")
        .await
        .expect("get")
        .json()
        .await
        .expect("json");
    let us: Value = current("us")
        .await
        .expect("get")
        .json()
        .await
        .expect("json");
    assert_eq!(
        (eu["bundleVersion"].as_u64(), us["bundleVersion"].as_u64()),
        (Some(2), Some(1))
    );

    // Agents report what they run; the status shows the skew.
    // us-2 runs another pepper than us-1: the status shows the region's two fingerprints.
    for (region, agent, version, pepper) in [
        ("eu", "eu-1", 2, "0a1b2c3d"),
        ("us", "us-1", 1, "0a1b2c3d"),
        ("us", "us-2", 0, "ffff0000"),
    ] {
        let response = server
            .client
            .post(format!("{}/v1/policies/status", server.url))
            .bearer_auth(AGENT)
            .json(
                &json!({ "region": region, "agentId": agent, "version": version,
                           "pepperFingerprint": pepper }),
            )
            .send()
            .await
            .expect("report");
        assert_eq!(response.status(), 204);
    }
    let (_, status) = server.get("/v1/policies/status", OPERATOR).await;
    assert_eq!(status["rollout"]["current"], 1);
    assert_eq!(status["rollout"]["canary"]["version"], 2);
    assert_eq!(
        (status["minVersion"].as_u64(), status["maxVersion"].as_u64()),
        (Some(0), Some(2))
    );
    assert_eq!(status["agentsBehind"], 1, "us-2 runs nothing yet");
    assert_eq!(status["pepperFingerprints"]["eu"], json!(["0a1b2c3d"]));
    assert_eq!(
        status["pepperFingerprints"]["us"],
        json!(["0a1b2c3d", "ffff0000"])
    );

    let promoted = server
        .client
        .post(format!("{}/v1/policies/2/promote", server.url))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .expect("promote");
    assert_eq!(promoted.status(), 200);
    let us: Value = current("us")
        .await
        .expect("get")
        .json()
        .await
        .expect("json");
    assert_eq!(us["bundleVersion"], 2);
    let (status, old) = server.get("/v1/policies/1", OPERATOR).await;
    assert_eq!((status, old["bundleVersion"].as_u64()), (200, Some(1)));
    assert_eq!(server.get("/v1/policies/9", OPERATOR).await.0, 404);
    assert_eq!(server.get("/v1/policies/x", OPERATOR).await.0, 400);

    // An invalid bundle is refused naming the rule's field; nothing is published.
    let invalid = bundle.replacen("\"costMillis\": 1000,", "\"costMillis\": 99999,", 1);
    let refused = publish("", invalid).await.expect("publish");
    assert_eq!(refused.status(), 400);
    let problem: Value = refused.json().await.expect("json");
    assert_eq!(problem["field"], "rules[0].costMillis");
    assert!(
        problem["detail"]
            .as_str()
            .is_some_and(|d| d.contains("read-user-v3")),
        "{problem}"
    );
    let (_, status) = server.get("/v1/policies/status", OPERATOR).await;
    assert_eq!(status["rollout"]["latest"], 2);
    // Staging to an invalid region is refused.
    assert_eq!(
        publish("?canary=E%7DU", bundle.to_owned())
            .await
            .expect("publish")
            .status(),
        400
    );
}

const BUNDLE: &str = include_str!("../../../deploy/examples/northstar-bundle.json");

/// The example bundle with its first rule's burst changed, so versions differ in content.
fn bundle_with_capacity(capacity_millis: u64) -> String {
    BUNDLE.replacen(
        "\"capacityMillis\": 20000",
        &format!("\"capacityMillis\": {capacity_millis}"),
        1,
    )
}

/// An answer's status, JSON body and `Location`.
struct Answered {
    status: u16,
    body: Value,
    location: Option<String>,
}

impl Server {
    async fn publish_policy(&self, query: &str, body: String) -> Answered {
        let request = self
            .client
            .put(format!("{}/v1/policies{query}", self.url))
            .header("content-type", "application/json")
            .body(body);
        answered(request).await
    }

    /// `POST /v1/policies/{version}/{action}` (promote, rollback) as an author.
    async fn policy_action(&self, version: &str, action: &str) -> Answered {
        let request = self
            .client
            .post(format!("{}/v1/policies/{version}/{action}", self.url));
        answered(request).await
    }

    /// The bundle version an agent of `region` is told to run.
    async fn version_for(&self, region: &str) -> Option<u64> {
        let (status, bundle) = self
            .get(&format!("/v1/policies/current?region={region}"), AGENT)
            .await;
        assert_eq!(status, 200, "{bundle}");
        bundle["bundleVersion"].as_u64()
    }
}

async fn answered(request: reqwest::RequestBuilder) -> Answered {
    let response = request.bearer_auth(AUTHOR).send().await.expect("send");
    let status = response.status().as_u16();
    if !response.status().is_success() {
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json",
            "errors are problem+json"
        );
    }
    let location = response
        .headers()
        .get("location")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = response.json().await.unwrap_or(Value::Null);
    Answered {
        status,
        body,
        location,
    }
}

/// Agents only install a higher version: promoting an older one would leave running agents on the
/// current one while new ones fetch the older (a region split), so it is refused with the way out;
/// a rollback publishes the older content as the next version, current everywhere.
#[tokio::test]
async fn promoting_an_older_version_is_refused_and_a_rollback_publishes_it_anew() {
    let server = start().await;
    let first = server.publish_policy("", BUNDLE.to_owned()).await;
    assert_eq!(
        (first.status, first.body["bundleVersion"].as_u64()),
        (200, Some(1))
    );
    let second = server
        .publish_policy("", bundle_with_capacity(30_000))
        .await;
    assert_eq!(second.body["bundleVersion"], 2, "{}", second.body);

    let refused = server.policy_action("1", "promote").await;
    assert_eq!(refused.status, 409, "{}", refused.body);
    let detail = refused.body["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("version 1 is older than the current version 2")
            && detail.contains("POST /v1/policies/1/rollback"),
        "{detail}"
    );
    let (_, status) = server.get("/v1/policies/status", OPERATOR).await;
    assert_eq!(
        (
            status["rollout"]["current"].as_u64(),
            status["rollout"]["latest"].as_u64()
        ),
        (Some(2), Some(2)),
        "{status}"
    );
    let again = server.policy_action("2", "promote").await;
    assert_eq!(
        again.status, 200,
        "promoting the current version is a no-op"
    );

    let rolled = server.policy_action("1", "rollback").await;
    assert_eq!(rolled.status, 201, "{}", rolled.body);
    assert_eq!(rolled.location.as_deref(), Some("/v1/policies/3"));
    assert_eq!(rolled.body["bundleVersion"], 3);
    assert_eq!(rolled.body["rules"], first.body["rules"], "v1's rules");
    assert_ne!(rolled.body["checksum"], first.body["checksum"]);
    // The checksum is v1's content sealed as version 3 at its publication time: nothing else.
    let v1 = allot_shared::policy::parse_bundle(&first.body.to_string()).expect("v1");
    let published_at = rolled.body["publishedAt"].as_str().map(str::to_owned);
    let resealed = v1.seal(3, published_at);
    assert_eq!(rolled.body["checksum"], resealed.checksum());

    let (_, status) = server.get("/v1/policies/status", OPERATOR).await;
    assert_eq!(status["rollout"]["current"], 3, "{status}");
    assert!(status["rollout"].get("canary").is_none(), "{status}");
    assert_eq!(server.version_for("eu").await, Some(3));
    let (_, stored) = server.get("/v1/policies/3", AGENT).await;
    assert_eq!(stored, rolled.body);

    // Audited as a rollback of the new version.
    let (_, audit) = server.get("/v1/audit?last=1", OPERATOR).await;
    let entry = &audit["entries"][0];
    assert_eq!(
        (
            entry["action"].as_str(),
            entry["target"].as_str(),
            entry["version"].as_u64()
        ),
        (Some("policy.rollback"), Some("3"), Some(3)),
        "{audit}"
    );
    assert_eq!(server.policy_action("9", "rollback").await.status, 404);
    let bad = server.policy_action("x", "rollback").await;
    assert_eq!(
        (bad.status, bad.body["field"].as_str()),
        (400, Some("version"))
    );
}

/// A canary replaced by a newer one must not leave the older canary's regions behind: their
/// agents run a version above the current one and would never go back down to it.
#[tokio::test]
async fn a_newer_canary_never_strands_the_older_canarys_regions() {
    let server = start().await;
    assert_eq!(
        server.publish_policy("", BUNDLE.to_owned()).await.status,
        200
    );
    let staged = server
        .publish_policy("?canary=eu", bundle_with_capacity(30_000))
        .await;
    assert_eq!(staged.body["bundleVersion"], 2, "{}", staged.body);

    let refused = server
        .publish_policy("?canary=us", bundle_with_capacity(40_000))
        .await;
    assert_eq!(refused.status, 409, "{}", refused.body);
    assert_eq!(refused.body["field"], "canary");
    let detail = refused.body["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("canary version 2 runs in eu") && detail.contains("must include eu"),
        "{detail}"
    );
    assert_eq!(
        server.version_for("eu").await,
        Some(2),
        "eu stays on its canary"
    );
    assert_eq!(server.version_for("us").await, Some(1));

    let widened = server
        .publish_policy("?canary=us,eu", bundle_with_capacity(40_000))
        .await;
    assert_eq!(widened.body["bundleVersion"], 3, "{}", widened.body);
    for (region, version) in [("eu", 3), ("us", 3), ("ap", 1)] {
        assert_eq!(server.version_for(region).await, Some(version), "{region}");
    }

    // Promoting the orphaned version 2 raises everyone else to it; the canary regions keep 3.
    assert_eq!(server.policy_action("2", "promote").await.status, 200);
    for (region, version) in [("eu", 3), ("us", 3), ("ap", 2)] {
        assert_eq!(server.version_for(region).await, Some(version), "{region}");
    }
    assert_eq!(server.policy_action("1", "promote").await.status, 409);
    // A rollback ends the canary: everyone runs version 1's content as version 4.
    assert_eq!(server.policy_action("1", "rollback").await.status, 201);
    for region in ["eu", "us", "ap"] {
        assert_eq!(server.version_for(region).await, Some(4), "{region}");
    }
}

/// Calendar windows: a monthly plan in Berlin time. The spec round-trips, grants and terms carry
/// the local month's bounds, and bad calendars, zones or combinations are refused by field.
#[tokio::test]
async fn calendar_pools_grant_within_the_local_month() {
    let server = start().await;
    let monthly = json!({ "limit": 100000, "window": { "calendar": "month", "timeZone": "Europe/Berlin" },
                          "chunk": 1000, "leaseTtlMs": 60000, "fallbackPerRegion": 0, "regions": ["eu"] });
    let (status, body) = server
        .put_pool("atlas/plan", OPERATOR, monthly.to_string())
        .await;
    assert_eq!(status, 200, "{body}");
    // The view's one window object says what the window is and where it stands.
    let (_, view) = server.get("/v1/pools/atlas/plan", OPERATOR).await;
    assert_eq!(view["window"]["calendar"], "month", "{view}");
    assert_eq!(view["window"]["timeZone"], "Europe/Berlin", "{view}");
    assert!(view["window"]["windowStartMs"].is_u64(), "{view}");
    assert!(view.get("windowMs").is_none(), "{view}");
    let (_, list) = server.get("/v1/pools", OPERATOR).await;
    assert_eq!(list["pools"][0]["window"], monthly["window"], "{list}");
    let (_, terms) = server.get("/v1/pools/atlas/plan/terms", AGENT).await;
    assert_eq!(terms["window"], monthly["window"], "{terms}");
    assert_eq!(
        terms["windowMs"],
        (31 * 24 + 2) * 3_600_000u64,
        "old agents read the longest month"
    );
    // A lease id made more than an hour ago is refused in windows that outlive a grant's record
    // (its grant, if any, may be forgotten): the field is named, and a fresh id is granted.
    let now_ms = allot_allocator::clock::Clock::now_ms(&allot_allocator::clock::SystemClock);
    let outlived = server
        .client
        .post(format!("{}/v1/grants", server.url))
        .bearer_auth(AGENT)
        .json(
            &json!({ "leaseId": allot_shared::ids::LeaseId::from_parts(now_ms - 2 * 3_600_000, 7),
                       "tenant": "atlas", "pool": "plan", "region": "eu", "want": 10 }),
        )
        .send()
        .await
        .expect("grant");
    let (status, problem) = status_and_body(outlived).await;
    assert_eq!(
        (status, problem["field"].as_str()),
        (400, Some("leaseId")),
        "{problem}"
    );
    let grant: Value = server
        .client
        .post(format!("{}/v1/grants", server.url))
        .bearer_auth(AGENT)
        .json(
            &json!({ "leaseId": allot_shared::ids::LeaseId::from_parts(now_ms, 7), "tenant": "atlas",
                       "pool": "plan", "region": "eu", "want": 10 }),
        )
        .send()
        .await
        .expect("grant")
        .json()
        .await
        .expect("json");
    // The window starts at local midnight of the first and ends at the next month's, in Berlin.
    let berlin = jiff::tz::TimeZone::get("Europe/Berlin").expect("zone");
    let local = |ms: &Value| {
        jiff::Timestamp::from_millisecond(ms.as_i64().expect("ms"))
            .expect("instant")
            .to_zoned(berlin.clone())
    };
    let (start, end) = (local(&grant["windowStartMs"]), local(&grant["windowEndMs"]));
    assert_eq!(
        (start.day(), start.hour(), start.minute()),
        (1, 0, 0),
        "{start}"
    );
    assert_eq!((end.day(), end.hour()), (1, 0), "{end}");
    assert_eq!(
        end.date(),
        start
            .date()
            .first_of_month()
            .checked_add(jiff::ToSpan::month(1))
            .expect("next month"),
        "one month"
    );
    assert!(
        grant["expiresAtMs"].as_u64() <= grant["windowEndMs"].as_u64(),
        "{grant}"
    );

    for (window, field) in [
        (
            json!({ "calendar": "fortnight", "timeZone": "UTC" }),
            "window.calendar",
        ),
        (
            json!({ "calendar": "month", "timeZone": "Mars/Olympus_Mons" }),
            "window.timeZone",
        ),
        (
            json!({ "calendar": "month", "timeZone": "+02:00" }),
            "window.timeZone",
        ),
        (json!({ "calendar": "month" }), "window.timeZone"),
    ] {
        let mut body = monthly.clone();
        body["window"] = window;
        let (status, problem) = server
            .put_pool("atlas/bad", OPERATOR, body.to_string())
            .await;
        assert_eq!(status, 400, "{problem}");
        assert_eq!(problem["field"], field, "{problem}");
    }
    let mut both = monthly.clone();
    both["windowMs"] = json!(60000);
    let (status, problem) = server
        .put_pool("atlas/bad", OPERATOR, both.to_string())
        .await;
    assert_eq!(
        (status, problem["field"].as_str()),
        (400, Some("windowMs")),
        "{problem}"
    );
    let mut daily_long_lease = monthly.clone();
    daily_long_lease["window"] = json!({ "calendar": "day", "timeZone": "UTC" });
    daily_long_lease["leaseTtlMs"] = json!(24 * 3_600_000);
    let (status, problem) = server
        .put_pool("atlas/bad", OPERATOR, daily_long_lease.to_string())
        .await;
    assert_eq!(
        (status, problem["field"].as_str()),
        (400, Some("leaseTtlMs")),
        "{problem}"
    );
    assert_eq!(
        server.get("/v1/pools/atlas/bad", OPERATOR).await.0,
        404,
        "nothing was written"
    );
}

/// Agent sessions over HTTP: a run starts (the region's first agent is clean), a crash leaves the
/// next run unclean, a clean end makes the next one clean; only agents of the region may speak for
/// it, and a bad body is a 400 naming the field.
#[tokio::test]
async fn agent_sessions_say_how_the_last_run_ended() {
    let server = start().await;
    let call = async |path: &'static str, token: &'static str, body: Value| {
        let (status, body) = server.post(path, token, &body).await;
        Answered {
            status,
            body,
            location: None,
        }
    };
    let run = |n: u128| {
        json!({ "region": "eu", "agentId": "eu-9700",
                "incarnation": allot_shared::ids::AgentIncarnation::from_parts(1, n) })
    };
    let first = call("/v1/agent-sessions", AGENT, run(1)).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    assert_eq!(
        first.body["predecessorEndedCleanly"], true,
        "the first agent"
    );
    assert!(first.body["startedAtMs"].as_u64().is_some());
    let crashed = call("/v1/agent-sessions", AGENT, run(2)).await;
    assert_eq!(
        crashed.body["predecessorEndedCleanly"], false,
        "run 1 never ended"
    );
    assert!(
        crashed.body["uncleanSinceMs"].as_u64().is_some(),
        "{:?}",
        crashed.body
    );
    assert!(
        first.body.get("uncleanSinceMs").is_none(),
        "{:?}",
        first.body
    );
    let ended = call("/v1/agent-sessions/end", AGENT, run(2)).await;
    assert_eq!(
        (ended.status, ended.body["ended"].clone()),
        (200, json!(true))
    );
    let clean = call("/v1/agent-sessions", AGENT, run(3)).await;
    assert_eq!(clean.body["predecessorEndedCleanly"], true, "run 2 ended");

    // An agent token scoped to eu may not speak for us.
    let us = json!({ "region": "us", "agentId": "us-1",
                     "incarnation": allot_shared::ids::AgentIncarnation::from_parts(1, 9) });
    let refused = call("/v1/agent-sessions", common::AGENT_EU, us).await;
    assert_eq!(refused.status, 403, "{:?}", refused.body);
    assert_eq!(refused.body["field"], "region");
    // Operators are not agents.
    assert_eq!(
        call("/v1/agent-sessions", OPERATOR, run(4)).await.status,
        403
    );
    for (body, field) in [
        (
            json!({ "region": "eu", "agentId": "eu 1", "incarnation": allot_shared::ids::AgentIncarnation::from_parts(1, 5) }),
            "agentId",
        ),
        (
            json!({ "region": "eu", "agentId": "eu-1", "incarnation": "9f3a61c2-e07b-4d18-8a2b-0c1d2e3f4a5b" }),
            "incarnation",
        ),
        (json!({ "region": "eu", "agentId": "eu-1" }), "incarnation"),
        (
            json!({ "region": "eu", "agentId": "eu-1", "incarnation": allot_shared::ids::AgentIncarnation::from_parts(1, 5), "extra": 1 }),
            "extra",
        ),
    ] {
        let bad = call("/v1/agent-sessions", AGENT, body.clone()).await;
        assert_eq!(bad.status, 400, "{body}: {:?}", bad.body);
        assert!(
            bad.body.to_string().contains(field),
            "{body}: the problem names {field}: {:?}",
            bad.body
        );
    }
}

/// Writes into the ledger what the allocator and agents would have for `tenant/pool` in the
/// minute windows `minutes_ago` before now: a grant to each of eu and us and its final report.
async fn usage_history(server: &Server, tenant: &str, pool: &str, minutes_ago: &[u64]) {
    let now_ms = allot_allocator::clock::Clock::now_ms(&allot_allocator::clock::SystemClock);
    let tenant_id = allot_shared::ids::TenantId::parse(tenant).expect("tenant");
    let pool_id = allot_shared::ids::PoolId::parse(pool).expect("pool");
    for &ago in minutes_ago {
        let start_ms = (now_ms / 60_000 - ago) * 60_000;
        for (n, region) in ["eu", "us"].into_iter().enumerate() {
            let lease = allot_shared::ids::LeaseId::from_parts(start_ms + 1, rand::random());
            let granted = 100 + ago * 10 + n as u64;
            let record: allot_allocator::pools::GrantRecord = serde_json::from_value(json!({
                "leaseId": lease, "region": region, "granted": granted, "epoch": 1,
                "windowStartMs": start_ms, "windowEndMs": start_ms + 60_000,
                "expiresAtMs": start_ms + 30_000, "retryAfterMs": 0 }))
            .expect("grant record");
            server
                .ledger
                .record_grants(&tenant_id, &pool_id, &[record])
                .await
                .expect("grant");
            let report: allot_shared::wire::Report = serde_json::from_value(json!({
                "reportId": format!("r-{lease}"), "region": region, "tenant": tenant,
                "pool": pool, "windowStartMs": start_ms,
                "leases": [{ "leaseId": lease, "spent": granted - 7, "final": true }],
                "fallbackAdmitted": 2 }))
            .expect("report");
            server
                .ledger
                .record_report(&report, start_ms + 40_000)
                .await
                .expect("report");
        }
    }
}

#[tokio::test]
async fn usage_exports_every_region_and_window_once_in_pages_as_json_lines_or_csv() {
    let server = start().await;
    for name in ["atlas/api", "atlas/web", "beta/api"] {
        let mut body = pool_body();
        body["limit"] = json!(100_000);
        body["chunk"] = json!(1_000);
        assert_eq!(
            server.put_pool(name, OPERATOR, body.to_string()).await.0,
            200
        );
        let (tenant, pool) = name.split_once('/').expect("name");
        usage_history(&server, tenant, pool, &[2, 3, 4, 5, 6]).await;
    }
    let now_ms = allot_allocator::clock::Clock::now_ms(&allot_allocator::clock::SystemClock);
    let (from, to) = (now_ms - 10 * 60_000, now_ms);
    let export = async |query: String| -> (u16, reqwest::header::HeaderMap, String) {
        let response = server
            .client
            .get(format!("{}/v1/usage?{query}", server.url))
            .bearer_auth(OPERATOR)
            .send()
            .await
            .expect("usage");
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        (status, headers, response.text().await.expect("text"))
    };
    let records = |text: &str| -> Vec<Value> {
        text.lines()
            .map(|line| serde_json::from_str(line).expect("a JSON line"))
            .collect()
    };
    let (status, headers, whole) = export(format!("from={from}&to={to}")).await;
    assert_eq!(status, 200, "{whole}");
    assert_eq!(headers["content-type"], "application/x-ndjson");
    assert!(
        headers.get("allot-next-after").is_none(),
        "one page holds it all"
    );
    let all = records(&whole);
    assert_eq!(all.len(), 3 * 5 * 2, "a record per pool, window and region");
    let first = &all[0];
    assert_eq!(
        (
            first["tenant"].as_str(),
            first["pool"].as_str(),
            first["region"].as_str()
        ),
        (Some("atlas"), Some("api"), Some("eu"))
    );
    // Newest window first within a pool: 2 minutes ago, eu granted 100 + 20.
    assert_eq!(first["granted"], 120);
    assert_eq!(first["spent"], 113);
    assert_eq!(first["fallbackAdmitted"], 2);
    assert_eq!(first["admitted"], 115);
    assert_eq!(first["closed"], true);
    let ids: std::collections::BTreeSet<String> = all
        .iter()
        .map(|r| r["recordId"].as_str().expect("id").to_owned())
        .collect();
    assert_eq!(ids.len(), all.len(), "every record has an id of its own");
    let (_, _, again) = export(format!("from={from}&to={to}")).await;
    assert_eq!(
        again, whole,
        "an export run twice gives the same records and ids"
    );

    // Pages of 3 records: a window's two regions are never split, and following the cursor
    // gives every record once.
    let mut paged = Vec::new();
    let mut pages = 0;
    let mut after: Option<String> = None;
    loop {
        let mut query = format!("from={from}&to={to}&limit=3");
        if let Some(after) = &after {
            query.push_str(&format!(
                "&after={}",
                after.replace('/', "%2F").replace('@', "%40")
            ));
        }
        let (status, headers, text) = export(query).await;
        assert_eq!(status, 200, "{text}");
        let page = records(&text);
        assert!(page.len() <= 3 && page.len() % 2 == 0, "{text}");
        paged.extend(page);
        pages += 1;
        match headers.get("allot-next-after") {
            Some(next) => after = Some(next.to_str().expect("ascii").to_owned()),
            None => break,
        }
        assert!(pages < 100, "the cursor moves on");
    }
    assert_eq!(paged, all, "the pages are the whole export, in order");

    let (_, _, atlas) = export(format!("from={from}&to={to}&prefix=atlas%2F")).await;
    assert_eq!(records(&atlas).len(), 2 * 5 * 2);
    let narrow = format!(
        "from={}&to={}",
        now_ms - 4 * 60_000 - now_ms % 60_000,
        now_ms - 2 * 60_000 - now_ms % 60_000
    );
    let (_, _, two_windows) = export(narrow).await;
    assert_eq!(
        records(&two_windows).len(),
        3 * 2 * 2,
        "windows starting in [from, to)"
    );

    let (status, headers, csv) = export(format!("from={from}&to={to}&format=csv")).await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "text/csv; charset=utf-8");
    let mut lines = csv.lines();
    assert_eq!(lines.next(), Some(allot_allocator::http::USAGE_CSV_HEADER));
    let rows: Vec<&str> = lines.collect();
    assert_eq!(rows.len(), all.len());
    assert!(rows[0].starts_with(all[0]["recordId"].as_str().expect("id")));
    assert!(rows[0].contains(",atlas,api,eu,"), "{}", rows[0]);

    for (query, field) in [
        (format!("from={to}&to={from}"), "to"),
        (format!("from={from}&to={to}&format=xml"), "format"),
        (format!("from={from}&to={to}&limit=0"), "limit"),
        (format!("from={from}&to={to}&limit=10001"), "limit"),
        (format!("from={from}&to={to}&limit=x"), "limit"),
        (format!("from=x&to={to}"), "from"),
        (format!("from={from}&to={to}&colour=red"), "colour"),
        (format!("from={from}&to={to}&after=nonsense"), "after"),
        (format!("from={from}&to={to}&prefix=Bad%20Prefix"), "prefix"),
        (format!("to={to}"), "from"),
    ] {
        let (status, _, text) = export(query.clone()).await;
        assert_eq!(status, 400, "{query}: {text}");
        let problem: Value = serde_json::from_str(&text).expect("problem+json");
        assert_eq!(problem["field"], field, "{query}: {text}");
    }
    let viewer = server
        .client
        .get(format!("{}/v1/usage?from={from}&to={to}", server.url))
        .bearer_auth(VIEWER)
        .send()
        .await
        .expect("usage");
    assert_eq!(viewer.status(), 200, "viewers may export usage");
    let agent = server
        .client
        .get(format!("{}/v1/usage?from={from}&to={to}", server.url))
        .bearer_auth(AGENT)
        .send()
        .await
        .expect("usage");
    assert_eq!(agent.status(), 403, "agents may not");
}
