//! What only the Redis store has: the script cache, contention between connections, the server's
//! clock, the scripts' own argument validation, and a cluster.

use std::sync::Arc;
use std::time::Duration;

use allot_shared::limit::RetryAfter;
use allot_shared::limit::fixed_window::FixedWindowState;
use allot_shared::limit::multi::State;
use allot_shared::limit::token_bucket::TokenBucketState;
use allot_testkit::RedisServer;

use super::harness::{
    FUTURE_BASE_MS, P_READ, P_TENANT, RECOVERY_DEADLINE, Subject, TEST_CONFIG, batch, decision_id,
    redis_query, rule_key, tenant,
};
use crate::limiter::batch::RuleParams;
use crate::limiter::redis_store::{Connection, RedisStore, RedisStoreConfig};
use crate::limiter::store::{LeaseCall, LimiterStore, Rejection, StoreError};

/// How often a recovering store is polled.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// One rule of each algorithm, with small parameters.
fn one_of_each() -> [(&'static str, RuleParams, u64); 5] {
    [
        ("tb", P_READ, 1_000),
        (
            "gcra",
            RuleParams::Gcra {
                capacity_millitokens: 20_000,
                refill_millitokens: 2_000,
                period_ms: 1_000,
            },
            1_000,
        ),
        (
            "fw",
            RuleParams::FixedWindow {
                limit_units: 5,
                window_ms: 10_000,
            },
            1_000,
        ),
        (
            "sc",
            RuleParams::SlidingCounter {
                limit_units: 5,
                window_ms: 10_000,
            },
            1_000,
        ),
        (
            "sl",
            RuleParams::SlidingLog {
                limit_units: 5,
                window_ms: 10_000,
            },
            1_000,
        ),
    ]
}

/// The server's clock, in epoch ms (floored, as the scripts read it).
async fn server_time_ms(connection: &Connection) -> u64 {
    let (seconds, micros): (u64, u64) = redis_query(connection, &redis::cmd("TIME")).await;
    seconds * 1_000 + micros / 1_000
}

#[tokio::test]
async fn a_flushed_library_or_script_is_reloaded_once_and_the_call_succeeds() {
    let s = Subject::redis_single().await;
    s.set_now(FUTURE_BASE_MS);
    let atlas = tenant("atlas");
    let request = |id: &str| batch(&atlas, id, 0, &[("u:17", P_READ, 1_000)]);
    assert!(s.decide(&request("r-1")).await.expect("decides").allowed);
    assert_eq!(s.redis_store().script_reloads(), 0);

    // Every function library and every script is gone (as after a restart without persistence).
    let _: String = redis_query(&s.redis_connection(), redis::cmd("FUNCTION").arg("FLUSH")).await;
    let _: String = redis_query(&s.redis_connection(), redis::cmd("SCRIPT").arg("FLUSH")).await;
    let decision = s
        .decide(&request("r-2"))
        .await
        .expect("decides after the library was lost");
    assert_eq!(
        decision.remaining,
        [18_000],
        "the state survived; only the library was lost"
    );
    assert_eq!(s.redis_store().script_reloads(), 1);

    let lease =
        LeaseCall::new(rule_key(&atlas, "cc"), 3, 60_000, decision_id("e-1")).expect("valid");
    assert!(
        s.store
            .acquire_lease(&lease)
            .await
            .expect("acquires after NOSCRIPT")
            .held
    );
    assert_eq!(
        s.redis_store().script_reloads(),
        2,
        "the lease script was reloaded too"
    );
}

#[tokio::test]
async fn after_a_server_restart_the_store_reconnects_and_reloads_its_scripts() {
    let mut s = Subject::redis_single().await;
    s.set_now(FUTURE_BASE_MS);
    let atlas = tenant("atlas");
    let request = |id: &str| batch(&atlas, id, 0, &[("u:17", P_READ, 1_000)]);
    assert_eq!(
        s.decide(&request("r-1")).await.expect("decides").remaining,
        [19_000]
    );

    let server = s.redis.as_mut().expect("a single server");
    server.stop();
    server.restart();
    let attempts = RECOVERY_DEADLINE.as_millis() / POLL_INTERVAL.as_millis();
    let mut recovered = None;
    for attempt in 0..attempts {
        // Straight to the store: the harness's own commands would fail while the server is down.
        match s
            .store
            .decide(&request(&format!("r-retry-{attempt}")))
            .await
        {
            Ok(decision) => {
                recovered = Some(decision);
                break;
            }
            // While the connection is re-established, calls fail without a decision.
            Err(StoreError::NotExecuted { .. } | StoreError::Ambiguous { .. }) => {
                tokio::time::sleep(POLL_INTERVAL).await;
            }
            Err(other) => panic!("a restart is not a {other}"),
        }
    }
    let decision = recovered.expect("the store recovers within the deadline");
    assert_eq!(
        decision.remaining,
        [19_000],
        "nothing was persisted: a fresh bucket"
    );
    assert!(
        s.redis_store().script_reloads() >= 1,
        "NOSCRIPT was answered by a reload"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racers_for_the_last_token_on_separate_connections_admit_exactly_one() {
    const RACERS: usize = 32;
    let server = RedisServer::start();
    // One token that takes an hour to come back: only the first decision can have it.
    let one_token = RuleParams::TokenBucket {
        capacity_millitokens: 1_000,
        refill_millitokens: 1_000,
        period_ms: 3_600_000,
        slack_ms: 0,
    };
    let atlas = tenant("atlas");
    let barrier = Arc::new(tokio::sync::Barrier::new(RACERS));
    let mut racers = Vec::new();
    for n in 0..RACERS {
        // Separate connections, as separate gateways would have; production time (TIME).
        let store = RedisStore::connect(&server.url(), TEST_CONFIG)
            .await
            .expect("connects");
        let request = batch(&atlas, &format!("r-{n}"), 0, &[("u:17", one_token, 1_000)]);
        let barrier = barrier.clone();
        racers.push(tokio::spawn(async move {
            barrier.wait().await;
            store.decide(&request).await.expect("decides")
        }));
    }
    let mut winners = 0;
    for racer in racers {
        let decision = racer.await.expect("the racer finishes");
        if decision.allowed {
            winners += 1;
            assert_eq!(decision.remaining, [0]);
        } else {
            assert_eq!(decision.remaining, [0]);
            assert!(matches!(decision.retry, RetryAfter::Ms(ms) if ms > 0));
        }
    }
    assert_eq!(winners, 1, "exactly one racer gets the last token");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_tasks_never_admit_more_than_capacity_plus_refill_over_elapsed_time() {
    const TASKS: usize = 64;
    const CALLS_PER_TASK: usize = 200;
    const CONNECTIONS: usize = 8;
    let capacity_millitokens = 100_000;
    let refill_millitokens = 50_000;
    let period_ms = 1_000;
    let cost_millitokens = 1_000;
    let bucket = RuleParams::TokenBucket {
        capacity_millitokens,
        refill_millitokens,
        period_ms,
        slack_ms: 5_000,
    };
    let server = RedisServer::start();
    let mut stores = Vec::new();
    for _ in 0..CONNECTIONS {
        let store = RedisStore::connect(&server.url(), TEST_CONFIG)
            .await
            .expect("connects");
        stores.push(Arc::new(store));
    }
    let clock_connection = stores[0].connection();
    let atlas = tenant("atlas");
    let started_ms = server_time_ms(&clock_connection).await;
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let store = stores[task % CONNECTIONS].clone();
        let atlas = atlas.clone();
        tasks.push(tokio::spawn(async move {
            let mut admitted = 0u64;
            for call in 0..CALLS_PER_TASK {
                let id = format!("r-{task}-{call}");
                let request = batch(&atlas, &id, 0, &[("tenant", bucket, cost_millitokens)]);
                admitted += u64::from(store.decide(&request).await.expect("decides").allowed);
            }
            admitted
        }));
    }
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.expect("the task finishes");
    }
    let elapsed_ms = server_time_ms(&clock_connection).await - started_ms;
    let calls = (TASKS * CALLS_PER_TASK) as u64;
    // admitted x cost <= capacity + refill x elapsed / period, multiplied through by the period.
    let admitted_scaled = admitted * cost_millitokens * period_ms;
    let bound_scaled = capacity_millitokens * period_ms + refill_millitokens * elapsed_ms;
    assert!(
        admitted_scaled <= bound_scaled,
        "{admitted} admitted in {elapsed_ms} ms exceeds capacity + refill x elapsed"
    );
    assert!(
        admitted >= capacity_millitokens / cost_millitokens,
        "a full bucket admits its capacity first"
    );
    assert!(
        admitted < calls,
        "the bucket ran dry: {admitted} of {calls} admitted in {elapsed_ms} ms"
    );
}

#[tokio::test]
async fn every_key_a_decision_writes_has_a_ttl_on_the_server_clock() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url(), TEST_CONFIG)
        .await
        .expect("connects");
    let connection = store.connection();
    let atlas = tenant("atlas");
    let request = batch(&atlas, "r-ttl", 30_000, &one_of_each());
    let decision = store.decide(&request).await.expect("decides");
    assert!(decision.allowed);
    let expected_ttls_ms = [15_000, 500, 10_000, 20_000, 10_000];
    for ((name, _, _), ttl_ms) in one_of_each().iter().zip(expected_ttls_ms) {
        let pttl: i64 =
            redis_query(&connection, redis::cmd("PTTL").arg(rule_key(&atlas, name))).await;
        assert!(
            pttl > 0 && pttl <= ttl_ms,
            "{name}: PTTL {pttl}, at most {ttl_ms}"
        );
    }
    let pttl: i64 = redis_query(&connection, redis::cmd("PTTL").arg(request.record_key())).await;
    assert!(pttl > 0 && pttl <= 30_000, "decision record: PTTL {pttl}");
    let lease =
        LeaseCall::new(rule_key(&atlas, "cc"), 3, 60_000, decision_id("e-1")).expect("valid");
    assert!(store.acquire_lease(&lease).await.expect("acquires").held);
    let pttl: i64 = redis_query(&connection, redis::cmd("PTTL").arg(lease.key())).await;
    assert!(pttl > 0 && pttl <= 60_000, "lease set: PTTL {pttl}");
    let keys: i64 = redis_query(&connection, &redis::cmd("DBSIZE")).await;
    assert_eq!(
        keys, 7,
        "five rules, a record and a lease set; nothing else"
    );
}

