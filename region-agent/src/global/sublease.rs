//! Sub-leases: a share of what the agent holds, handed to one gateway to spend on its own.
//!
//! Envoy's rate limit quota service (RLQS) lets a gateway enforce a *quota assignment* locally: a
//! token bucket for a time to live. The agent carves each assignment out of tokens it holds (leases,
//! or the fallback allowance), so what every gateway may admit is bounded by what the agent holds.
//! This module is the arithmetic: how many requests an assignment should hold, how that is written
//! as a token bucket that can admit no more, and how scarce tokens are divided by demand. Pure.
//!
//! # The bound
//! A gateway's token bucket starts full with `max_tokens` and refills continuously at
//! `tokens_per_fill / fill_interval`, so within a time to live of `ttl_ms` it admits at most
//! `max_tokens + floor(ttl_ms * tokens_per_fill / fill_interval_ms)`
//! ([`BucketStrategy::admissible_requests`]). [`BucketStrategy::spreading`] writes a carve of `n`
//! requests so that this is at most `n`; an assignment replaced before its end holds at most a
//! fresh bucket's `max_tokens` (Envoy keeps the old bucket, never fuller, when only the time to
//! live changed), so every assignment is a carve of its own, and the sum of the carves of live
//! assignments is at most what the agent holds plus the fallback allowance left in the window.
//!
//! # Whole seconds
//! Envoy's filter reads an assignment's `assignment_time_to_live` and its bucket's `fill_interval`
//! in whole seconds: the nanos are dropped, a time to live of 0 expires at once, and a fill
//! interval under a second divides by zero (no limit at all). It keeps the bucket it has when
//! `max_tokens` and `tokens_per_fill` are unchanged, whatever the fill interval's seconds say. So
//! every assignment here is written in whole seconds ([`MIN_ASSIGNMENT_TTL_MS`] at least) and
//! refilled every [`FILL_INTERVAL_MS`] exactly; a carve too small to be spread over its time to
//! live at one request a second gets a shorter one instead, and one of fewer than
//! [`MIN_ASSIGNMENT_REQUESTS`] is not assigned at all.

/// How long an assignment lasts at most, ms.
pub const ASSIGNMENT_TTL_MS: u64 = 5_000;
/// Shorter assignments are not made (the leases behind them end too soon): the bucket waits for
/// the next lease, ms. One second: Envoy reads a time to live in whole seconds.
pub const MIN_ASSIGNMENT_TTL_MS: u64 = 1_000;
/// The fewest requests an assignment holds: a bucket of one refilled by one a second admits two
/// within the shortest time to live, and Envoy can be told no slower refill (module docs).
pub const MIN_ASSIGNMENT_REQUESTS: u64 = 2;
/// An assignment found too small for its gateway's demand is renewed once it has lasted this long,
/// ms (a first assignment is sized on a single request: Envoy reports a new bucket at once).
pub const UNDERSIZED_RENEW_AFTER_MS: u64 = 500;
/// An assignment is renewed once this share of its time to live has passed, percent.
pub const RENEW_AT_PERCENT: u64 = 60;
/// An assignment is renewed once its gateway reported this share of it used, percent.
pub const RENEW_AT_USED_PERCENT: u64 = 75;
/// An assignment reaches its gateway within this long, ms: it ends this long before the leases
/// behind it, and a replaced one is cut to what its gateway could admit until this long after.
pub const DELIVERY_MARGIN_MS: u64 = 200;
/// An ended carve waits this long at least (at most [`MAX_SETTLE_GRACE_MS`]), and two reporting
/// intervals, for a report of its gateway's that covers its end; without one it withholds what it
/// still holds, ms.
pub const MIN_SETTLE_GRACE_MS: u64 = 1_000;
/// See [`MIN_SETTLE_GRACE_MS`].
pub const MAX_SETTLE_GRACE_MS: u64 = 60_000;
/// Refill interval of every assignment, ms: one second, the shortest Envoy reads as more than 0.
pub const FILL_INTERVAL_MS: u64 = 1_000;
/// Demand is kept in thousandths of a request per second.
pub const RATE_SCALE: u64 = 1_000;
/// A bucket's first report is read over at least this long, ms ([`Demand::record`]).
pub const FIRST_REPORT_MIN_MS: u64 = 1_000;
/// An assignment holds this many times its gateway's measured demand over its life, so a gateway
/// whose load grows between reports is not starved before its next assignment.
pub const HEADROOM_PERCENT: u64 = 150;

