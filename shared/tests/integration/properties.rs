//! Invariants of the pure core, checked with proptest over random parameters, states and clocks.

use allot_shared::ids::{Epoch, LeaseId, RegionId};
use allot_shared::lease::{GrantRequest, LeaseClamping, PoolConfig, grant, returnable_tokens};
use allot_shared::limit::RetryAfter;
use allot_shared::limit::fixed_window::FixedWindow;
use allot_shared::limit::gcra::Gcra;
use allot_shared::limit::multi::{Algorithm, RuleInput, State, decide_all};
use allot_shared::limit::sliding_counter::SlidingCounter;
use allot_shared::limit::token_bucket::{TokenBucket, TokenBucketState};
use allot_shared::{MAX_CAPACITY_TIMES_PERIOD, MAX_RULE_PARAMETER};
use proptest::prelude::*;

/// Valid token-bucket parameters anywhere inside the validated bounds, biased towards the extremes.
fn bucket_params() -> impl Strategy<Value = TokenBucket> {
    let edge = prop_oneof![
        1u64..=100,
        1_000u64..=100_000,
        Just(MAX_RULE_PARAMETER),
        1u64..=MAX_RULE_PARAMETER
    ];
    (edge.clone(), edge.clone(), edge, 0u64..=MAX_RULE_PARAMETER).prop_filter_map(
        "capacity x period within 2^52",
        |(capacity, refill, period, slack)| {
            (capacity.checked_mul(period)? <= MAX_CAPACITY_TIMES_PERIOD)
                .then(|| TokenBucket::new(capacity, refill, period, slack).ok())
                .flatten()
        },
    )
}

/// A clock that mostly moves forward, sometimes jumps far, sometimes steps back.
fn clock_steps() -> impl Strategy<Value = Vec<i64>> {
    prop::collection::vec(
        prop_oneof![
            6 => 0i64..2_000,
            1 => 0i64..(1 << 45),
            1 => -5_000i64..0,
        ],
        1..60,
    )
}