/// Whether a call was refused for its arguments (a policy or client defect; nothing was written).
fn refused_for_its_arguments<T>(result: &Result<T, StoreError>) -> bool {
    matches!(
        result,
        Err(StoreError::Rejected {
            kind: Rejection::InvalidArgument,
            ..
        })
    )
}

#[tokio::test]
async fn the_decide_script_refuses_malformed_arguments_and_writes_nothing() {
    let s = Subject::redis_single().await;
    let store = s.redis_store();
    let keys = ["rl:v1:{t:a}:d:r-1", "rl:v1:{t:a}:x"];
    let now = FUTURE_BASE_MS.to_string();
    // The header's fields: now, record ttl, n, dry run, advisory mask.
    let header_fields = [now.as_str(), "0", "1", "0", "0", "0"];
    let call = |header: [&str; 6], kind: &str, fields: [&str; 5]| {
        vec![
            header.join(" "),
            "r-1".to_owned(),
            format!("{kind} {}", fields.join(" ")),
        ]
    };
    let tb = |fields: [&str; 5]| call(header_fields, "tb", fields);
    let with = |kind: &str, fields: [&str; 5]| call(header_fields, kind, fields);
    let valid = tb(["20000", "2000", "1000", "5000", "1000"]);
    let mut cases: Vec<(&str, Vec<String>)> = vec![
        ("nan", tb(["nan", "2000", "1000", "5000", "1000"])),
        ("inf", tb(["20000", "inf", "1000", "5000", "1000"])),
        ("exponent", tb(["2e4", "2000", "1000", "5000", "1000"])),
        ("negative", tb(["20000", "2000", "-1000", "5000", "1000"])),
        ("fraction", tb(["20000", "2000", "1000", "5000", "1000.5"])),
        ("padded", tb([" 20000", "2000", "1000", "5000", "1000"])),
        ("hex", tb(["0x4e20", "2000", "1000", "5000", "1000"])),
        ("empty", tb(["", "2000", "1000", "5000", "1000"])),
        ("zero refill", tb(["20000", "0", "1000", "5000", "1000"])),
        (
            "above 2^40",
            tb(["1099511627777", "2000", "1000", "5000", "1000"]),
        ),
        (
            "capacity x period above 2^52",
            tb(["1099511627776", "2000", "4097", "0", "1000"]),
        ),
        (
            "slack above 2^40",
            tb(["20000", "2000", "1000", "1099511627777", "1000"]),
        ),
        (
            "cost above 2^40",
            tb(["20000", "2000", "1000", "5000", "1099511627777"]),
        ),
        ("cost zero", tb(["20000", "2000", "1000", "5000", "0"])),
        (
            "unknown algorithm",
            with("leaky", ["20000", "2000", "1000", "5000", "1000"]),
        ),
        (
            "gcra with slack",
            with("gcra", ["20000", "2000", "1000", "5", "1000"]),
        ),
        (
            "window with a third parameter",
            with("fw", ["5", "1000", "1", "0", "1000"]),
        ),
        (
            "partial window units",
            with("fw", ["5", "1000", "0", "0", "1500"]),
        ),
        (
            "weighted sliding log",
            with("sl", ["5", "1000", "0", "0", "2000"]),
        ),
    ];
    let mut header = |field: usize, value: &str, name: &'static str| {
        let mut fields = header_fields;
        fields[field] = value;
        cases.push((
            name,
            call(fields, "tb", ["20000", "2000", "1000", "5000", "1000"]),
        ));
    };
    header(0, "-5", "negative now");
    header(0, "1125899906842625", "now above 2^50");
    header(1, "1099511627777", "record ttl above 2^40");
    header(2, "2", "n larger than the keys");
    header(2, "9", "more than 8 rules");
    header(3, "2", "dry run neither 0 nor 1");
    header(3, "", "an empty dry run flag");
    header(
        4,
        "2",
        "an advisory mask naming a rule the call does not have",
    );
    header(4, "-1", "a negative advisory mask");
    header(5, "2", "a state layout neither 0 nor 1");
    // Sent with a decision record: a request without one goes without its id.
    let mut long_id = valid.clone();
    long_id[0] = format!("{now} 30000 1 0 0 0");
    long_id[1] = "x".repeat(65);
    cases.push(("a 65-byte decision id", long_id));
    let mut seven_fields = valid.clone();
    seven_fields[0].push_str(" 0");
    cases.push(("a header of seven fields", seven_fields));
    let mut five_fields = valid.clone();
    five_fields[0] = header_fields[..5].join(" ");
    cases.push(("a header of five fields", five_fields));
    let mut short_rule = valid.clone();
    short_rule[2] = "tb 20000 2000 1000 5000".to_owned();
    cases.push(("a rule missing a field", short_rule));
    let mut short = valid.clone();
    short.pop();
    cases.push(("a missing rule", short));
    for (name, args) in &cases {
        let refused = store.run_decide_raw(&keys, args).await;
        assert!(refused_for_its_arguments(&refused), "{name}: {refused:?}");
    }
    // Without the record's key and the decision id: a request that keeps no record and has no
    // sliding log is sent so, and nothing else may be.
    let without_id = |header: String, rule: &str| vec![header, rule.to_owned()];
    for (name, args) in [
        (
            "a decision record without its key and id",
            without_id(format!("{now} 30000 1 0 0 0"), &valid[2]),
        ),
        (
            "a sliding log without the decision id",
            without_id(format!("{now} 0 1 0 0 0"), "sl 5 1000 0 0 1000"),
        ),
    ] {
        let refused = store.run_decide_raw(&keys[1..], &args).await;
        assert!(refused_for_its_arguments(&refused), "{name}: {refused:?}");
    }
    let duplicate = {
        let mut args = valid.clone();
        args[0] = format!("{now} 0 2 0 0");
        args.push(valid[2].clone());
        args
    };
    let refused = store
        .run_decide_raw(&[keys[0], keys[1], keys[1]], &duplicate)
        .await;
    assert!(refused_for_its_arguments(&refused), "{refused:?}");
    let exists: i64 = redis_query(&s.redis_connection(), redis::cmd("EXISTS").arg(&keys[..])).await;
    assert_eq!(exists, 0, "no refused call wrote anything");
    assert_eq!(
        store
            .run_decide_raw(&keys, &valid)
            .await
            .expect("the valid call decides"),
        [1, 0, 0, 0, 0, 19_000]
    );
}

