//! One contract suite, run against every store: the reference design's worked outcomes, replay,
//! tightening, and the faults that must be refused. Each test names the example it reproduces.

use allot_shared::ids::TenantId;
use allot_shared::limit::RetryAfter;
use allot_shared::limit::multi::State;

use super::harness::{
    FUTURE_BASE_MS, P_READ, P_TENANT, Subject, batch, decision_id, rule_key, tenant,
};
use crate::limiter::batch::RuleParams;
use crate::limiter::store::{BatchDecision, LeaseCall, LeaseOutcome, Rejection, StoreError};

/// Runs each contract test against the in-process store and against a real Redis.
macro_rules! for_every_store {
    ($($test:ident),* $(,)?) => {
        mod in_process {
            $(
                #[tokio::test]
                async fn $test() {
                    super::$test(&super::Subject::in_process()).await;
                }
            )*
        }
        mod redis_single {
            $(
                #[tokio::test]
                async fn $test() {
                    super::$test(&super::Subject::redis_single().await).await;
                }
            )*
        }
    };
}

for_every_store!(
    p_read_admits_twenty_then_hints_500_ms_and_the_denial_writes_nothing,
    weighted_cost_of_ten_against_three_tokens_waits_3500_ms,
    multi_rule_outcomes_leave_the_other_bucket_untouched,
    a_lost_reply_is_replayed_from_the_record_and_debited_once,
    tightening_applies_to_existing_buckets_on_the_next_call,
    gcra_gives_the_token_buckets_answers,
    fixed_window_admits_forty_across_a_boundary,
    sliding_log_hints_a_full_window_and_replays_an_admitted_id,
    sliding_counter_admits_at_195000_and_hints_278_ms,
    invalid_costs_are_refused_and_write_nothing,
    a_key_of_another_algorithm_is_refused,
    concurrency_caps_three_exports_idempotently,
);

fn denied(index: usize, retry: RetryAfter, remaining: &[u64]) -> BatchDecision {
    BatchDecision {
        allowed: false,
        denied_by: Some(index),
        advisory_denials: Vec::new(),
        retry,
        remaining: remaining.to_vec(),
        replayed: false,
    }
}

fn allowed(remaining: &[u64]) -> BatchDecision {
    BatchDecision {
        allowed: true,
        denied_by: None,
        advisory_denials: Vec::new(),
        retry: RetryAfter::Ms(0),
        remaining: remaining.to_vec(),
        replayed: false,
    }
}

/// Chapters 6 and 8: P-READ at one instant admits 20, then denies with 500 ms (Retry-After: 1);
/// 300 ms later 600 millitokens are back and the hint is 200 ms.
async fn p_read_admits_twenty_then_hints_500_ms_and_the_denial_writes_nothing(s: &Subject) {
    let atlas = tenant("atlas");
    let now = FUTURE_BASE_MS;
    s.set_now(now);
    let request = |n: u64| {
        batch(
            &atlas,
            &format!("r-{n}"),
            0,
            &[("u:17:read", P_READ, 1_000)],
        )
    };
    for n in 1..=20 {
        let decision = s.decide(&request(n)).await.expect("decides");
        assert_eq!(decision, allowed(&[20_000 - n * 1_000]), "request {n}");
    }
    let key = rule_key(&atlas, "u:17:read");
    let stored = s.token_bucket(&key).await;
    let expires_at = s.expires_at(&key).await;
    assert_eq!(
        expires_at,
        Some(now + 15_000),
        "full refill 10 s + slack 5 s"
    );
    let decision = s.decide(&request(21)).await.expect("decides");
    assert_eq!(decision, denied(0, RetryAfter::Ms(500), &[0]));
    assert_eq!(
        s.token_bucket(&key).await,
        stored,
        "a denial debits nothing"
    );
    assert_eq!(s.expires_at(&key).await, expires_at, "nor touches the TTL");

    s.set_now(now + 300);
    let decision = s.decide(&request(22)).await.expect("decides");
    assert_eq!(decision, denied(0, RetryAfter::Ms(200), &[600]));
}