fn step(now: u64, delta: i64) -> u64 {
    now.saturating_add_signed(delta).min(1 << 50)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Tokens never exceed capacity; a denial writes nothing; an admit debits exactly its cost; the
    /// stored time never goes back; arithmetic never overflows inside the validated bounds.
    #[test]
    fn token_bucket_invariants(
        bucket in bucket_params(),
        start in 0u64..(1 << 50),
        steps in clock_steps(),
        costs in prop::collection::vec(1u64..=MAX_RULE_PARAMETER, 60),
    ) {
        let mut state: Option<TokenBucketState> = None;
        let mut now = start;
        for (delta, cost) in steps.into_iter().zip(costs) {
            now = step(now, delta);
            let available = bucket.available_millitokens(state.as_ref(), now);
            prop_assert!(available <= bucket.capacity_millitokens());
            let d = bucket.decide(state.as_ref(), now, cost).expect("cost is in bounds");
            if d.allowed {
                prop_assert_eq!(d.remaining + cost, available);
                let write = d.write.expect("an admit writes");
                prop_assert!(write.state.tokens_millitokens <= bucket.capacity_millitokens());
                if let Some(old) = state {
                    prop_assert!(write.state.updated_at_ms >= old.updated_at_ms);
                }
                // The key lives until the stored state would be full again.
                prop_assert_eq!(
                    write.ttl_ms,
                    write.state.updated_at_ms - now + bucket.full_refill_ms() + bucket.slack_ms()
                );
                state = Some(write.state);
            } else {
                prop_assert_eq!(d.write, None);
                prop_assert_ne!(d.retry, RetryAfter::Ms(0));
            }
        }
    }

    /// The retry hint is exact and never optimistic: with no other traffic, the request is admitted
    /// at `now + retry` and not one millisecond earlier.
    #[test]
    fn retry_hints_are_exact(
        bucket in bucket_params(),
        tokens_fraction in 0u64..=1_000,
        cost_fraction in 1u64..=1_000,
        now in 0u64..(1 << 45),
    ) {
        let capacity = bucket.capacity_millitokens();
        let state = TokenBucketState {
            tokens_millitokens: capacity / 1_000 * tokens_fraction,
            updated_at_ms: now,
        };
        let cost = (capacity / 1_000 * cost_fraction).max(1);
        let d = bucket.decide(Some(&state), now, cost).expect("valid");
        if let RetryAfter::Ms(retry) = d.retry && !d.allowed {
            prop_assert!(bucket.decide(Some(&state), now + retry, cost).expect("valid").allowed);
            prop_assert!(!bucket.decide(Some(&state), now + retry - 1, cost).expect("valid").allowed);
        }
    }

    /// With corresponding parameters (an integer refill rate k millitokens/ms dividing 1,000 and the
    /// capacity, whole-token costs), token bucket and GCRA admit the same sequences with the same
    /// remaining counts and retry hints.
    #[test]
    fn token_bucket_and_gcra_agree(
        k in prop::sample::select(vec![1u64, 2, 4, 5, 8, 10, 20, 25, 40, 50, 100, 125, 200, 250, 500, 1_000]),
        capacity_tokens in 1u64..200,
        period in 1u64..5_000,
        start in 0u64..(1 << 40),
        steps in prop::collection::vec((0u64..3_000, 1u64..30), 1..80),
    ) {
        let capacity = capacity_tokens * 1_000;
        let bucket = TokenBucket::new(capacity, k * period, period, 0).expect("valid");
        let gcra = Gcra::new(capacity, k * period, period).expect("valid");
        let (mut b_state, mut g_state) = (None, None);
        let mut now = start;
        for (delta, cost_tokens) in steps {
            now += delta;
            let cost = cost_tokens * 1_000;
            let b = bucket.decide(b_state.as_ref(), now, cost).expect("valid");
            let g = gcra.decide(g_state.as_ref(), now, cost).expect("valid");
            prop_assert_eq!(b.allowed, g.allowed, "at {} cost {}", now, cost);
            prop_assert_eq!(b.remaining, g.remaining);
            prop_assert_eq!(b.retry, g.retry);
            if let Some(w) = b.write { b_state = Some(w.state); }
            if let Some(w) = g.write { g_state = Some(w.state); }
        }
    }

    /// A clamped lease never outlives its window, grants never exceed min(want, chunk, remaining), and
    /// the grants of one window never sum past G.
    #[test]
    fn grants_stay_within_the_window_and_the_pool(
        limit in 1u64..5_000,
        window_ms in 1_000u64..120_000,
        chunk_fraction in 1u64..=100,
        ttl_fraction in 1u64..=100,
        start in 0u64..(1 << 44),
        requests in prop::collection::vec((0u64..5_000, 1u64..10_000, any::<bool>()), 1..100),
    ) {
        let chunk = (limit * chunk_fraction / 100).max(1);
        let ttl = (window_ms * ttl_fraction / 100).max(100);
        let regions = vec![RegionId::parse("eu").expect("id"), RegionId::parse("us").expect("id")];
        let config = PoolConfig::new(limit, window_ms, chunk, ttl, 0, regions.clone()).expect("valid");
        let mut state = None;
        let mut now = start;
        let mut granted_in_window = std::collections::BTreeMap::new();
        for (n, (delta, want, us)) in requests.into_iter().enumerate() {
            now += delta;
            let request = GrantRequest {
                lease_id: LeaseId::from_parts(now, n as u128),
                region: regions[usize::from(us)].clone(),
                want_tokens: want,
            };
            let remaining_before = state
                .as_ref()
                .filter(|s: &&allot_shared::lease::PoolWindowState| s.window == config.window_at(now))
                .map_or(limit, |s| s.remaining_tokens(&config));
            let (g, next) = grant(&config, state.as_ref(), Epoch(3), now, &request, LeaseClamping::Clamped)
                .expect("grant");
            prop_assert_eq!(g.granted_tokens, want.min(chunk).min(remaining_before));
            prop_assert!(g.expires_at_ms <= g.window.end_ms);
            prop_assert!(g.window.contains(now));
            let total = granted_in_window.entry(g.window.start_ms).or_insert(0u64);
            *total += g.granted_tokens;
            prop_assert!(*total <= limit);
            prop_assert_eq!(next.granted_tokens() + next.remaining_tokens(&config), limit);
            state = Some(next);
        }
    }

    /// Leases that end and give back what they left unspent, between grants of the same pool: what
    /// the window's leases may spend (granted less taken back) never exceeds G, each lease is taken
    /// back from once, never more than it left, and only in its own window.
    #[test]
    fn unspent_tokens_given_back_never_lift_a_window_past_its_limit(
        limit in 1u64..2_000,
        chunk_fraction in 1u64..=100,
        steps in prop::collection::vec((0u64..20_000, 1u64..3_000, 0u64..=100, any::<bool>()), 1..120),
    ) {
        let window_ms = 60_000;
        let chunk = (limit * chunk_fraction / 100).max(1);
        let regions = vec![RegionId::parse("eu").expect("id"), RegionId::parse("us").expect("id")];
        let config = PoolConfig::new(limit, window_ms, chunk, 15_000, 0, regions.clone()).expect("valid");
        let mut state: Option<allot_shared::lease::PoolWindowState> = None;
        let mut now = 1u64 << 40;
        // Per window start: what each lease may still spend (its grant, less what came back).
        let mut spendable: std::collections::BTreeMap<u64, std::collections::BTreeMap<u128, u64>> =
            Default::default();
        let mut leases: Vec<(u128, allot_shared::lease::Grant, bool)> = Vec::new();
        for (n, (delta, want, spent_percent, give_back)) in steps.into_iter().enumerate() {
            now += delta;
            let request = GrantRequest {
                lease_id: LeaseId::from_parts(now, n as u128),
                region: regions[n % 2].clone(),
                want_tokens: want,
            };
            let (g, mut next) = grant(&config, state.as_ref(), Epoch(1), now, &request, LeaseClamping::Clamped)
                .expect("grant");
            if g.granted_tokens > 0 {
                spendable.entry(g.window.start_ms).or_default().insert(n as u128, g.granted_tokens);
                leases.push((n as u128, g.clone(), false));
            }
            // Some earlier lease ends and gives back what it left (asked twice, once honoured).
            if give_back && !leases.is_empty() {
                let pick = (now as usize) % leases.len();
                let (id, lease, done) = leases[pick].clone();
                let spent = lease.granted_tokens * spent_percent / 100;
                let unspent = lease.granted_tokens - spent;
                let returnable = returnable_tokens(lease.granted_tokens, spent, unspent + 5);
                prop_assert_eq!(returnable, unspent, "never more than the grant less the spend");
                let taken = if done { 0 } else { next.take_back(lease.window, returnable) };
                prop_assert!(taken <= unspent);
                if lease.window != next.window {
                    prop_assert_eq!(taken, 0, "only in the lease's own window");
                }
                if let Some(left) = spendable.get_mut(&lease.window.start_ms).and_then(|w| w.get_mut(&id)) {
                    *left -= taken;
                }
                leases[pick].2 = true;
            }
            let in_window: u64 = spendable.get(&next.window.start_ms).map_or(0, |w| w.values().sum());
            prop_assert!(in_window <= limit, "{} spendable of {}", in_window, limit);
            prop_assert_eq!(in_window, next.outstanding_tokens());
            prop_assert_eq!(next.outstanding_tokens() + next.remaining_tokens(&config), limit);
            state = Some(next);
        }
    }

    /// Several rules debit all or none: a denial writes nothing and reports untouched counts; an admit
    /// writes every rule.
    #[test]
    fn multi_rule_debits_all_or_none(
        rules in prop::collection::vec((1u64..50, 1u64..5, 1_000u64..20_000, 0u64..=50, 0u8..3), 1..=8),
        cost_tokens in 1u64..5,
        now in 0u64..(1 << 40),
    ) {
        let algorithms: Vec<Algorithm> = rules
            .iter()
            .map(|&(capacity_tokens, refill_tokens, period, _, kind)| match kind {
                0 => Algorithm::TokenBucket(
                    TokenBucket::new(capacity_tokens * 1_000, refill_tokens * 1_000, period, 0).expect("valid"),
                ),
                1 => Algorithm::FixedWindow(FixedWindow::new(capacity_tokens, period).expect("valid")),
                _ => Algorithm::SlidingCounter(SlidingCounter::new(capacity_tokens, period).expect("valid")),
            })
            .collect();
        let states: Vec<Option<State>> = rules
            .iter()
            .zip(&algorithms)
            .map(|(&(capacity_tokens, _, _, fill, _), algorithm)| match algorithm {
                Algorithm::TokenBucket(_) => Some(State::TokenBucket(TokenBucketState {
                    tokens_millitokens: capacity_tokens * 1_000 * fill / 50,
                    updated_at_ms: now,
                })),
                _ => None,
            })
            .collect();
        let inputs: Vec<RuleInput<'_>> = algorithms
            .iter()
            .zip(&states)
            .map(|(algorithm, state)| RuleInput {
                algorithm,
                state: state.as_ref(),
                cost_millitokens: cost_tokens * 1_000,
                advisory: false,
            })
            .collect();
        let d = decide_all(&inputs, now, "r-1").expect("valid");
        if d.allowed {
            prop_assert!(d.writes.iter().all(Option::is_some));
            prop_assert_eq!(d.retry, RetryAfter::Ms(0));
        } else {
            prop_assert!(d.writes.iter().all(Option::is_none));
            let first = d.denied_by.expect("a denial names its rule");
            // The named rule is the first one that denies on its own.
            let mut worst = RetryAfter::Ms(0);
            for (index, input) in inputs.iter().enumerate() {
                let alone = decide_all(&[*input], now, "r-1").expect("valid");
                if index < first {
                    prop_assert!(alone.allowed, "rule {} before the named one admits", index);
                }
                if index == first {
                    prop_assert!(!alone.allowed, "the named rule denies on its own");
                }
                if alone.allowed {
                    // Untouched: it reports what it had before, i.e. its remaining plus the cost.
                    prop_assert!(d.remaining[index] > alone.remaining[0]);
                } else {
                    prop_assert_eq!(d.remaining[index], alone.remaining[0]);
                    worst = worst.max(alone.retry);
                }
            }
            prop_assert_eq!(d.retry, worst, "the hint is the maximum over denying rules");
        }
    }

    /// Advisory (shadow or soft) rules never deny: the request is decided by the enforced rules
    /// alone, every advisory rule that would deny on its own is listed, and an admitted request
    /// spends exactly the rules that admit it on their own (an advisory rule that would deny is
    /// left untouched, so its state follows what enforcing it would have admitted).
    #[test]
    fn advisory_rules_never_deny_and_are_spent_only_where_they_admit(
        rules in prop::collection::vec(
            (1u64..20, 1u64..5, 1_000u64..20_000, 0u64..=50, 0u8..3, any::<bool>()), 1..=8),
        cost_tokens in 1u64..5,
        now in 0u64..(1 << 40),
    ) {
        let algorithms: Vec<Algorithm> = rules
            .iter()
            .map(|&(capacity_tokens, refill_tokens, period, _, kind, _)| match kind {
                0 => Algorithm::TokenBucket(
                    TokenBucket::new(capacity_tokens * 1_000, refill_tokens * 1_000, period, 0).expect("valid"),
                ),
                1 => Algorithm::FixedWindow(FixedWindow::new(capacity_tokens, period).expect("valid")),
                _ => Algorithm::SlidingCounter(SlidingCounter::new(capacity_tokens, period).expect("valid")),
            })
            .collect();
        let states: Vec<Option<State>> = rules
            .iter()
            .zip(&algorithms)
            .map(|(&(capacity_tokens, _, _, fill, _, _), algorithm)| match algorithm {
                Algorithm::TokenBucket(_) => Some(State::TokenBucket(TokenBucketState {
                    tokens_millitokens: capacity_tokens * 1_000 * fill / 50,
                    updated_at_ms: now,
                })),
                _ => None,
            })
            .collect();
        let inputs: Vec<RuleInput<'_>> = algorithms
            .iter()
            .zip(&states)
            .zip(&rules)
            .map(|((algorithm, state), rule)| RuleInput {
                algorithm,
                state: state.as_ref(),
                cost_millitokens: cost_tokens * 1_000,
                advisory: rule.5,
            })
            .collect();
        let d = decide_all(&inputs, now, "r-1").expect("valid");
        let alone: Vec<bool> = inputs
            .iter()
            .map(|input| {
                let enforced = RuleInput { advisory: false, ..*input };
                decide_all(&[enforced], now, "r-1").expect("valid").allowed
            })
            .collect();
        let enforced_deny: Vec<usize> =
            (0..inputs.len()).filter(|&i| !alone[i] && !inputs[i].advisory).collect();
        let advisory_deny: Vec<usize> =
            (0..inputs.len()).filter(|&i| !alone[i] && inputs[i].advisory).collect();
        prop_assert_eq!(d.allowed, enforced_deny.is_empty());
        prop_assert_eq!(d.denied_by, enforced_deny.first().copied());
        prop_assert_eq!(&d.advisory_denials, &advisory_deny);
        for (index, write) in d.writes.iter().enumerate() {
            prop_assert_eq!(write.is_some(), d.allowed && alone[index], "rule {}", index);
        }
    }

    /// Fixed window and sliding counter: a denial writes nothing, counts never pass the limit, and
    /// the retry hint is exact for the counter.
    #[test]
    fn window_algorithms_stay_within_their_limit(
        limit in 1u64..50,
        window_ms in 1u64..20_000,
        start in 0u64..(1 << 44),
        steps in prop::collection::vec((0u64..3_000, 1u64..4), 1..100),
    ) {
        let fixed = FixedWindow::new(limit, window_ms).expect("valid");
        let counter = SlidingCounter::new(limit, window_ms).expect("valid");
        let (mut f_state, mut c_state) = (None, None);
        let mut now = start;
        for (delta, cost) in steps {
            now += delta;
            let f = fixed.decide(f_state.as_ref(), now, cost).expect("valid");
            if let Some(w) = f.write {
                prop_assert!(w.state.count_units <= limit);
                prop_assert!(w.ttl_ms <= window_ms);
                f_state = Some(w.state);
            }
            let c = counter.decide(c_state.as_ref(), now, cost).expect("valid");
            match (c.allowed, c.retry) {
                (true, _) => {
                    let w = c.write.expect("an admit writes");
                    prop_assert!(w.state.current_units <= limit);
                    c_state = Some(w.state);
                }
                (false, RetryAfter::Ms(retry)) => {
                    prop_assert!(c.write.is_none());
                    prop_assert!(counter.decide(c_state.as_ref(), now + retry, cost).expect("valid").allowed);
                    if retry > 1 {
                        prop_assert!(!counter.decide(c_state.as_ref(), now + retry - 1, cost).expect("valid").allowed);
                    }
                }
                (false, RetryAfter::Never) => prop_assert!(cost > limit),
            }
        }
    }
}