/// The coalesced function refuses a call whose layout is wrong as a whole, before deciding or
/// writing anything; a request refused for its own keys is answered with its error text while
/// the others are decided.
#[tokio::test]
async fn the_coalesced_function_refuses_malformed_layouts_and_writes_nothing() {
    let s = Subject::redis_single().await;
    let store = s.redis_store();
    let now = FUTURE_BASE_MS.to_string();
    let header = format!("{now} 0 2 0 0 0");
    let user = "tb 20000 2000 1000 5000 1000";
    let tenant = "tb 90000 9000 1000 0 1000";
    let keys = ["rl:v1:{t:m}:u:1", "rl:v1:{t:m}:t", "rl:v1:{t:m}:u:2"];
    // Two requests: the first takes the first user's key and the tenant's, the second takes the
    // second user's and names the tenant's again.
    let call = |runs: &[&str]| {
        let mut args = vec![
            "2".to_owned(),
            "3".to_owned(),
            header.clone(),
            user.to_owned(),
            tenant.to_owned(),
        ];
        args.extend(runs.iter().map(|field| (*field).to_owned()));
        args
    };
    let valid = call(&["1", "1 - - 2 n 3 n", "1", "1 - - 2 n 3 2"]);
    let recorded = format!("{now} 30000 2 0 0 0");
    let logged = "sl 20 10000 0 0 1000";
    // Runs that do not add up.
    let broken_runs: [(&str, &[&str]); 4] = [
        (
            "a run longer than the requests left",
            &["2", "1 - - 2 n 3 n"],
        ),
        (
            "a run of none",
            &["0", "1 - - 2 n 3 n", "2", "1 - - 2 n 3 2"],
        ),
        ("a missing run", &["1", "1 - - 2 n 3 n"]),
        (
            "a key named before any request took it",
            &["1", "1 - - 2 n 3 n", "1", "1 - - 2 3 3 n"],
        ),
    ];
    let mut cases: Vec<(&str, Vec<&str>, Vec<String>)> = broken_runs
        .iter()
        .map(|(name, runs)| (*name, keys.to_vec(), call(runs)))
        .collect();
    // A first layout that does not fit the texts or is not a layout (the second is valid).
    for (name, first) in [
        ("a header index past the texts", "4 - - 2 n 3 n"),
        ("a rule index past the texts", "1 - - 2 n 9 n"),
        ("a layout of fewer rules than its header", "1 - - 2 n"),
        ("an id flag neither i nor -", "1 x - 2 n 3 n"),
        ("two spaces in a layout", "1 -  - 2 n 3 n"),
    ] {
        cases.push((
            name,
            keys.to_vec(),
            call(&["1", first, "1", "1 - - 2 n 3 2"]),
        ));
    }
    // Keys that do not add up.
    cases.push((
        "a key left over",
        vec![keys[0], keys[1], keys[2], "rl:v1:{t:m}:extra"],
        valid.clone(),
    ));
    cases.push(("a key missing", keys[..2].to_vec(), valid.clone()));
    // The valid call's arguments with one thing changed.
    let mut changed = |name: &'static str, change: &dyn Fn(&mut Vec<String>)| {
        let mut args = valid.clone();
        change(&mut args);
        cases.push((name, keys.to_vec(), args));
    };
    changed("an argument left over", &|args| args.push("1".to_owned()));
    changed("a request count of none", &|args| args[0] = "0".to_owned());
    changed("a text count past the arguments", &|args| {
        args[1] = "40".to_owned()
    });
    // A decision record needs its key and the decision id; a sliding log needs the id.
    changed("a decision record without its key", &|args| {
        args[2] = recorded.clone();
        args[6] = "1 i - 2 n 3 n".to_owned();
        args.insert(7, "d1".to_owned());
    });
    changed("a decision record without the id", &|args| {
        args[2] = recorded.clone()
    });
    changed("a sliding log without the id", &|args| {
        args[4] = logged.to_owned()
    });
    for (name, keys, args) in &cases {
        let refused = store.run_decide_many_raw(keys, args).await;
        assert!(refused_for_its_arguments(&refused), "{name}: {refused:?}");
    }
    let written: i64 =
        redis_query(&s.redis_connection(), redis::cmd("EXISTS").arg(&keys[..])).await;
    assert_eq!(written, 0, "no refused call wrote anything");

    // A call that sends a key twice is refused whole, before anything ran: the function reads a
    // key a request takes for itself straight from the store.
    let twice = store
        .run_decide_many_raw(
            &[keys[0], keys[0], keys[2], keys[1]],
            &call(&["1", "1 - - 2 n 3 n", "1", "1 - - 2 n 3 n"]),
        )
        .await;
    assert!(refused_for_its_arguments(&twice), "{twice:?}");
    let written: i64 =
        redis_query(&s.redis_connection(), redis::cmd("EXISTS").arg(&keys[..])).await;
    assert_eq!(written, 0, "the call that sent a key twice wrote nothing");
    // A request naming one key twice is refused on its own, as the lone function refuses it; the
    // other is decided.
    let record = "rl:v1:{t:m}:r:1".to_owned();
    let lone_args = vec![
        header.clone(),
        "d1".to_owned(),
        user.to_owned(),
        tenant.to_owned(),
    ];
    let twice_keys = [record.clone(), keys[0].to_owned(), keys[0].to_owned()];
    let other_keys = [record, keys[2].to_owned(), keys[1].to_owned()];
    let repeated = store
        .decide_many_requests(&[(&twice_keys, &lone_args), (&other_keys, &lone_args)])
        .await
        .expect("the call runs");
    let twice_key_refs: Vec<&str> = twice_keys.iter().map(String::as_str).collect();
    let lone_refusal = store.run_decide_raw(&twice_key_refs, &lone_args).await;
    let says_twice = |refusal: &Result<Vec<i64>, StoreError>| {
        matches!(refusal, Err(StoreError::Rejected { kind: Rejection::InvalidArgument, detail })
            if detail.contains(&format!("rule key {} appears twice", keys[0])))
    };
    assert!(
        says_twice(&repeated[0]) && says_twice(&lone_refusal),
        "{repeated:?} against the lone call's {lone_refusal:?}"
    );
    assert!(
        matches!(
            &repeated[..],
            [
                Err(StoreError::Rejected {
                    kind: Rejection::InvalidArgument,
                    ..
                }),
                Ok(_)
            ]
        ),
        "{repeated:?}"
    );
    // The valid call: the second user's bucket and the tenant's were each debited once already,
    // by the other request of the call above.
    let decided = store
        .run_decide_many_raw(&keys, &valid)
        .await
        .expect("the valid call decides");
    assert_eq!(
        decided,
        [
            Ok(vec![1, 0, 0, 0, 0, 19_000, 88_000]),
            Ok(vec![1, 0, 0, 0, 0, 18_000, 87_000])
        ]
    );
}

