//! All-or-nothing evaluation of the rules that apply to one request.
//!
//! Every rule is decided against the same `now`; the request is admitted only if every rule admits it,
//! and only then is any state written. A denial anywhere debits nothing, so no refund is ever needed
//! (refunds after ambiguous failures are how quotas get double-refunded). The first denying rule in
//! evaluation order is named; the retry hint is the maximum over denying rules, with
//! [`RetryAfter::Never`] dominating.
//!
//! An **advisory** rule (a policy's `shadow` or `soft` mode) is decided like the others but never
//! denies: a request it would deny is listed in [`MultiDecision::advisory_denials`] and decided by
//! the enforced rules alone. When the request is admitted, an advisory rule is spent only if it
//! would have admitted it, so its state follows what enforcing it would have admitted. This is the reference the Redis multi-rule script and the in-process
//! store are tested against.

use super::fixed_window::{FixedWindow, FixedWindowState};
use super::gcra::{Gcra, GcraState};
use super::sliding_counter::{SlidingCounter, SlidingCounterState};
use super::sliding_log::{SlidingLog, SlidingLogState, check_unit_cost};
use super::token_bucket::{TokenBucket, TokenBucketState};
use super::{Decision, ParamError, RetryAfter, Write};
use crate::MILLITOKENS_PER_TOKEN;

/// Most rules one request may be evaluated against: script time grows with the rule count, and the
/// store runs nothing else meanwhile.
pub const MAX_RULES_PER_REQUEST: usize = 8;

/// A validated algorithm with its parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Token bucket (millitokens).
    TokenBucket(TokenBucket),
    /// GCRA (millitokens).
    Gcra(Gcra),
    /// Fixed window (units).
    FixedWindow(FixedWindow),
    /// Sliding approximate counter (units).
    SlidingCounter(SlidingCounter),
    /// Sliding log (units, unit cost only).
    SlidingLog(SlidingLog),
}

impl Algorithm {
    /// Whether a request costing `cost_millitokens` could ever be admitted by this rule, whatever
    /// its state: the cost is a valid parameter (at most 2^40; whole units for window algorithms,
    /// exactly one unit for the sliding log) and fits in the rule's capacity or window limit. A
    /// request that fails this is refused before any store is asked (`COST_TOO_HIGH`).
    pub fn can_ever_admit(&self, cost_millitokens: u64) -> bool {
        if cost_millitokens == 0 || cost_millitokens > crate::MAX_RULE_PARAMETER {
            return false;
        }
        let whole_units = || {
            cost_millitokens
                .is_multiple_of(MILLITOKENS_PER_TOKEN)
                .then_some(cost_millitokens / MILLITOKENS_PER_TOKEN)
        };
        match self {
            Algorithm::TokenBucket(bucket) => cost_millitokens <= bucket.capacity_millitokens(),
            Algorithm::Gcra(gcra) => cost_millitokens <= gcra.capacity_millitokens(),
            Algorithm::FixedWindow(window) => {
                whole_units().is_some_and(|units| units <= window.limit_units())
            }
            Algorithm::SlidingCounter(counter) => {
                whole_units().is_some_and(|units| units <= counter.limit_units())
            }
            Algorithm::SlidingLog(log) => whole_units() == Some(1) && log.limit_units() >= 1,
        }
    }

    /// The shape of the state this algorithm stores, as the last segment of its store key: a rule
    /// whose algorithm changes starts from fresh state under a new key instead of meeting the old
    /// algorithm's state (which would be an error until it expired). Never contains `:`.
    pub fn state_shape(&self) -> &'static str {
        match self {
            Algorithm::TokenBucket(_) => "tb",
            Algorithm::Gcra(_) => "gcra",
            Algorithm::FixedWindow(_) => "fw",
            Algorithm::SlidingCounter(_) => "sc",
            Algorithm::SlidingLog(_) => "sl",
        }
    }
}

