//! A circuit breaker per store shard: stop calling a shard that keeps failing, probe it now and then,
//! and go back to it when it answers.
//!
//! ```text
//!            threshold failures within the window          a probe succeeds
//!   Closed ───────────────────────────────────────▶ Open ◀──────────┐     ┌──────▶ Closed
//!                                                    │ cool-down     │     │
//!                                                    ▼ elapsed       │fails│
//!                                                 HalfOpen ──────────┴─────┘
//!                                          (at most `half_open_probes` calls in flight)
//! ```
//!
//! - **Closed**: every call passes. Each failure (a timeout, an ambiguous or unexecuted call) is
//!   remembered with its time; when the last `failure_threshold` failures all fall within
//!   `failure_window_ms`, the breaker opens. Successes do not erase failures; failures age out.
//! - **Open**: no call passes (the decision degrades at once, without touching the shard) until
//!   `open_ms` have passed since it opened.
//! - **HalfOpen**: at most `half_open_probes` calls are in flight; the rest are refused as if open.
//!   The first probe to succeed closes the breaker; a probe that fails opens it again for another
//!   `open_ms`. A probe that ends without a verdict (a policy fault, a cancelled call) frees its slot.
//!
//! Results of calls that were let through in an earlier state (a slow call admitted while closed and
//! finishing after the breaker opened) change nothing: only probes decide a half-open breaker, and
//! a generation number tells a current probe from a stale one.
//!
//! The state machine (`BreakerCore`) is pure: time is an argument (monotonic ms), so its tests step
//! a clock by hand. `CircuitBreaker` puts it behind a mutex and hands out `BreakerCall` guards.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Most failures a breaker remembers, which bounds `failure_threshold` (I10).
pub const MAX_FAILURE_THRESHOLD: u32 = 1_024;

/// Default failures within [`DEFAULT_FAILURE_WINDOW_MS`] that open a breaker: enough that one
/// unlucky timeout does not degrade a whole shard, few enough that a dead shard is cut off within a
/// handful of requests.
pub const DEFAULT_FAILURE_THRESHOLD: u32 = 5;

/// Default window in which [`DEFAULT_FAILURE_THRESHOLD`] failures open a breaker, in ms.
pub const DEFAULT_FAILURE_WINDOW_MS: u64 = 1_000;

/// Default time an open breaker refuses every call before it lets probes through, in ms.
pub const DEFAULT_OPEN_MS: u64 = 1_000;

/// Default number of probe calls a half-open breaker lets through at once: one, so a recovering
/// shard sees one call per gateway, not a thundering herd.
pub const DEFAULT_HALF_OPEN_PROBES: u32 = 1;

/// When a breaker opens and how it recovers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Failures within `failure_window_ms` that open the breaker, 1 to [`MAX_FAILURE_THRESHOLD`].
    pub failure_threshold: u32,
    /// The window those failures must fall in, in ms.
    pub failure_window_ms: u64,
    /// How long an open breaker refuses every call (the cool-down), in ms.
    pub open_ms: u64,
    /// Probe calls in flight while half-open, at least 1.
    pub half_open_probes: u32,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failure_threshold: DEFAULT_FAILURE_THRESHOLD,
            failure_window_ms: DEFAULT_FAILURE_WINDOW_MS,
            open_ms: DEFAULT_OPEN_MS,
            half_open_probes: DEFAULT_HALF_OPEN_PROBES,
        }
    }
}

impl BreakerConfig {
    /// Checks the bounds; returns what is wrong.
    pub fn validate(&self) -> Result<(), &'static str> {
        if !(1..=MAX_FAILURE_THRESHOLD).contains(&self.failure_threshold) {
            return Err("breaker failure_threshold must be in [1, 1024]");
        }
        if self.half_open_probes == 0 {
            return Err("breaker half_open_probes must be at least 1");
        }
        Ok(())
    }
}