/// A decision id is any id the contract admits, `-` too: in a coalesced call it keeps its record
/// and is replayed to a retry, as alone.
#[tokio::test]
async fn a_coalesced_request_with_the_id_dash_keeps_its_record() {
    let s = Subject::redis_single().await;
    let store = s.redis_store();
    let now = FUTURE_BASE_MS;
    let keys = ["rl:v1:{t:m}:d:-".to_owned(), "rl:v1:{t:m}:u:1".to_owned()];
    let args = vec![
        format!("{now} 30000 1 0 0 0"),
        "-".to_owned(),
        "tb 20000 2000 1000 5000 1000".to_owned(),
    ];
    let first = store
        .decide_many_requests(&[(&keys, &args)])
        .await
        .expect("the call runs");
    assert_eq!(first, [Ok(vec![1, 0, 0, 0, 0, 19_000])]);
    let retried = store
        .decide_many_requests(&[(&keys, &args)])
        .await
        .expect("the call runs");
    assert_eq!(
        retried,
        [Ok(vec![1, 0, 0, 1, 0, 19_000])],
        "replayed, not debited again"
    );
}

#[tokio::test]
async fn corrupt_state_is_refused_not_reset() {
    let s = Subject::redis_single().await;
    s.set_now(FUTURE_BASE_MS);
    let connection = s.redis_connection();
    let atlas = tenant("atlas");
    let key = rule_key(&atlas, "u:17");
    let refuse = async |name: &str| {
        let _: i64 = redis_query(&connection, redis::cmd("PEXPIRE").arg(&key).arg(60_000)).await;
        // Straight to the store: the keys above expire on the real clock, not the test clock.
        let refused = s
            .store
            .decide(&batch(&atlas, "r-1", 0, &[("u:17", P_READ, 1_000)]))
            .await;
        assert!(
            matches!(
                refused,
                Err(StoreError::Rejected {
                    kind: Rejection::StateMismatch,
                    ..
                })
            ),
            "{name}: {refused:?}"
        );
    };
    for (name, value) in [
        ("a non-integer", "tabc 1"),
        ("a missing field", "t5"),
        ("a sign", "t-5 1"),
        ("a fraction", "t5.5 1"),
        ("two spaces", "t5  1"),
        ("seventeen digits", "t00000000000000005 1"),
        ("past 2^53", "t9007199254740993 1"),
        ("another algorithm's state", "f5 1"),
        ("a GCRA state", "5"),
        ("nothing", ""),
    ] {
        let _: () = redis_query(&connection, redis::cmd("SET").arg(&key).arg(value)).await;
        refuse(name).await;
    }
    // The hashes of earlier versions are checked as strictly.
    for (name, fields) in [
        ("a hash with a non-integer", vec!["tk", "abc", "ts", "1"]),
        ("a hash with a missing field", vec!["tk", "5"]),
        (
            "a hash with a field of another algorithm",
            vec!["tk", "5", "ts", "1", "n", "2"],
        ),
    ] {
        let _: i64 = redis_query(&connection, redis::cmd("DEL").arg(&key)).await;
        let _: i64 = redis_query(&connection, redis::cmd("HSET").arg(&key).arg(&fields)).await;
        refuse(name).await;
    }
    // A decision record that is not a string.
    let request = batch(&atlas, "r-2", 30_000, &[("u:18", P_READ, 1_000)]);
    let _: i64 = redis_query(
        &connection,
        redis::cmd("HSET").arg(request.record_key()).arg("x").arg(1),
    )
    .await;
    let _: i64 = redis_query(
        &connection,
        redis::cmd("PEXPIRE").arg(request.record_key()).arg(60_000),
    )
    .await;
    let refused = s.store.decide(&request).await;
    assert!(
        matches!(
            refused,
            Err(StoreError::Rejected {
                kind: Rejection::StateMismatch,
                ..
            })
        ),
        "{refused:?}"
    );
}