/// A token bucket a gateway enforces for one bucket of requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketStrategy {
    /// Capacity, and what the bucket starts with.
    pub max_tokens: u32,
    /// Tokens added per fill.
    pub tokens_per_fill: u32,
    /// How often it is filled, ms.
    pub fill_interval_ms: u64,
}

impl BucketStrategy {
    /// The most requests a gateway enforcing this strategy admits within `ttl_ms` of applying it:
    /// the bucket starts full and refills continuously.
    pub fn admissible_requests(&self, ttl_ms: u64) -> u64 {
        let refilled = u128::from(ttl_ms) * u128::from(self.tokens_per_fill)
            / u128::from(self.fill_interval_ms.max(1));
        u64::from(self.max_tokens).saturating_add(u64::try_from(refilled).unwrap_or(u64::MAX))
    }

    /// A strategy that admits at most `requests` within a time to live of at most `ttl_ms`, spread
    /// over it, in whole seconds (module docs): a burst of one fill and a fill every second. A carve
    /// of fewer requests than the seconds it would last plus one gets a shorter time to live
    /// (`requests - 1` seconds, a request a second). `None` under [`MIN_ASSIGNMENT_REQUESTS`] or
    /// under a second.
    pub fn spreading(requests: u64, ttl_ms: u64) -> Option<Spread> {
        let requests = requests.min(u64::from(u32::MAX));
        let whole_seconds = ttl_ms / FILL_INTERVAL_MS;
        if requests < MIN_ASSIGNMENT_REQUESTS || whole_seconds == 0 {
            return None;
        }
        // Fills within the time to live; the continuous refill adds at most `per_fill * fills`,
        // and `per_fill * (fills + 1) <= requests` leaves a burst of at least one fill.
        let fills = whole_seconds.min(requests - 1);
        let per_fill = requests / (fills + 1);
        let burst = requests - per_fill * fills;
        let spread = Spread {
            strategy: Self {
                max_tokens: u32::try_from(burst).unwrap_or(u32::MAX),
                tokens_per_fill: u32::try_from(per_fill).unwrap_or(u32::MAX),
                fill_interval_ms: FILL_INTERVAL_MS,
            },
            ttl_ms: fills * FILL_INTERVAL_MS,
        };
        debug_assert!(spread.strategy.admissible_requests(spread.ttl_ms) <= requests);
        debug_assert!(spread.strategy.max_tokens >= 1 && spread.strategy.tokens_per_fill >= 1);
        debug_assert!(spread.ttl_ms >= MIN_ASSIGNMENT_TTL_MS && spread.ttl_ms <= ttl_ms);
        Some(spread)
    }
}

/// An assignment as written: its strategy and its time to live, whole seconds both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spread {
    /// The token bucket.
    pub strategy: BucketStrategy,
    /// The time to live, ms: a whole number of seconds.
    pub ttl_ms: u64,
}

/// A gateway enforcing one assignment the way Envoy's filter does: the bucket starts full, refills
/// continuously, and admits nothing once the time to live has run out. The bound above assumes this
/// of gateways; tests and drills enforce assignments with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnforcedBucket {
    strategy: BucketStrategy,
    ends_at_ms: u64,
    /// Thousandths of a token, so slow refills accumulate exactly.
    milli_tokens: u64,
    refilled_at_ms: u64,
}

impl EnforcedBucket {
    /// `strategy` applied at `now_ms` for `ttl_ms`.
    pub fn new(strategy: BucketStrategy, ttl_ms: u64, now_ms: u64) -> Self {
        Self {
            strategy,
            ends_at_ms: now_ms.saturating_add(ttl_ms),
            milli_tokens: u64::from(strategy.max_tokens) * 1_000,
            refilled_at_ms: now_ms,
        }
    }

