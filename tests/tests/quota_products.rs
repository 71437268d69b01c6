//! Quota products end to end: a real allocator on a real etcd, an agent on a real Redis, a gateway
//! calling the agent's HTTP API. Checks without spending (`dryRun`) leave the ledger untouched;
//! `GET /v1/quota` shows the caller's own and exposed quotas, the pool's from the allocator's last
//! answer; a soft rule flags the caller; a pool in shadow mode grants nothing while the ledger
//! records what enforcing it would have spent.

use serde_json::{Value, json};

mod stack;

use allot_testkit::{EtcdCluster, RedisServer};
use stack::{GATEWAY, put_pool, start_agent, start_allocator, windows};

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
