//! Token bucket: a sustained rate plus a bounded burst, in constant space. The primary algorithm.
//!
//! `tokens = min(capacity, stored + floor(min(delta, full_refill_ms) * refill / period))`, then admit when
//! `tokens >= cost`. The refill rate is a pair (amount, period) rather than a per-second number, so rates
//! such as 1,000,000 millitokens per 60,000 ms stay exact. Rounding is always strict: floor on refill
//! (an admitted request loses less than one millitoken of refill), ceiling on retry (hints are never
//! optimistic).

use super::{Decision, ParamError, RetryAfter, check_capacity_times_period, check_param, div_ceil};

/// Validated token-bucket parameters. All amounts in millitokens, all times in ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenBucket {
    capacity_millitokens: u64,
    refill_millitokens: u64,
    period_ms: u64,
    slack_ms: u64,
}

/// Stored token-bucket state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenBucketState {
    /// Tokens in the bucket at `updated_at_ms`, in millitokens.
    pub tokens_millitokens: u64,
    /// When the tokens were last computed, epoch ms. Never moves backwards.
    pub updated_at_ms: u64,
}

impl TokenBucket {
    /// Validates the parameters: capacity, refill and period in `[1, 2^40]`, slack in `[0, 2^40]` and
    /// `capacity * period <= 2^52`.
    pub fn new(
        capacity_millitokens: u64,
        refill_millitokens: u64,
        period_ms: u64,
        slack_ms: u64,
    ) -> Result<Self, ParamError> {
        check_param("capacityMillis", capacity_millitokens, 1)?;
        check_param("refillMillis", refill_millitokens, 1)?;
        check_param("periodMs", period_ms, 1)?;
        check_param("slackMs", slack_ms, 0)?;
        check_capacity_times_period("capacityMillis", capacity_millitokens, period_ms)?;
        Ok(Self {
            capacity_millitokens,
            refill_millitokens,
            period_ms,
            slack_ms,
        })
    }

    /// Capacity in millitokens.
    pub fn capacity_millitokens(&self) -> u64 {
        self.capacity_millitokens
    }

    /// Refill amount per period, in millitokens.
    pub fn refill_millitokens(&self) -> u64 {
        self.refill_millitokens
    }

    /// Refill period, in ms.
    pub fn period_ms(&self) -> u64 {
        self.period_ms
    }

    /// TTL slack added to the full-refill time, in ms.
    pub fn slack_ms(&self) -> u64 {
        self.slack_ms
    }

    /// Time for an empty bucket to refill completely, in ms: `ceil(capacity * period / refill)`.
    pub fn full_refill_ms(&self) -> u64 {
        div_ceil(
            self.capacity_millitokens * self.period_ms,
            self.refill_millitokens,
        )
    }

    /// Key TTL after a write: the full-refill time plus slack. Once that much idle time has passed the
    /// bucket is full, and a missing key (which reads as full) is indistinguishable from it.
    pub fn ttl_ms(&self) -> u64 {
        self.full_refill_ms() + self.slack_ms
    }

    /// Tokens available at `now_ms` (after refill, clamped to capacity), in millitokens.
    pub fn available_millitokens(&self, state: Option<&TokenBucketState>, now_ms: u64) -> u64 {
        let Some(state) = state else {
            return self.capacity_millitokens;
        };
        let delta_ms = now_ms
            .saturating_sub(state.updated_at_ms)
            .min(self.full_refill_ms());
        // delta_ms * refill <= (capacity * period / refill + 1) * refill <= 2^52 + 2^40: no overflow.
        let refilled = delta_ms * self.refill_millitokens / self.period_ms;
        state
            .tokens_millitokens
            .saturating_add(refilled)
            .min(self.capacity_millitokens)
    }

    /// Decides a request of `cost_millitokens` at `now_ms`.
    ///
    /// A cost outside `[1, 2^40]` is a parameter error; a cost above capacity is denied with
    /// [`RetryAfter::Never`] and `remaining` 0 without touching state.
    pub fn decide(
        &self,
        state: Option<&TokenBucketState>,
        now_ms: u64,
        cost_millitokens: u64,
    ) -> Result<Decision<TokenBucketState>, ParamError> {
        check_param("costMillis", cost_millitokens, 1)?;
        if cost_millitokens > self.capacity_millitokens {
            return Ok(Decision::deny(0, RetryAfter::Never));
        }
        let tokens = self.available_millitokens(state, now_ms);
        debug_assert!(tokens <= self.capacity_millitokens);
        if tokens >= cost_millitokens {
            let remaining = tokens - cost_millitokens;
            let updated_at_ms = state.map_or(now_ms, |s| s.updated_at_ms.max(now_ms));
            let new_state = TokenBucketState {
                tokens_millitokens: remaining,
                updated_at_ms,
            };
            // The state refills from `updated_at`, which a clock that stepped back leaves ahead of
            // now: the key must live until that state is full, or a missing key (full) would read
            // early.
            let ttl_ms = (updated_at_ms - now_ms) + self.ttl_ms();
            return Ok(Decision::allow(remaining, new_state, ttl_ms));
        }
        let deficit = cost_millitokens - tokens;
        // deficit <= capacity, so deficit * period <= 2^52.
        let retry_ms = div_ceil(deficit * self.period_ms, self.refill_millitokens);
        Ok(Decision::deny(tokens, RetryAfter::Ms(retry_ms)))
    }
}