    /// The same bucket, its tokens as they are, given a new time to live from `now_ms` (Envoy
    /// keeps a bucket an assignment does not change).
    #[must_use]
    pub fn renewed(mut self, ttl_ms: u64, now_ms: u64) -> Self {
        self.ends_at_ms = now_ms.saturating_add(ttl_ms);
        self
    }

    /// Whether its time to live has run out at `now_ms`.
    pub fn expired(&self, now_ms: u64) -> bool {
        now_ms >= self.ends_at_ms
    }

    /// Whether one request at `now_ms` is admitted (and takes a token).
    pub fn try_admit(&mut self, now_ms: u64) -> bool {
        if now_ms >= self.ends_at_ms {
            return false;
        }
        let elapsed_ms = now_ms.saturating_sub(self.refilled_at_ms);
        let refill = u128::from(elapsed_ms) * u128::from(self.strategy.tokens_per_fill) * 1_000
            / u128::from(self.strategy.fill_interval_ms.max(1));
        let capacity = u64::from(self.strategy.max_tokens) * 1_000;
        self.milli_tokens = self
            .milli_tokens
            .saturating_add(u64::try_from(refill).unwrap_or(u64::MAX))
            .min(capacity);
        // Refill only whole thousandths: the rest of the interval carries to the next call.
        if refill > 0 {
            self.refilled_at_ms = now_ms;
        }
        if self.milli_tokens >= 1_000 {
            self.milli_tokens -= 1_000;
            true
        } else {
            false
        }
    }
}

/// The time to live of an assignment of `requests` for a gateway measured at `rate_milli_per_s`,
/// whose carve must be spent within `usable_ms`: about as long as the carve lasts at that rate,
/// within [`MIN_ASSIGNMENT_TTL_MS`] and [`ASSIGNMENT_TTL_MS`], ending [`DELIVERY_MARGIN_MS`]
/// before the carve must be spent, in whole seconds. A carve smaller than the demand (a small chunk, scarce quota)
/// is thus spread over a shorter time and renewed sooner, rather than trickled over the longest
/// one. `None` when that leaves less than the minimum (wait for the next lease).
pub fn assignment_ttl_ms(requests: u64, rate_milli_per_s: u64, usable_ms: u64) -> Option<u64> {
    let lasts_ms = if rate_milli_per_s == 0 {
        ASSIGNMENT_TTL_MS
    } else {
        let ms =
            u128::from(requests) * u128::from(RATE_SCALE) * 1_000 / u128::from(rate_milli_per_s);
        u64::try_from(ms)
            .unwrap_or(u64::MAX)
            .clamp(MIN_ASSIGNMENT_TTL_MS, ASSIGNMENT_TTL_MS)
    };
    let ttl_ms = lasts_ms.min(usable_ms.saturating_sub(DELIVERY_MARGIN_MS));
    // Whole seconds, rounded down: Envoy drops the rest.
    let ttl_ms = ttl_ms - ttl_ms % 1_000;
    (ttl_ms >= MIN_ASSIGNMENT_TTL_MS).then_some(ttl_ms)
}

/// Whether an assignment of `requests` sent at `sent_at_ms` for `ttl_ms`, of which its gateway
/// reported `used_requests`, is due for renewal at `now_ms` when its gateway's demand now wants
/// `wanted_requests`: [`RENEW_AT_PERCENT`] of its life has passed, [`RENEW_AT_USED_PERCENT`] of it
/// is used, or it holds less than half of what is wanted now (demand grew: a first assignment is
/// sized on a single request) and has lasted [`UNDERSIZED_RENEW_AFTER_MS`].
pub fn renewal_due(
    sent_at_ms: u64,
    ttl_ms: u64,
    used_requests: u64,
    requests: u64,
    wanted_requests: u64,
    now_ms: u64,
) -> bool {
    let aged = now_ms >= sent_at_ms + ttl_ms * RENEW_AT_PERCENT / 100;
    let used_up = requests > 0 && used_requests * 100 >= requests * RENEW_AT_USED_PERCENT;
    let undersized =
        wanted_requests >= 2 * requests.max(1) && now_ms >= sent_at_ms + UNDERSIZED_RENEW_AFTER_MS;
    aged || used_up || undersized
}

