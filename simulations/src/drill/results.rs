//! What a drill produces: per region and window, the admits, denials, grants and strands; the
//! drill's report with its bound, convergence and violations. Written by the engine, checked by
//! [`super::check`], printed by [`super::report`].

pub use super::scenario::START_MS;
/// Most violation lines a report keeps (the rest are counted) (I10).
pub const MAX_VIOLATION_LINES: usize = 100;

use allot_shared::lease::OvershootBound;

use super::scenario::Scenario;

/// One region in one window, summed over the drill's tenants.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RegionWindow {
    /// Requests arriving.
    pub demand: u64,
    /// Admitted from leases of this window.
    pub leased: u64,
    /// Admitted from leases of an earlier window (unclamped carry-over).
    pub carried_over: u64,
    /// Admitted in fallback.
    pub fallback: u64,
    /// Denied: the pool is exhausted.
    pub denied_exhausted: u64,
    /// Denied: unreachable allocator and the fallback allowance is spent (or zero).
    pub denied_fallback_spent: u64,
    /// Denied after waiting for a grant that did not arrive in time.
    pub denied_awaiting: u64,
    /// Denied in the last moments of a window with no lease held (a lease asked for then would end
    /// before it could be spent); retried when the window ends.
    pub denied_window_end: u64,
    /// Not served: the agent was down, or had no pool terms (fails closed).
    pub denied_unavailable: u64,
    /// Denied by a gateway on its own (RLQS drills): no live assignment, or its bucket was empty.
    pub denied_by_gateway: u64,
    /// Of the pool-exhausted denials, those while the tenant's whole quota (G) was not yet granted
    /// in this window: the cost of a static split.
    pub denied_while_tokens_left: u64,
    /// Of the pool-exhausted denials, those while more than a twentieth of G was neither granted
    /// nor held (5 % of the quota unspent and unheld, what was taken back included).
    #[serde(default)]
    pub denied_while_a_twentieth_left: u64,
    /// Tokens granted to this region for this window.
    #[serde(rename = "granted")]
    pub granted_tokens: u64,
    /// Tokens that became stranded during this window (unspent at a lease's end, or held by an
    /// agent that crashed).
    #[serde(rename = "stranded")]
    pub stranded_tokens: u64,
    /// Tokens the allocator took back of what leases left unspent at their end (counted in
    /// `stranded` when the lease ended, grantable again since): what stayed stranded is the
    /// difference.
    #[serde(rename = "returned", default)]
    pub returned_tokens: u64,
    /// Grant answers lost on the way back.
    pub answers_lost: u64,
    /// Tokens of lost answers recovered by asking again with the same lease id.
    pub recovered_tokens: u64,
    /// Admits that never reached the ledger: a crashed agent's last report interval.
    #[serde(rename = "unreported")]
    pub unreported_tokens: u64,
    /// Tokens spent at or after their lease's end, in true time (an invariant violation unless the
    /// scenario expects it).
    pub spent_after_lease_end: u64,
    /// Decisions that waited for a grant.
    pub waited: u64,
    /// The longest such wait, ms.
    pub max_wait_ms: u64,
    /// Denied by a regional rule after their global reservation: cancelled, nothing debited.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub denied_regional: u64,
    /// Of those, denials whose cancel left the pool's holder other than before the reservation
    /// (spent or spendable moved): a debit on a denial, an invariant violation.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub denials_that_debited: u64,
    /// Extra cost of metered requests settled above their estimate that the pool took: paid from
    /// leases, or owed within the agent's settle debt. Consumed in the window.
    #[serde(default, rename = "chargedExtra", skip_serializing_if = "is_zero")]
    pub charged_extra_tokens: u64,
    /// Extra cost beyond what the agent may owe: never charged, outside the bound.
    #[serde(default, rename = "writtenOff", skip_serializing_if = "is_zero")]
    pub written_off_tokens: u64,
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

impl RegionWindow {
    /// Tokens that stayed stranded: unspent at a lease's end and not taken back. (A lease's
    /// tokens are counted stranded when it ends and taken back at its final report, possibly in
    /// the next window's record: per window this can read low, over a run it is exact.)
    pub fn stranded_net_tokens(&self) -> u64 {
        self.stranded_tokens.saturating_sub(self.returned_tokens)
    }