/// An agent upgraded in place finds the state its earlier version wrote as hashes: it decides on
/// it as it stands, then replaces it with its own layout.
#[tokio::test]
async fn state_an_earlier_version_kept_in_hashes_is_decided_on_and_rewritten() {
    let s = Subject::redis_single().await;
    let now = FUTURE_BASE_MS;
    s.set_now(now);
    let connection = s.redis_connection();
    let atlas = tenant("atlas");
    let window = RuleParams::FixedWindow {
        limit_units: 5,
        window_ms: 60_000,
    };
    let window_start = now - now % 60_000;
    let bucket_key = rule_key(&atlas, "u:1");
    let window_key = rule_key(&atlas, "u:2");
    let earlier: [(&str, Vec<String>); 2] = [
        (
            &bucket_key,
            vec!["tk".into(), "7000".into(), "ts".into(), now.to_string()],
        ),
        (
            &window_key,
            vec!["w".into(), window_start.to_string(), "n".into(), "4".into()],
        ),
    ];
    for (key, fields) in &earlier {
        let _: i64 = redis_query(&connection, redis::cmd("HSET").arg(key).arg(fields)).await;
        let _: i64 = redis_query(&connection, redis::cmd("PEXPIRE").arg(key).arg(60_000)).await;
    }
    let decision = s
        .store
        .decide(&batch(
            &atlas,
            "r-1",
            0,
            &[("u:1", P_READ, 1_000), ("u:2", window, 1_000)],
        ))
        .await
        .expect("decides");
    assert!(decision.allowed, "{decision:?}");
    // 7 tokens less one; the fifth of five units.
    assert_eq!(decision.remaining, vec![6_000, 0]);
    assert_eq!(
        s.rule_state(&bucket_key, &P_READ).await,
        Some(State::TokenBucket(TokenBucketState {
            tokens_millitokens: 6_000,
            updated_at_ms: now,
        }))
    );
    assert_eq!(
        s.rule_state(&window_key, &window).await,
        Some(State::FixedWindow(FixedWindowState {
            window_start_ms: window_start,
            count_units: 5,
        }))
    );
}