/// Where a breaker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BreakerState {
    /// Calls pass; failures are counted.
    Closed,
    /// Calls are refused until the cool-down ends.
    Open,
    /// A limited number of probe calls pass.
    HalfOpen,
}

/// What a breaker shows to metrics and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerSnapshot {
    /// The state (an open breaker whose cool-down has ended still shows `Open` until a call
    /// arrives and makes it half-open).
    pub state: BreakerState,
    /// Failures remembered within the window (closed state).
    pub recent_failures: usize,
    /// How many times the breaker opened.
    pub opened_total: u64,
    /// Calls refused because the breaker was open or its probes were all in flight.
    pub refused_total: u64,
    /// Failures reported, each attempt of a call that fails and is retried included (stale ones
    /// too: they are counted, though they change nothing).
    pub failed_total: u64,
}

/// How a call was let through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    /// The breaker is closed.
    Normal,
    /// A half-open probe of this generation.
    Probe(u64),
}

/// The pure state machine. See the module docs.
#[derive(Debug)]
pub(crate) struct BreakerCore {
    config: BreakerConfig,
    state: BreakerState,
    /// The last failures' times (closed state), at most `failure_threshold` of them.
    failures: VecDeque<u64>,
    opened_at_ms: u64,
    /// Bumped on every transition to half-open: a probe of another generation is stale.
    generation: u64,
    probes_in_flight: u32,
    opened_total: u64,
    refused_total: u64,
    failed_total: u64,
}

impl BreakerCore {
    pub(crate) fn new(config: BreakerConfig) -> Self {
        Self {
            config,
            state: BreakerState::Closed,
            failures: VecDeque::with_capacity(config.failure_threshold as usize),
            opened_at_ms: 0,
            generation: 0,
            probes_in_flight: 0,
            opened_total: 0,
            refused_total: 0,
            failed_total: 0,
        }
    }

    /// Lets a call through at `now_ms`, or refuses it (`None`).
    pub(crate) fn admit(&mut self, now_ms: u64) -> Option<Pass> {
        if self.state == BreakerState::Open
            && now_ms >= self.opened_at_ms.saturating_add(self.config.open_ms)
        {
            self.state = BreakerState::HalfOpen;
            self.generation += 1;
            self.probes_in_flight = 0;
        }
        match self.state {
            BreakerState::Closed => Some(Pass::Normal),
            BreakerState::HalfOpen if self.probes_in_flight < self.config.half_open_probes => {
                self.probes_in_flight += 1;
                Some(Pass::Probe(self.generation))
            }
            BreakerState::Open | BreakerState::HalfOpen => {
                self.refused_total += 1;
                None
            }
        }
    }

    fn is_current_probe(&self, pass: Pass) -> bool {
        self.state == BreakerState::HalfOpen && pass == Pass::Probe(self.generation)
    }

    /// A call let through as `pass` got an answer from the shard.
    pub(crate) fn succeeded(&mut self, pass: Pass) {
        if self.is_current_probe(pass) {
            self.state = BreakerState::Closed;
            self.failures.clear();
            self.probes_in_flight = 0;
        }
    }

    /// A call let through as `pass` timed out or failed at `now_ms`.
    pub(crate) fn failed(&mut self, pass: Pass, now_ms: u64) {
        self.failed_total += 1;
        match (self.state, pass) {
            (BreakerState::Closed, Pass::Normal) => {
                if self.failures.len() == self.config.failure_threshold as usize {
                    self.failures.pop_front();
                }
                self.failures.push_back(now_ms);
                let oldest = self.failures.front().copied().unwrap_or(now_ms);
                if self.failures.len() == self.config.failure_threshold as usize
                    && now_ms.saturating_sub(oldest) <= self.config.failure_window_ms
                {
                    self.open(now_ms);
                }
            }
            _ if self.is_current_probe(pass) => self.open(now_ms),
            // A stale call: the breaker has already moved on.
            _ => {}
        }
    }

