//! The model's state: each region's agent (its pool agent, the call in flight, what its gateways
//! were served), the allocators (leader, cache, records), the messages in flight, and the actions
//! that move it.

use std::collections::{BTreeMap, BTreeSet};

use allot_allocator::pools::GrantRecord;
use allot_region_agent::global::{PoolAgent, PoolJournal};
use allot_shared::ids::{Epoch, LeaseId};
use allot_shared::lease::PoolWindowState;
use allot_shared::wire::GrantAnswer;

/// A breach of a safety property, recorded by the step that saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Breach {
    /// A token was spent at or after its lease's end (the allocator's clock).
    SpentPastLeaseEnd,
    /// A token was spent outside its lease's window.
    SpentOutsideWindow,
    /// A grant older than one already taken was held.
    StaleEpochHeld,
    /// A denied request changed what was spent or spendable.
    DenialDebited,
    /// After the heal, a renewal went a whole step unanswered.
    RenewalUnansweredAfterHeal,
    /// A window that ended admitted more than the bound.
    OverBound,
    /// A region admitted more than its allowance in fallback in a window.
    FallbackOverAllowance,
}

impl Breach {
    pub(super) fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

/// What the allocator answered.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reply {
    /// A grant (possibly of nothing).
    Grant(GrantAnswer),
    /// A definite refusal.
    Refused,
    /// A deposed leader: the agent's client treats it as no answer.
    NotLeader,
}

/// A message in flight.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Message {
    /// A region's renewal, to the allocator.
    Ask {
        /// The asking region.
        region: u8,
        /// The call that sent it gave up: the allocator still serves it, but its answer goes
        /// nowhere (an answer travels back on its call's own connection).
        orphan: bool,
        /// The lease id asked with.
        lease_id: LeaseId,
        /// Tokens wanted.
        want_tokens: u64,
    },
    /// The allocator's answer, to the region.
    Answer {
        /// The region.
        region: u8,
        /// The lease id it answers.
        lease_id: LeaseId,
        /// What was answered.
        reply: Reply,
    },
    /// A lease's final report line with what it left unspent, to the allocator (which takes it
    /// back as the report route does; the agent waits for nothing).
    GiveBack {
        /// The reporting agent.
        region: u8,
        /// The line.
        line: GivenBack,
    },
}

/// A final report line that gives tokens back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GivenBack {
    /// The lease that ended.
    pub lease_id: LeaseId,
    /// What the line says was spent.
    pub spent_tokens: u64,
    /// What the line says was left unspent.
    pub unspent_tokens: u64,
}

/// One allocator node that believes it leads.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Leader {
    pub(super) epoch: Epoch,
    /// Its cached window and the store revision it was read at.
    pub(super) window: Option<PoolWindowState>,
    pub(super) revision: u64,
}

/// The allocator: the store (etcd) and the nodes serving from it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Allocator {
    /// The epoch the store's leader key holds: the fence.
    pub(super) epoch: Epoch,
    pub(super) window: Option<PoolWindowState>,
    pub(super) window_revision: u64,
    pub(super) records: BTreeMap<LeaseId, GrantRecord>,
    /// The store's marks of leases whose unspent tokens were taken back.
    pub(super) returned: BTreeSet<LeaseId>,
    /// The newest last; a deposed one serves until the model forgets it.
    pub(super) leaders: Vec<Leader>,
}

/// A renewal call the agent is waiting on (the renewal is its pool agent's in flight).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Call {
    pub(super) lease_id: LeaseId,
    pub(super) asked_at_ms: u64,
}

/// One agent, for the pool (a region's one agent, or one of the first region's two: its messages
/// and figures are by agent).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Region {
    pub(super) agent: PoolAgent,
    pub(super) call: Option<Call>,
    pub(super) reachable: bool,
    pub(super) next_lease: u32,
    pub(super) journal: PoolJournal,
    pub(super) spends_this_step: u8,
    pub(super) highest_epoch_held: Epoch,
}

/// A state of the whole system.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ModelState {
    pub(super) step: u32,
    pub(super) allocator: Allocator,
    pub(super) regions: Vec<Region>,
    /// Messages in flight, sorted (a multiset).
    pub(super) network: Vec<Message>,
    pub(super) losses: u8,
    pub(super) duplicates: u8,
    pub(super) failovers: u8,
    pub(super) restarts: u8,
    pub(super) regional_denials: u8,
    pub(super) charges: u8,
    /// Tokens admitted per window (its start on the allocator's clock).
    pub(super) admitted: BTreeMap<u64, u64>,
    /// Without a state directory (or with a region of two agents): tokens each agent admitted in
    /// fallback per window, in truth and as the ledger holds them (reported), by (window start,
    /// agent). Kept only then, so the configurations with one explore the states they always did.
    pub(super) fallback_admitted: BTreeMap<(u64, u8), u64>,
    pub(super) ledger_fallback: BTreeMap<(u64, u8), u64>,
    pub(super) breaches: u8,
}

impl ModelState {
    /// Whether a step recorded `breach`.
    pub fn breached(&self, breach: Breach) -> bool {
        self.breaches & breach.bit() != 0
    }
}

/// A step the checker may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Time moves on a step: calls that timed out give up, agents journal and renew.
    Tick,
    /// A gateway asks region `r`'s agent to admit one token.
    Spend(u8),
    /// An ask is served by leader `leader` (0 the oldest) and its answer arrives at once: the
    /// only way asks travel after the heal (and in a model without faults), which spares the
    /// checker the interleavings of answers with other regions' steps that change nothing.
    RoundTrip {
        /// Index into the network.
        index: u8,
        /// Which leader serves it.
        leader: u8,
    },
    /// Message `index` arrives; an ask is served by leader `leader` (0 the oldest).
    Deliver {
        /// Index into the network.
        index: u8,
        /// Which leader serves an ask.
        leader: u8,
    },
    /// Message `index` is lost.
    Lose(u8),
    /// Ask `index` is delivered twice.
    Duplicate(u8),
    /// The allocator fails over to a new leader of the next epoch.
    FailOver,
    /// Region `r`'s agent crashes and restarts (from its journal, if it keeps a state directory).
    Restart(u8),
    /// Agent `r` reserves a request's token, and a regional rule then denies the request: what
    /// was reserved is cancelled (one of the step's requests).
    DenyRegionally(u8),
    /// A metered request agent `r` admitted earlier is settled a token above its estimate.
    Charge(u8),
    /// Every ask in flight is served by leader `leader` in one batch, committed together, and
    /// each answer arrives at once.
    RoundTripAll {
        /// Which leader serves them.
        leader: u8,
    },
}
