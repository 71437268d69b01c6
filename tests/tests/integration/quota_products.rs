//! Quota products end to end: a real allocator on a real etcd, an agent on a real Redis, a gateway
//! calling the agent's HTTP API. Checks without spending (`dryRun`) leave the ledger untouched;
//! `GET /v1/quota` shows the caller's own and exposed quotas, the pool's from the allocator's last
//! answer; a soft rule flags the caller; a pool in shadow mode grants nothing while the ledger
//! records what enforcing it would have spent; a monthly plan follows the local calendar; metered
//! requests settle their actual cost after the response, and the ledger accounts for every token.

use serde_json::{Value, json};

use crate::stack;

use crate::stack::{GATEWAY, put_pool, start_agent, start_allocator, windows};
use allot_testkit::{EtcdCluster, RedisServer};

fn request(n: usize, user: &str, dry_run: bool) -> Value {
    json!({ "requestId": format!("q-{n}"), "tenantId": "atlas",
            "principal": { "type": "user", "id": user }, "routeGroup": "read", "method": "GET",
            "dryRun": dry_run })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_quotas_soft_rules_and_shadow_pools_through_the_agent_and_the_ledger() {
    let etcd = EtcdCluster::single();
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let allocator = start_allocator(&etcd, dir.path()).await;
    // Hour-long windows: the whole run is one window.
    let pool = |limit: u64| {
        json!({ "limit": limit, "windowMs": 3_600_000, "chunk": 5, "leaseTtlMs": 60_000,
                "fallbackPerRegion": 0, "regions": ["eu"] })
    };
    put_pool(&allocator, "atlas", "api", &pool(20)).await;
    put_pool(&allocator, "atlas", "beta", &pool(5)).await;
    let bundle = stack::bundle(&json!({ "rules": [
        { "id": "user-read", "scope": "user", "routeGroup": "read", "algorithm": "fixed_window",
          "limit": 3, "windowMs": 3_600_000, "failMode": "closed" },
        { "id": "plan", "scope": "tenant", "algorithm": "fixed_window", "limit": 6,
          "windowMs": 3_600_000, "failMode": "closed", "mode": "soft", "expose": true },
        { "id": "global-api", "scope": "global", "pool": "api", "failMode": "closed",
          "expose": true },
        { "id": "global-beta", "scope": "global", "pool": "beta", "failMode": "closed",
          "mode": "shadow" }
    ]}));
    let (agent, url) = start_agent("eu", &allocator, &redis, bundle).await;
    let http = stack::http();
    let admit = |body: Value| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            http.post(format!("{url}/v1/admit"))
                .bearer_auth(GATEWAY)
                .json(&body)
                .send()
                .await
                .expect("admit")
                .json::<Value>()
                .await
                .expect("decision")
        }
    };
    let quota = |user: &str| {
        let (http, url) = (http.clone(), url.clone());
        let query = format!("tenantId=atlas&principalType=user&principalId={user}&routeGroup=read");
        async move {
            let answer = http
                .get(format!("{url}/v1/quota?{query}"))
                .bearer_auth(GATEWAY)
                .send()
                .await
                .expect("quota");
            assert_eq!(answer.status(), 200);
            answer.json::<Value>().await.expect("status")
        }
    };
    let line = |status: &Value, id: &str| -> Value {
        status["quotas"]
            .as_array()
            .and_then(|lines| lines.iter().find(|l| l["policyId"] == id).cloned())
            .unwrap_or_else(|| panic!("no {id} in {status}"))
    };

    // Ten checks by U-1: all would be admitted, none spends anything anywhere.
    for n in 0..10 {
        let check = admit(request(n, "U-1", true)).await;
        assert_eq!(
            (check["allowed"].clone(), check["dryRun"].clone()),
            (json!(true), json!(true)),
            "{check}"
        );
    }
    let before = quota("U-1").await;
    assert_eq!(line(&before, "user-read")["remaining"], 3, "{before}");
    assert_eq!(line(&before, "plan")["remaining"], 6, "{before}");
    let api = line(&before, "global-api");
    assert_eq!(api["limit"], 20, "{api}");
    assert!(
        api["remaining"].is_null() || api["remaining"] == 20,
        "nothing spent yet: {api}"
    );
    assert!(
        before["quotas"]
            .as_array()
            .is_some_and(|l| l.iter().all(|q| q["policyId"] != "global-beta")),
        "a shadow pool nobody exposed is not shown: {before}"
    );

    // U-1's three real requests, then a denial by their own rule.
    for n in 10..13 {
        let real = admit(request(n, "U-1", false)).await;
        assert_eq!(real["allowed"], true, "{real}");
        assert!(real.get("dryRun").is_none(), "{real}");
    }
    let denied = admit(request(13, "U-1", false)).await;
    assert_eq!(denied["deniedScope"], "user", "{denied}");
    let after = quota("U-1").await;
    assert_eq!(line(&after, "user-read")["remaining"], 0, "{after}");
    assert_eq!(line(&after, "plan")["remaining"], 3, "{after}");
    let api = line(&after, "global-api");
    assert_eq!(
        api["remaining"], 17,
        "the allocator's ungranted plus what the region holds unspent: {api}"
    );
    assert!(
        api["ageMs"].as_u64().is_some_and(|age| age < 60_000),
        "{api}"
    );

    // Seven more users: the soft plan of 6 is passed by the fourth, which is admitted and told.
    let mut flagged = Vec::new();
    for n in 0..7 {
        let answer = http
            .post(format!("{url}/v1/check"))
            .bearer_auth(GATEWAY)
            .json(&request(100 + n, &format!("U-{}", 10 + n), false))
            .send()
            .await
            .expect("check");
        assert_eq!(answer.status(), 200, "a soft rule never denies");
        flagged.push(
            answer
                .headers()
                .get("x-allot-soft-limit-exceeded")
                .is_some(),
        );
    }
    assert_eq!(flagged, [false, false, false, true, true, true, true]);

    // The ledger: 10 spent from api (the checks spent nothing); beta granted nothing and counted all
    // 10 admitted requests, twice its limit.
    agent.send_reports().await;
    let api_window = &windows(&allocator, "atlas", "api", 1).await[0];
    assert_eq!(api_window["spent"], 10, "{api_window}");
    assert_eq!(api_window["admitted"], 10, "{api_window}");
    assert_eq!(api_window["shadowAdmitted"], 0, "{api_window}");
    let beta = windows(&allocator, "atlas", "beta", 1).await;
    let beta_window = beta.first().expect("the shadow pool's window is listed");
    assert_eq!(beta_window["granted"], 0, "{beta_window}");
    assert_eq!(beta_window["admitted"], 0, "{beta_window}");
    assert_eq!(beta_window["shadowAdmitted"], 10, "{beta_window}");
    assert_eq!(
        beta_window["shadowAdmittedByRegion"]["eu"], 10,
        "{beta_window}"
    );
    assert_eq!(beta_window["limit"], 5, "{beta_window}");
}

