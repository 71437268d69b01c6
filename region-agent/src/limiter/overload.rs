//! Graceful overload: each shard's in-flight bound, learnt from how fast the shard answers, and a
//! short, bounded wait for it.
//!
//! A store that is saturated but answering is not down. Were every decision sent at once, the queue
//! would grow inside Redis: each call waits behind all the others, replies pass the decision budget,
//! decisions time out late, and a breaker counting those timeouts would cut a healthy shard off. So a
//! shard keeps at most `limit` calls in flight, and `limit` follows the replies (AIMD):
//!
//! - while the smoothed reply latency (a moving average over about ten replies) is above the latency
//!   target, a reply cuts the limit to `limit x 0.9`, at most once per target interval (a slow round
//!   of replies is one signal, not `limit` of them); so does a call that overran its deadline;
//! - otherwise a reply to a call sent while the limit was reached raises it by `1 / limit` (about
//!   one call per round of replies); an unused limit does not grow;
//! - the limit stays within `[min_limit, max_limit]` and starts at `max_limit`.
//!
//! With `limit` calls in flight and a store deciding `C` calls a second, a call takes about
//! `limit / C` (Little's law): the limit settles where replies come back within the target, so the
//! store stays busy and a call that is sent ends well inside the budget.
//!
//! A decision that finds the limit reached waits, in arrival order, for a call to end, at most the
//! wait the limiter gives it. When more decisions wait already than twice what the shard serves in
//! that wait, it does not queue at all: it is shed at once and its rules' fail modes answer (a fast
//! 503, or the local bucket). Under overload the excess is refused early instead of timing out late,
//! and the waiting queue is bounded (I10). What the shard serves is the more of `limit / latency`
//! now and of the replies counted over the last 10 ms interval.
//!
//! The agent measures both through its own thread, and a thread held up (a busy host, a neighbour
//! on its core) reads the replies of that moment late: the shard looks slow just as the requests
//! that arrived meanwhile come in together, and judged by that moment a burst the shard serves in
//! time would be shed. Such a moment shows as a gap: no reply for `REPLY_GAP_US` while calls
//! were out, where a shard answering at its pace replies every few µs. For `REMEMBERED_US` after
//! a gap, what the shard serves is also the most it served in any interval that closed within the
//! last `REMEMBERED_US`. Under a steady overload replies come without gaps, the memory stays
//! unused, and the excess is shed as early as before; a shard that stops answering is judged by
//! what it serves now once its remembered intervals age out.
//!
//! `ConcurrencyCore` is the pure arithmetic (time is an argument); `InFlightBound` puts it behind a
//! mutex beside a semaphore holding `limit` permits.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{Semaphore, SemaphorePermit};

use super::late_turn;

/// The factor a slow reply multiplies the limit by.
const CUT_FACTOR: f64 = 0.9;

/// The weight of a new reply in the smoothed latency.
const LATENCY_SMOOTHING: f64 = 0.1;

/// The interval over which replies are counted for the shard's reply rate, µs.
const RATE_INTERVAL_US: u64 = 10_000;

/// How long a closed interval's serving rate is remembered, and how long after a gap in the
/// replies the remembered best counts (module docs), µs.
const REMEMBERED_US: u64 = 80_000;

/// Intervals ([`RATE_INTERVAL_US`]) that fit in `REMEMBERED_US`.
const REMEMBERED_INTERVALS: usize = (REMEMBERED_US / RATE_INTERVAL_US) as usize;

/// No reply for this long, with calls out, is a gap (module docs), µs.
const REPLY_GAP_US: u64 = 5_000;

/// How many times the calls that end within a wait may wait for them.
const WAITING_ROOM: f64 = 2.0;

/// Most decisions that wait for one shard, whatever the arithmetic says (I10).
pub const MAX_WAITING_PER_SHARD: usize = 4_096;

/// Default least in-flight limit. Replies also come back slowly when the agent itself is busy (it
/// reads them late), and cutting the bound does not help then: with a floor of 2 (and the waiting
/// line sized by latency alone, before the reply count) the agent bench at
/// 64 callers shed most of its decisions. By Little's law a store deciding 20,000 calls a second
/// answers 64 in flight within 3.2 ms, a third of the default budget; the overload bench's sweep
/// (see `DEFAULT_ACQUIRE_WAIT`) chose 64 over 32 with the 4 ms wait.
pub const DEFAULT_MIN_IN_FLIGHT: usize = 64;

