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
//! requests so that this is at most `n`; an assignment replaced before its end starts a fresh bucket,
//! so every assignment is a carve of its own, and the sum of the carves of live assignments is at
//! most what the agent holds plus the fallback allowance left in the window.

/// How long an assignment lasts at most, ms.
pub const ASSIGNMENT_TTL_MS: u64 = 5_000;
/// Shorter assignments are not made (the leases behind them end too soon): the bucket waits for
/// the next lease, ms.
pub const MIN_ASSIGNMENT_TTL_MS: u64 = 500;
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
/// Refill interval of assignments that hold at least one request per second of their life, ms.
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

    /// A strategy that admits at most `requests` within `ttl_ms`, spread over it: refilled about
    /// every second when there is at least a request per second of life, with a burst of one
    /// fill; otherwise one request at a time at even intervals. `None` for no request at all.
    pub fn spreading(requests: u64, ttl_ms: u64) -> Option<Self> {
        let requests = requests.min(u64::from(u32::MAX));
        if requests == 0 {
            return None;
        }
        // Whole fills the time to live spans, rounded up: the continuous refill within it adds at
        // most `per_fill * fills`.
        let fills = ttl_ms.div_ceil(FILL_INTERVAL_MS);
        let strategy = if requests > fills {
            // A burst of at least one fill, and a fill per interval: per_fill * (fills + 1) <=
            // requests.
            let per_fill = requests / (fills + 1);
            let burst = requests - per_fill * fills;
            Self {
                max_tokens: u32::try_from(burst).unwrap_or(u32::MAX),
                tokens_per_fill: u32::try_from(per_fill).unwrap_or(u32::MAX),
                fill_interval_ms: FILL_INTERVAL_MS,
            }
        } else {
            // Fewer requests than seconds: one at the start, one more every `interval`, with
            // `floor(ttl / interval) <= requests - 1`.
            let interval_ms = ttl_ms / requests + 1;
            Self {
                max_tokens: 1,
                tokens_per_fill: 1,
                fill_interval_ms: interval_ms,
            }
        };
        debug_assert!(strategy.admissible_requests(ttl_ms) <= requests);
        debug_assert!(strategy.max_tokens >= 1 && strategy.tokens_per_fill >= 1);
        Some(strategy)
    }
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
/// before the carve must be spent. A carve smaller than the demand (a small chunk, scarce quota)
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
    (ttl_ms >= MIN_ASSIGNMENT_TTL_MS).then_some(ttl_ms)
}

/// Whether an assignment of `requests` sent at `sent_at_ms` for `ttl_ms`, of which its gateway
/// reported `used_requests`, is due for renewal at `now_ms` when its gateway's demand now wants
/// `wanted_requests`: [`RENEW_AT_PERCENT`] of its life has passed, [`RENEW_AT_USED_PERCENT`] of it
/// is used, or it holds less than half of what is wanted now (demand grew: a first assignment is
/// sized on a single request) and has lasted [`MIN_ASSIGNMENT_TTL_MS`].
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
        wanted_requests >= 2 * requests.max(1) && now_ms >= sent_at_ms + MIN_ASSIGNMENT_TTL_MS;
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

/// How long a bucket nothing can be carved for is denied, given the refusal's retry hint.
pub fn deny_ttl_ms(retry_after_ms: u64) -> u64 {
    retry_after_ms.clamp(MIN_DENY_TTL_MS, MAX_DENY_TTL_MS)
}

/// Requests an assignment of `ttl_ms` should hold for a gateway measured at `rate_milli_per_s`
/// (thousandths of a request per second): its demand over the time to live with
/// [`HEADROOM_PERCENT`], at least one.
pub fn wanted_requests(rate_milli_per_s: u64, ttl_ms: u64) -> u64 {
    let over_ttl = u128::from(rate_milli_per_s) * u128::from(ttl_ms) * u128::from(HEADROOM_PERCENT)
        / (u128::from(RATE_SCALE) * 1_000 * 100);
    u64::try_from(over_ttl).unwrap_or(u64::MAX).max(1)
}

/// What one gateway gets of `available` when every gateway of the pool wants `total_wanted` and
/// this one `wanted`: all it wants when there is enough for everyone, else its share in proportion
/// to what it wants (rounded down, at least one while anything is available).
pub fn share(available: u64, wanted: u64, total_wanted: u64) -> u64 {
    if available == 0 || wanted == 0 {
        return 0;
    }
    let total_wanted = total_wanted.max(wanted);
    if total_wanted <= available {
        return wanted;
    }
    let proportional = u128::from(available) * u128::from(wanted) / u128::from(total_wanted);
    u64::try_from(proportional)
        .unwrap_or(u64::MAX)
        .clamp(1, wanted.min(available))
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
    fn a_spread_carve_admits_no_more_than_it_holds_and_nearly_all_of_it() {
        for (requests, ttl_ms) in [
            (1, 5_000),
            (2, 5_000),
            (5, 5_000),
            (6, 5_000),
            (7, 5_000),
            (100, 5_000),
            (1_000_000, 5_000),
            (3, 1),
            (10, 999),
            (10, 60_000),
            (57, 5_500),
            (1_000, 5_999),
        ] {
            let strategy = BucketStrategy::spreading(requests, ttl_ms).expect("some");
            let admissible = strategy.admissible_requests(ttl_ms);
            assert!(
                admissible <= requests,
                "{requests} over {ttl_ms}: {strategy:?}"
            );
            assert!(
                admissible * 2 >= requests,
                "{requests} over {ttl_ms} admits only {admissible}: {strategy:?}"
            );
        }
        assert_eq!(BucketStrategy::spreading(0, 5_000), None);
    }

    #[test]
    fn an_enforced_bucket_admits_what_its_strategy_allows_and_nothing_after() {
        let strategy = BucketStrategy::spreading(30, 5_000).expect("some");
        let mut bucket = EnforcedBucket::new(strategy, 5_000, 1_000);
        let admitted = (1_000..7_000)
            .step_by(10)
            .filter(|&now_ms| bucket.try_admit(now_ms))
            .count() as u64;
        let admissible = strategy.admissible_requests(5_000);
        assert!(admitted <= admissible, "{admitted} > {admissible}");
        assert!(
            admitted + u64::from(strategy.tokens_per_fill) >= admissible,
            "{admitted} of {admissible}: the last fill lands as the assignment ends"
        );
        assert!(!bucket.try_admit(6_000), "nothing after its time to live");
    }

    #[test]
    fn scarce_tokens_go_by_demand() {
        assert_eq!(share(100, 30, 60), 30, "enough for all");
        assert_eq!(share(60, 90, 120), 45);
        assert_eq!(share(60, 30, 120), 15);
        assert_eq!(share(1, 1, 1_000), 1, "at least one while anything is held");
        assert_eq!(share(0, 10, 10), 0);
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
        assert_eq!(wanted_requests(0, 5_000), 1);
    }
}