#[tokio::test]
async fn tenants_spread_over_a_three_master_cluster_each_decide_in_one_slot() {
    let s = Subject::redis_cluster().await;
    let now = FUTURE_BASE_MS;
    s.set_now(now);
    let connection = s.redis_connection();
    let tenants: Vec<_> = (0..12).map(|n| tenant(&format!("tenant-{n}"))).collect();
    for t in &tenants {
        let request = batch(t, "r-1", 30_000, &one_of_each());
        let mut slots = Vec::new();
        for key in
            std::iter::once(request.record_key()).chain(request.rules().iter().map(|r| r.key()))
        {
            let slot: i64 =
                redis_query(&connection, redis::cmd("CLUSTER").arg("KEYSLOT").arg(key)).await;
            slots.push(slot);
        }
        assert!(
            slots.windows(2).all(|pair| pair[0] == pair[1]),
            "{t}: one slot for all keys, got {slots:?}"
        );

        let first = s.decide(&request).await.expect("decides");
        assert_eq!(first.remaining, [19_000, 19_000, 4, 4, 4]);
        let replay = s.decide(&request).await.expect("replays");
        assert!(
            replay.replayed && replay.remaining == first.remaining,
            "{t}: {replay:?}"
        );
        // A denial by the tenant bucket leaves every other rule untouched.
        let denied = batch(
            t,
            "r-2",
            0,
            &[("tb", P_READ, 1_000), ("tenant", P_TENANT, 1_000_001)],
        );
        let decision = s.decide(&denied).await.expect("decides");
        assert_eq!(
            (decision.denied_by, decision.retry),
            (Some(1), RetryAfter::Never)
        );
        assert_eq!(decision.remaining, [19_000, 0]);
        let user = s.token_bucket(&rule_key(t, "tb")).await.expect("exists");
        assert_eq!(user.tokens_millitokens, 19_000);
        for (name, _, _) in one_of_each() {
            let expiry = s.expires_at(&rule_key(t, name)).await;
            assert!(
                expiry.is_some_and(|at| at > now),
                "{t} {name}: every key carries a TTL"
            );
        }
    }
    // The tenants' slots fall on every master: the script ran on all three.
    let cluster = s.cluster.as_ref().expect("a cluster");
    for node in 0..3 {
        let client = redis::Client::open(cluster.node_url(node)).expect("a node url");
        let mut direct = client
            .get_multiplexed_async_connection()
            .await
            .expect("connects");
        let keys: i64 = redis::cmd("DBSIZE")
            .query_async(&mut direct)
            .await
            .expect("DBSIZE");
        assert!(keys > 0, "node {node} holds no tenant's keys");
    }
}

