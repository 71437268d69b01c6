//! Per-key limiting algorithms, as pure state machines.
//!
//! Every algorithm has the same shape: `decide(params, state, now_ms, cost) -> Decision<State>`. The
//! caller owns the state (in Redis, in memory, in the simulator) and must write [`Decision::write`] back
//! atomically with the read, with its TTL, or write nothing when it is `None`. A denial never asks for a
//! write: a denied request consumes nothing (the flooding client cannot drain its own bucket below what
//! honest retry timing gives it).
//!
//! Units: token bucket and GCRA count **millitokens**; fixed window, sliding counter and sliding log
//! count whole **units** (one unit per request of cost 1). Time is epoch **milliseconds**, supplied by the
//! caller; in production it is the store's own clock, so gateways with skewed clocks cannot influence
//! refill.
//!
//! Clock behaviour, shared by all algorithms: a clock that moved backwards never refills and never moves a
//! stored timestamp back (stricter, never more generous); a clock that jumped forward refills at most to
//! full.

pub mod concurrency;
pub mod fixed_window;
pub mod gcra;
pub mod multi;
pub mod sliding_counter;
pub mod sliding_log;
pub mod token_bucket;

use crate::{MAX_CAPACITY_TIMES_PERIOD, MAX_RULE_PARAMETER};

/// When a denied request could succeed, assuming no other traffic.
///
/// Ordered so that `max` over several rules gives the hint for the whole request: any `Ms` is smaller
/// than `Never`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RetryAfter {
    /// Retry after this many milliseconds; `Ms(0)` for an allowed request.
    Ms(u64),
    /// The request can never succeed under this policy (its cost exceeds the rule's capacity). Waiting
    /// cannot help; this is a policy defect to alert on.
    Never,
}

impl RetryAfter {
    /// The wire form used by the decision contract: milliseconds, or `-1` for [`RetryAfter::Never`].
    pub fn as_wire_ms(self) -> i64 {
        match self {
            RetryAfter::Ms(ms) => i64::try_from(ms).unwrap_or(i64::MAX),
            RetryAfter::Never => -1,
        }
    }
}

/// A state to store, with the expiry to set in the same write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write<S> {
    /// The new state.
    pub state: S,
    /// Time to live of the key from `now`, in ms. Expiry is part of the algorithm: once it passes, a
    /// missing key decides exactly like the expired state would have (e.g. a full bucket).
    pub ttl_ms: u64,
}

/// The result of one algorithm on one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision<S> {
    /// Whether the request is admitted by this rule.
    pub allowed: bool,
    /// What is left after the decision, in the algorithm's unit (millitokens or units).
    pub remaining: u64,
    /// `Ms(0)` when allowed; otherwise when to retry.
    pub retry: RetryAfter,
    /// The state to write, or `None` to write nothing. Always `None` when denied.
    pub write: Option<Write<S>>,
}

impl<S> Decision<S> {
    pub(crate) fn deny(remaining: u64, retry: RetryAfter) -> Self {
        debug_assert!(
            retry != RetryAfter::Ms(0),
            "a denial must give a positive retry hint"
        );
        Self {
            allowed: false,
            remaining,
            retry,
            write: None,
        }
    }

    pub(crate) fn allow(remaining: u64, state: S, ttl_ms: u64) -> Self {
        Self {
            allowed: true,
            remaining,
            retry: RetryAfter::Ms(0),
            write: Some(Write { state, ttl_ms }),
        }
    }
}

/// A rule parameter outside its bounds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} = {value} is out of bounds: {expected}")]
pub struct ParamError {
    /// The parameter's name as it appears in a policy bundle, e.g. `capacityMillis`.
    pub field: &'static str,
    /// The offending value.
    pub value: u64,
    /// What was expected, e.g. `an integer in [1, 2^40]`.
    pub expected: &'static str,
}

/// Checks `value` is in `[min, 2^40]`.
pub(crate) fn check_param(field: &'static str, value: u64, min: u64) -> Result<u64, ParamError> {
    let expected = if min == 0 {
        "an integer in [0, 2^40]"
    } else {
        "an integer in [1, 2^40]"
    };
    if value < min || value > MAX_RULE_PARAMETER {
        return Err(ParamError {
            field,
            value,
            expected,
        });
    }
    Ok(value)
}

/// Checks `capacity * period <= 2^52`, which keeps every product the algorithms form below 2^53.
pub(crate) fn check_capacity_times_period(
    field: &'static str,
    capacity: u64,
    period_ms: u64,
) -> Result<(), ParamError> {
    match capacity.checked_mul(period_ms) {
        Some(product) if product <= MAX_CAPACITY_TIMES_PERIOD => Ok(()),
        _ => Err(ParamError {
            field,
            value: capacity,
            expected: "capacity x period at most 2^52",
        }),
    }
}

/// `ceil(a / b)` for `b > 0`.
pub(crate) fn div_ceil(a: u64, b: u64) -> u64 {
    debug_assert!(b > 0);
    a.div_ceil(b)
}
