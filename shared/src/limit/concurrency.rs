//! Concurrency semaphore with expiring leases: at most `max_in_flight` leases at once.
//!
//! It answers a different question from a rate rule (how many at once, not how fast), so it is a
//! different state machine: acquire a lease with an expiry, release it when the work ends, and let
//! expiry reclaim the leases of holders that crashed. Acquire is idempotent per lease id (a retry after a
//! lost reply finds its lease); release is idempotent by construction (releasing twice, or an expired
//! lease, changes nothing). A denial has no computable retry time: a slot frees when some holder
//! finishes, so the caller answers with a policy-chosen hint.

use super::{ParamError, check_param};

/// Validated semaphore parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Semaphore {
    max_in_flight: u64,
    lease_ttl_ms: u64,
}

/// One held lease.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HeldLease {
    /// The holder's lease id (in practice the decision id of the admitted request).
    pub lease_id: String,
    /// When the lease lapses unless renewed, epoch ms.
    pub expires_at_ms: u64,
}

/// Stored semaphore state: the held leases, in no particular order. At most `max_in_flight` live ones.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct SemaphoreState {
    /// Held leases; those with `expires_at_ms <= now` are dead and ignored.
    pub leases: Vec<HeldLease>,
}

/// The answer to an acquire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acquire {
    /// Whether the lease is held (newly, or already by this id).
    pub acquired: bool,
    /// Live leases after the decision.
    pub in_flight: u64,
    /// The new state and its key TTL, or `None` to write nothing.
    pub write: Option<(SemaphoreState, u64)>,
}

impl Semaphore {
    /// Validates: `max_in_flight` in `[1, 2^40]`, lease TTL in `[1, 2^40]` ms.
    pub fn new(max_in_flight: u64, lease_ttl_ms: u64) -> Result<Self, ParamError> {
        check_param("concurrencyMax", max_in_flight, 1)?;
        check_param("leaseTtlMs", lease_ttl_ms, 1)?;
        Ok(Self {
            max_in_flight,
            lease_ttl_ms,
        })
    }

    /// The cap on simultaneous leases.
    pub fn max_in_flight(&self) -> u64 {
        self.max_in_flight
    }

    /// How long a lease lasts unless renewed, in ms.
    pub fn lease_ttl_ms(&self) -> u64 {
        self.lease_ttl_ms
    }

    fn live(state: Option<&SemaphoreState>, now_ms: u64) -> Vec<HeldLease> {
        state
            .map(|s| {
                s.leases
                    .iter()
                    .filter(|l| l.expires_at_ms > now_ms)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    fn key_ttl_ms(leases: &[HeldLease], now_ms: u64) -> u64 {
        leases
            .iter()
            .map(|l| l.expires_at_ms - now_ms)
            .max()
            .unwrap_or(1)
    }

    /// Acquires `lease_id` at `now_ms`. Idempotent: a lease id that is already held is answered
    /// "acquired" without taking a second slot or extending its expiry.
    pub fn acquire(&self, state: Option<&SemaphoreState>, now_ms: u64, lease_id: &str) -> Acquire {
        let mut leases = Self::live(state, now_ms);
        let in_flight = leases.len() as u64;
        if leases.iter().any(|l| l.lease_id == lease_id) {
            return Acquire {
                acquired: true,
                in_flight,
                write: None,
            };
        }
        if in_flight >= self.max_in_flight {
            return Acquire {
                acquired: false,
                in_flight,
                write: None,
            };
        }
        leases.push(HeldLease {
            lease_id: lease_id.to_owned(),
            expires_at_ms: now_ms + self.lease_ttl_ms,
        });
        debug_assert!(leases.len() as u64 <= self.max_in_flight);
        let ttl_ms = Self::key_ttl_ms(&leases, now_ms);
        Acquire {
            acquired: true,
            in_flight: in_flight + 1,
            write: Some((SemaphoreState { leases }, ttl_ms)),
        }
    }

    /// Extends a live lease to `now + lease_ttl`. Returns the new state, or `None` when the lease is not
    /// held (expired or never acquired): a heartbeat cannot resurrect a lapsed lease.
    pub fn renew(
        &self,
        state: Option<&SemaphoreState>,
        now_ms: u64,
        lease_id: &str,
    ) -> Option<(SemaphoreState, u64)> {
        let mut leases = Self::live(state, now_ms);
        let held = leases.iter_mut().find(|l| l.lease_id == lease_id)?;
        held.expires_at_ms = held.expires_at_ms.max(now_ms + self.lease_ttl_ms);
        let ttl_ms = Self::key_ttl_ms(&leases, now_ms);
        Some((SemaphoreState { leases }, ttl_ms))
    }

    /// Releases `lease_id`. Idempotent. Returns the remaining live leases.
    pub fn release(
        &self,
        state: Option<&SemaphoreState>,
        now_ms: u64,
        lease_id: &str,
    ) -> SemaphoreState {
        let leases = Self::live(state, now_ms)
            .into_iter()
            .filter(|l| l.lease_id != lease_id)
            .collect();
        SemaphoreState { leases }
    }
}
