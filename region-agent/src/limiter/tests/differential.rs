//! Differential tests: random request sequences against three implementations of one semantics.
//!
//! 1. The reference: `allot_shared`'s pure functions over a plain map of key -> (state, expiry),
//!    written here as simply as possible.
//! 2. The [`InProcessStore`](crate::limiter::InProcessStore).
//! 3. The Lua scripts on a real Redis (single node, and a 3-master cluster), driven by the scripts'
//!    test clock.
//!
//! Each case draws a pool of up to 8 rules (mixed algorithms, small and extreme parameters), then a
//! sequence of steps: requests over random subsets of the pool with random costs (including costs
//! above capacity and invalid ones), repeated decision ids, decision records, parameter changes
//! (tightened capacities, redrawn parameters) and clock steps (forward, backward, jumps of years).
//! After every step the three must agree on the decision (allowed, denying index, retry hint,
//! remaining, replay) or the rejection, and on every key's stored state and expiry.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use allot_shared::limit::RetryAfter;
use allot_shared::limit::concurrency::SemaphoreState;
use allot_shared::limit::multi::{MultiRuleError, RuleInput, State, decide_all};
use allot_shared::{MAX_CAPACITY_TIMES_PERIOD, MAX_RULE_PARAMETER};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use super::harness::{FUTURE_BASE_MS, Subject, decision_id, redis_query, rule_key, tenant};
use crate::limiter::batch::{BatchRule, RuleBatch, RuleParams};
use crate::limiter::in_process::Stored;
use crate::limiter::redis_store::Connection;
use crate::limiter::store::{BatchDecision, LeaseCall, LeaseOutcome, Rejection, StoreError};

/// The pure core over a map, with Redis's expiry rule (a key is gone once `now > expires_at`).
#[derive(Debug, Default)]
struct Reference {
    keys: HashMap<String, (Stored, u64)>,
}

impl Reference {
    fn live(&mut self, key: &str, now_ms: u64) -> Option<Stored> {
        if self.keys.get(key).is_some_and(|(_, at)| *at < now_ms) {
            self.keys.remove(key);
        }
        self.keys.get(key).map(|(value, _)| value.clone())
    }

    fn decide(&mut self, batch: &RuleBatch, now_ms: u64) -> Result<BatchDecision, Rejection> {
        if batch.record_ttl_ms() > 0
            && let Some(Stored::Record(recorded)) = self.live(batch.record_key(), now_ms)
        {
            return Ok(BatchDecision {
                replayed: true,
                advisory_denials: Vec::new(),
                ..recorded
            });
        }
        let states: Vec<Option<State>> = batch
            .rules()
            .iter()
            .map(|rule| match self.live(rule.key(), now_ms) {
                Some(Stored::Rule(state)) => Some(state),
                None => None,
                Some(other) => panic!("a rule key holds {other:?}"),
            })
            .collect();
        let inputs: Vec<RuleInput<'_>> = batch
            .rules()
            .iter()
            .zip(&states)
            .map(|(rule, state)| RuleInput {
                algorithm: rule.algorithm(),
                state: state.as_ref(),
                cost_millitokens: rule.cost_millitokens(),
                advisory: rule.advisory(),
            })
            .collect();
        let decision =
            decide_all(&inputs, now_ms, batch.decision_id().as_str()).map_err(|e| match e {
                MultiRuleError::StateMismatch { .. } => Rejection::StateMismatch,
                MultiRuleError::Param { .. } | MultiRuleError::RuleCount(_) => {
                    Rejection::InvalidArgument
                }
            })?;
        let outcome = BatchDecision::from_multi(&decision);
        if batch.dry_run() {
            return Ok(outcome);
        }
        for (rule, write) in batch.rules().iter().zip(decision.writes) {
            if let Some(write) = write {
                let value = (Stored::Rule(write.state), now_ms + write.ttl_ms);
                self.keys.insert(rule.key().to_owned(), value);
            }
        }
        if decision.allowed && batch.record_ttl_ms() > 0 {
            let value = (
                Stored::Record(outcome.clone()),
                now_ms + batch.record_ttl_ms(),
            );
            self.keys.insert(batch.record_key().to_owned(), value);
        }
        Ok(outcome)
    }

    fn lease(&mut self, operation: Operation, call: &LeaseCall, now_ms: u64) -> LeaseOutcome {
        let key = call.key();
        let state = match self.live(key, now_ms) {
            Some(Stored::Leases(state)) => Some(state),
            None => None,
            Some(other) => panic!("a lease key holds {other:?}"),
        };
        let semaphore = call.semaphore();
        let id = call.lease_id().as_str();
        let live = |state: &Option<SemaphoreState>| {
            state.as_ref().map_or(0, |s| {
                s.leases.iter().filter(|l| l.expires_at_ms > now_ms).count() as u64
            })
        };
        match operation {
            Operation::Acquire => {
                let acquire = semaphore.acquire(state.as_ref(), now_ms, id);
                if let Some((leases, ttl_ms)) = acquire.write {
                    let value = (Stored::Leases(leases), now_ms + ttl_ms);
                    self.keys.insert(key.to_owned(), value);
                }
                LeaseOutcome {
                    held: acquire.acquired,
                    in_flight: acquire.in_flight,
                }
            }
            Operation::Renew => match semaphore.renew(state.as_ref(), now_ms, id) {
                Some((leases, ttl_ms)) => {
                    let in_flight = leases.leases.len() as u64;
                    let value = (Stored::Leases(leases), now_ms + ttl_ms);
                    self.keys.insert(key.to_owned(), value);
                    LeaseOutcome {
                        held: true,
                        in_flight,
                    }
                }
                None => LeaseOutcome {
                    held: false,
                    in_flight: live(&state),
                },
            },
            Operation::Release => {
                let was_held = state.as_ref().is_some_and(|s| {
                    s.leases
                        .iter()
                        .any(|l| l.lease_id == id && l.expires_at_ms > now_ms)
                });
                let rest = semaphore.release(state.as_ref(), now_ms, id);
                let in_flight = rest.leases.len() as u64;
                if rest.leases.is_empty() {
                    self.keys.remove(key);
                } else if let Some(entry) = self.keys.get_mut(key) {
                    entry.0 = Stored::Leases(rest);
                }
                LeaseOutcome {
                    held: was_held,
                    in_flight,
                }
            }
        }
    }
}

