//! Idempotent retries on every tier: a request id that was admitted is answered again, not decided
//! again.
//!
//! A gateway that lost the answer to a request marked `idempotent` (any of its rules, regional or
//! global) retries it with the same `requestId`. The regional store replays its decision record; the
//! global tier must not spend the tenant's pool a second time either. So the agent remembers each
//! admitted idempotent request, per tenant and request id, for the decision record's retention, and
//! answers a retry with the admission it already made: nothing is reserved, committed, settled or
//! counted against a pool again.
//!
//! - **In flight.** A retry that arrives while its original is still being decided waits for it
//!   (at most [`ORIGINAL_WAIT`]) rather than racing it for a second reservation; an original that is
//!   denied, fails or is abandoned leaves nothing behind, and the retry is decided afresh.
//! - **Bounded** (I10): at most [`MAX_REMEMBERED_ADMISSIONS`] admissions are remembered. When full,
//!   the oldest is forgotten before its time and counted
//!   (`allot_agent_idempotency_forgotten_early_total`); a retry of it would be decided again. The
//!   store's own record still keeps the regional tier to one debit, and an agent that sees the store
//!   replay a record cancels the request's global reservation instead of committing it (see
//!   [`admission`](super::admission)), so an agent restarted, or a second agent of the region, does
//!   not spend the pool twice either.
//! - **Not durable**: memory only. A restart forgets it, and the store's record covers the rules it
//!   decides; a request with only global rules and no store call is then decided again.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use allot_shared::contract::Decision;
use allot_shared::ids::{DecisionId, TenantId};
use tokio::sync::watch;

use super::lock;

/// Most admissions remembered at once (I10). At the default 30 s retention this is over 2,000
/// idempotent admissions a second.
pub const MAX_REMEMBERED_ADMISSIONS: usize = 65_536;

/// Longest a retry waits for its original, still being decided, before it is answered
/// `LIMITER_UNAVAILABLE` (retry later): longer than any decision takes (the regional hold, a first
/// grant and a fallback claim).
pub const ORIGINAL_WAIT: Duration = Duration::from_secs(1);

type Key = (TenantId, DecisionId);

enum Entry {
    /// The original is being decided. Retries wait for this sender to be dropped, which happens
    /// when the entry leaves the map (whatever the outcome, so no wake-up can be missed).
    Deciding(watch::Sender<()>),
    /// Admitted; answered again until `until_ms`.
    Admitted {
        decision: Decision,
        until_ms: u64,
        generation: u64,
    },
}

#[derive(Default)]
struct Remembered {
    entries: HashMap<Key, Entry>,
    /// Admissions in the order they were remembered, with their generation (a key remembered again
    /// after it was forgotten has a newer one), for expiry and eviction.
    order: VecDeque<(Key, u64, u64)>,
    next_generation: u64,
    forgotten_early: u64,
}

impl Remembered {
    /// Forgets admissions whose retention ended; when full, the oldest too (counted).
    fn make_room(&mut self, now_ms: u64) {
        while let Some((_, until_ms, _)) = self.order.front() {
            let expired = *until_ms <= now_ms;
            let full = self.entries.len() >= MAX_REMEMBERED_ADMISSIONS;
            if !expired && !full {
                break;
            }
            let Some((key, _, generation)) = self.order.pop_front() else {
                break;
            };
            let current = matches!(self.entries.get(&key),
                Some(Entry::Admitted { generation: g, .. }) if *g == generation);
            if current {
                self.entries.remove(&key);
                if !expired {
                    self.forgotten_early += 1;
                    metrics::counter!(crate::metrics::IDEMPOTENCY_FORGOTTEN_EARLY).increment(1);
                }
            }
        }
    }
}

/// What a request with an idempotency key should do.
pub enum Begin {
    /// It was admitted before: answer this again.
    Replay(Decision),
    /// Its original is being decided: wait for this to close (`changed()` fails), then begin again.
    Wait(watch::Receiver<()>),
    /// Decide it; remember an admission through the ticket.
    Decide(Ticket),
    /// Too many requests are being decided at once to remember another: decide it unremembered.
    Unremembered,
}

/// The admitted idempotent requests of one agent.
#[derive(Default, Clone)]
pub struct Replays {
    inner: Arc<Mutex<Remembered>>,
}

impl Replays {
    /// Starts `request_id` of `tenant` at `now_ms`.
    pub fn begin(&self, tenant: &TenantId, request_id: &DecisionId, now_ms: u64) -> Begin {
        let key: Key = (tenant.clone(), request_id.clone());
        let mut remembered = lock(&self.inner);
        remembered.make_room(now_ms);
        match remembered.entries.get(&key) {
            Some(Entry::Admitted {
                decision, until_ms, ..
            }) if *until_ms > now_ms => return Begin::Replay(decision.clone()),
            Some(Entry::Deciding(sender)) => return Begin::Wait(sender.subscribe()),
            _ => {}
        }
        if remembered.entries.len() >= MAX_REMEMBERED_ADMISSIONS {
            // Every place is taken by a request in flight (bounded by the servers' concurrency).
            return Begin::Unremembered;
        }
        remembered
            .entries
            .insert(key.clone(), Entry::Deciding(watch::Sender::new(())));
        Begin::Decide(Ticket {
            replays: self.clone(),
            key: Some(key),
        })
    }