/// Chapter 6: an export of cost 10 against 3 tokens waits 3.5 s (Retry-After: 4).
async fn weighted_cost_of_ten_against_three_tokens_waits_3500_ms(s: &Subject) {
    let atlas = tenant("atlas");
    s.set_now(FUTURE_BASE_MS);
    let spend = batch(&atlas, "r-1", 0, &[("u:17:export", P_READ, 17_000)]);
    assert_eq!(s.decide(&spend).await.expect("decides"), allowed(&[3_000]));
    let export = batch(&atlas, "r-2", 0, &[("u:17:export", P_READ, 10_000)]);
    let decision = s.decide(&export).await.expect("decides");
    assert_eq!(decision, denied(0, RetryAfter::Ms(3_500), &[3_000]));
    // A cost above capacity can never succeed: -1, and still nothing written.
    let impossible = batch(&atlas, "r-3", 0, &[("u:17:export", P_READ, 20_001)]);
    let decision = s.decide(&impossible).await.expect("decides");
    assert_eq!(decision, denied(0, RetryAfter::Never, &[0]));
    let key = rule_key(&atlas, "u:17:export");
    assert_eq!(
        s.token_bucket(&key).await.map(|b| b.tokens_millitokens),
        Some(3_000)
    );
}

/// Chapter 9: {1,0,0,0,638000}, {0,1,500,0,639000} and a 420 ms hint, the other bucket untouched.
async fn multi_rule_outcomes_leave_the_other_bucket_untouched(s: &Subject) {
    let now = FUTURE_BASE_MS;
    s.set_now(now);
    // Brings a tenant's user bucket and tenant bucket to the given millitokens left, spending at
    // `now` (or, for a full user bucket, half a second earlier so it exists and has refilled).
    let seed = async |name: &str, user_left: u64, tenant_left: u64| {
        let tenant = tenant(name);
        if user_left == 20_000 {
            s.set_now(now - 500);
            let user = batch(&tenant, "seed-u", 0, &[("u:17", P_READ, 1_000)]);
            s.decide(&user).await.expect("decides");
            s.set_now(now);
        } else {
            let user = batch(
                &tenant,
                "seed-u",
                0,
                &[("u:17", P_READ, 20_000 - user_left)],
            );
            s.decide(&user).await.expect("decides");
        }
        let whole = batch(
            &tenant,
            "seed-t",
            0,
            &[("tenant", P_TENANT, 1_000_000 - tenant_left)],
        );
        s.decide(&whole).await.expect("decides");
        tenant
    };
    let both = |tenant: &TenantId, cost: u64| {
        let rules = [("u:17", P_READ, cost), ("tenant", P_TENANT, cost)];
        batch(tenant, "r-9f3a61c2e07b4d18", 0, &rules)
    };

    // U-17 has 1,000 left and Atlas 639,000: admitted, both debited.
    let atlas = seed("atlas-a", 1_000, 639_000).await;
    assert_eq!(
        s.decide(&both(&atlas, 1_000)).await.expect("decides"),
        allowed(&[0, 638_000])
    );
    let tenant_bucket = s
        .token_bucket(&rule_key(&atlas, "tenant"))
        .await
        .expect("exists");
    assert_eq!(tenant_bucket.tokens_millitokens, 638_000);

    // U-17 empty: denied by rule 1, 500 ms; the tenant bucket still holds 639,000.
    let atlas = seed("atlas-b", 0, 639_000).await;
    let tenant_key = rule_key(&atlas, "tenant");
    let before = (
        s.token_bucket(&tenant_key).await,
        s.expires_at(&tenant_key).await,
    );
    let decision = s.decide(&both(&atlas, 1_000)).await.expect("decides");
    assert_eq!(decision, denied(0, RetryAfter::Ms(500), &[0, 639_000]));
    let after = (
        s.token_bucket(&tenant_key).await,
        s.expires_at(&tenant_key).await,
    );
    assert_eq!(after, before, "the tenant bucket is untouched");
    assert_eq!(after.0.map(|b| b.tokens_millitokens), Some(639_000));

    // Atlas holds 3,000 and the export costs 10,000: denied by rule 2, ceil(7,000 x 60,000 /
    // 1,000,000) = 420 ms; the user bucket (full, 20,000) untouched.
    let atlas = seed("atlas-c", 20_000, 3_000).await;
    let user_key = rule_key(&atlas, "u:17");
    let before = (
        s.token_bucket(&user_key).await,
        s.expires_at(&user_key).await,
    );
    let decision = s.decide(&both(&atlas, 10_000)).await.expect("decides");
    assert_eq!(decision, denied(1, RetryAfter::Ms(420), &[20_000, 3_000]));
    assert_eq!(
        (
            s.token_bucket(&user_key).await,
            s.expires_at(&user_key).await
        ),
        before
    );
}

