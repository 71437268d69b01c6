//! The sampled decision log: lines carry the decision and the request with its principal replaced by
//! the keyed hash, and replaying them against the bundle reproduces the denials.

use std::sync::Arc;
use std::time::Duration;

use allot_region_agent::clock::SystemClock;
use allot_region_agent::decision_log::{DecisionLog, DecisionLogConfig};
use allot_region_agent::limiter::{InProcessStore, Limiter, LimiterConfig};
use allot_region_agent::service::{Agent, AgentSettings};
use allot_shared::contract::{AdmissionRequest, Principal, PrincipalType};
use allot_shared::ids::{DecisionId, RegionId, RouteGroup, TenantId};
use allot_shared::keys::{IpPrefixes, Pepper};
use allot_shared::replay::{ReplaySample, replay};

fn request(n: usize) -> AdmissionRequest {
    AdmissionRequest {
        request_id: DecisionId::parse(&format!("d-{n}")).expect("id"),
        tenant_id: TenantId::parse("atlas").expect("tenant"),
        principal: Principal {
            kind: PrincipalType::User,
            id: "U-17".to_owned(),
            api_key_id: Some("K1-secret-key".to_owned()),
        },
        route_group: RouteGroup::parse("read").expect("route"),
        method: "GET".to_owned(),
        cost_hint: 1,
        policy_epoch: None,
        dry_run: false,
        metered: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logged_decisions_hide_principals_and_replay_to_the_same_denials() {
    let bundle = allot_shared::policy::parse_bundle(
        r#"{ "rules": [ { "id": "per-user", "scope": "user", "algorithm": "token_bucket",
            "capacityMillis": 3000, "refillMillis": 1000, "periodMs": 3600000, "failMode": "closed" } ] }"#,
    )
    .and_then(|d| d.into_file_bundle())
    .expect("bundle");
    let pepper = Pepper::new(b"decision-log-pepper-01".to_vec()).expect("pepper");
    let clock = Arc::new(SystemClock);
    let limiter = Limiter::new(
        Arc::new(InProcessStore::new(clock.clone(), 1_000)),
        LimiterConfig::default(),
    )
    .expect("limiter");
    let agent = Agent::new(
        AgentSettings::new(
            RegionId::parse("eu").expect("region"),
            allot_shared::ids::AgentId::parse("eu-1").expect("agent id"),
            pepper.clone(),
        ),
        clock,
        limiter,
        None,
        Some(bundle.clone()),
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("decisions.jsonl");
    let log = DecisionLog::open(
        DecisionLogConfig {
            path: path.clone(),
            allowed_rate: 1.0,
            denied_rate: 1.0,
            max_bytes: 1 << 20,
        },
        pepper,
        IpPrefixes::default(),
    )
    .expect("log");
    agent.set_decision_log(log);
    let mut denied = 0;
    for n in 0..5 {
        if !agent.admit(&request(n)).await.expect("decision").allowed {
            denied += 1;
        }
    }
    assert_eq!(denied, 2, "3 tokens, 5 requests");

    let mut text = String::new();
    for _ in 0..200 {
        text = std::fs::read_to_string(&path).unwrap_or_default();
        if text.lines().count() == 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        text.lines().count(),
        5,
        "every decision sampled at rate 1: {text}"
    );
    assert!(!text.contains("U-17"), "no raw principal id in the log");
    assert!(!text.contains("K1-secret-key"), "no raw API key in the log");
    let samples: Vec<ReplaySample> = text
        .lines()
        .map(|line| serde_json::from_str(line).expect("a replay sample"))
        .collect();
    let replayed = replay(
        &bundle,
        &samples,
        &Pepper::new(b"another-replay-pepper".to_vec()).expect("pepper"),
    );
    assert_eq!((replayed.requests, replayed.denied), (5, 2));
}