/// Regression (found by the limiter's differential tests): a sliding counter whose stored window
/// starts inside the current one (its window length changed) must not underflow the retry hint.
#[test]
fn sliding_counter_with_a_misaligned_stored_window_does_not_underflow() {
    use allot_shared::limit::sliding_counter::SlidingCounterState;
    let counter = SlidingCounter::new(1, 1_000).expect("valid");
    let state = SlidingCounterState {
        window_start_ms: 1_000_500,
        current_units: 1,
        previous_units: 0,
    };
    let d = counter.decide(Some(&state), 1_000_700, 1).expect("valid");
    assert!(!d.allowed);
    // Decided as if at the stored window's start (the strict reading), the hint is a full window
    // past it: conservative, never optimistic.
    assert_eq!(d.retry, RetryAfter::Ms(1_800));
    let at_hint = counter
        .decide(Some(&state), 1_000_700 + 1_800, 1)
        .expect("valid");
    assert!(at_hint.allowed);
}

/// After a clock step back, a token bucket key lives until its (later) stored time plus a full refill.
#[test]
fn token_bucket_ttl_covers_a_stored_time_ahead_of_now() {
    let bucket = TokenBucket::new(20_000, 2_000, 1_000, 5_000).expect("valid");
    let ahead = TokenBucketState {
        tokens_millitokens: 5_000,
        updated_at_ms: 100_000,
    };
    let d = bucket.decide(Some(&ahead), 80_000, 1_000).expect("valid");
    let write = d.write.expect("admitted");
    assert_eq!(write.state.updated_at_ms, 100_000);
    assert_eq!(write.ttl_ms, 20_000 + 15_000);
}