/// Chapter 10: the reply to an admitted, recorded decision is lost; the retry with the same decision
/// id is answered from the record and debits nothing. Retention is bounded by the record's TTL.
async fn a_lost_reply_is_replayed_from_the_record_and_debited_once(s: &Subject) {
    let atlas = tenant("atlas");
    let now = FUTURE_BASE_MS;
    s.set_now(now);
    let export = |id: &str| batch(&atlas, id, 30_000, &[("u:17:export", P_READ, 1_000)]);
    let first = s.decide(&export("r-e41")).await.expect("decides");
    assert_eq!(first, allowed(&[19_000]));
    // ... the reply is lost; the gateway retries with the same id.
    s.set_now(now + 20);
    let retry = s.decide(&export("r-e41")).await.expect("decides");
    assert_eq!(
        retry,
        BatchDecision {
            replayed: true,
            ..first
        }
    );
    let key = rule_key(&atlas, "u:17:export");
    assert_eq!(
        s.token_bucket(&key).await.map(|b| b.tokens_millitokens),
        Some(19_000),
        "one debit"
    );
    let record_key = export("r-e41").record_key().to_owned();
    assert_eq!(s.record(&record_key).await, Some(vec![19_000]));
    assert_eq!(s.expires_at(&record_key).await, Some(now + 30_000));
    // Another request is a new debit (after 20 ms of refill: 40 millitokens).
    assert_eq!(
        s.decide(&export("r-e42")).await.expect("decides"),
        allowed(&[18_040])
    );
    // After the record's retention, the same id is a new decision again (the bounded residual risk).
    s.set_now(now + 30_001);
    let late = s.decide(&export("r-e41")).await.expect("decides");
    assert_eq!(
        late,
        allowed(&[19_000]),
        "refilled to full, then debited once more"
    );
    // Denials are not recorded.
    let huge = batch(&atlas, "r-e43", 30_000, &[("u:17:export", P_READ, 20_000)]);
    assert!(!s.decide(&huge).await.expect("decides").allowed);
    let denied_record = huge.record_key().to_owned();
    assert_eq!(s.record(&denied_record).await, None);
}

/// Chapter 6, "stored tokens above a lowered capacity": an emergency tightening applies on the next
/// call to existing buckets.
async fn tightening_applies_to_existing_buckets_on_the_next_call(s: &Subject) {
    let atlas = tenant("atlas");
    s.set_now(FUTURE_BASE_MS);
    let first = batch(&atlas, "r-1", 0, &[("u:17", P_READ, 1_000)]);
    assert_eq!(s.decide(&first).await.expect("decides"), allowed(&[19_000]));
    let tightened = RuleParams::TokenBucket {
        capacity_millitokens: 5_000,
        refill_millitokens: 2_000,
        period_ms: 1_000,
        slack_ms: 5_000,
    };
    let next = batch(&atlas, "r-2", 0, &[("u:17", tightened, 1_000)]);
    assert_eq!(
        s.decide(&next).await.expect("decides"),
        allowed(&[4_000]),
        "19,000 clamped to 5,000"
    );
    let key = rule_key(&atlas, "u:17");
    assert_eq!(
        s.token_bucket(&key).await.map(|b| b.tokens_millitokens),
        Some(4_000)
    );
}

/// Chapter 7: GCRA on P-READ admits 20 and hints 500 ms, like the bucket; 5 s later 10 tokens are back.
async fn gcra_gives_the_token_buckets_answers(s: &Subject) {
    let atlas = tenant("atlas");
    let now = FUTURE_BASE_MS;
    s.set_now(now);
    let gcra = RuleParams::Gcra {
        capacity_millitokens: 20_000,
        refill_millitokens: 2_000,
        period_ms: 1_000,
    };
    let request = |n: u64| batch(&atlas, &format!("r-{n}"), 0, &[("u:17:gcra", gcra, 1_000)]);
    for n in 1..=20 {
        assert_eq!(
            s.decide(&request(n)).await.expect("decides"),
            allowed(&[20_000 - n * 1_000])
        );
    }
    assert_eq!(
        s.decide(&request(21)).await.expect("decides"),
        denied(0, RetryAfter::Ms(500), &[0])
    );
    s.set_now(now + 5_000);
    assert_eq!(
        s.decide(&request(22)).await.expect("decides"),
        allowed(&[9_000])
    );
    let key = rule_key(&atlas, "u:17:gcra");
    assert_eq!(
        s.expires_at(&key).await,
        Some(now + 5_000 + 5_500),
        "TTL = newTat - now"
    );
}

