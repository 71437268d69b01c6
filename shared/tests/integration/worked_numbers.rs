//! The reference design's worked numbers, reproduced through the pure core.
//!
//! Each test names the example it reproduces. Policy shapes: P-READ is a user token bucket of 20 tokens
//! refilling 2 per second (20,000 millitokens, 2,000 per 1,000 ms, 5 s TTL slack); P-TENANT is 1,000
//! tokens per minute (1,000,000 millitokens per 60,000 ms).

use std::num::NonZeroU64;

use allot_shared::contract::{
    Decision, DeniedScope, QuotaView, Reason, http_status, rate_limit_fields, retry_after_header,
    retry_after_seconds,
};
use allot_shared::ids::{DecisionId, Epoch, LeaseId, RegionId};
use allot_shared::lease::{
    GrantRequest, LeaseClamping, OvershootBound, PoolConfig, grant, overshoot_tokens,
};
use allot_shared::limit::RetryAfter;
use allot_shared::limit::concurrency::Semaphore;
use allot_shared::limit::fixed_window::FixedWindow;
use allot_shared::limit::gcra::{Gcra, GcraState};
use allot_shared::limit::multi::{Algorithm, RuleInput, State, decide_all};
use allot_shared::limit::sliding_counter::{SlidingCounter, SlidingCounterState};
use allot_shared::limit::sliding_log::SlidingLog;
use allot_shared::limit::token_bucket::{TokenBucket, TokenBucketState};
use allot_shared::window::Window;

fn p_read() -> TokenBucket {
    TokenBucket::new(20_000, 2_000, 1_000, 5_000).expect("P-READ is valid")
}

fn p_tenant() -> TokenBucket {
    TokenBucket::new(1_000_000, 1_000_000, 60_000, 5_000).expect("P-TENANT is valid")
}

fn bucket_at(tokens_millitokens: u64, updated_at_ms: u64) -> TokenBucketState {
    TokenBucketState {
        tokens_millitokens,
        updated_at_ms,
    }
}

/// Chapter 6, the P-READ timeline, and chapter 8's walk through the script.
#[test]
fn p_read_timeline() {
    let bucket = p_read();
    assert_eq!(bucket.full_refill_ms(), 10_000);
    assert_eq!(bucket.ttl_ms(), 15_000, "full refill 10 s + 5 s slack");

    let t0 = 1_700_000_000_000;
    let mut state = None;
    for n in 1..=20u64 {
        let d = bucket
            .decide(state.as_ref(), t0, 1_000)
            .expect("valid cost");
        assert!(d.allowed, "request {n} is allowed");
        assert_eq!(d.remaining, 20_000 - n * 1_000);
        let write = d.write.expect("an admit writes");
        assert_eq!(write.ttl_ms, 15_000);
        state = Some(write.state);
    }
    // The 21st: deficit 1 token at 2 tokens/s -> 500 ms, Retry-After: 1. Nothing is written.
    let d = bucket
        .decide(state.as_ref(), t0, 1_000)
        .expect("valid cost");
    assert!(!d.allowed);
    assert_eq!(d.retry, RetryAfter::Ms(500));
    assert_eq!(d.write, None, "a denial changes nothing");
    assert_eq!(retry_after_seconds(d.retry.as_wire_ms()), Some(1));

    // 300 ms idle: 600 millitokens; a request is still 400 millitokens short -> 200 ms.
    assert_eq!(bucket.available_millitokens(state.as_ref(), t0 + 300), 600);
    let d = bucket
        .decide(state.as_ref(), t0 + 300, 1_000)
        .expect("valid cost");
    assert!(!d.allowed);
    assert_eq!(d.remaining, 600);
    assert_eq!(d.retry, RetryAfter::Ms(200));

    // 5 s idle: 10 tokens, so exactly 10 requests are allowed.
    assert_eq!(
        bucket.available_millitokens(state.as_ref(), t0 + 5_000),
        10_000
    );
    let mut later = state;
    for _ in 0..10 {
        let d = bucket
            .decide(later.as_ref(), t0 + 5_000, 1_000)
            .expect("valid");
        assert!(d.allowed);
        later = Some(d.write.expect("admit writes").state);
    }
    assert!(
        !bucket
            .decide(later.as_ref(), t0 + 5_000, 1_000)
            .expect("valid")
            .allowed
    );

    // 10 s idle: capped at capacity; more idle time adds nothing.
    assert_eq!(
        bucket.available_millitokens(state.as_ref(), t0 + 10_000),
        20_000
    );
    assert_eq!(
        bucket.available_millitokens(state.as_ref(), t0 + 60_000),
        20_000
    );
}