// Strategies -----------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    TokenBucket,
    Gcra,
    FixedWindow,
    SlidingCounter,
    SlidingLog,
}

/// What a case's requests look like: any shape, or the plain shape the decide library serves on
/// paths of its own: one to three token buckets and fixed windows, no decision record, dry run or
/// advisory rule. Its single-rule requests (a path of their own too) and its requests of two and
/// three rules draw from a small pool of rules, so that the paths meet on one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    Any,
    Plain,
}

fn kind(shape: Shape) -> BoxedStrategy<Kind> {
    match shape {
        Shape::Any => prop_oneof![
            Just(Kind::TokenBucket),
            Just(Kind::Gcra),
            Just(Kind::FixedWindow),
            Just(Kind::SlidingCounter),
            Just(Kind::SlidingLog),
        ]
        .boxed(),
        Shape::Plain => prop_oneof![Just(Kind::TokenBucket), Just(Kind::FixedWindow)].boxed(),
    }
}

/// A capacity (or limit) and a period (or window) with `capacity x period <= 2^52`: mostly small
/// (so requests run out and windows roll), sometimes at the validated extremes (where Lua's doubles
/// must still be exact).
fn amount_and_period(small_amount: u64, small_period: u64) -> impl Strategy<Value = (u64, u64)> {
    let extreme = (1u64..=MAX_RULE_PARAMETER).prop_flat_map(|amount| {
        let max_period = (MAX_CAPACITY_TIMES_PERIOD / amount).clamp(1, MAX_RULE_PARAMETER);
        (Just(amount), prop_oneof![Just(max_period), 1..=max_period])
    });
    prop_oneof![
        6 => (1..=small_amount, 1..=small_period),
        1 => extreme,
    ]
}

fn refill() -> impl Strategy<Value = u64> {
    prop_oneof![4 => 1u64..=5_000, 1 => 1u64..=MAX_RULE_PARAMETER, 1 => Just(MAX_RULE_PARAMETER)]
}

fn params(kind: Kind) -> BoxedStrategy<RuleParams> {
    match kind {
        Kind::TokenBucket => (amount_and_period(50_000, 5_000), refill(), 0u64..=10_000)
            .prop_map(
                |((capacity_millitokens, period_ms), refill_millitokens, slack_ms)| {
                    RuleParams::TokenBucket {
                        capacity_millitokens,
                        refill_millitokens,
                        period_ms,
                        slack_ms,
                    }
                },
            )
            .boxed(),
        Kind::Gcra => (amount_and_period(50_000, 5_000), refill())
            .prop_map(
                |((capacity_millitokens, period_ms), refill_millitokens)| RuleParams::Gcra {
                    capacity_millitokens,
                    refill_millitokens,
                    period_ms,
                },
            )
            .boxed(),
        Kind::FixedWindow | Kind::SlidingCounter | Kind::SlidingLog => amount_and_period(8, 5_000)
            .prop_map(move |(limit_units, window_ms)| match kind {
                Kind::FixedWindow => RuleParams::FixedWindow {
                    limit_units,
                    window_ms,
                },
                Kind::SlidingCounter => RuleParams::SlidingCounter {
                    limit_units,
                    window_ms,
                },
                _ => RuleParams::SlidingLog {
                    limit_units,
                    window_ms,
                },
            })
            .boxed(),
    }
}

/// A rule of the pool: its parameters now, and another draw of the same algorithm to switch to.
#[derive(Debug, Clone)]
struct PoolRule {
    params: RuleParams,
    alternative: RuleParams,
}

fn pool(shape: Shape) -> impl Strategy<Value = Vec<PoolRule>> {
    // Few rules for the plain shape, so that its requests meet on keys.
    let size = if shape == Shape::Plain { 1..=4 } else { 1..=8 };
    prop::collection::vec(kind(shape), size).prop_flat_map(|kinds| {
        kinds
            .into_iter()
            .map(|kind| {
                (params(kind), params(kind)).prop_map(|(params, alternative)| PoolRule {
                    params,
                    alternative,
                })
            })
            .collect::<Vec<_>>()
    })
}

/// How a step moves the clock, in ms: mostly forward a little, sometimes back, sometimes years on.
fn clock_step() -> impl Strategy<Value = i64> {
    prop_oneof![
        6 => 0i64..2_000,
        2 => -5_000i64..0,
        1 => 0i64..(1 << 36),
    ]
}

#[derive(Debug, Clone)]
enum Step {
    /// A request over some pool rules (index into the pool, cost draw, advisory).
    Request {
        rules: Vec<(usize, (u8, u64), bool)>,
        /// `Some(k)`: reuse the k-th most recent decision id (a retry); `None`: a fresh id.
        repeat_id: Option<usize>,
        record_ttl_ms: u64,
        /// A dry run: decided and answered, nothing written.
        dry_run: bool,
    },
    /// A policy change to pool rule `rule`: tightened to `percent` of its capacity (limit), or
    /// switched to its alternative parameters.
    Change {
        rule: usize,
        tighten_percent: Option<u64>,
    },
}