/// Chapter 3: 20 requests at 9.9 s fill one window, 20 more at 10.1 s fill the next.
async fn fixed_window_admits_forty_across_a_boundary(s: &Subject) {
    let anon = tenant("anon");
    let window_ms = 10_000;
    let start = FUTURE_BASE_MS - FUTURE_BASE_MS % window_ms;
    let params = RuleParams::FixedWindow {
        limit_units: 20,
        window_ms,
    };
    let request = |n: u64| batch(&anon, &format!("r-{n}"), 0, &[("ip:1", params, 1_000)]);
    s.set_now(start + 9_900);
    for n in 1..=20 {
        assert_eq!(
            s.decide(&request(n)).await.expect("decides"),
            allowed(&[20 - n])
        );
    }
    assert_eq!(
        s.decide(&request(21)).await.expect("decides"),
        denied(0, RetryAfter::Ms(100), &[0])
    );
    assert_eq!(
        s.expires_at(&rule_key(&anon, "ip:1")).await,
        Some(start + window_ms)
    );
    s.set_now(start + 10_100);
    let mut admitted = 0;
    for n in 22..47 {
        admitted += u64::from(s.decide(&request(n)).await.expect("decides").allowed);
    }
    assert_eq!(admitted, 20, "40 admitted within 0.2 s");
}

/// Chapter 4: 20 entries at one instant; the 21st waits the full 10 s; a replayed id is not counted.
async fn sliding_log_hints_a_full_window_and_replays_an_admitted_id(s: &Subject) {
    let atlas = tenant("atlas");
    let now = FUTURE_BASE_MS;
    s.set_now(now);
    let params = RuleParams::SlidingLog {
        limit_units: 20,
        window_ms: 10_000,
    };
    let request = |id: &str| batch(&atlas, id, 0, &[("audit", params, 1_000)]);
    for n in 0..20 {
        assert!(
            s.decide(&request(&format!("r-{n}")))
                .await
                .expect("decides")
                .allowed
        );
    }
    let decision = s.decide(&request("r-new")).await.expect("decides");
    assert_eq!(decision, denied(0, RetryAfter::Ms(10_000), &[0]));
    assert_eq!(
        s.decide(&request("r-7")).await.expect("decides"),
        allowed(&[0]),
        "a replay"
    );
    let key = rule_key(&atlas, "audit");
    let Some(State::SlidingLog(log)) = s.rule_state(&key, &params).await else {
        panic!("the log exists");
    };
    assert_eq!(log.entries.len(), 20, "no second entry for r-7");
    s.set_now(now + 10_000);
    assert_eq!(
        s.decide(&request("r-new")).await.expect("decides"),
        allowed(&[19]),
        "(now - W, now]"
    );
}

/// Chapter 5: W = 10 s, limit 20, previous window 18, current 5, 2.5 s in: the sixth is admitted
/// (195,000 <= 200,000), the seventh fits 278 ms later.
async fn sliding_counter_admits_at_195000_and_hints_278_ms(s: &Subject) {
    let atlas = tenant("atlas");
    let window_ms = 10_000;
    let previous_start = FUTURE_BASE_MS - FUTURE_BASE_MS % window_ms;
    let params = RuleParams::SlidingCounter {
        limit_units: 20,
        window_ms,
    };
    let request = |n: u64| batch(&atlas, &format!("r-{n}"), 0, &[("smooth", params, 1_000)]);
    s.set_now(previous_start);
    for n in 0..18 {
        assert!(s.decide(&request(n)).await.expect("decides").allowed);
    }
    let now = previous_start + window_ms + 2_500;
    s.set_now(now);
    for n in 18..23 {
        assert!(
            s.decide(&request(n)).await.expect("decides").allowed,
            "current window, request {n}"
        );
    }
    // 18 x 7,500 + 5 x 10,000 + 10,000 = 195,000 <= 200,000: the sixth is admitted.
    assert_eq!(
        s.decide(&request(23)).await.expect("decides"),
        allowed(&[0])
    );
    // 135,000 + 60,000 + 10,000 = 205,000: the seventh fits at e = 2,778 ms.
    assert_eq!(
        s.decide(&request(24)).await.expect("decides"),
        denied(0, RetryAfter::Ms(278), &[0])
    );
    s.set_now(now + 278);
    assert!(s.decide(&request(25)).await.expect("decides").allowed);
}