/// Chapter 6 and 11: an export of cost 10 against 3 remaining tokens waits 3.5 s -> Retry-After: 4.
#[test]
fn weighted_export_retry() {
    let bucket = p_read();
    let now = 50_000;
    let d = bucket
        .decide(Some(&bucket_at(3_000, now)), now, 10_000)
        .expect("valid");
    assert!(!d.allowed);
    assert_eq!(d.remaining, 3_000);
    assert_eq!(d.retry, RetryAfter::Ms(3_500));
    assert_eq!(retry_after_seconds(3_500), Some(4));
    // A cost above capacity can never succeed: -1 and no Retry-After.
    let d = bucket.decide(None, now, 20_001).expect("valid");
    assert_eq!(d.retry, RetryAfter::Never);
    assert_eq!(d.retry.as_wire_ms(), -1);
    assert_eq!(retry_after_seconds(-1), None);
    assert_eq!(d.write, None);
}

/// Chapter 7: GCRA on P-READ gives the same answers as the bucket.
#[test]
fn gcra_equivalence_example() {
    let gcra = Gcra::new(20_000, 2_000, 1_000).expect("valid");
    assert_eq!(gcra.increment_ms(1_000), 500, "T = 500 ms");
    assert_eq!(gcra.burst_tolerance_ms(), 10_000, "B = 10,000 ms");
    let now = 1_000_000;
    let mut state = None;
    for n in 1..=20u64 {
        let d = gcra.decide(state.as_ref(), now, 1_000).expect("valid");
        assert!(d.allowed, "request {n}");
        let write = d.write.expect("admit writes");
        assert_eq!(write.state.tat_ms - now, 500 * n, "newTat - now");
        state = Some(write.state);
    }
    let d = gcra.decide(state.as_ref(), now, 1_000).expect("valid");
    assert!(!d.allowed, "10,500 > 10,000");
    assert_eq!(
        d.retry,
        RetryAfter::Ms(500),
        "the same hint as the token bucket"
    );

    // 5 s later with TAT 10,000 ms ahead: newTat - now = 5,500, admitted; 10 tokens were available.
    let later = now + 5_000;
    assert_eq!(gcra.available_millitokens(state.as_ref(), later), 10_000);
    let d = gcra.decide(state.as_ref(), later, 1_000).expect("valid");
    assert!(d.allowed);
    assert_eq!(
        d.write.expect("admit writes").state,
        GcraState {
            tat_ms: later + 5_500
        }
    );
}

/// Chapter 5: W = 10 s, limit 20, previous 18, current 5, 2.5 s into the window -> allow, because
/// 18 x 7,500 + 5 x 10,000 + 10,000 = 195,000 <= 200,000.
#[test]
fn sliding_counter_example() {
    let counter = SlidingCounter::new(20, 10_000).expect("valid");
    let state = SlidingCounterState {
        window_start_ms: 10_000,
        current_units: 5,
        previous_units: 18,
    };
    let d = counter.decide(Some(&state), 12_500, 1).expect("valid");
    assert!(d.allowed);
    let next = d.write.expect("admit writes").state;
    assert_eq!(next.current_units, 6);
    // The next one: 135,000 + 60,000 + 10,000 = 205,000 > 200,000 -> denied.
    let d = counter.decide(Some(&next), 12_500, 1).expect("valid");
    assert!(!d.allowed);
    // It fits once 18 x (10,000 - e) <= (20 - 6 - 1) x 10,000, i.e. at e = 2,778 ms: 278 ms from now.
    assert_eq!(d.retry, RetryAfter::Ms(278));
    assert!(
        counter
            .decide(Some(&next), 12_777, 1)
            .map(|d| !d.allowed)
            .expect("valid")
    );
    assert!(
        counter
            .decide(Some(&next), 12_778, 1)
            .map(|d| d.allowed)
            .expect("valid")
    );
}

/// Chapter 3: 20 requests at 9.9 s fill window one, 20 more at 10.1 s fill window two: 40 in 0.2 s.
#[test]
fn fixed_window_boundary_burst() {
    let window = FixedWindow::new(20, 10_000).expect("valid");
    let mut state = None;
    for _ in 0..20 {
        let d = window.decide(state.as_ref(), 9_900, 1).expect("valid");
        assert!(d.allowed);
        state = Some(d.write.expect("admit writes").state);
    }
    let d = window.decide(state.as_ref(), 9_900, 1).expect("valid");
    assert!(!d.allowed);
    assert_eq!(d.retry, RetryAfter::Ms(100), "100 ms until the window ends");
    let mut admitted_after_boundary = 0;
    for _ in 0..25 {
        let d = window.decide(state.as_ref(), 10_100, 1).expect("valid");
        if d.allowed {
            admitted_after_boundary += 1;
            state = Some(d.write.expect("admit writes").state);
        }
    }
    assert_eq!(admitted_after_boundary, 20, "40 admitted within 0.2 s");
}