fn step(shape: Shape) -> impl Strategy<Value = (i64, Step)> {
    let (rule_count, advisory, dry_run) = match shape {
        Shape::Any => (
            prop_oneof![1 => Just(1usize), 3 => 1usize..=8].boxed(),
            0.2,
            0.15,
        ),
        Shape::Plain => (
            prop_oneof![4 => Just(1usize), 2 => Just(2usize), 1 => Just(3usize)].boxed(),
            0.0,
            0.0,
        ),
    };
    let record_ttl_ms = match shape {
        Shape::Any => prop_oneof![3 => Just(0u64), 1 => 1u64..5_000, 1 => Just(30_000u64)].boxed(),
        Shape::Plain => Just(0u64).boxed(),
    };
    let request = (
        rule_count.prop_flat_map(move |count| {
            prop::collection::vec(
                (
                    any::<usize>(),
                    any::<(u8, u64)>(),
                    prop::bool::weighted(advisory),
                ),
                count,
            )
        }),
        prop_oneof![4 => Just(None), 1 => (0usize..4).prop_map(Some)],
        record_ttl_ms,
        prop::bool::weighted(dry_run),
    )
        .prop_map(|(rules, repeat_id, record_ttl_ms, dry_run)| Step::Request {
            rules,
            repeat_id,
            record_ttl_ms,
            dry_run,
        });
    let change =
        (any::<usize>(), prop::option::of(1u64..100)).prop_map(|(rule, tighten_percent)| {
            Step::Change {
                rule,
                tighten_percent,
            }
        });
    (clock_step(), prop_oneof![8 => request, 1 => change])
}

/// The cost of a request against a rule, from a random draw: mostly within capacity, sometimes
/// above it (never admitted), rarely invalid (a policy fault for the whole batch).
fn cost_millitokens(params: &RuleParams, (variant, raw): (u8, u64)) -> u64 {
    match *params {
        RuleParams::TokenBucket {
            capacity_millitokens: capacity,
            ..
        }
        | RuleParams::Gcra {
            capacity_millitokens: capacity,
            ..
        } => match variant % 64 {
            0 => MAX_RULE_PARAMETER + 1 + raw % 1_000,
            1..=4 => capacity + 1 + raw % 1_000,
            5..=40 => 1 + raw % (capacity / 8).max(1),
            _ => 1 + raw % capacity,
        },
        RuleParams::FixedWindow { limit_units, .. }
        | RuleParams::SlidingCounter { limit_units, .. } => match variant % 64 {
            0 => 1_000 * (1 + raw % 3) + 1 + raw % 999,
            1..=4 => 1_000 * (limit_units + 1 + raw % 3),
            _ => 1_000 * (1 + raw % limit_units.min(3)),
        },
        RuleParams::SlidingLog { .. } => {
            if variant % 64 == 0 {
                2_000
            } else {
                1_000
            }
        }
    }
}

fn tightened(params: RuleParams, percent: u64) -> RuleParams {
    let shrink = |amount: u64| (amount * percent / 100).max(1);
    match params {
        RuleParams::TokenBucket {
            capacity_millitokens,
            refill_millitokens,
            period_ms,
            slack_ms,
        } => RuleParams::TokenBucket {
            capacity_millitokens: shrink(capacity_millitokens),
            refill_millitokens,
            period_ms,
            slack_ms,
        },
        RuleParams::Gcra {
            capacity_millitokens,
            refill_millitokens,
            period_ms,
        } => RuleParams::Gcra {
            capacity_millitokens: shrink(capacity_millitokens),
            refill_millitokens,
            period_ms,
        },
        RuleParams::FixedWindow {
            limit_units,
            window_ms,
        } => RuleParams::FixedWindow {
            limit_units: shrink(limit_units),
            window_ms,
        },
        RuleParams::SlidingCounter {
            limit_units,
            window_ms,
        } => RuleParams::SlidingCounter {
            limit_units: shrink(limit_units),
            window_ms,
        },
        RuleParams::SlidingLog {
            limit_units,
            window_ms,
        } => RuleParams::SlidingLog {
            limit_units: shrink(limit_units),
            window_ms,
        },
    }
}

// Running ----------------------------------------------------------------------------------------

/// How often each kind of outcome came up, so a generator that stopped reaching one (and made the
/// comparison vacuous for it) fails the test.
#[derive(Debug, Default)]
struct Tally {
    allowed_single_rule: u64,
    allowed_multi_rule: u64,
    /// Denied requests of more than one rule (counted among the denials too).
    denied_multi_rule: u64,
    denied_with_a_wait: u64,
    denied_never: u64,
    rejected: u64,
    replayed_records: u64,
    clock_steps_back: u64,
    allowed_dry_runs: u64,
    advisory_denials: u64,
}

impl Tally {
    fn count(&mut self, outcome: &Result<BatchDecision, Rejection>, rules: usize, dry_run: bool) {
        if dry_run && matches!(outcome, Ok(d) if d.allowed && !d.replayed) {
            self.allowed_dry_runs += 1;
        }
        if let Ok(decision) = outcome {
            self.advisory_denials += decision.advisory_denials.len() as u64;
            if !decision.allowed && rules > 1 {
                self.denied_multi_rule += 1;
            }
        }
        match outcome {
            Ok(decision) if decision.replayed => self.replayed_records += 1,
            Ok(decision) if decision.allowed && rules == 1 => self.allowed_single_rule += 1,
            Ok(decision) if decision.allowed => self.allowed_multi_rule += 1,
            Ok(decision) if decision.retry == RetryAfter::Never => self.denied_never += 1,
            Ok(_) => self.denied_with_a_wait += 1,
            Err(_) => self.rejected += 1,
        }
    }

    fn assert_every_outcome_was_reached(&self) {
        let counts = [
            self.allowed_multi_rule,
            self.denied_with_a_wait,
            self.denied_never,
            self.rejected,
            self.replayed_records,
            self.clock_steps_back,
            self.allowed_dry_runs,
            self.advisory_denials,
        ];
        assert!(
            counts.iter().all(|&n| n > 0),
            "an outcome was never reached: {self:?}"
        );
    }
}

/// Tenants are unique per case, so cases never share keys on the long-lived Redis.
static NEXT_CASE: AtomicU64 = AtomicU64::new(0);