/// A monthly plan in Berlin time, end to end: the grant's window is the local month, the caller's
/// quota resets at the local month's end, and the ledger's window is the month.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_monthly_plan_follows_the_local_calendar_from_grant_to_ledger() {
    let etcd = EtcdCluster::single();
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let allocator = start_allocator(&etcd, dir.path()).await;
    let monthly = json!({ "limit": 50_000, "window": { "calendar": "month", "timeZone": "Europe/Berlin" },
                          "chunk": 100, "leaseTtlMs": 60_000, "fallbackPerRegion": 0, "regions": ["eu"] });
    put_pool(&allocator, "atlas", "plan", &monthly).await;
    let bundle = stack::bundle(&json!({ "rules": [
        { "id": "monthly-plan", "scope": "global", "pool": "plan", "failMode": "closed",
          "expose": true }
    ]}));
    let (agent, url) = start_agent("eu", &allocator, &redis, bundle).await;
    let http = stack::http();
    for n in 0..5 {
        let decision: Value = http
            .post(format!("{url}/v1/admit"))
            .bearer_auth(GATEWAY)
            .json(&request(n, "U-1", false))
            .send()
            .await
            .expect("admit")
            .json()
            .await
            .expect("decision");
        assert_eq!(decision["allowed"], true, "{decision}");
    }
    // This month in Berlin, computed here from the calendar.
    let berlin = jiff::tz::TimeZone::get("Europe/Berlin").expect("zone");
    let now = jiff::Timestamp::now().to_zoned(berlin.clone());
    let first = now.date().first_of_month();
    let ms = |date: jiff::civil::Date| {
        date.to_zoned(berlin.clone())
            .expect("local midnight")
            .timestamp()
            .as_millisecond()
    };
    let (start_ms, end_ms) = (
        ms(first),
        ms(first
            .checked_add(jiff::ToSpan::month(1))
            .expect("next month")),
    );
    let asked_at_ms = jiff::Timestamp::now().as_millisecond();
    let status: Value = http
        .get(format!(
            "{url}/v1/quota?tenantId=atlas&principalType=user&principalId=U-1"
        ))
        .bearer_auth(GATEWAY)
        .send()
        .await
        .expect("quota")
        .json()
        .await
        .expect("status");
    let plan = &status["quotas"][0];
    assert_eq!(plan["policyId"], "monthly-plan", "{status}");
    assert_eq!(plan["remaining"], 50_000 - 5, "{status}");
    assert_eq!(
        plan["windowMs"],
        end_ms - start_ms,
        "this month's own length: {status}"
    );
    // The agent read its clock between the ask and the answer.
    let answered_at_ms = jiff::Timestamp::now().as_millisecond();
    let reset_ms = plan["resetMs"].as_i64().expect("resetMs");
    assert!(
        (end_ms - answered_at_ms..=end_ms - asked_at_ms).contains(&reset_ms),
        "{reset_ms} ms to the local month's end, asked {} ms before it",
        end_ms - asked_at_ms
    );
    agent.send_reports().await;
    let window = &windows(&allocator, "atlas", "plan", 1).await[0];
    assert_eq!(window["windowStartMs"], start_ms, "{window}");
    assert_eq!(window["windowEndMs"], end_ms, "{window}");
    assert_eq!(window["spent"], 5, "{window}");
}