/// What a gateway could have admitted under `strategy`, sent at `sent_at_ms`, when a replacement
/// is sent at `now_ms` (it arrives within [`DELIVERY_MARGIN_MS`]).
pub fn admissible_until_replaced(strategy: BucketStrategy, sent_at_ms: u64, now_ms: u64) -> u64 {
    strategy.admissible_requests((now_ms + DELIVERY_MARGIN_MS).saturating_sub(sent_at_ms))
}

/// How long an ended carve waits for its gateway's last report, given the gateway's reporting
/// interval: two intervals and the delivery margin, within [`MIN_SETTLE_GRACE_MS`] and
/// [`MAX_SETTLE_GRACE_MS`].
pub fn settle_grace_ms(report_interval_ms: u64) -> u64 {
    (2 * report_interval_ms + DELIVERY_MARGIN_MS).clamp(MIN_SETTLE_GRACE_MS, MAX_SETTLE_GRACE_MS)
}

/// Where a carve's tokens come from, as far as settling it is concerned: the fallback allowance or
/// leases, of which window. Usage reports are drawn from a bucket's carves oldest first, which may
/// charge an older carve with what a newer one's gateway admitted; within one kind that only moves
/// tokens between leases of one window, but across kinds it would move them across windows or
/// between leases and the allowance. So a carve of another kind is handed only once the older ones
/// are settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CarveKind {
    /// From the fallback allowance.
    pub fallback: bool,
    /// The window its leases (or allowance) belong to, epoch ms.
    pub window_start_ms: u64,
}

/// The kind of `reservation` on `holder`.
pub fn carve_kind(holder: &super::PoolHolder, reservation: &super::Reservation) -> CarveKind {
    match reservation.fallback_window_start_ms() {
        Some(window_start_ms) => CarveKind {
            fallback: true,
            window_start_ms,
        },
        None => CarveKind {
            fallback: false,
            window_start_ms: reservation
                .lease_parts()
                .first()
                .and_then(|(lease, _)| holder.lease_window_start_ms(*lease))
                .unwrap_or(0),
        },
    }
}

/// How an ended carve is settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    /// Its gateway reported past its end: everything admitted under it has been counted, and
    /// what it still holds was provably not used: give it back.
    GiveBack,
    /// No report covered its end within the grace (a stream broke, a gateway went quiet): its
    /// gateway may have admitted some of what it holds unreported: withhold it (stranded).
    Withhold,
}

/// How a carve whose assignment ended at `ends_at_ms` is settled at `now_ms`, when its gateway's
/// last report arrived at `last_report_at_ms` and it reports every `report_interval_ms`: `None`
/// while it may still be reported. A report arriving [`DELIVERY_MARGIN_MS`] after the end was sent
/// after it, and reports on one stream are in order and each covers everything since the one
/// before, so what reports drew from the bucket's carves, oldest first, is exactly what was
/// admitted: the carves' remainders together are what was not.
pub fn settlement(
    ends_at_ms: u64,
    last_report_at_ms: u64,
    now_ms: u64,
    report_interval_ms: u64,
) -> Option<Settlement> {
    if last_report_at_ms >= ends_at_ms.saturating_add(DELIVERY_MARGIN_MS) {
        Some(Settlement::GiveBack)
    } else if now_ms >= ends_at_ms.saturating_add(settle_grace_ms(report_interval_ms)) {
        Some(Settlement::Withhold)
    } else {
        None
    }
}

/// Shortest `DENY_ALL`, ms.
pub const MIN_DENY_TTL_MS: u64 = 1_000;
/// Longest `DENY_ALL`, ms: a denied bucket is looked at again this often, so it gets quota soon
/// after the agent has some again (a heal, a new window, a new lease).
pub const MAX_DENY_TTL_MS: u64 = 5_000;