/// One store, 64 tasks, one tenant: decisions that arrive while the slot has a call in flight go
/// together in coalesced calls, and each is still all or nothing and in order: a tenant window of
/// 100 (no refill within the run) admits exactly 100 of the 64 users' 640 attempts, each admission
/// seeing a distinct count left, and no user past its own limit of 3 (a user refused by its own
/// rule takes nothing from the tenant's).
async fn coalesced_decisions_of_a_hot_tenant_admit_exactly_its_limit(s: &Subject) {
    const TASKS: usize = 64;
    const CALLS_PER_TASK: usize = 10;
    let window = |limit_units| RuleParams::FixedWindow {
        limit_units,
        window_ms: 3_600_000,
    };
    s.set_now(FUTURE_BASE_MS + 60_000);
    let atlas = tenant("atlas");
    let store = s.store.clone();
    let barrier = Arc::new(tokio::sync::Barrier::new(TASKS));
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let (store, atlas, barrier) = (store.clone(), atlas.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut left_after = Vec::new();
            for call in 0..CALLS_PER_TASK {
                let user = format!("u:{task}");
                let request = batch(
                    &atlas,
                    &format!("r-{task}-{call}"),
                    0,
                    &[(&user, window(3), 1_000), ("tenant", window(100), 1_000)],
                );
                let decision = store.decide(&request).await.expect("decides");
                if decision.allowed {
                    left_after.push((user, decision.remaining[1]));
                }
            }
            left_after
        }));
    }
    let mut admitted = Vec::new();
    for task in tasks {
        admitted.extend(task.await.expect("the task finishes"));
    }
    let mut tenant_left: Vec<u64> = admitted.iter().map(|(_, left)| *left).collect();
    tenant_left.sort_unstable();
    assert_eq!(
        tenant_left,
        (0..100).collect::<Vec<u64>>(),
        "the tenant's 100, each taken once"
    );
    for user in 0..TASKS {
        let name = format!("u:{user}");
        assert!(
            admitted.iter().filter(|(u, _)| *u == name).count() <= 3,
            "{name} admitted past its own limit"
        );
    }
    let (decisions, calls) = s.redis_store().coalesced();
    assert!(
        calls > 0 && decisions >= 2 * calls,
        "decisions went together: {decisions} in {calls} coalesced calls"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesced_decisions_on_one_redis_admit_exactly_the_limit() {
    coalesced_decisions_of_a_hot_tenant_admit_exactly_its_limit(&Subject::redis_single().await)
        .await;
}

/// Requests of one coalesced call naming one key under rules of different algorithms: each later
/// request is answered as it is when the requests go one by one in lone calls (the state an
/// earlier request read or wrote is another algorithm's, so it is refused), never with the call
/// failing or a state taken for another algorithm's.
#[tokio::test]
async fn a_key_carried_for_another_algorithm_is_refused_as_lone_calls_refuse_it() {
    let s = Subject::redis_single().await;
    let store = s.redis_store();
    let connection = s.redis_connection();
    let now = FUTURE_BASE_MS;
    let header = format!("{now} 0 1 0 0 0");
    let gcra = "gcra 1000 1000 1000 0 1000";
    let bucket = "tb 5000 1000 1000 0 1000";
    let window = "fw 5 60000 0 0 1000";
    let log = "sl 5 60000 0 0 1000";
    // Each case: what the key holds first (a GCRA's arrival time far ahead, so it denies), then
    // the rules of the requests, in order.
    let cases: [(Option<u64>, &[&str]); 4] = [
        (Some(now + 100_000), &[gcra, bucket]),
        (None, &[window, bucket]),
        (None, &[bucket, window, gcra]),
        (None, &[bucket, log]),
    ];
    let mut refused = 0;
    for (case, (held, rules)) in cases.iter().enumerate() {
        let mut answers = Vec::new();
        for way in ["many", "lone"] {
            let tenant = tenant(&format!("carried-{way}-{case}"));
            let key = rule_key(&tenant, "k");
            if let Some(tat) = held {
                let _: () = redis_query(&connection, redis::cmd("SET").arg(&key).arg(tat)).await;
            }
            let requests: Vec<(Vec<String>, Vec<String>)> = rules
                .iter()
                .enumerate()
                .map(|(i, rule)| {
                    let keys = vec![rule_key(&tenant, &format!("r:{i}")), key.clone()];
                    let args = vec![header.clone(), format!("d{i}"), (*rule).to_owned()];
                    (keys, args)
                })
                .collect();
            let replies = if way == "many" {
                let sent: Vec<(&[String], &[String])> = requests
                    .iter()
                    .map(|(keys, args)| (&keys[..], &args[..]))
                    .collect();
                store
                    .decide_many_requests(&sent)
                    .await
                    .expect("the coalesced call runs")
            } else {
                let mut replies = Vec::new();
                for (keys, args) in &requests {
                    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                    replies.push(store.run_decide_raw(&keys, args).await);
                }
                replies
            };
            let kinds: Vec<Result<Vec<i64>, Option<Rejection>>> = replies
                .into_iter()
                .map(|reply| {
                    reply.map_err(|error| match error {
                        StoreError::Rejected { kind, .. } => Some(kind),
                        _ => None,
                    })
                })
                .collect();
            answers.push(kinds);
        }
        refused += answers[1]
            .iter()
            .filter(|answer| **answer == Err(Some(Rejection::StateMismatch)))
            .count();
        assert_eq!(
            answers[0], answers[1],
            "case {case}: coalesced against lone"
        );
    }
    assert!(
        refused >= cases.len(),
        "every case refused a later request: {refused}"
    );
}

/// However many calls of a slot may be in flight at once, a hot tenant's decisions admit exactly
/// its limit, the bound holds (and is reached: a second call goes while the first is in flight),
/// and once every decision is answered every place in flight is given back (a leaked place would
/// queue the slot's later decisions behind calls that never end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesced_calls_in_flight_stay_within_their_bound_and_are_all_given_back() {
    for calls_in_flight in 1..=3 {
        let config = RedisStoreConfig {
            coalesced_calls_in_flight: calls_in_flight,
            ..TEST_CONFIG
        };
        let s = Subject::redis_single_with(config).await;
        coalesced_decisions_of_a_hot_tenant_admit_exactly_its_limit(&s).await;
        let (peak, slots_left) = places_once_the_senders_are_done(&s).await;
        assert_eq!(
            peak, calls_in_flight,
            "at most {calls_in_flight} calls of the slot in flight, and that many were"
        );
        assert_eq!(
            slots_left, 0,
            "every place in flight given back ({calls_in_flight} in flight at most)"
        );
    }
}