/// Posts `body` to the agent's `path` and returns the status and the JSON answer.
async fn post(http: &reqwest::Client, url: &str, path: &str, body: &Value) -> (u16, Value) {
    let answer = http
        .post(format!("{url}{path}"))
        .bearer_auth(GATEWAY)
        .json(body)
        .send()
        .await
        .expect("agent call");
    let status = answer.status().as_u16();
    (status, answer.json().await.expect("JSON answer"))
}

fn metered(n: usize, user: &str, estimate: u64) -> Value {
    json!({ "requestId": format!("llm-{n}"), "tenantId": "atlas",
            "principal": { "type": "user", "id": user }, "routeGroup": "chat", "method": "POST",
            "costHint": estimate, "metered": true })
}

fn settle(n: usize, actual: u64) -> Value {
    json!({ "decisionId": format!("llm-{n}"), "tenantId": "atlas", "actualCost": actual })
}

/// Paid, owed and written off of one limit's part of a settle answer.
fn parts(charge: &Value) -> (u64, u64, u64) {
    let amount = |name: &str| {
        charge[name]
            .as_u64()
            .unwrap_or_else(|| panic!("{name} in {charge}"))
    };
    (amount("paid"), amount("owed"), amount("writtenOff"))
}

/// Metered requests (model tokens known only after the response) through a real agent, Redis,
/// allocator and ledger: the estimate is charged at admission, the actual cost settled once; extra
/// cost is charged to the user's regional rule and to the pool at once where it fits, owed where it
/// does not (the pool's debt within settleDebtPerRegion, paid first from the next lease), written
/// off and counted beyond; and the ledger's spent figure is every estimate plus every extra token
/// but those written off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metered_requests_settle_their_actual_cost_and_the_ledger_counts_every_token() {
    let etcd = EtcdCluster::single();
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let allocator = start_allocator(&etcd, dir.path()).await;
    put_pool(
        &allocator,
        "atlas",
        "llm",
        &json!({ "limit": 1_000, "windowMs": 3_600_000, "chunk": 50, "leaseTtlMs": 60_000,
                 "fallbackPerRegion": 0, "settleDebtPerRegion": 30, "regions": ["eu"] }),
    )
    .await;
    let bundle = stack::bundle(&json!({ "rules": [
        { "id": "user-chat", "scope": "user", "routeGroup": "chat", "algorithm": "fixed_window",
          "limit": 100, "windowMs": 3_600_000, "failMode": "closed" },
        { "id": "llm-tokens", "scope": "global", "routeGroup": "chat", "pool": "llm",
          "failMode": "closed" }
    ]}));
    let (agent, url) = start_agent("eu", &allocator, &redis, bundle).await;
    let http = stack::http();

    // 10 estimated, 25 used: 15 more, on U-1's rule and on the pool.
    let (status, admitted) = post(&http, &url, "/v1/admit", &metered(1, "U-1", 10)).await;
    assert_eq!(
        (status, admitted["allowed"].clone()),
        (200, json!(true)),
        "{admitted}"
    );
    assert!(admitted["settleByMs"].as_u64().is_some(), "{admitted}");
    let (status, first) = post(&http, &url, "/v1/settle", &settle(1, 25)).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(
        (first["estimate"].clone(), first["extra"].clone()),
        (json!(10), json!(15))
    );
    assert_eq!(parts(&first["regional"]), (15, 0, 0), "{first}");
    let (paid, owed, written_off) = parts(&first["pools"][0]);
    assert_eq!(paid + owed + written_off, 15, "{first}");
    assert_eq!(written_off, 0, "the debt bound holds 15: {first}");
    let mut pool_written_off = written_off;
    // The same settlement again is answered as before; another cost is refused, naming the field;
    // an id never admitted as metered is not open.
    let (status, again) = post(&http, &url, "/v1/settle", &settle(1, 25)).await;
    assert_eq!(
        (status, again["replayed"].clone()),
        (200, json!(true)),
        "{again}"
    );
    assert_eq!(again["pools"], first["pools"], "charged once");
    let (status, conflict) = post(&http, &url, "/v1/settle", &settle(1, 30)).await;
    assert_eq!(
        (status, conflict["field"].clone()),
        (409, json!("actualCost")),
        "{conflict}"
    );
    let (status, unknown) = post(&http, &url, "/v1/settle", &settle(99, 3)).await;
    assert_eq!(
        (status, unknown["field"].clone()),
        (404, json!("decisionId")),
        "{unknown}"
    );
    let (status, bad) = post(
        &http,
        &url,
        "/v1/settle",
        &json!({ "decisionId": "llm-1",
        "tenantId": "atlas", "actualCost": -1 }),
    )
    .await;
    assert_eq!(
        (status, bad["field"].clone()),
        (400, json!("actualCost")),
        "{bad}"
    );
    // An overestimate is not refunded.
    let (_, overestimated) = post(&http, &url, "/v1/admit", &metered(2, "U-2", 8)).await;
    assert_eq!(overestimated["allowed"], true, "{overestimated}");
    let (_, refund) = post(&http, &url, "/v1/settle", &settle(2, 3)).await;
    assert_eq!(
        (refund["unused"].clone(), refund["extra"].clone()),
        (json!(5), json!(0)),
        "{refund}"
    );

    // 5 estimated, 200 used: U-1's rule has 70 left, so its 195 extra are owed (at most one full
    // limit, 100; the rest written off); the pool pays what its leases hold, owes up to 30 and
    // writes off the rest.
    let (_, admitted) = post(&http, &url, "/v1/admit", &metered(3, "U-1", 5)).await;
    assert_eq!(admitted["allowed"], true, "{admitted}");
    let (status, big) = post(&http, &url, "/v1/settle", &settle(3, 200)).await;
    assert_eq!(status, 200, "{big}");
    assert_eq!(parts(&big["regional"]), (0, 100, 95), "{big}");
    let (paid, owed, written_off) = parts(&big["pools"][0]);
    assert_eq!(paid + owed + written_off, 195, "{big}");
    assert!(
        owed <= 30 && written_off > 0,
        "the pool's debt is bounded: {big}"
    );
    pool_written_off += written_off;
    // U-1 owes its rule 100 with 70 left: its next request is denied by that rule, and nothing else
    // is charged for it.
    let (_, owing) = post(
        &http,
        &url,
        "/v1/admit",
        &json!({ "requestId": "u1-next",
        "tenantId": "atlas", "principal": { "type": "user", "id": "U-1" }, "routeGroup": "chat",
        "method": "POST" }),
    )
    .await;
    assert_eq!(
        (owing["allowed"].clone(), owing["deniedScope"].clone()),
        (json!(false), json!("user")),
        "{owing}"
    );
    // U-3 is admitted once the region's next lease has paid the pool's debt.
    let mut admitted_for_u3 = 0u64;
    for n in 0..200 {
        let (_, answer) = post(
            &http,
            &url,
            "/v1/admit",
            &json!({ "requestId": format!("u3-{n}"),
            "tenantId": "atlas", "principal": { "type": "user", "id": "U-3" },
            "routeGroup": "chat", "method": "POST" }),
        )
        .await;
        if answer["allowed"] == true {
            admitted_for_u3 += 1;
            if admitted_for_u3 == 3 {
                break;
            }
        } else {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
    assert_eq!(
        admitted_for_u3, 3,
        "the pool's debt is paid from its next leases"
    );

    // The ledger: every estimate (10 + 8 + 5), every extra token but those written off (15 + 195),
    // and U-3's three requests are spent; the window shows the debt carried and what was written off.
    agent.send_reports().await;
    let window = &windows(&allocator, "atlas", "llm", 1).await[0];
    assert_eq!(
        window["spent"],
        10 + 8 + 5 + 15 + 195 - pool_written_off + admitted_for_u3,
        "{window}"
    );
    assert_eq!(window["writtenOff"], pool_written_off, "{window}");
    assert!(
        window["settleDebt"]
            .as_u64()
            .is_some_and(|debt| debt > 0 && debt <= 30),
        "{window}"
    );
    assert_eq!(
        window["bound"],
        1_000 + 30,
        "the debt is a term of the bound: {window}"
    );
}