/// Chapter 4: 20 entries admitted at t = 1,000 ms; the 21st at the same instant waits 10,000 ms. A
/// replayed decision id is recognised, not counted twice.
#[test]
fn sliding_log_retry_and_replay() {
    let log = SlidingLog::new(20, 10_000).expect("valid");
    let mut state = None;
    for n in 0..20 {
        let d = log
            .decide(state.as_ref(), 1_000, &format!("r-{n}"))
            .expect("valid");
        assert!(d.allowed);
        state = Some(d.write.expect("admit writes").state);
    }
    let d = log.decide(state.as_ref(), 1_000, "r-new").expect("valid");
    assert_eq!(d.retry, RetryAfter::Ms(10_000));
    let replay = log.decide(state.as_ref(), 1_000, "r-7").expect("valid");
    assert!(replay.allowed, "a retry of an admitted request is allowed");
    assert_eq!(replay.write, None, "and adds no second entry");
    // Exactly one window later the entries have left: (now - W, now] excludes t = 1,000.
    assert!(
        log.decide(state.as_ref(), 11_000, "r-new")
            .expect("valid")
            .allowed
    );
}

fn multi(
    user: &TokenBucketState,
    tenant: &TokenBucketState,
    now: u64,
    cost: u64,
) -> allot_shared::limit::multi::MultiDecision {
    let user_rule = Algorithm::TokenBucket(p_read());
    let tenant_rule = Algorithm::TokenBucket(p_tenant());
    let user_state = State::TokenBucket(*user);
    let tenant_state = State::TokenBucket(*tenant);
    decide_all(
        &[
            RuleInput {
                algorithm: &user_rule,
                state: Some(&user_state),
                cost_millitokens: cost,
                advisory: false,
            },
            RuleInput {
                algorithm: &tenant_rule,
                state: Some(&tenant_state),
                cost_millitokens: cost,
                advisory: false,
            },
        ],
        now,
        "r-9f3a61c2e07b4d18",
    )
    .expect("valid rules")
}

/// Chapter 9's multi-rule outcomes: {1,0,0,0,638000}, {0,1,500,0,639000} and a retry of 420 ms.
#[test]
fn multi_rule_outcomes() {
    let now = 8_000;
    // U-17 has 1,000 left and Atlas 639,000: admitted, both debited.
    let d = multi(&bucket_at(1_000, now), &bucket_at(639_000, now), now, 1_000);
    assert!(d.allowed);
    assert_eq!((d.denied_by, d.retry), (None, RetryAfter::Ms(0)));
    assert_eq!(d.remaining, vec![0, 638_000]);
    assert!(d.writes.iter().all(Option::is_some));

    // U-17 empty: denied by rule 1 (index 0), retry 500 ms, the tenant bucket untouched at 639,000.
    let d = multi(&bucket_at(0, now), &bucket_at(639_000, now), now, 1_000);
    assert!(!d.allowed);
    assert_eq!(d.denied_by, Some(0));
    assert_eq!(d.retry, RetryAfter::Ms(500));
    assert_eq!(d.remaining, vec![0, 639_000]);
    assert!(d.writes.iter().all(Option::is_none), "nothing is debited");

    // Atlas holds 3,000 and the request costs 10,000: denied by rule 2, retry
    // ceil(7,000 x 60,000 / 1,000,000) = 420 ms, the user bucket untouched.
    let d = multi(&bucket_at(20_000, now), &bucket_at(3_000, now), now, 10_000);
    assert_eq!(d.denied_by, Some(1));
    assert_eq!(d.retry, RetryAfter::Ms(420));
    assert_eq!(d.remaining, vec![20_000, 3_000]);
    assert!(d.writes.iter().all(Option::is_none));
}