/// Any algorithm of small or extreme parameters.
fn any_algorithm() -> impl Strategy<Value = Algorithm> {
    let amount = prop_oneof![1u64..=10, 1_000u64..=50_000, Just(MAX_RULE_PARAMETER)];
    let period = prop_oneof![1u64..=1_000, Just(3_600_000u64)];
    (0u8..5, amount, period).prop_filter_map(
        "valid parameters",
        |(kind, amount, period)| match kind {
            0 => TokenBucket::new(amount, amount, period, 0)
                .ok()
                .map(Algorithm::TokenBucket),
            1 => Gcra::new(amount, amount, period).ok().map(Algorithm::Gcra),
            2 => FixedWindow::new(amount, period)
                .ok()
                .map(Algorithm::FixedWindow),
            3 => SlidingCounter::new(amount, period)
                .ok()
                .map(Algorithm::SlidingCounter),
            _ => allot_shared::limit::sliding_log::SlidingLog::new(amount.min(1_000), period)
                .ok()
                .map(Algorithm::SlidingLog),
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_048))]

    /// `can_ever_admit` is exactly whether a fresh key admits the cost: a request it refuses would
    /// be refused by every state (a fresh key is the fullest), and one it lets through would be
    /// admitted by a fresh key. Costs range over every u64, the parameter bound's edges included.
    #[test]
    fn a_cost_that_can_never_be_admitted_is_known_before_any_state(
        algorithm in any_algorithm(),
        cost in prop_oneof![
            0u64..=3_000,
            Just(MAX_RULE_PARAMETER),
            Just(MAX_RULE_PARAMETER + 1),
            any::<u64>(),
            (1u64..=50).prop_map(|units| units * 1_000),
        ],
        now in 0u64..(1 << 45),
    ) {
        let input = RuleInput { algorithm: &algorithm, state: None, cost_millitokens: cost, advisory: false };
        let fresh = decide_all(&[input], now, "r-1");
        let admitted = matches!(&fresh, Ok(decision) if decision.allowed);
        prop_assert_eq!(algorithm.can_ever_admit(cost), admitted, "{:?} {:?}", algorithm, fresh);
    }
}