    /// Every request admitted.
    pub fn admitted(&self) -> u64 {
        self.leased + self.carried_over + self.fallback
    }

    /// Every token consumed against the window's bound: the requests admitted, and what metered
    /// ones cost beyond their estimate that the pool took (paid or owed).
    pub fn consumed(&self) -> u64 {
        self.admitted() + self.charged_extra_tokens
    }

    /// Every denial.
    pub fn denied(&self) -> u64 {
        self.denied_exhausted
            + self.denied_fallback_spent
            + self.denied_awaiting
            + self.denied_window_end
            + self.denied_unavailable
            + self.denied_by_gateway
            + self.denied_regional
    }

    pub(super) fn add(&mut self, other: &RegionWindow) {
        self.demand += other.demand;
        self.leased += other.leased;
        self.carried_over += other.carried_over;
        self.fallback += other.fallback;
        self.denied_exhausted += other.denied_exhausted;
        self.denied_fallback_spent += other.denied_fallback_spent;
        self.denied_awaiting += other.denied_awaiting;
        self.denied_window_end += other.denied_window_end;
        self.denied_unavailable += other.denied_unavailable;
        self.denied_by_gateway += other.denied_by_gateway;
        self.denied_while_tokens_left += other.denied_while_tokens_left;
        self.denied_while_a_twentieth_left += other.denied_while_a_twentieth_left;
        self.granted_tokens += other.granted_tokens;
        self.stranded_tokens += other.stranded_tokens;
        self.returned_tokens += other.returned_tokens;
        self.answers_lost += other.answers_lost;
        self.recovered_tokens += other.recovered_tokens;
        self.unreported_tokens += other.unreported_tokens;
        self.spent_after_lease_end += other.spent_after_lease_end;
        self.waited += other.waited;
        self.max_wait_ms = self.max_wait_ms.max(other.max_wait_ms);
        self.denied_regional += other.denied_regional;
        self.denials_that_debited += other.denials_that_debited;
        self.charged_extra_tokens += other.charged_extra_tokens;
        self.written_off_tokens += other.written_off_tokens;
    }
}

/// One window of a drill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowRecord {
    /// Window start, ms since the drill's start.
    pub offset_ms: u64,
    /// Tokens granted in this window by an allocator whose records a failover lost (the bound's
    /// lost-record term for this window, summed over tenants).
    pub lost_grant_record_tokens: u64,
    /// Per region, in scenario order, summed over tenants.
    pub regions: Vec<RegionWindow>,
    /// The window's G summed over tenants: each tenant's pool limit, or the highest an override
    /// put in force during the window.
    pub limit_tokens: u64,
}

impl WindowRecord {
    /// A sum over the regions.
    pub fn sum(&self, field: impl Fn(&RegionWindow) -> u64) -> u64 {
        self.regions.iter().map(field).sum()
    }
}

/// How long a region took to get back to normal leasing after the last fault healed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Convergence {
    /// The last fault's end, ms since the start.
    pub healed_at_ms: u64,
    /// Per region: ms after the heal until the last abnormal decision (fallback, waiting for or
    /// lacking a grant, agent down); 0 when none followed the heal.
    pub after_ms: [u64; super::scenario::MAX_REGIONS],
    /// The limit: `converge_within_ttls` lease TTLs, ms.
    pub limit_ms: u64,
}

/// The result of a drill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrillReport {
    /// The scenario.
    pub scenario: Scenario,
    /// The seed the run used.
    pub seed: u64,
    /// The design's bound per tenant and window (without lost records).
    pub bound: OvershootBound,
    /// Every window, in order.
    pub windows: Vec<WindowRecord>,
    /// Convergence after the last healing fault, if any.
    pub convergence: Option<Convergence>,
    /// Violated invariants and expectations (empty: the drill passed), at most
    /// [`MAX_VIOLATION_LINES`].
    pub violations: Vec<String>,
    /// Violations beyond those listed.
    pub violations_not_listed: u64,
}

impl DrillReport {
    /// Whether every invariant and the expectation held.
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }
}