/// How long a bucket nothing can be carved for is denied, given the refusal's retry hint: whole
/// seconds (rounded up), as Envoy reads them.
pub fn deny_ttl_ms(retry_after_ms: u64) -> u64 {
    retry_after_ms
        .div_ceil(1_000)
        .saturating_mul(1_000)
        .clamp(MIN_DENY_TTL_MS, MAX_DENY_TTL_MS)
}

/// Requests an assignment of `ttl_ms` should hold for a gateway measured at `rate_milli_per_s`
/// (thousandths of a request per second): its demand over the time to live with
/// [`HEADROOM_PERCENT`], at least [`MIN_ASSIGNMENT_REQUESTS`].
pub fn wanted_requests(rate_milli_per_s: u64, ttl_ms: u64) -> u64 {
    let over_ttl = u128::from(rate_milli_per_s) * u128::from(ttl_ms) * u128::from(HEADROOM_PERCENT)
        / (u128::from(RATE_SCALE) * 1_000 * 100);
    u64::try_from(over_ttl)
        .unwrap_or(u64::MAX)
        .max(MIN_ASSIGNMENT_REQUESTS)
}

/// What one gateway gets of `available` when every gateway of the pool wants `total_wanted` and
/// this one `wanted`: all it wants when there is enough for everyone, else its share in proportion
/// to what it wants (rounded down), at least `floor` (the smallest assignment, while that much is
/// available and wanted: a share below it could not be told to Envoy at all).
pub fn share(available: u64, wanted: u64, total_wanted: u64, floor: u64) -> u64 {
    if available == 0 || wanted == 0 {
        return 0;
    }
    let total_wanted = total_wanted.max(wanted);
    if total_wanted <= available {
        return wanted;
    }
    let proportional = u128::from(available) * u128::from(wanted) / u128::from(total_wanted);
    let most = wanted.min(available);
    u64::try_from(proportional)
        .unwrap_or(u64::MAX)
        .clamp(floor.clamp(1, most), most)
}

/// Demand of one gateway for one bucket, measured from its reports: an exponentially weighted
/// average of `(allowed + denied) / elapsed`, in thousandths of a request per second.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Demand {
    rate_milli_per_s: u64,
    measured: bool,
}

impl Demand {
    /// Folds in a report of `requests` over `elapsed_ms`: the first report sets the rate, later
    /// ones move it halfway. A bucket's first report comes on its first request (Envoy reports a
    /// new bucket at once), so it is read over at least [`FIRST_REPORT_MIN_MS`]: one request in a
    /// millisecond is not a thousand a second.
    pub fn record(&mut self, requests: u64, elapsed_ms: u64) {
        let elapsed_ms = if self.measured {
            elapsed_ms.max(1)
        } else {
            elapsed_ms.max(FIRST_REPORT_MIN_MS)
        };
        let observed =
            u128::from(requests) * u128::from(RATE_SCALE) * 1_000 / u128::from(elapsed_ms);
        let observed = u64::try_from(observed).unwrap_or(u64::MAX);
        self.rate_milli_per_s = if self.measured {
            self.rate_milli_per_s / 2 + observed / 2
        } else {
            observed
        };
        self.measured = true;
    }

