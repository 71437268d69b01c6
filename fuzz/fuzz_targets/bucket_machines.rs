//! The token bucket and GCRA state machines under arbitrary parameters, clocks (forwards, backwards,
//! jumps) and costs, checked at every step against their invariants: a denial writes nothing, the
//! bucket never holds more than its capacity, stored time never moves back. With corresponding
//! parameters (an integer refill rate dividing 1,000 and the capacity, whole-token costs, a clock
//! that only moves forward), the two admit exactly the same requests with the same answers.
#![no_main]

use allot_shared::limit::gcra::Gcra;
use allot_shared::limit::token_bucket::TokenBucket;
use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Input {
    capacity_millitokens: u64,
    refill_millitokens: u64,
    period_ms: u64,
    start_ms: u64,
    steps: Vec<(i32, u64)>,
}

const RATES: [u64; 16] = [1, 2, 4, 5, 8, 10, 20, 25, 40, 50, 100, 125, 200, 250, 500, 1_000];

fuzz_target!(|input: Input| {
    arbitrary_machines(&input);
    corresponding_machines(&input);
});

fn arbitrary_machines(input: &Input) {
    let (Ok(bucket), Ok(gcra)) = (
        TokenBucket::new(input.capacity_millitokens, input.refill_millitokens, input.period_ms, 0),
        Gcra::new(input.capacity_millitokens, input.refill_millitokens, input.period_ms),
    ) else {
        return;
    };
    let mut now_ms = input.start_ms % (1 << 50);
    let (mut bucket_state, mut gcra_state) = (None, None);
    for &(step_ms, cost) in input.steps.iter().take(256) {
        now_ms = now_ms.saturating_add_signed(i64::from(step_ms));
        if let Ok(b) = bucket.decide(bucket_state.as_ref(), now_ms, cost) {
            assert!(b.remaining <= bucket.capacity_millitokens());
            assert_eq!(b.allowed, b.write.is_some(), "a denial wrote, or an admit did not");
            if let Some(write) = b.write {
                assert!(write.state.tokens_millitokens <= bucket.capacity_millitokens());
                if let Some(old) = &bucket_state {
                    assert!(write.state.updated_at_ms >= old.updated_at_ms, "time moved back");
                }
                bucket_state = Some(write.state);
            }
        }
        if let Ok(g) = gcra.decide(gcra_state.as_ref(), now_ms, cost) {
            assert!(g.remaining <= gcra.capacity_millitokens());
            assert_eq!(g.allowed, g.write.is_some(), "a denial wrote, or an admit did not");
            if let Some(write) = g.write {
                if let Some(old) = &gcra_state {
                    assert!(write.state.tat_ms >= old.tat_ms, "TAT moved back");
                }
                gcra_state = Some(write.state);
            }
        }
    }
}

fn corresponding_machines(input: &Input) {
    let rate = RATES[(input.refill_millitokens % RATES.len() as u64) as usize];
    let capacity = (input.capacity_millitokens % 1_000 + 1) * 1_000;
    let period = input.period_ms % 10_000 + 1;
    let (Ok(bucket), Ok(gcra)) = (
        TokenBucket::new(capacity, rate * period, period, 0),
        Gcra::new(capacity, rate * period, period),
    ) else {
        return;
    };
    let mut now_ms = input.start_ms % (1 << 44);
    let (mut bucket_state, mut gcra_state) = (None, None);
    for &(step_ms, cost) in input.steps.iter().take(256) {
        now_ms += u64::from(step_ms.unsigned_abs() % 5_000);
        let cost = (cost % 50 + 1) * 1_000;
        let b = bucket.decide(bucket_state.as_ref(), now_ms, cost).expect("valid");
        let g = gcra.decide(gcra_state.as_ref(), now_ms, cost).expect("valid");
        assert_eq!(b.allowed, g.allowed, "token bucket and GCRA disagree");
        assert_eq!(b.remaining, g.remaining);
        assert_eq!(b.retry, g.retry);
        if let Some(write) = b.write {
            bucket_state = Some(write.state);
        }
        if let Some(write) = g.write {
            gcra_state = Some(write.state);
        }
    }
}