/// Longest a test waits for a slot's sending tasks to give their places back after the last
/// answer (I10).
const SENDERS_DONE_WITHIN: Duration = Duration::from_secs(2);

/// The store's (peak calls in flight, slots holding a place) once its sending tasks are done, or
/// after [`SENDERS_DONE_WITHIN`]. A sending task answers a call's decisions and gives their
/// callers a turn before it looks for more to send (coalescing's module docs), so with several
/// calls of a slot in flight it can hold its place for that turn after another task answered the
/// last decision.
async fn places_once_the_senders_are_done(s: &Subject) -> (usize, usize) {
    let store = s.redis_store();
    let all_given_back = async {
        while store.coalesced_calls_in_flight().1 > 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    // Timing out leaves the places held for the assertion to report.
    let _ = tokio::time::timeout(SENDERS_DONE_WITHIN, all_given_back).await;
    store.coalesced_calls_in_flight()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesced_decisions_on_a_cluster_admit_exactly_the_limit() {
    coalesced_decisions_of_a_hot_tenant_admit_exactly_its_limit(&Subject::redis_cluster().await)
        .await;
}

/// Connecting loads the decision library, whose compilation takes a Redis several milliseconds
/// (more on a loaded machine): that setup is bounded by the connect timeout, not by the deadline of
/// one decision, which a store started beside a busy Redis would otherwise miss and fail to start.
#[tokio::test]
async fn connecting_loads_the_library_within_the_connect_timeout_not_a_decisions_deadline() {
    let server = RedisServer::start();
    let config = RedisStoreConfig {
        call_timeout: Duration::from_micros(1),
        connect_timeout: Duration::from_secs(5),
        ..TEST_CONFIG
    };
    for attempt in 0..3 {
        // Each time on a server that has to compile the library again.
        redis::cmd("FUNCTION")
            .arg("FLUSH")
            .query::<()>(
                &mut redis::Client::open(server.url())
                    .expect("url")
                    .get_connection()
                    .expect("connects"),
            )
            .expect("FUNCTION FLUSH");
        RedisStore::connect(&server.url(), config)
            .await
            .unwrap_or_else(|error| panic!("attempt {attempt}: connects and loads: {error}"));
    }
}