/// Costs the core refuses are refused by every store, as a policy fault, before any write.
async fn invalid_costs_are_refused_and_write_nothing(s: &Subject) {
    let atlas = tenant("atlas");
    s.set_now(FUTURE_BASE_MS);
    let window = RuleParams::FixedWindow {
        limit_units: 5,
        window_ms: 1_000,
    };
    let log = RuleParams::SlidingLog {
        limit_units: 5,
        window_ms: 1_000,
    };
    for (n, bad) in [
        ("tb", P_READ, (1 << 40) + 1),
        ("fw", window, 1_500),
        ("sl", log, 2_000),
    ]
    .into_iter()
    .enumerate()
    {
        let rules = [("first", P_READ, 1_000), bad];
        let refused = s
            .decide(&batch(&atlas, &format!("r-{n}"), 30_000, &rules))
            .await;
        assert!(
            matches!(
                refused,
                Err(StoreError::Rejected {
                    kind: Rejection::InvalidArgument,
                    ..
                })
            ),
            "{}: {refused:?}",
            bad.0
        );
        assert_eq!(
            s.token_bucket(&rule_key(&atlas, "first")).await,
            None,
            "nothing written"
        );
    }
}

/// A rule whose algorithm changed while its key lived finds state of another shape: refused.
async fn a_key_of_another_algorithm_is_refused(s: &Subject) {
    let atlas = tenant("atlas");
    s.set_now(FUTURE_BASE_MS);
    let bucket = batch(&atlas, "r-1", 0, &[("shared", P_READ, 1_000)]);
    s.decide(&bucket).await.expect("decides");
    let gcra = RuleParams::Gcra {
        capacity_millitokens: 20_000,
        refill_millitokens: 2_000,
        period_ms: 1_000,
    };
    let window = RuleParams::FixedWindow {
        limit_units: 5,
        window_ms: 1_000,
    };
    for other in [gcra, window] {
        let refused = s
            .decide(&batch(&atlas, "r-2", 0, &[("shared", other, 1_000)]))
            .await;
        assert!(
            matches!(
                refused,
                Err(StoreError::Rejected {
                    kind: Rejection::StateMismatch,
                    ..
                })
            ),
            "{other:?}: {refused:?}"
        );
    }
    let key = rule_key(&atlas, "shared");
    assert_eq!(
        s.token_bucket(&key).await.map(|b| b.tokens_millitokens),
        Some(19_000)
    );
}

/// Chapters 9 and 18: at most 3 exports in flight; acquire and release are idempotent; leases of
/// crashed holders lapse and cannot be renewed.
async fn concurrency_caps_three_exports_idempotently(s: &Subject) {
    let atlas = tenant("atlas");
    let now = FUTURE_BASE_MS;
    s.set_now(now);
    let key = rule_key(&atlas, "tenant:atlas:export:cc");
    let call = |id: &str| LeaseCall::new(key.clone(), 3, 60_000, decision_id(id)).expect("valid");
    let outcome = |held, in_flight| LeaseOutcome { held, in_flight };
    for (n, id) in ["e-1", "e-2", "e-3"].into_iter().enumerate() {
        let acquired = s.store.acquire_lease(&call(id)).await.expect("acquires");
        assert_eq!(acquired, outcome(true, n as u64 + 1));
    }
    assert_eq!(s.expires_at(&key).await, Some(now + 60_000));
    assert_eq!(
        s.store.acquire_lease(&call("e-4")).await.expect("answers"),
        outcome(false, 3)
    );
    s.set_now(now + 1_000);
    assert_eq!(
        s.store.acquire_lease(&call("e-2")).await.expect("answers"),
        outcome(true, 3),
        "idempotent"
    );
    assert_eq!(
        s.store.release_lease(&call("e-2")).await.expect("answers"),
        outcome(true, 2)
    );
    assert_eq!(
        s.store.release_lease(&call("e-2")).await.expect("answers"),
        outcome(false, 2),
        "idempotent"
    );
    assert_eq!(
        s.store.acquire_lease(&call("e-4")).await.expect("answers"),
        outcome(true, 3)
    );
    assert_eq!(
        s.store.renew_lease(&call("e-1")).await.expect("answers"),
        outcome(true, 3)
    );
    assert_eq!(
        s.expires_at(&key).await,
        Some(now + 61_000),
        "the latest lease's expiry"
    );
    // At +60,001 e-3 has lapsed (e-1 was renewed, e-4 taken at +1,000): no resurrection.
    s.set_now(now + 60_001);
    assert_eq!(
        s.store.renew_lease(&call("e-3")).await.expect("answers"),
        outcome(false, 2)
    );
    assert_eq!(
        s.store.acquire_lease(&call("e-9")).await.expect("answers"),
        outcome(true, 3)
    );
}