/// Stored state of one rule's key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum State {
    /// Token-bucket state.
    TokenBucket(TokenBucketState),
    /// GCRA state.
    Gcra(GcraState),
    /// Fixed-window state.
    FixedWindow(FixedWindowState),
    /// Sliding-counter state.
    SlidingCounter(SlidingCounterState),
    /// Sliding-log state.
    SlidingLog(SlidingLogState),
}

/// One rule of a request: its algorithm, its key's current state (if any) and the request's cost.
#[derive(Debug, Clone, Copy)]
pub struct RuleInput<'a> {
    /// The rule's algorithm and parameters.
    pub algorithm: &'a Algorithm,
    /// The rule key's stored state; `None` when the key does not exist (or expired).
    pub state: Option<&'a State>,
    /// The request's cost in millitokens. Window algorithms count whole units, so there it must be a
    /// multiple of 1,000 (policy validation guarantees it).
    pub cost_millitokens: u64,
    /// Whether the rule only advises (shadow or soft): it never denies the request.
    pub advisory: bool,
}

/// The outcome for the whole request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MultiDecision {
    /// True only when every rule admitted the request.
    pub allowed: bool,
    /// Index of the first denying (enforced) rule in evaluation order.
    pub denied_by: Option<usize>,
    /// Indexes of the advisory rules that would have denied the request, in order.
    pub advisory_denials: Vec<usize>,
    /// `Ms(0)` when allowed; otherwise the maximum over denying rules.
    pub retry: RetryAfter,
    /// Per rule, what is left in its own unit: after the debit when allowed, untouched when denied.
    pub remaining: Vec<u64>,
    /// Per rule, the state to write with its TTL. All `None` when denied.
    pub writes: Vec<Option<Write<State>>>,
}

/// Why a set of rules could not be evaluated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MultiRuleError {
    /// No rules, or more than [`MAX_RULES_PER_REQUEST`].
    #[error("a request must be evaluated against 1 to {MAX_RULES_PER_REQUEST} rules, got {0}")]
    RuleCount(usize),
    /// A rule parameter or cost out of bounds.
    #[error("rule {index}: {source}")]
    Param {
        /// The rule's position.
        index: usize,
        /// What was wrong.
        source: ParamError,
    },
    /// The stored state has the shape of another algorithm (a key collision or a state-shape change).
    #[error("rule {index}: stored state does not belong to this rule's algorithm")]
    StateMismatch {
        /// The rule's position.
        index: usize,
    },
}

fn units(cost_millitokens: u64) -> Result<u64, ParamError> {
    if cost_millitokens == 0 || !cost_millitokens.is_multiple_of(MILLITOKENS_PER_TOKEN) {
        return Err(ParamError {
            field: "costMillis",
            value: cost_millitokens,
            expected: "a positive multiple of 1,000 for window algorithms",
        });
    }
    Ok(cost_millitokens / MILLITOKENS_PER_TOKEN)
}

fn lift<S>(decision: Decision<S>, wrap: fn(S) -> State) -> Decision<State> {
    Decision {
        allowed: decision.allowed,
        remaining: decision.remaining,
        retry: decision.retry,
        write: decision.write.map(|w| Write {
            state: wrap(w.state),
            ttl_ms: w.ttl_ms,
        }),
    }
}

struct RuleOutcome {
    decision: Decision<State>,
    /// What is left without debiting, for reporting when another rule denies.
    available: u64,
}