fn rejection_of(result: Result<BatchDecision, StoreError>) -> Result<BatchDecision, Rejection> {
    result.map_err(|error| match error {
        StoreError::Rejected { kind, .. } => kind,
        other => panic!("a store failed instead of deciding: {other}"),
    })
}

fn normalized(state: Option<Stored>) -> Option<Stored> {
    match state {
        Some(Stored::Rule(State::SlidingLog(mut log))) => {
            log.entries
                .sort_by(|a, b| (a.admitted_at_ms, &a.member).cmp(&(b.admitted_at_ms, &b.member)));
            Some(Stored::Rule(State::SlidingLog(log)))
        }
        Some(Stored::Leases(mut leases)) => {
            leases.leases.sort_by(|a, b| {
                (a.expires_at_ms, &a.lease_id).cmp(&(b.expires_at_ms, &b.lease_id))
            });
            Some(Stored::Leases(leases))
        }
        other => other,
    }
}

/// The batch of a request step: its rules from `pool` (each index once), a fresh decision id or a
/// repeat of a recent one (recorded in `ids`).
#[allow(clippy::too_many_arguments)]
fn request_batch(
    tenant: &allot_shared::ids::TenantId,
    pool: &[PoolRule],
    key_of: &dyn Fn(usize) -> String,
    ids: &mut Vec<String>,
    number: usize,
    rules: Vec<(usize, (u8, u64), bool)>,
    repeat_id: Option<usize>,
    record_ttl_ms: u64,
    dry_run: bool,
) -> RuleBatch {
    let mut chosen: Vec<usize> = Vec::new();
    let mut batch_rules = Vec::new();
    for (index, draw, advisory) in rules {
        let index = index % pool.len();
        if chosen.contains(&index) {
            continue;
        }
        chosen.push(index);
        let params = pool[index].params;
        let cost = cost_millitokens(&params, draw);
        let rule = BatchRule::new(key_of(index), params, cost).expect("valid");
        batch_rules.push(if advisory { rule.into_advisory() } else { rule });
    }
    let id = match repeat_id {
        Some(back) if !ids.is_empty() => ids[ids.len() - 1 - back % ids.len()].clone(),
        _ => format!("r-{number}"),
    };
    ids.push(id.clone());
    let batch = RuleBatch::new(tenant, decision_id(&id), record_ttl_ms, batch_rules)
        .expect("a valid batch");
    // A dry run writes nothing: the state comparisons after it prove it.
    if dry_run { batch.into_dry_run() } else { batch }
}

/// Applies a policy change step to the pool.
fn change(pool: &mut [PoolRule], rule: usize, tighten_percent: Option<u64>) {
    let pool_len = pool.len();
    let rule = &mut pool[rule % pool_len];
    rule.params = match tighten_percent {
        Some(percent) => tightened(rule.params, percent),
        None => {
            let redrawn = rule.alternative;
            rule.alternative = rule.params;
            redrawn
        }
    };
}

/// Every key of the pool, and every record of `records`, holds the reference's state with the
/// reference's expiry in every subject.
async fn states_agree(
    reference: &mut Reference,
    subjects: &[(&str, &Subject)],
    pool: &[PoolRule],
    key_of: &dyn Fn(usize) -> String,
    records: &[&str],
    now_ms: u64,
    number: usize,
) -> Result<(), TestCaseError> {
    for (index, rule) in pool.iter().enumerate() {
        let key = key_of(index);
        for (_, subject) in subjects {
            subject.expire(&[&key]).await;
        }
        let expected = normalized(reference.live(&key, now_ms));
        let expected_expiry = reference.keys.get(&key).map(|(_, at)| *at);
        for (name, subject) in subjects {
            let stored = subject
                .rule_state(&key, &rule.params)
                .await
                .map(Stored::Rule);
            prop_assert_eq!(
                normalized(stored),
                expected.clone(),
                "{} state of {}, step {}",
                name,
                key,
                number
            );
            let expiry = subject.expires_at(&key).await;
            prop_assert_eq!(
                expiry,
                expected_expiry,
                "{} expiry of {}, step {}",
                name,
                key,
                number
            );
        }
    }
    for record_key in records {
        for (_, subject) in subjects {
            subject.expire(&[record_key]).await;
        }
        let expected_record = match reference.live(record_key, now_ms) {
            Some(Stored::Record(recorded)) => Some(recorded.remaining),
            None => None,
            Some(other) => panic!("the record key holds {other:?}"),
        };
        let expected_expiry = reference.keys.get(*record_key).map(|(_, at)| *at);
        for (name, subject) in subjects {
            prop_assert_eq!(
                subject.record(record_key).await,
                expected_record.clone(),
                "{} record, step {}",
                name,
                number
            );
            prop_assert_eq!(
                subject.expires_at(record_key).await,
                expected_expiry,
                "{} record expiry, step {}",
                name,
                number
            );
        }
    }
    Ok(())
}