    /// A call let through as `pass` ended without a verdict on the shard's health.
    pub(crate) fn abandoned(&mut self, pass: Pass) {
        if self.is_current_probe(pass) {
            self.probes_in_flight = self.probes_in_flight.saturating_sub(1);
        }
    }

    fn open(&mut self, now_ms: u64) {
        self.state = BreakerState::Open;
        self.opened_at_ms = now_ms;
        self.failures.clear();
        self.probes_in_flight = 0;
        self.opened_total += 1;
    }

    pub(crate) fn snapshot(&self, now_ms: u64) -> BreakerSnapshot {
        let window_start = now_ms.saturating_sub(self.config.failure_window_ms);
        BreakerSnapshot {
            state: self.state,
            recent_failures: self.failures.iter().filter(|&&t| t >= window_start).count(),
            opened_total: self.opened_total,
            refused_total: self.refused_total,
            failed_total: self.failed_total,
        }
    }
}

/// A [`BreakerCore`] shared by concurrent calls.
#[derive(Debug)]
pub(crate) struct CircuitBreaker {
    core: Mutex<BreakerCore>,
}

impl CircuitBreaker {
    pub(crate) fn new(config: BreakerConfig) -> Self {
        Self {
            core: Mutex::new(BreakerCore::new(config)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BreakerCore> {
        // Every method leaves the core consistent between statements, so a poisoned lock is usable.
        self.core.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Lets a call through at `now_ms`; `None` when the breaker refuses it.
    pub(crate) fn admit(&self, now_ms: u64) -> Option<BreakerCall<'_>> {
        let pass = self.lock().admit(now_ms)?;
        Some(BreakerCall {
            breaker: self,
            pass,
            settled: false,
        })
    }

    pub(crate) fn snapshot(&self, now_ms: u64) -> BreakerSnapshot {
        self.lock().snapshot(now_ms)
    }
}

/// A call the breaker let through. Report how it went; dropping it unreported (a cancelled call)
/// frees a probe slot and changes nothing else.
#[derive(Debug)]
pub(crate) struct BreakerCall<'a> {
    breaker: &'a CircuitBreaker,
    pass: Pass,
    settled: bool,
}

impl BreakerCall<'_> {
    /// The shard answered.
    pub(crate) fn succeeded(mut self) {
        self.settled = true;
        self.breaker.lock().succeeded(self.pass);
    }

    /// The shard failed or timed out at `now_ms`. The call may go on (a retry): it can report again.
    pub(crate) fn failed(&mut self, now_ms: u64) {
        self.breaker.lock().failed(self.pass, now_ms);
    }

    /// The call failed, and that was its last attempt.
    pub(crate) fn finally_failed(mut self, now_ms: u64) {
        self.settled = true;
        self.breaker.lock().failed(self.pass, now_ms);
    }
}

impl Drop for BreakerCall<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.breaker.lock().abandoned(self.pass);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> BreakerConfig {
        BreakerConfig {
            failure_threshold: 3,
            failure_window_ms: 1_000,
            open_ms: 500,
            half_open_probes: 2,
        }
    }

    #[test]
    fn threshold_failures_within_the_window_open_it_and_older_ones_age_out() {
        let mut breaker = BreakerCore::new(config());
        // Three failures spread over more than the window: never three within one window.
        for now in [0, 600, 1_200, 1_800] {
            let pass = breaker.admit(now).expect("closed");
            breaker.failed(pass, now);
            assert_eq!(
                breaker.snapshot(now).state,
                BreakerState::Closed,
                "at {now}"
            );
        }
        // A success does not erase them; a third failure within 1,000 ms of the first does it.
        let pass = breaker.admit(1_900).expect("closed");
        breaker.succeeded(pass);
        let pass = breaker.admit(2_100).expect("closed");
        breaker.failed(pass, 2_100);
        let snapshot = breaker.snapshot(2_100);
        assert_eq!(snapshot.state, BreakerState::Open);
        assert_eq!(snapshot.opened_total, 1);
        assert_eq!(
            snapshot.failed_total, 5,
            "every failure reported, aged out or not"
        );
    }