/// How a shard's in-flight bound moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConcurrencyConfig {
    /// Replies slower than this cut the limit.
    pub latency_target: Duration,
    /// The least limit, at least 1.
    pub min_limit: usize,
    /// The most, and the first, limit.
    pub max_limit: usize,
}

/// What a shard's bound shows to metrics and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardLoad {
    /// Calls the shard may have in flight now.
    pub limit: usize,
    /// Calls in flight now.
    pub in_flight: usize,
    /// Decisions waiting for a call to end.
    pub waiting: usize,
    /// The smoothed reply latency, µs (0 before the first reply).
    pub latency_us: u64,
}

/// The pure arithmetic of the bound. See the module docs.
#[derive(Debug, Clone)]
pub(crate) struct ConcurrencyCore {
    config: ConcurrencyConfig,
    limit: f64,
    latency_us: f64,
    last_cut_us: Option<u64>,
    /// Replies counted since `rate_since_us`.
    rate_since_us: u64,
    rate_replies: u64,
    /// The last closed intervals: calls per µs the shard served, and when the interval closed
    /// (µs); a ring whose next entry to overwrite is `served_next`. The newest is the last
    /// interval's rate.
    served: [Served; REMEMBERED_INTERVALS],
    served_next: usize,
    /// When the last reply came, µs (`None`: never).
    last_reply_us: Option<u64>,
    /// Until when the remembered best counts, after the last gap in the replies, µs.
    remember_until_us: u64,
}

/// One closed interval's serving rate.
#[derive(Debug, Clone, Copy, Default)]
struct Served {
    per_us: f64,
    closed_us: u64,
}

impl ConcurrencyCore {
    pub(crate) fn new(config: ConcurrencyConfig) -> Self {
        debug_assert!(config.min_limit >= 1 && config.min_limit <= config.max_limit);
        Self {
            config,
            limit: config.max_limit as f64,
            latency_us: 0.0,
            last_cut_us: None,
            rate_since_us: 0,
            rate_replies: 0,
            served: [Served::default(); REMEMBERED_INTERVALS],
            served_next: 0,
            last_reply_us: None,
            remember_until_us: 0,
        }
    }

    /// The whole number of calls allowed in flight.
    pub(crate) fn limit(&self) -> usize {
        // The limit is kept within [min_limit, max_limit], both whole numbers.
        self.limit.floor() as usize
    }

    /// The smoothed reply latency, µs.
    pub(crate) fn latency_us(&self) -> u64 {
        self.latency_us.round() as u64
    }

    /// Whether the shard replied within `window_us` before `now_us`.
    fn answered_within(&self, window_us: u64, now_us: u64) -> bool {
        self.last_reply_us
            .is_some_and(|last| now_us.saturating_sub(last) <= window_us)
    }

    /// A reply after `latency_us`, to a call sent while the limit was reached (`limit_reached`) or
    /// not, at `now_us`.
    pub(crate) fn on_reply(&mut self, latency_us: u64, limit_reached: bool, now_us: u64) {
        self.count_reply(now_us);
        let sample = latency_us as f64;
        self.latency_us = if self.latency_us == 0.0 {
            sample
        } else {
            self.latency_us + LATENCY_SMOOTHING * (sample - self.latency_us)
        };
        // The smoothed latency, not the reply's own: one reply held up by a scheduling hiccup says
        // little about the shard's queue.
        if self.latency_us > self.target_us() as f64 {
            self.cut(now_us);
        } else if limit_reached {
            self.limit = (self.limit + 1.0 / self.limit).min(self.config.max_limit as f64);
        }
        self.check();
    }

    /// A call that overran its deadline at `now_us`: as slow a reply as there is.
    pub(crate) fn on_overrun(&mut self, now_us: u64) {
        self.cut(now_us);
        self.check();
    }