async fn run_decisions(
    tally: &RefCell<Tally>,
    redis: &Subject,
    start_offset_ms: u64,
    mut pool: Vec<PoolRule>,
    steps: Vec<(i64, Step)>,
) -> Result<(), TestCaseError> {
    let case = NEXT_CASE.fetch_add(1, Ordering::Relaxed);
    let tenant = tenant(&format!("case-{case}"));
    let in_process = Subject::in_process();
    let mut reference = Reference::default();
    let mut now_ms = FUTURE_BASE_MS + start_offset_ms;
    let mut ids: Vec<String> = Vec::new();
    let key_of = |index: usize| rule_key(&tenant, &format!("rule-{index}"));
    for (number, (clock_step, step)) in steps.into_iter().enumerate() {
        now_ms = now_ms.saturating_add_signed(clock_step).max(FUTURE_BASE_MS);
        tally.borrow_mut().clock_steps_back += u64::from(clock_step < 0);
        let batch = match step {
            Step::Change {
                rule,
                tighten_percent,
            } => {
                change(&mut pool, rule, tighten_percent);
                continue;
            }
            Step::Request {
                rules,
                repeat_id,
                record_ttl_ms,
                dry_run,
            } => request_batch(
                &tenant,
                &pool,
                &key_of,
                &mut ids,
                number,
                rules,
                repeat_id,
                record_ttl_ms,
                dry_run,
            ),
        };
        for subject in [&in_process, redis] {
            subject.set_now(now_ms);
        }
        let expected = reference.decide(&batch, now_ms);
        let from_memory = rejection_of(in_process.decide(&batch).await);
        let from_redis = rejection_of(redis.decide(&batch).await);
        prop_assert_eq!(
            &from_memory,
            &expected,
            "in-process, step {}: {:?}",
            number,
            batch
        );
        prop_assert_eq!(
            &from_redis,
            &expected,
            "redis, step {}: {:?}",
            number,
            batch
        );
        tally
            .borrow_mut()
            .count(&expected, batch.rules().len(), batch.dry_run());
        states_agree(
            &mut reference,
            &[("in-process", &in_process), ("redis", redis)],
            &pool,
            &key_of,
            &[batch.record_key()],
            now_ms,
            number,
        )
        .await?;
    }
    Ok(())
}

/// The same steps as [`run_decisions`], but runs of consecutive requests (of `sizes`' lengths)
/// go to Redis in one coalesced call, all at the clock of the run's first step: each reply and
/// every state after the call must be what the pure core gives deciding them one by one.
async fn run_coalesced(
    tally: &RefCell<Tally>,
    redis: &Subject,
    start_offset_ms: u64,
    mut pool: Vec<PoolRule>,
    steps: Vec<(i64, Step)>,
    sizes: Vec<usize>,
) -> Result<(), TestCaseError> {
    let case = NEXT_CASE.fetch_add(1, Ordering::Relaxed);
    let tenant = tenant(&format!("coalesced-{case}"));
    let mut reference = Reference::default();
    let mut now_ms = FUTURE_BASE_MS + start_offset_ms;
    let mut ids: Vec<String> = Vec::new();
    let key_of = |index: usize| rule_key(&tenant, &format!("rule-{index}"));
    let mut steps = steps.into_iter().enumerate().peekable();
    let mut sizes = sizes.into_iter().cycle();
    while steps.peek().is_some() {
        let size = sizes.next().unwrap_or(1);
        let mut batches = Vec::new();
        let mut first_number = None;
        while batches.len() < size {
            let Some((number, (clock_step, step))) = steps.next() else {
                break;
            };
            match step {
                Step::Change {
                    rule,
                    tighten_percent,
                } => {
                    // A policy change ends the run: the next requests decide with it.
                    change(&mut pool, rule, tighten_percent);
                    break;
                }
                Step::Request {
                    rules,
                    repeat_id,
                    record_ttl_ms,
                    dry_run,
                } => {
                    if first_number.is_none() {
                        now_ms = now_ms.saturating_add_signed(clock_step).max(FUTURE_BASE_MS);
                        tally.borrow_mut().clock_steps_back += u64::from(clock_step < 0);
                        first_number = Some(number);
                    }
                    batches.push(request_batch(
                        &tenant,
                        &pool,
                        &key_of,
                        &mut ids,
                        number,
                        rules,
                        repeat_id,
                        record_ttl_ms,
                        dry_run,
                    ));
                }
            }
        }
        let Some(number) = first_number else {
            continue;
        };
        redis.set_now(now_ms);
        // Expiry at the test clock, as a lone call's harness applies it.
        let keys: Vec<&str> = batches
            .iter()
            .flat_map(|batch| {
                std::iter::once(batch.record_key()).chain(batch.rules().iter().map(BatchRule::key))
            })
            .collect();
        redis.expire(&keys).await;
        let replies = redis
            .redis_store()
            .decide_coalesced_raw(&batches)
            .await
            .map_err(|error| TestCaseError::fail(format!("the coalesced call failed: {error}")))?;
        prop_assert_eq!(replies.len(), batches.len());
        for (offset, (batch, reply)) in batches.iter().zip(replies).enumerate() {
            let expected = reference.decide(batch, now_ms);
            prop_assert_eq!(
                &rejection_of(reply),
                &expected,
                "request {} of the call at step {}: {:?}",
                offset,
                number,
                batch
            );
            tally
                .borrow_mut()
                .count(&expected, batch.rules().len(), batch.dry_run());
        }
        let records: Vec<&str> = batches.iter().map(RuleBatch::record_key).collect();
        states_agree(
            &mut reference,
            &[("redis", redis)],
            &pool,
            &key_of,
            &records,
            now_ms,
            number,
        )
        .await?;
    }
    Ok(())
}

