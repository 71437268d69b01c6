//! A pool's demand: how fast its tokens are asked for, as two integer averages over one-second
//! buckets (one that says how soon what is held runs out, one that sizes leases), and when it was
//! last asked for.

/// Demand is measured in buckets of this many ms.
pub(super) const RATE_BUCKET_MS: u64 = 1_000;
/// The spend rate is kept in 1/1024 tokens per second, for precision in integers: a pool spending a
/// token every few seconds must not be sized as if it spent one every second (with a long lease
/// TTL that over-asks by the TTL in seconds, and strands it).
pub(super) const RATE_SCALE: u64 = 1_024;

/// Demand, as two integer EWMAs over one-second buckets: a fast one (alpha 1/4) that says how soon
/// what is held runs out, and a slow one that sizes leases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct SpendRate {
    bucket_start_ms: u64,
    bucket_tokens: u64,
    /// Tokens per second x [`RATE_SCALE`] (alpha 1/4: follows demand within seconds).
    scaled_per_s: u64,
    /// The same, averaged over about one lease TTL, at most a minute (alpha 1/`slow_buckets`):
    /// steady enough to size a lease even when tokens are seconds apart. (Longer spans strand less
    /// but follow a demand rise so slowly that leases come out small and renewals double: measured
    /// with the 24-hour drill, docs/drills.md.)
    slow_scaled_per_s: u64,
    /// Buckets the slow average spans: the lease TTL in seconds, 4 to 64.
    pub(super) slow_buckets: u64,
}

/// Buckets the slow demand average spans for a lease TTL: the TTL in seconds, 4 to 64.
pub(super) fn slow_buckets(lease_ttl_ms: u64) -> u64 {
    (lease_ttl_ms / RATE_BUCKET_MS).clamp(4, 64)
}

/// Most buckets one roll decays (a quiet spell longer than this leaves both averages near zero).
const MAX_ROLLED_BUCKETS: u32 = 1_024;

impl SpendRate {
    pub(super) fn new(lease_ttl_ms: u64) -> Self {
        Self {
            bucket_start_ms: 0,
            bucket_tokens: 0,
            scaled_per_s: 0,
            slow_scaled_per_s: 0,
            slow_buckets: slow_buckets(lease_ttl_ms),
        }
    }

    pub(super) fn roll(&mut self, now_ms: u64) {
        if now_ms < self.bucket_start_ms + RATE_BUCKET_MS {
            return;
        }
        let n = self.slow_buckets;
        for _ in 0..MAX_ROLLED_BUCKETS {
            if now_ms < self.bucket_start_ms + RATE_BUCKET_MS {
                return;
            }
            let bucket = self.bucket_tokens.saturating_mul(RATE_SCALE);
            self.scaled_per_s = (self.scaled_per_s * 3 + bucket) / 4;
            self.slow_scaled_per_s = (self.slow_scaled_per_s.saturating_mul(n - 1) + bucket) / n;
            self.bucket_tokens = 0;
            self.bucket_start_ms += RATE_BUCKET_MS;
            if self.scaled_per_s == 0 && self.slow_scaled_per_s == 0 {
                break;
            }
        }
        self.bucket_start_ms = now_ms - now_ms % RATE_BUCKET_MS;
    }

    pub(super) fn record(&mut self, now_ms: u64, tokens: u64) {
        self.roll(now_ms);
        self.bucket_tokens = self.bucket_tokens.saturating_add(tokens);
    }

    /// Takes back demand recorded at `recorded_at_ms` that turned out not to be the pool's (a
    /// request another rule denied), if its bucket is still open.
    pub(super) fn unrecord(&mut self, recorded_at_ms: u64, tokens: u64) {
        if recorded_at_ms >= self.bucket_start_ms {
            self.bucket_tokens = self.bucket_tokens.saturating_sub(tokens);
        }
    }

    /// Tokens per second x [`RATE_SCALE`], at least 1, as if the bucket in progress closed now: how
    /// soon what is held runs out (a burst counts at once). Sets the renewal watermark.
    pub(super) fn urgency(&self) -> u64 {
        let with_bucket = (self.scaled_per_s.saturating_mul(3)
            + self.bucket_tokens.saturating_mul(RATE_SCALE))
            / 4;
        with_bucket.max(self.scaled_per_s).max(1)
    }

    /// Tokens per second x [`RATE_SCALE`], at least 1, over closed buckets only: what a lease should
    /// hold. Renewals are asked right after a spend, so counting the bucket in progress would size
    /// every lease of a sparse pool as if a token a second were spent (and strand the excess);
    /// with no closed bucket yet, the bucket in progress is all there is.
    pub(super) fn sizing(&self) -> u64 {
        if self.scaled_per_s == 0 {
            return self.urgency();
        }
        // A demand rise shows in the fast average first: follow it up at once, down slowly.
        self.slow_scaled_per_s
            .max(self.scaled_per_s.min(self.slow_scaled_per_s * 2))
            .max(1)
    }
}

/// A pool's demand: its spend rate, and the last instant anything was asked of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Demand {
    pub(super) rate: SpendRate,
    pub(super) last_ms: Option<u64>,
}

impl Demand {
    pub(super) fn new(lease_ttl_ms: u64) -> Self {
        Self {
            rate: SpendRate::new(lease_ttl_ms),
            last_ms: None,
        }
    }

    /// `tokens` asked for at `now_ms`.
    pub(super) fn record(&mut self, now_ms: u64, tokens: u64) {
        self.last_ms = Some(now_ms);
        self.rate.record(now_ms, tokens);
    }

    /// Whether nothing was asked for `idle_ms` before `now_ms`.
    pub(super) fn quiet_for(&self, now_ms: u64, idle_ms: u64) -> bool {
        self.last_ms
            .is_none_or(|last| now_ms.saturating_sub(last) >= idle_ms)
    }
}