    /// How many decisions may wait for `wait` at `now_us`: twice as many calls as end in that time
    /// at what the shard serves (module docs; an estimate, so it is given room: past it a wait is
    /// likely in vain). The counted replies matter when the agent itself is busy: its replies are
    /// read late, the latency it sees grows, and `limit / latency` then undercounts what the shard
    /// serves.
    pub(crate) fn max_waiting(&self, wait: Duration, now_us: u64) -> usize {
        if self.latency_us < 1.0 {
            // No reply yet: nothing to go by but the bound.
            return MAX_WAITING_PER_SHARD;
        }
        let serving_per_us = self
            .serving_now_per_us()
            .max(self.served_lately_per_us(now_us));
        debug_assert!(serving_per_us.is_finite() && serving_per_us >= 0.0);
        let ending = WAITING_ROOM * serving_per_us * wait.as_micros() as f64;
        (ending.floor() as usize).min(MAX_WAITING_PER_SHARD)
    }

    /// Calls per µs the shard serves by Little's law: `limit` in flight, each `latency` long.
    fn serving_now_per_us(&self) -> f64 {
        if self.latency_us < 1.0 {
            return 0.0;
        }
        self.limit / self.latency_us
    }

    /// The last interval's rate; within `REMEMBERED_US` after a gap, the best remembered one.
    /// Intervals closed longer than `REMEMBERED_US` ago count for nothing.
    fn served_lately_per_us(&self, now_us: u64) -> f64 {
        let fresh = |served: &Served| now_us.saturating_sub(served.closed_us) <= REMEMBERED_US;
        if now_us < self.remember_until_us {
            return self
                .served
                .iter()
                .filter(|served| fresh(served))
                .map(|served| served.per_us)
                .fold(0.0, f64::max);
        }
        let newest = (self.served_next + REMEMBERED_INTERVALS - 1) % REMEMBERED_INTERVALS;
        self.served
            .get(newest)
            .filter(|served| fresh(served))
            .map_or(0.0, |served| served.per_us)
    }

    fn count_reply(&mut self, now_us: u64) {
        if self
            .last_reply_us
            .is_some_and(|last| now_us.saturating_sub(last) >= REPLY_GAP_US)
        {
            self.remember_until_us = now_us.saturating_add(REMEMBERED_US);
        }
        // `now_us` is read before the core's lock: replies may arrive here slightly out of order.
        self.last_reply_us = Some(self.last_reply_us.map_or(now_us, |last| last.max(now_us)));
        let elapsed_us = now_us.saturating_sub(self.rate_since_us);
        if elapsed_us >= RATE_INTERVAL_US {
            let counted_per_us = self.rate_replies as f64 / elapsed_us as f64;
            self.remember_served(Served {
                per_us: counted_per_us.max(self.serving_now_per_us()),
                closed_us: now_us,
            });
            self.rate_since_us = now_us;
            self.rate_replies = 0;
        }
        self.rate_replies += 1;
    }

    fn remember_served(&mut self, served: Served) {
        debug_assert!(served.per_us.is_finite() && served.per_us >= 0.0);
        self.served[self.served_next] = served;
        self.served_next = (self.served_next + 1) % REMEMBERED_INTERVALS;
    }

    fn target_us(&self) -> u64 {
        u64::try_from(self.config.latency_target.as_micros()).unwrap_or(u64::MAX)
    }

    fn cut(&mut self, now_us: u64) {
        let interval_us = self.target_us().max(1);
        if self
            .last_cut_us
            .is_some_and(|last| now_us < last.saturating_add(interval_us))
        {
            return;
        }
        self.last_cut_us = Some(now_us);
        self.limit = (self.limit * CUT_FACTOR).max(self.config.min_limit as f64);
    }

    fn check(&self) {
        debug_assert!(
            self.limit >= self.config.min_limit as f64
                && self.limit <= self.config.max_limit as f64,
            "the limit {} left [{}, {}]",
            self.limit,
            self.config.min_limit,
            self.config.max_limit
        );
    }
}

/// Why no call may be sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NoSlot {
    /// More decisions wait already than the shard serves in the wait: refused at once.
    Shed,
    /// The wait ended before a call did; `held_up` when it ended half the wait late or more, this
    /// thread held up meanwhile ([`late_turn::was_held_up`]).
    WaitedOut { held_up: bool },
}

/// A shard's in-flight bound: the core and a semaphore with `limit` permits.
#[derive(Debug)]
pub(crate) struct InFlightBound {
    core: Mutex<ConcurrencyCore>,
    permits: Semaphore,
    /// Permits the semaphore holds beyond the limit (in use when the limit was cut), forgotten as
    /// their calls end. Besides these, the semaphore holds exactly the core's limit.
    excess: AtomicUsize,
    waiting: AtomicUsize,
    /// The origin of the core's µs.
    epoch: tokio::time::Instant,
}