/// One lease operation of a sequence.
#[derive(Debug, Clone)]
struct LeaseStep {
    clock_step_ms: i64,
    /// Acquire, renew or release, modulo 3.
    operation: u8,
    /// Which of five lease ids, modulo 5.
    lease: usize,
    /// A policy change first: the new (max in flight, lease TTL ms).
    new_semaphore: Option<(u64, u64)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Operation {
    Acquire,
    Renew,
    Release,
}

async fn run_leases(
    outcomes: &RefCell<HashMap<(Operation, bool), u64>>,
    redis: &Subject,
    start_offset_ms: u64,
    mut semaphore: (u64, u64),
    steps: Vec<LeaseStep>,
) -> Result<(), TestCaseError> {
    let case = NEXT_CASE.fetch_add(1, Ordering::Relaxed);
    let key = rule_key(&tenant(&format!("lease-{case}")), "export:cc");
    let in_process = Subject::in_process();
    let mut reference = Reference::default();
    let mut now_ms = FUTURE_BASE_MS + start_offset_ms;
    for (number, step) in steps.into_iter().enumerate() {
        let LeaseStep {
            clock_step_ms,
            operation,
            lease,
            new_semaphore,
        } = step;
        now_ms = now_ms
            .saturating_add_signed(clock_step_ms)
            .max(FUTURE_BASE_MS);
        if let Some(new_semaphore) = new_semaphore {
            semaphore = new_semaphore;
        }
        for subject in [&in_process, redis] {
            subject.set_now(now_ms);
        }
        redis.expire(&[&key]).await;
        let lease_id = decision_id(["a", "b", "c", "d", "e"][lease % 5]);
        let call = LeaseCall::new(key.clone(), semaphore.0, semaphore.1, lease_id).expect("valid");
        let operation =
            [Operation::Acquire, Operation::Renew, Operation::Release][usize::from(operation % 3)];
        let expected = reference.lease(operation, &call, now_ms);
        *outcomes
            .borrow_mut()
            .entry((operation, expected.held))
            .or_default() += 1;
        for (name, subject) in [("in-process", &in_process), ("redis", redis)] {
            let outcome = match operation {
                Operation::Acquire => subject.store.acquire_lease(&call).await,
                Operation::Renew => subject.store.renew_lease(&call).await,
                Operation::Release => subject.store.release_lease(&call).await,
            }
            .expect("the store answers");
            prop_assert_eq!(
                outcome,
                expected,
                "{} {:?}, step {}",
                name,
                operation,
                number
            );
            let leases = subject.leases(&key).await.map(Stored::Leases);
            let expected_leases =
                normalized(reference.keys.get(&key).map(|(value, _)| value.clone()));
            prop_assert_eq!(leases, expected_leases, "{} leases, step {}", name, number);
            let expected_expiry = reference.keys.get(&key).map(|(_, at)| *at);
            prop_assert_eq!(
                subject.expires_at(&key).await,
                expected_expiry,
                "{} expiry, step {}",
                name,
                number
            );
        }
    }
    Ok(())
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

/// `cases` random cases of `shape`, each of up to `max_steps` steps, decided one by one; what they
/// reached.
fn random_decisions(
    redis: &Subject,
    runtime: &tokio::runtime::Runtime,
    shape: Shape,
    cases: u32,
    max_steps: usize,
) -> RefCell<Tally> {
    let scenario = (
        0u64..1_000_000,
        pool(shape),
        prop::collection::vec(step(shape), 1..max_steps),
    );
    let tally = RefCell::new(Tally::default());
    let result = runner(cases).run(&scenario, |(start, pool, steps)| {
        runtime.block_on(run_decisions(&tally, redis, start, pool, steps))
    });
    if let Err(failure) = result {
        panic!("{shape:?}: {failure}");
    }
    tally
}

fn check_decisions(redis: &Subject, runtime: &tokio::runtime::Runtime, cases: u32) {
    let tally = random_decisions(redis, runtime, Shape::Any, cases, 40);
    // The rarest outcome, a replayed record, needs an admitted request with a record and a retry
    // of its id within the record's life: one fixed case reaches it whatever the random cases drew
    // (one unit of a fresh fixed window of 10 is admitted; a drawn rule may never admit, e.g. a
    // GCRA whose one-millitoken increment exceeds its burst). A fresh id's dry run after them is
    // admitted too, and must write nothing.
    let window = RuleParams::FixedWindow {
        limit_units: 10,
        window_ms: 60_000,
    };
    let any_pool = vec![PoolRule {
        params: window,
        alternative: window,
    }];
    let request = |repeat_id, dry_run| Step::Request {
        rules: vec![(0, (5, 0), false)],
        repeat_id,
        record_ttl_ms: 30_000,
        dry_run,
    };
    let retried = vec![
        (0, request(None, false)),
        (10, request(Some(0), false)),
        (10, request(None, true)),
    ];
    let replays_before = tally.borrow().replayed_records;
    if let Err(failure) = runtime.block_on(run_decisions(&tally, redis, 0, any_pool, retried)) {
        panic!("the retried case: {failure}");
    }
    assert!(
        tally.borrow().replayed_records > replays_before,
        "the retried case replayed its record"
    );
    tally.borrow().assert_every_outcome_was_reached();
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

#[test]
fn decisions_agree_across_the_pure_core_the_in_process_store_and_redis() {
    let runtime = runtime();
    let redis = runtime.block_on(Subject::redis_single());
    check_decisions(&redis, &runtime, 96);
}

/// The store loads the decide library with its marked steps inlined; the library as written calls
/// them. Both decide as the pure core does, alone and coalesced, on every path (the plain shape
/// takes the paths the steps were inlined into).
#[test]
fn the_library_as_written_decides_as_the_inlined_one() {
    let runtime = runtime();
    let redis = runtime.block_on(Subject::redis_single_as_written());
    check_decisions(&redis, &runtime, 32);
    let tally = random_decisions(&redis, &runtime, Shape::Plain, 32, 60);
    assert!(
        tally.borrow().allowed_multi_rule > 0 && tally.borrow().denied_with_a_wait > 0,
        "{:?}",
        tally.borrow()
    );
    check_coalesced(&redis, &runtime, &[(Shape::Any, 16), (Shape::Plain, 16)]);
}

/// Coalesced calls decide as their requests would one by one: runs of 1 to 8 requests of random
/// rules (several requests of a run sharing keys, as a hot tenant's do) in one call.
#[test]
fn coalesced_calls_decide_as_their_requests_one_by_one() {
    let runtime = runtime();
    let redis = runtime.block_on(Subject::redis_single());
    check_coalesced(&redis, &runtime, &[(Shape::Any, 64), (Shape::Plain, 48)]);
}

/// Each shape's `cases` random runs of coalesced calls, which must decide as lone calls in a row
/// and reach every outcome.
fn check_coalesced(redis: &Subject, runtime: &tokio::runtime::Runtime, shapes: &[(Shape, u32)]) {
    for &(shape, cases) in shapes {
        let scenario = (
            0u64..1_000_000,
            pool(shape),
            prop::collection::vec(step(shape), 1..40),
            prop::collection::vec(1usize..=8, 1..8),
        );
        let tally = RefCell::new(Tally::default());
        let result = runner(cases).run(&scenario, |(start, pool, steps, sizes)| {
            runtime.block_on(run_coalesced(&tally, redis, start, pool, steps, sizes))
        });
        if let Err(failure) = result {
            panic!("{shape:?}: {failure}");
        }
        let tally = tally.borrow();
        assert!(
            tally.allowed_single_rule > 0
                && tally.allowed_multi_rule > 0
                && tally.denied_multi_rule > 0
                && tally.denied_with_a_wait > 0
                && tally.rejected > 0,
            "{shape:?}: the coalesced calls admitted, denied and refused: {tally:?}"
        );
    }
}

/// What a key of a hot tenant's call holds before the call.
#[derive(Debug, Clone, Copy)]
enum Held {
    Nothing,
    /// The rule's own state as a string: a bucket with this many whole tokens, or a window with
    /// this many units admitted.
    Own(u64),
    /// The same as the hash an earlier version wrote.
    EarlierHash(u64),
    /// The other algorithm's string (a window's for a bucket, a bucket's for a window), which
    /// refuses the request.
    AnotherAlgorithm,
}

fn held() -> impl Strategy<Value = Held> {
    prop_oneof![
        2 => Just(Held::Nothing),
        4 => (0u64..=4).prop_map(Held::Own),
        1 => (0u64..=4).prop_map(Held::EarlierHash),
        1 => Just(Held::AnotherAlgorithm),
    ]
}

/// Writes `held` under `key` for a token bucket rule (`bucket`) or a fixed window of `window_ms`,
/// as of `at_ms` (after the call's clock when the clock stepped back), with a far expiry.
async fn hold(
    connection: &Connection,
    key: &str,
    held: Held,
    bucket: bool,
    window_ms: u64,
    at_ms: u64,
) {
    let window_start = at_ms - at_ms % window_ms;
    let expires = (at_ms + 3_600_000).to_string();
    let string = |value: String| {
        let mut cmd = redis::cmd("SET");
        cmd.arg(key).arg(value).arg("PXAT").arg(&expires);
        cmd
    };
    let bucket_string = |tokens: u64| format!("t{} {at_ms}", tokens * 1_000);
    let window_string = |units: u64| format!("f{window_start} {units}");
    let commands = match held {
        Held::Nothing => Vec::new(),
        Held::Own(amount) if bucket => vec![string(bucket_string(amount))],
        Held::Own(amount) => vec![string(window_string(amount))],
        Held::EarlierHash(amount) => {
            let mut fields = redis::cmd("HSET");
            fields.arg(key);
            if bucket {
                fields.arg("tk").arg(amount * 1_000).arg("ts").arg(at_ms);
            } else {
                fields.arg("w").arg(window_start).arg("n").arg(amount);
            }
            let mut expiry = redis::cmd("PEXPIREAT");
            expiry.arg(key).arg(&expires);
            vec![fields, expiry]
        }
        Held::AnotherAlgorithm if bucket => vec![string(window_string(1))],
        Held::AnotherAlgorithm => vec![string(bucket_string(1))],
    };
    for cmd in &commands {
        let _: redis::Value = redis_query(connection, cmd).await;
    }
}

/// What `key` holds, as comparable text: its type, its value (a hash's fields sorted) and when it
/// expires.
async fn held_now(connection: &Connection, key: &str) -> String {
    let kind: String = redis_query(connection, redis::cmd("TYPE").arg(key)).await;
    let value = match kind.as_str() {
        "string" => redis_query::<String>(connection, redis::cmd("GET").arg(key)).await,
        "hash" => {
            let mut fields: Vec<(String, String)> =
                redis_query(connection, redis::cmd("HGETALL").arg(key)).await;
            fields.sort();
            format!("{fields:?}")
        }
        _ => String::new(),
    };
    let expires: i64 = redis_query(connection, redis::cmd("PEXPIRETIME").arg(key)).await;
    format!("{kind} {value} {expires}")
}

/// A hot tenant's coalesced call, each request its own user's bucket or window and the tenant's
/// bucket (the shape whose users' keys the library reads in one MGET and whose tenant's state it
/// carries through the run), decides and writes exactly as the same requests do in lone calls one
/// after another, whatever the keys held before: nothing, the rule's own state (written a moment
/// ago, or after the call's clock: a clock that stepped back), an earlier version's hash (read,
/// then replaced), or another algorithm's state (which refuses that request alone, or every
/// request when the tenant's key holds it).
#[test]
fn a_hot_tenants_coalesced_call_decides_as_lone_calls_in_a_row() {
    let runtime = runtime();
    let redis = runtime.block_on(Subject::redis_single());
    let store = redis.redis_store();
    let connection = redis.redis_connection();
    let scenario = (
        prop::collection::vec(held(), 2..=12),
        held(),
        (1u64..=4, any::<bool>()),
        1u64..=10,
        (0u64..1_000_000, any::<bool>()),
    );
    let outcomes = RefCell::new(HashMap::<&str, u64>::new());
    let result = runner(48).run(
        &scenario,
        |(
            users,
            tenant_held,
            (user_units, user_bucket),
            tenant_units,
            (offset_ms, stepped_back),
        )| {
            runtime.block_on(async {
                let case = NEXT_CASE.fetch_add(1, Ordering::Relaxed);
                let now_ms = FUTURE_BASE_MS + offset_ms;
                let header = format!("{now_ms} 0 2 0 0 0");
                let user_rule = if user_bucket {
                    format!("tb {} 1000 60000 0 1000", user_units * 1_000)
                } else {
                    format!("fw {user_units} 60000 0 0 1000")
                };
                // The states were written a moment ago, or after the call's clock.
                let at_ms = if stepped_back { now_ms + 5 } else { now_ms - 1 };
                let tenant_rule = format!("tb {} 1000 60000 0 1000", tenant_units * 1_000);
                // The same requests under two tenants: one coalesced, one lone call at a time.
                let requests = |name: &str| -> Vec<(Vec<String>, Vec<String>)> {
                    let tenant = tenant(&format!("{name}-{case}"));
                    (0..users.len())
                        .map(|user| {
                            let keys = vec![
                                rule_key(&tenant, &format!("r:{user}")),
                                rule_key(&tenant, &format!("u:{user}")),
                                rule_key(&tenant, "t"),
                            ];
                            let args = vec![
                                header.clone(),
                                format!("d{user}"),
                                user_rule.clone(),
                                tenant_rule.clone(),
                            ];
                            (keys, args)
                        })
                        .collect()
                };
                let (coalesced, lone) = (requests("hot-many"), requests("hot-lone"));
                for requests in [&coalesced, &lone] {
                    for ((keys, _), held) in requests.iter().zip(&users) {
                        hold(&connection, &keys[1], *held, user_bucket, 60_000, at_ms).await;
                    }
                    hold(
                        &connection,
                        &requests[0].0[2],
                        tenant_held,
                        true,
                        60_000,
                        at_ms,
                    )
                    .await;
                }
                let sent: Vec<(&[String], &[String])> = coalesced
                    .iter()
                    .map(|(keys, args)| (&keys[..], &args[..]))
                    .collect();
                let replies = store
                    .decide_many_requests(&sent)
                    .await
                    .map_err(|error| TestCaseError::fail(format!("the call failed: {error}")))?;
                prop_assert_eq!(replies.len(), lone.len());
                let kind = |reply: Result<Vec<i64>, StoreError>| {
                    reply.map_err(|error| match error {
                        StoreError::Rejected { kind, .. } => Some(kind),
                        _ => None,
                    })
                };
                for (user, ((keys, args), reply)) in lone.iter().zip(replies).enumerate() {
                    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                    let alone = kind(store.run_decide_raw(&keys, args).await);
                    let outcome = match &alone {
                        Ok(fields) if fields.first() == Some(&1) => "admitted",
                        Ok(_) => "denied",
                        Err(_) => "refused",
                    };
                    *outcomes.borrow_mut().entry(outcome).or_default() += 1;
                    prop_assert_eq!(kind(reply), alone, "request {}", user);
                }
                for ((many_keys, _), (lone_keys, _)) in coalesced.iter().zip(&lone) {
                    for (many_key, lone_key) in many_keys.iter().zip(lone_keys) {
                        prop_assert_eq!(
                            held_now(&connection, many_key).await,
                            held_now(&connection, lone_key).await,
                            "{} against {}",
                            many_key,
                            lone_key
                        );
                    }
                }
                Ok(())
            })
        },
    );
    if let Err(failure) = result {
        panic!("{failure}");
    }
    let outcomes = outcomes.borrow();
    assert!(
        ["admitted", "denied", "refused"]
            .iter()
            .all(|outcome| outcomes.get(outcome).copied().unwrap_or(0) > 0),
        "the calls admitted, denied and refused: {outcomes:?}"
    );
}

/// Requests of the plain shape, which the decide library serves on paths of their own (one rule,
/// and two or three on the same keys), decide as the pure core does, one by one on one server (the
/// coalesced test draws the shape too).
#[test]
fn plain_requests_agree_across_the_pure_core_the_in_process_store_and_redis() {
    let runtime = runtime();
    let redis = runtime.block_on(Subject::redis_single());
    let tally = random_decisions(&redis, &runtime, Shape::Plain, 96, 60);
    let tally = tally.borrow();
    assert!(
        tally.allowed_single_rule > 0
            && tally.allowed_multi_rule > 0
            && tally.denied_multi_rule > 0
            && tally.denied_with_a_wait > 0
            && tally.denied_never > 0
            && tally.rejected > 0
            && tally.clock_steps_back > 0,
        "every outcome of the plain shape was reached: {tally:?}"
    );
}

/// During a rolling upgrade agents that write rule state as hashes and agents that write strings
/// share the keys: decisions taken by the two in turns agree with the pure core all the same.
#[test]
fn decisions_agree_while_two_state_layouts_share_the_keys() {
    let runtime = runtime();
    let redis = runtime.block_on(Subject::redis_rolling_upgrade());
    check_decisions(&redis, &runtime, 48);
}

#[test]
fn decisions_agree_on_a_three_master_cluster() {
    let runtime = runtime();
    let redis = runtime.block_on(Subject::redis_cluster());
    check_decisions(&redis, &runtime, 24);
}

#[test]
fn leases_agree_across_the_pure_core_the_in_process_store_and_redis() {
    let runtime = runtime();
    let redis = runtime.block_on(Subject::redis_single());
    let semaphore = (1u64..=4, 1u64..=3_000);
    let lease_step = (
        clock_step().prop_map(|step| step.clamp(-2_000, 4_000)),
        any::<u8>(),
        any::<usize>(),
        prop::option::weighted(0.1, semaphore.clone()),
    )
        .prop_map(
            |(clock_step_ms, operation, lease, new_semaphore)| LeaseStep {
                clock_step_ms,
                operation,
                lease,
                new_semaphore,
            },
        );
    let scenario = (
        0u64..1_000_000,
        semaphore,
        prop::collection::vec(lease_step, 1..40),
    );
    let outcomes = RefCell::new(HashMap::new());
    let result = runner(96).run(&scenario, |(start, semaphore, steps)| {
        runtime.block_on(run_leases(&outcomes, &redis, start, semaphore, steps))
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
    // Every operation both succeeded and was refused at least once.
    let outcomes = outcomes.into_inner();
    assert_eq!(
        outcomes.len(),
        6,
        "an outcome was never reached: {outcomes:?}"
    );
}