    /// Admissions remembered now (and requests being decided).
    pub fn len(&self) -> usize {
        lock(&self.inner).entries.len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Admissions forgotten before their retention ended, to make room.
    pub fn forgotten_early(&self) -> u64 {
        lock(&self.inner).forgotten_early
    }

    fn settle(&self, key: Key, admitted: Option<(Decision, u64)>) {
        let mut remembered = lock(&self.inner);
        // Removing the entry drops its sender, which wakes the retries waiting for it.
        let deciding = match remembered.entries.remove(&key) {
            Some(Entry::Deciding(sender)) => Some(sender),
            other => {
                // Not ours (cannot happen: only the ticket settles its key); put it back.
                if let Some(entry) = other {
                    remembered.entries.insert(key.clone(), entry);
                }
                None
            }
        };
        if let Some((decision, until_ms)) = admitted {
            let generation = remembered.next_generation;
            remembered.next_generation += 1;
            remembered.entries.insert(
                key.clone(),
                Entry::Admitted {
                    decision,
                    until_ms,
                    generation,
                },
            );
            remembered.order.push_back((key, until_ms, generation));
        }
        drop(remembered);
        drop(deciding);
    }
}

/// The right to decide one idempotent request. Dropped without [`admitted`](Self::admitted) (a
/// denial, a failure, an abandoned call), it leaves nothing behind and wakes the retries waiting.
pub struct Ticket {
    replays: Replays,
    key: Option<Key>,
}

impl Ticket {
    /// Remembers `decision` (an admission) until `until_ms`.
    pub fn admitted(mut self, decision: Decision, until_ms: u64) {
        debug_assert!(decision.allowed, "only admissions are replayed");
        if let Some(key) = self.key.take() {
            self.replays.settle(key, Some((decision, until_ms)));
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.replays.settle(key, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(request: &str) -> (TenantId, DecisionId) {
        (
            TenantId::parse("acme").expect("tenant"),
            DecisionId::parse(request).expect("request id"),
        )
    }

    fn admission(id: &DecisionId) -> Decision {
        Decision {
            allowed: true,
            decision_id: id.clone(),
            policy_id: None,
            policy_version: 1,
            denied_scope: None,
            reason: None,
            limit_units: 10,
            remaining_units: 3,
            retry_after_ms: 0,
            fallback: false,
            dry_run: false,
            violations: Vec::new(),
            settle_by_ms: None,
        }
    }

    #[test]
    fn an_admission_is_replayed_within_its_retention_and_decided_again_after() {
        let replays = Replays::default();
        let (tenant, id) = ids("r-1");
        let Begin::Decide(ticket) = replays.begin(&tenant, &id, 1_000) else {
            panic!("a new request is decided");
        };
        ticket.admitted(admission(&id), 31_000);
        assert!(
            matches!(replays.begin(&tenant, &id, 30_999), Begin::Replay(d) if d.remaining_units == 3)
        );
        assert!(matches!(
            replays.begin(&tenant, &id, 31_000),
            Begin::Decide(_)
        ));
    }

    #[test]
    fn a_retry_waits_for_its_original_and_a_denied_original_leaves_nothing() {
        let replays = Replays::default();
        let (tenant, id) = ids("r-2");
        let Begin::Decide(ticket) = replays.begin(&tenant, &id, 0) else {
            panic!("decided");
        };
        let Begin::Wait(original) = replays.begin(&tenant, &id, 1) else {
            panic!("a retry waits for its original");
        };
        drop(ticket);
        assert!(
            original.has_changed().is_err(),
            "the waiting retry is woken when its original ends"
        );
        assert!(replays.is_empty(), "a denial is not remembered");
        assert!(matches!(replays.begin(&tenant, &id, 2), Begin::Decide(_)));
    }

    #[test]
    fn the_same_request_id_of_another_tenant_is_another_request() {
        let replays = Replays::default();
        let (tenant, id) = ids("r-3");
        let Begin::Decide(ticket) = replays.begin(&tenant, &id, 0) else {
            panic!("decided");
        };
        ticket.admitted(admission(&id), 10_000);
        let other = TenantId::parse("globex").expect("tenant");
        assert!(matches!(replays.begin(&other, &id, 1), Begin::Decide(_)));
    }

    #[test]
    fn memory_is_bounded_and_the_oldest_is_forgotten_first_and_counted() {
        let replays = Replays::default();
        let tenant = TenantId::parse("acme").expect("tenant");
        let total = MAX_REMEMBERED_ADMISSIONS + 10;
        for n in 0..total {
            let id = DecisionId::parse(&format!("r-{n}")).expect("id");
            let Begin::Decide(ticket) = replays.begin(&tenant, &id, 0) else {
                panic!("decided");
            };
            ticket.admitted(admission(&id), 60_000);
        }
        assert!(replays.len() <= MAX_REMEMBERED_ADMISSIONS);
        assert_eq!(replays.forgotten_early(), 10);
        let oldest = DecisionId::parse("r-0").expect("id");
        assert!(matches!(
            replays.begin(&tenant, &oldest, 1),
            Begin::Decide(_)
        ));
        let newest = DecisionId::parse(&format!("r-{}", total - 1)).expect("id");
        assert!(matches!(
            replays.begin(&tenant, &newest, 1),
            Begin::Replay(_)
        ));
    }
}