/// Chapter 18, steps 6, 7 and 9: the end-to-end trace's numbers through the pure core.
#[test]
fn end_to_end_trace_numbers() {
    let t0 = 0;
    // Step 6: fresh user bucket, tenant at 640,000 -> {1, 0, 0, 19000, 639000}.
    let d = multi(&bucket_at(20_000, t0), &bucket_at(640_000, t0), t0, 1_000);
    assert!(d.allowed);
    assert_eq!(d.remaining, vec![19_000, 639_000]);
    // Step 7: two gateways race for U-17's last token at T0 + 8,000: exactly one wins.
    let t7 = 8_000;
    let first = multi(&bucket_at(1_000, t7), &bucket_at(639_000, t7), t7, 1_000);
    assert!(first.allowed);
    assert_eq!(first.remaining, vec![0, 638_000]);
    let Some(State::TokenBucket(user_after)) = first.writes[0].as_ref().map(|w| w.state.clone())
    else {
        panic!("the admit writes a token bucket")
    };
    let Some(State::TokenBucket(tenant_after)) = first.writes[1].as_ref().map(|w| w.state.clone())
    else {
        panic!("the admit writes a token bucket")
    };
    let second = multi(&user_after, &tenant_after, t7, 1_000);
    assert!(!second.allowed);
    assert_eq!(
        (second.denied_by, second.retry),
        (Some(0), RetryAfter::Ms(500))
    );
    assert_eq!(second.remaining, vec![0, 638_000]);
    // Step 9: one second later the user bucket has 2,000; the retry is admitted and leaves 1,000.
    let retry = p_read()
        .decide(Some(&user_after), t7 + 1_000, 1_000)
        .expect("valid");
    assert!(retry.allowed);
    assert_eq!(retry.remaining, 1_000);
}

/// Chapter 9 and 18 step 12: at most 3 exports in flight; the fourth is refused; acquire and release
/// are idempotent.
#[test]
fn concurrency_cap_of_three() {
    let semaphore = Semaphore::new(3, 60_000).expect("valid");
    let mut state = None;
    for id in ["e-1", "e-2", "e-3"] {
        let a = semaphore.acquire(state.as_ref(), 1_000, id);
        assert!(a.acquired);
        state = Some(a.write.expect("a new lease writes").0);
    }
    let fourth = semaphore.acquire(state.as_ref(), 1_000, "e-4");
    assert!(!fourth.acquired);
    assert_eq!(fourth.in_flight, 3);
    let again = semaphore.acquire(state.as_ref(), 2_000, "e-2");
    assert!(
        again.acquired && again.write.is_none(),
        "idempotent acquire"
    );
    let released = semaphore.release(state.as_ref(), 2_000, "e-2");
    let twice = semaphore.release(Some(&released), 2_000, "e-2");
    assert_eq!(released, twice, "idempotent release");
    assert!(semaphore.acquire(Some(&released), 2_000, "e-4").acquired);
    // Leases of crashed holders lapse: at 61,000 every lease has expired.
    assert!(semaphore.acquire(state.as_ref(), 61_000, "e-9").acquired);
    assert_eq!(
        semaphore.renew(state.as_ref(), 61_000, "e-1"),
        None,
        "no resurrection"
    );
}

fn pool(chunk: u64, fallback: u64) -> PoolConfig {
    let regions = vec![
        RegionId::parse("eu").expect("region"),
        RegionId::parse("us").expect("region"),
    ];
    PoolConfig::new(1_000, 60_000, chunk, 15_000, fallback, regions).expect("valid pool")
}

/// Chapter 13's bound: G = 1,000, two regions, chunk 100. Clamped leases add 0; unclamped carry-over
/// adds up to +200; a fallback of 100 per region adds up to +200.
#[test]
fn overshoot_bound_examples() {
    let clamped = OvershootBound::for_design(&pool(100, 0), LeaseClamping::Clamped, 1, 0);
    assert_eq!(clamped.total_tokens(), 1_000);
    let unclamped = OvershootBound::for_design(&pool(100, 0), LeaseClamping::Unclamped, 1, 0);
    assert_eq!(unclamped.unclamped_carry_over_tokens, 200);
    assert_eq!(unclamped.total_tokens(), 1_200);
    let fallback = OvershootBound::for_design(&pool(100, 100), LeaseClamping::Clamped, 1, 0);
    assert_eq!(fallback.fallback_allowance_tokens, 200);
    assert_eq!(fallback.total_tokens(), 1_200);
    assert!(fallback.holds(1_200) && !fallback.holds(1_201));
    assert_eq!(overshoot_tokens(1_150, 1_000), 150);
    assert_eq!(overshoot_tokens(800, 1_000), 0);
}