fn decide_one(
    input: &RuleInput<'_>,
    now_ms: u64,
    decision_id: &str,
) -> Result<Option<RuleOutcome>, ParamError> {
    let cost = input.cost_millitokens;
    let outcome = match (input.algorithm, input.state) {
        (Algorithm::TokenBucket(a), None | Some(State::TokenBucket(_))) => {
            let s = match input.state {
                Some(State::TokenBucket(s)) => Some(s),
                _ => None,
            };
            RuleOutcome {
                decision: lift(a.decide(s, now_ms, cost)?, State::TokenBucket),
                available: a.available_millitokens(s, now_ms),
            }
        }
        (Algorithm::Gcra(a), None | Some(State::Gcra(_))) => {
            let s = match input.state {
                Some(State::Gcra(s)) => Some(s),
                _ => None,
            };
            RuleOutcome {
                decision: lift(a.decide(s, now_ms, cost)?, State::Gcra),
                available: a.available_millitokens(s, now_ms),
            }
        }
        (Algorithm::FixedWindow(a), None | Some(State::FixedWindow(_))) => {
            let s = match input.state {
                Some(State::FixedWindow(s)) => Some(s),
                _ => None,
            };
            RuleOutcome {
                decision: lift(a.decide(s, now_ms, units(cost)?)?, State::FixedWindow),
                available: a.available_units(s, now_ms),
            }
        }
        (Algorithm::SlidingCounter(a), None | Some(State::SlidingCounter(_))) => {
            let s = match input.state {
                Some(State::SlidingCounter(s)) => Some(s),
                _ => None,
            };
            RuleOutcome {
                decision: lift(a.decide(s, now_ms, units(cost)?)?, State::SlidingCounter),
                available: a.available_units(s, now_ms),
            }
        }
        (Algorithm::SlidingLog(a), None | Some(State::SlidingLog(_))) => {
            let s = match input.state {
                Some(State::SlidingLog(s)) => Some(s),
                _ => None,
            };
            check_unit_cost(units(cost)?)?;
            RuleOutcome {
                decision: lift(a.decide(s, now_ms, decision_id)?, State::SlidingLog),
                available: a.available_units(s, now_ms),
            }
        }
        _ => return Ok(None),
    };
    Ok(Some(outcome))
}

/// Decides one request against all its rules at `now_ms`. `decision_id` is the request's stable id
/// (the sliding log's member).
pub fn decide_all(
    rules: &[RuleInput<'_>],
    now_ms: u64,
    decision_id: &str,
) -> Result<MultiDecision, MultiRuleError> {
    if rules.is_empty() || rules.len() > MAX_RULES_PER_REQUEST {
        return Err(MultiRuleError::RuleCount(rules.len()));
    }
    let mut outcomes = Vec::with_capacity(rules.len());
    for (index, input) in rules.iter().enumerate() {
        let outcome = decide_one(input, now_ms, decision_id)
            .map_err(|source| MultiRuleError::Param { index, source })?
            .ok_or(MultiRuleError::StateMismatch { index })?;
        outcomes.push(outcome);
    }
    let denies = |(index, outcome): &(usize, &RuleOutcome)| {
        !outcome.decision.allowed && !rules[*index].advisory
    };
    let advisory_denials: Vec<usize> = outcomes
        .iter()
        .enumerate()
        .filter(|(index, o)| !o.decision.allowed && rules[*index].advisory)
        .map(|(index, _)| index)
        .collect();
    let denied_by = outcomes
        .iter()
        .enumerate()
        .find(|entry| denies(entry))
        .map(|(index, _)| index);
    let Some(first_denial) = denied_by else {
        // An advisory rule that would deny writes nothing: a denial never asks for a write.
        let remaining = outcomes.iter().map(|o| o.decision.remaining).collect();
        let writes = outcomes.into_iter().map(|o| o.decision.write).collect();
        return Ok(MultiDecision {
            allowed: true,
            denied_by: None,
            advisory_denials,
            retry: RetryAfter::Ms(0),
            remaining,
            writes,
        });
    };
    let retry = outcomes
        .iter()
        .enumerate()
        .filter(denies)
        .map(|(_, o)| o.decision.retry)
        .max()
        .unwrap_or(RetryAfter::Never);
    let remaining = outcomes
        .iter()
        .map(|o| {
            if o.decision.allowed {
                o.available
            } else {
                o.decision.remaining
            }
        })
        .collect();
    Ok(MultiDecision {
        allowed: false,
        denied_by: Some(first_denial),
        advisory_denials,
        retry,
        remaining,
        writes: vec![None; rules.len()],
    })
}