impl InFlightBound {
    pub(crate) fn new(config: ConcurrencyConfig) -> Self {
        let core = ConcurrencyCore::new(config);
        let limit = core.limit();
        Self {
            core: Mutex::new(core),
            permits: Semaphore::new(limit),
            excess: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            epoch: crate::clock::monotonic_now(),
        }
    }

    /// A slot for one call, waiting at most `wait` behind others (module docs).
    pub(crate) async fn acquire(&self, wait: Duration) -> Result<Slot<'_>, NoSlot> {
        if let Ok(permit) = self.permits.try_acquire() {
            let limit_reached = self.permits.available_permits() == 0;
            return Ok(self.slot(permit, limit_reached));
        }
        if wait.is_zero() {
            return Err(NoSlot::WaitedOut { held_up: false });
        }
        let max_waiting = self.lock().max_waiting(wait, self.now_us());
        let _waiting = Waiting::join(&self.waiting, max_waiting).ok_or(NoSlot::Shed)?;
        // A place freed in the turn the wait expired is taken (see `late_turn`).
        let deadline = crate::clock::monotonic_now() + wait;
        let waited_out = || {
            let late = crate::clock::monotonic_now().saturating_duration_since(deadline);
            NoSlot::WaitedOut {
                held_up: late_turn::was_held_up(late, wait),
            }
        };
        late_turn::within(deadline, self.permits.acquire())
            .await
            .ok_or_else(waited_out)?
            .map(|permit| self.slot(permit, true))
            .map_err(|_closed| waited_out())
    }

    /// Where the bound stands.
    pub(crate) fn load(&self) -> ShardLoad {
        let core = self.lock();
        let limit = core.limit();
        let excess = self.excess.load(Ordering::Relaxed);
        ShardLoad {
            limit,
            in_flight: (limit + excess).saturating_sub(self.permits.available_permits()),
            waiting: self.waiting.load(Ordering::Relaxed),
            latency_us: core.latency_us(),
        }
    }

    fn slot<'a>(&'a self, permit: SemaphorePermit<'a>, limit_reached: bool) -> Slot<'a> {
        Slot {
            bound: self,
            permit: Some(permit),
            limit_reached,
        }
    }

    /// Whether the shard replied to some call within `window` before now: checked when a call
    /// overruns, since a shard that answers nothing for that long is down, not slow.
    pub(crate) fn answered_within(&self, window: Duration) -> bool {
        let window_us = u64::try_from(window.as_micros()).unwrap_or(u64::MAX);
        let now_us = self.now_us();
        self.lock().answered_within(window_us, now_us)
    }

    /// µs since the bound was made: the core's clock.
    fn now_us(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Applies a change of the core under its lock: adds permits, or takes them back (now if they
    /// are free, else as their calls end).
    fn update(&self, change: impl FnOnce(&mut ConcurrencyCore, u64)) {
        let now_us = self.now_us();
        let mut core = self.lock();
        let before = core.limit();
        change(&mut core, now_us);
        let limit = core.limit();
        if limit > before {
            // Cancel pending take-backs first, then add what is left.
            let more = limit - before;
            let pending = self
                .excess
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |excess| {
                    Some(excess.saturating_sub(more))
                })
                .unwrap_or(0);
            self.permits.add_permits(more - pending.min(more));
        } else if limit < before {
            let fewer = before - limit;
            let taken = self.permits.forget_permits(fewer);
            self.excess.fetch_add(fewer - taken, Ordering::AcqRel);
        }
    }

    fn lock(&self) -> MutexGuard<'_, ConcurrencyCore> {
        // The core's arithmetic cannot leave it half-updated: a panic elsewhere leaves it usable.
        self.core.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A place in a shard's waiting line, left on drop (a cancelled decision leaves it too).
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn join(count: &'a AtomicUsize, max: usize) -> Option<Self> {
        let before = count.fetch_add(1, Ordering::AcqRel);
        if before >= max {
            count.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Self(count))
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One call's place in flight. Tell it how the call went; dropped without a word (the call was not
/// sent, or ended without a reply that says anything of the shard's speed) it changes nothing.
#[derive(Debug)]
pub(crate) struct Slot<'a> {
    bound: &'a InFlightBound,
    permit: Option<SemaphorePermit<'a>>,
    limit_reached: bool,
}

impl Slot<'_> {
    /// The shard replied after `latency`.
    pub(crate) fn replied(&self, latency: Duration) {
        let latency_us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        let limit_reached = self.limit_reached;
        self.bound
            .update(|core, now_us| core.on_reply(latency_us, limit_reached, now_us));
    }

    /// The call overran its deadline.
    pub(crate) fn overran(&self) {
        self.bound.update(|core, now_us| core.on_overrun(now_us));
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let Some(permit) = self.permit.take() else {
            return;
        };
        // A permit beyond a cut limit goes away instead of back to the semaphore.
        let beyond_limit = self
            .bound
            .excess
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |excess| {
                excess.checked_sub(1)
            })
            .is_ok();
        if beyond_limit {
            permit.forget();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn config(max_limit: usize) -> ConcurrencyConfig {
        ConcurrencyConfig {
            latency_target: Duration::from_millis(2),
            min_limit: 2,
            max_limit,
        }
    }

    #[test]
    fn slow_replies_cut_the_limit_once_per_target_interval_and_fast_ones_raise_it_when_it_binds() {
        let mut core = ConcurrencyCore::new(config(100));
        assert_eq!(core.limit(), 100, "starts at the most");
        core.on_reply(5_000, true, 0);
        assert_eq!(core.limit(), 90);
        core.on_reply(5_000, true, 1_999);
        assert_eq!(core.limit(), 90, "one cut per interval");
        core.on_reply(5_000, true, 2_000);
        assert_eq!(core.limit(), 81);
        for _ in 0..81 {
            core.on_reply(500, false, 3_000);
        }
        assert_eq!(core.limit(), 81, "an unused limit does not grow");
        for _ in 0..82 {
            core.on_reply(500, true, 3_000);
        }
        assert_eq!(core.limit(), 82, "about one more per round of replies");
        core.on_reply(6_000, false, 9_000);
        assert_eq!(
            core.limit(),
            82,
            "one slow reply among quick ones is a hiccup"
        );
        core.on_overrun(10_000);
        assert_eq!(core.limit(), 73, "an overrun is a slow reply");
    }

    #[test]
    fn the_waiting_line_is_what_ends_within_the_wait() {
        let mut core = ConcurrencyCore::new(config(40));
        assert_eq!(
            core.max_waiting(Duration::from_millis(5), 0),
            MAX_WAITING_PER_SHARD,
            "no reply yet"
        );
        core.on_reply(1_000, false, 0);
        // 40 calls ending every millisecond: 200 in five, and room for twice as many.
        assert_eq!(core.max_waiting(Duration::from_millis(5), 0), 400);
        assert_eq!(core.max_waiting(Duration::ZERO, 0), 0);
        core.on_reply(1, false, 0);
        assert!(core.max_waiting(Duration::from_secs(60), 0) <= MAX_WAITING_PER_SHARD);

        // Replies read late (a busy agent): 8 ms each by its clock, yet one every 10 µs.
        let mut busy = ConcurrencyCore::new(config(40));
        for n in 0..=2_000u64 {
            busy.on_reply(8_000, false, n * 10);
        }
        // By latency 40 x 2 / 8 = 10 end in 2 ms; by the count, 200.
        assert_eq!(busy.max_waiting(Duration::from_millis(2), 20_000), 400);
    }

    proptest! {
        #[test]
        fn the_limit_stays_within_its_bounds(
            max_limit in 2usize..300,
            replies in proptest::collection::vec((0u64..20_000, any::<bool>(), 0u64..3_000), 1..400),
        ) {
            let mut core = ConcurrencyCore::new(config(max_limit));
            let mut now_us = 0u64;
            for (latency_us, reached, step_us) in replies {
                now_us += step_us;
                if latency_us == 0 {
                    core.on_overrun(now_us);
                } else {
                    core.on_reply(latency_us, reached, now_us);
                }
                prop_assert!((2..=max_limit).contains(&core.limit()));
            }
        }
    }

    #[tokio::test]
    async fn a_cut_takes_back_permits_as_their_calls_end_and_a_raise_gives_them_back() {
        let bound = InFlightBound::new(ConcurrencyConfig {
            latency_target: Duration::from_millis(1),
            min_limit: 1,
            max_limit: 10,
        });
        let mut slots = Vec::new();
        for _ in 0..10 {
            slots.push(bound.acquire(Duration::ZERO).await.expect("a free slot"));
        }
        assert!(slots.last().is_some_and(|slot| slot.limit_reached));
        assert_eq!(
            bound.acquire(Duration::ZERO).await.err(),
            Some(NoSlot::WaitedOut { held_up: false })
        );
        slots[0].replied(Duration::from_millis(50));
        assert_eq!(bound.load().limit, 9);
        assert_eq!(bound.load().in_flight, 10, "the calls sent go on");
        slots.pop();
        assert_eq!(bound.load().in_flight, 9);
        assert_eq!(
            bound.acquire(Duration::ZERO).await.err(),
            Some(NoSlot::WaitedOut { held_up: false }),
            "the ended call's permit was taken back"
        );
        slots.pop();
        let again = bound
            .acquire(Duration::ZERO)
            .await
            .expect("one free under 9");
        assert!(again.limit_reached, "the ninth call reaches the limit");
        for _ in 0..30 {
            slots[0].replied(Duration::from_micros(10));
        }
        assert_eq!(
            bound.load().limit,
            9,
            "calls sent below the limit do not raise it"
        );
        for _ in 0..30 {
            again.replied(Duration::from_micros(10));
        }
        assert_eq!(bound.load().limit, 10);
        drop(again);
        assert!(bound.acquire(Duration::ZERO).await.is_ok(), "raised again");
    }

    #[test]
    fn a_moment_of_late_replies_keeps_the_line_and_a_lasting_slowdown_shrinks_it() {
        let (mut core, mut now_us, steady) = steady_for_50_ms();
        // 40 calls a millisecond: 80 in the wait, and room for twice as many.
        assert!((159..=161).contains(&steady), "{steady}");

        // This thread held up for 20 ms: the replies that came meanwhile are read at once, late.
        now_us += 20_000;
        for _ in 0..40 {
            core.on_reply(21_000, false, now_us);
        }
        // It catches up slowly: more late replies for longer than an interval, so the last
        // interval's count is of the catching up, not of the shard.
        now_us = replies(&mut core, now_us, 12_000, 500, 20_000);
        assert!(
            core.latency_us() > 15_000,
            "the late replies are seen as slow ones"
        );
        let line = core.max_waiting(WAIT, now_us);
        assert!(
            line >= steady,
            "the shard served 40 a millisecond just before: {line} < {steady}"
        );

        // The shard itself slows to 10 ms a call, for longer than the remembered intervals.
        now_us = replies(&mut core, now_us, 100_000, 250, 10_000);
        let line = core.max_waiting(WAIT, now_us);
        assert!(
            line <= steady / 8,
            "{line} waiting for a shard that serves a tenth as many"
        );
    }

    /// Replies of `latency_us` every `every_us` for `span_us` after `from_us`; the time after.
    fn replies(
        core: &mut ConcurrencyCore,
        from_us: u64,
        span_us: u64,
        every_us: u64,
        latency_us: u64,
    ) -> u64 {
        let mut now_us = from_us;
        while now_us < from_us + span_us {
            now_us += every_us;
            core.on_reply(latency_us, false, now_us);
        }
        now_us
    }

    /// The wait the pace tests size the line for.
    const WAIT: Duration = Duration::from_millis(2);

    /// A core whose 40 calls in flight were answered in 1 ms each (a reply every 25 µs) for 50 ms;
    /// the time then, and the line it allows for [`WAIT`].
    fn steady_for_50_ms() -> (ConcurrencyCore, u64, usize) {
        let mut core = ConcurrencyCore::new(config(40));
        let now_us = replies(&mut core, 0, 50_000, 25, 1_000);
        let steady = core.max_waiting(WAIT, now_us);
        (core, now_us, steady)
    }

    #[test]
    fn a_shard_that_slows_without_a_gap_is_judged_by_its_new_pace_at_once() {
        let (mut core, mut now_us, steady) = steady_for_50_ms();
        // A quarter of the pace, replies still coming every 100 µs: an overload, not a stall.
        now_us = replies(&mut core, now_us, 25_000, 100, 4_000);
        let line = core.max_waiting(WAIT, now_us);
        assert!(
            line <= steady / 2,
            "the excess is shed as early as the new pace says: {line} waiting against {steady} before"
        );
    }

    #[test]
    fn a_shard_that_stops_answering_is_not_remembered_for_long() {
        let (mut core, mut now_us, steady) = steady_for_50_ms();
        // Every call from now on overruns: no reply, only cuts.
        let silent_until_us = now_us + 200_000;
        while now_us < silent_until_us {
            now_us += 1_000;
            core.on_overrun(now_us);
        }
        let line = core.max_waiting(WAIT, now_us);
        assert!(
            line <= steady / 8,
            "{line} waiting for a shard that answers nothing"
        );
    }

    /// A bound of one place, for tasks that outlive the test's borrow.
    fn one_place() -> &'static InFlightBound {
        Box::leak(Box::new(InFlightBound::new(ConcurrencyConfig {
            latency_target: Duration::from_millis(10),
            min_limit: 1,
            max_limit: 1,
        })))
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_that_expires_as_its_place_frees_gets_the_place() {
        let bound = one_place();
        let wait = Duration::from_millis(4);
        let held = bound.acquire(Duration::ZERO).await.expect("free");
        // The held call's task ends at the very instant the wait expires (as after a stall, when
        // both were due while the thread was held up); the waiter's timer was set first, so the
        // waiter runs first.
        let waiter = tokio::spawn(async move { bound.acquire(wait).await.map(|_slot| ()) });
        while bound.load().waiting < 1 {
            tokio::task::yield_now().await;
        }
        let holder = tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            drop(held);
        });
        holder.await.expect("ends");
        assert_eq!(
            waiter.await.expect("ends"),
            Ok(()),
            "the freed place is taken"
        );
        let started = crate::clock::monotonic_now();
        let _held = bound.acquire(Duration::ZERO).await.expect("free again");
        assert_eq!(
            bound.acquire(wait).await.err(),
            Some(NoSlot::WaitedOut { held_up: false }),
            "a place that stays taken is still waited out"
        );
        assert_eq!(started.elapsed(), wait, "after the wait, not later");
    }

    /// A wait whose timer fires well past its end says this thread was held up; one that ends on
    /// time does not.
    #[tokio::test(start_paused = true)]
    async fn a_wait_that_ran_out_late_says_the_thread_was_held_up() {
        let bound = one_place();
        let wait = Duration::from_millis(4);
        let _held = bound.acquire(Duration::ZERO).await.expect("free");
        let waiter = tokio::spawn(async move { bound.acquire(wait).await.err() });
        while bound.load().waiting < 1 {
            tokio::task::yield_now().await;
        }
        // The runtime stands still for 10 ms (as a held-up thread does), past the 4 ms wait.
        tokio::time::advance(Duration::from_millis(10)).await;
        assert_eq!(
            waiter.await.expect("ends"),
            Some(NoSlot::WaitedOut { held_up: true })
        );
        assert_eq!(
            bound.acquire(wait).await.err(),
            Some(NoSlot::WaitedOut { held_up: false }),
            "on time"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_waiting_line_sheds_at_once_and_a_waiter_gets_the_next_free_slot() {
        let bound = std::sync::Arc::new(InFlightBound::new(ConcurrencyConfig {
            latency_target: Duration::from_millis(10),
            min_limit: 1,
            max_limit: 1,
        }));
        let held = bound.acquire(Duration::ZERO).await.expect("free");
        // One call ending every 4 ms: in a 4 ms wait one ends, and two decisions may wait.
        held.replied(Duration::from_millis(4));
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let bound = bound.clone();
                tokio::spawn(async move {
                    let slot = bound.acquire(Duration::from_millis(4)).await;
                    // Hold it past the other's wait.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    slot.map(|slot| slot.limit_reached)
                })
            })
            .collect();
        while bound.load().waiting < 2 {
            tokio::task::yield_now().await;
        }
        let started = crate::clock::monotonic_now();
        assert_eq!(
            bound.acquire(Duration::from_millis(4)).await.err(),
            Some(NoSlot::Shed)
        );
        assert_eq!(started.elapsed(), Duration::ZERO, "shed without waiting");
        drop(held);
        let mut outcomes = Vec::new();
        for waiter in waiters {
            outcomes.push(waiter.await.expect("ends"));
        }
        assert!(outcomes.contains(&Ok(true)), "{outcomes:?}");
        assert!(
            outcomes.contains(&Err(NoSlot::WaitedOut { held_up: false })),
            "{outcomes:?}"
        );
        assert_eq!(bound.load().waiting, 0, "the line is empty again");
    }
}