/// Chapter 13: a lease granted at 0:50 with a 15 s TTL dies at 1:00 when clamped, 1:05 when not;
/// grants never exceed the pool, with a partial grant at the tail and 0 when exhausted.
#[test]
fn lease_grants_clamp_and_exhaust() {
    let config = pool(100, 0);
    let eu = RegionId::parse("eu").expect("region");
    let request = |n: u128, want| GrantRequest {
        lease_id: LeaseId::from_parts(1, n),
        region: eu.clone(),
        want_tokens: want,
    };
    let at_0_50 = 50_000;
    let (clamped, _) = grant(
        &config,
        None,
        Epoch(1),
        at_0_50,
        &request(1, 100),
        LeaseClamping::Clamped,
    )
    .expect("grant");
    assert_eq!(
        clamped.expires_at_ms, 60_000,
        "clamped to the window end, 1:00"
    );
    let (unclamped, _) = grant(
        &config,
        None,
        Epoch(1),
        at_0_50,
        &request(2, 100),
        LeaseClamping::Unclamped,
    )
    .expect("grant");
    assert_eq!(unclamped.expires_at_ms, 65_000, "1:05 when unclamped");

    let mut state = None;
    let mut total = 0;
    for n in 0..10 {
        let (g, next) = grant(
            &config,
            state.as_ref(),
            Epoch(1),
            1_000,
            &request(n, 150),
            LeaseClamping::Clamped,
        )
        .expect("grant");
        assert_eq!(g.granted_tokens, 100, "want is capped at the chunk");
        total += g.granted_tokens;
        state = Some(next);
    }
    assert_eq!(total, 1_000);
    let (g, _) = grant(
        &config,
        state.as_ref(),
        Epoch(1),
        1_000,
        &request(11, 10),
        LeaseClamping::Clamped,
    )
    .expect("grant");
    assert_eq!(g.granted_tokens, 0, "exhausted");
    assert_eq!(g.retry_after_ms, 59_000, "time to the next window");

    // Partial grant at the tail: 960 spent, 40 left, want 100 -> 40.
    let mut state = None;
    for n in 0..24 {
        let (_, next) = grant(
            &config,
            state.as_ref(),
            Epoch(1),
            1_000,
            &request(n, 40),
            LeaseClamping::Clamped,
        )
        .expect("grant");
        state = Some(next);
    }
    let (g, next) = grant(
        &config,
        state.as_ref(),
        Epoch(1),
        1_000,
        &request(99, 100),
        LeaseClamping::Clamped,
    )
    .expect("grant");
    assert_eq!(g.granted_tokens, 40);
    assert_eq!(next.remaining_tokens(&config), 0);
    assert_eq!(
        g.window,
        Window {
            start_ms: 0,
            end_ms: 60_000
        }
    );
    // The next window starts full.
    let (g, _) = grant(
        &config,
        Some(&next),
        Epoch(1),
        60_000,
        &request(100, 100),
        LeaseClamping::Clamped,
    )
    .expect("grant");
    assert_eq!(g.granted_tokens, 100);
    assert_eq!(g.window, config.window_at(60_000));
    assert_eq!(
        config.window(),
        &allot_shared::window::WindowSpec::Fixed(NonZeroU64::new(60_000).expect("non-zero"))
    );
}

fn denial(reason: Reason, scope: DeniedScope, retry_after_ms: i64) -> Decision {
    Decision {
        allowed: false,
        decision_id: DecisionId::parse("r-9f3a61c2e07b4d18").expect("id"),
        policy_id: Some("read-user-v3".to_owned()),
        policy_version: 42,
        denied_scope: Some(scope),
        reason: Some(reason),
        limit_units: 20,
        remaining_units: 0,
        retry_after_ms,
        fallback: false,
        dry_run: false,
        violations: Vec::new(),
        settle_by_ms: None,
    }
}

/// Chapter 11: status semantics, Retry-After rounding and the RateLimit fields.
#[test]
fn http_mapping() {
    let denied = denial(Reason::RateExceeded, DeniedScope::User, 500);
    assert_eq!(http_status(&denied), 429);
    assert_eq!(retry_after_header(&denied), Some(1));
    let never = denial(Reason::RateExceeded, DeniedScope::User, -1);
    assert_eq!(http_status(&never), 429);
    assert_eq!(
        retry_after_header(&never),
        None,
        "no Retry-After when it can never succeed"
    );
    let outage = denial(Reason::LimiterUnavailable, DeniedScope::Route, 1_000);
    assert_eq!(http_status(&outage), 503, "an outage is never a 429");
    let view = QuotaView {
        policy_name: "read".to_owned(),
        quota_units: 20,
        window_seconds: 10,
        remaining_units: 0,
        reset_seconds: 1,
    };
    assert_eq!(
        rate_limit_fields(&view),
        (
            "\"read\";q=20;w=10".to_owned(),
            "\"read\";r=0;t=1".to_owned()
        )
    );
}