    #[test]
    fn open_refuses_until_the_cool_down_then_lets_a_bounded_number_of_probes_through() {
        let mut breaker = BreakerCore::new(config());
        for now in [10, 20, 30] {
            let pass = breaker.admit(now).expect("closed");
            breaker.failed(pass, now);
        }
        assert_eq!(breaker.admit(31), None);
        assert_eq!(breaker.admit(529), None, "cool-down runs to 30 + 500");
        assert_eq!(breaker.snapshot(529).refused_total, 2);
        let first = breaker.admit(530).expect("a probe");
        let second = breaker.admit(530).expect("a second probe");
        assert!(matches!(first, Pass::Probe(_)));
        assert_eq!(breaker.snapshot(530).state, BreakerState::HalfOpen);
        assert_eq!(breaker.admit(531), None, "two probes are in flight");
        breaker.abandoned(second);
        let third = breaker
            .admit(532)
            .expect("an abandoned probe freed its slot");
        breaker.succeeded(first);
        assert_eq!(breaker.snapshot(533).state, BreakerState::Closed);
        // The other probe's late failure is stale: the breaker stays closed.
        breaker.failed(third, 534);
        assert_eq!(breaker.snapshot(534).state, BreakerState::Closed);
        assert_eq!(breaker.snapshot(534).recent_failures, 0);
    }

    #[test]
    fn a_failed_probe_opens_it_again_for_another_cool_down() {
        let mut breaker = BreakerCore::new(config());
        for now in [0, 1, 2] {
            let pass = breaker.admit(now).expect("closed");
            breaker.failed(pass, now);
        }
        let probe = breaker.admit(502).expect("a probe");
        breaker.failed(probe, 510);
        assert_eq!(breaker.snapshot(510).state, BreakerState::Open);
        assert_eq!(breaker.snapshot(510).opened_total, 2);
        assert_eq!(breaker.admit(1_009), None, "open again from 510");
        assert!(breaker.admit(1_010).is_some());
    }

    #[test]
    fn calls_admitted_while_closed_cannot_close_or_reopen_a_later_state() {
        let mut breaker = BreakerCore::new(config());
        let slow = breaker.admit(0).expect("closed");
        for now in [1, 2, 3] {
            let pass = breaker.admit(now).expect("closed");
            breaker.failed(pass, now);
        }
        // The slow call succeeds while the breaker is open: it proves nothing about recovery.
        breaker.succeeded(slow);
        assert_eq!(breaker.snapshot(4).state, BreakerState::Open);
        let probe = breaker.admit(503).expect("a probe");
        breaker.failed(slow, 504);
        assert_eq!(
            breaker.snapshot(504).state,
            BreakerState::HalfOpen,
            "stale failure ignored"
        );
        breaker.succeeded(probe);
        assert_eq!(breaker.snapshot(505).state, BreakerState::Closed);
    }

    #[test]
    fn a_dropped_guard_frees_its_probe_slot() {
        let breaker = CircuitBreaker::new(BreakerConfig {
            half_open_probes: 1,
            ..config()
        });
        for now in [0, 1, 2] {
            breaker.admit(now).expect("closed").finally_failed(now);
        }
        let probe = breaker.admit(600).expect("a probe");
        assert!(breaker.admit(600).is_none(), "the one probe is in flight");
        drop(probe);
        let probe = breaker.admit(601).expect("the slot was freed");
        probe.succeeded();
        assert_eq!(breaker.snapshot(601).state, BreakerState::Closed);
    }

    #[test]
    fn configs_out_of_bounds_are_refused() {
        assert!(BreakerConfig::default().validate().is_ok());
        for bad in [
            BreakerConfig {
                failure_threshold: 0,
                ..config()
            },
            BreakerConfig {
                failure_threshold: MAX_FAILURE_THRESHOLD + 1,
                ..config()
            },
            BreakerConfig {
                half_open_probes: 0,
                ..config()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