    /// The rate, thousandths of a request per second.
    pub fn rate_milli_per_s(&self) -> u64 {
        self.rate_milli_per_s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spread_carve_admits_no_more_than_it_holds_in_whole_seconds_and_nearly_all_of_it() {
        for (requests, ttl_ms) in [
            (2, 5_000),
            (3, 5_000),
            (5, 5_000),
            (6, 5_000),
            (7, 5_000),
            (100, 5_000),
            (1_000_000, 5_000),
            (10, 1_999),
            (10, 60_000),
            (57, 5_500),
            (1_000, 5_999),
        ] {
            let Spread {
                strategy,
                ttl_ms: given_ms,
            } = BucketStrategy::spreading(requests, ttl_ms).expect("some");
            assert_eq!(given_ms % 1_000, 0, "whole seconds: {given_ms}");
            assert!((MIN_ASSIGNMENT_TTL_MS..=ttl_ms).contains(&given_ms));
            assert_eq!(strategy.fill_interval_ms, FILL_INTERVAL_MS);
            let admissible = strategy.admissible_requests(given_ms);
            assert!(
                admissible <= requests,
                "{requests} over {ttl_ms}: {strategy:?} for {given_ms}"
            );
            assert!(
                admissible * 2 >= requests,
                "{requests} over {ttl_ms} admits only {admissible}: {strategy:?}"
            );
        }
        let small = BucketStrategy::spreading(3, 5_000).expect("some");
        assert_eq!(
            (
                small.strategy.max_tokens,
                small.strategy.tokens_per_fill,
                small.ttl_ms
            ),
            (1, 1, 2_000),
            "three requests: one, then one a second for two seconds"
        );
        assert_eq!(BucketStrategy::spreading(0, 5_000), None);
        assert_eq!(
            BucketStrategy::spreading(1, 5_000),
            None,
            "Envoy cannot be told one"
        );
        assert_eq!(
            BucketStrategy::spreading(10, 999),
            None,
            "under a second is 0 to Envoy"
        );
    }

    #[test]
    fn times_to_live_are_whole_seconds() {
        assert_eq!(assignment_ttl_ms(1_000, 0, 60_000), Some(ASSIGNMENT_TTL_MS));
        assert_eq!(
            assignment_ttl_ms(1_000, 0, 3_150),
            Some(2_000),
            "2.95 s is 2 s"
        );
        assert_eq!(assignment_ttl_ms(1_000, 0, 1_150), None, "0.95 s is 0 s");
        assert_eq!(
            assignment_ttl_ms(3, 2_000, 60_000),
            Some(1_000),
            "1.5 s of demand is 1 s"
        );
        assert_eq!(deny_ttl_ms(0), 1_000);
        assert_eq!(
            deny_ttl_ms(1_200),
            2_000,
            "rounded up: a denial may last longer"
        );
        assert_eq!(deny_ttl_ms(60_000), MAX_DENY_TTL_MS);
    }

    #[test]
    fn an_enforced_bucket_admits_what_its_strategy_allows_and_nothing_after() {
        let Spread { strategy, ttl_ms } = BucketStrategy::spreading(30, 5_000).expect("some");
        let mut bucket = EnforcedBucket::new(strategy, ttl_ms, 1_000);
        let admitted = (1_000..7_000)
            .step_by(10)
            .filter(|&now_ms| bucket.try_admit(now_ms))
            .count() as u64;
        let admissible = strategy.admissible_requests(ttl_ms);
        assert!(admitted <= admissible, "{admitted} > {admissible}");
        assert!(
            admitted + u64::from(strategy.tokens_per_fill) >= admissible,
            "{admitted} of {admissible}: the last fill lands as the assignment ends"
        );
        assert!(!bucket.try_admit(6_000), "nothing after its time to live");
    }

    #[test]
    fn scarce_tokens_go_by_demand() {
        assert_eq!(share(100, 30, 60, 2), 30, "enough for all");
        assert_eq!(share(60, 90, 120, 2), 45);
        assert_eq!(share(60, 30, 120, 2), 15);
        assert_eq!(
            share(10, 10, 1_000, 2),
            2,
            "the smallest assignment while it is held"
        );
        assert_eq!(
            share(1, 10, 1_000, 2),
            1,
            "at least one while anything is held"
        );
        assert_eq!(share(0, 10, 10, 2), 0);
    }

    #[test]
    fn demand_follows_reports() {
        let mut first = Demand::default();
        first.record(1, 2);
        assert_eq!(
            first.rate_milli_per_s(),
            1_000,
            "a first request is not a flood"
        );
        let mut demand = Demand::default();
        demand.record(50, 1_000);
        assert_eq!(demand.rate_milli_per_s(), 50_000);
        demand.record(0, 1_000);
        assert_eq!(demand.rate_milli_per_s(), 25_000);
        assert_eq!(wanted_requests(50_000, 5_000), 375, "50/s over 5 s, 1.5x");
        assert_eq!(wanted_requests(0, 5_000), MIN_ASSIGNMENT_REQUESTS);
    }
}
