//! Gateways behind the rate limit quota service (RLQS), in virtual time: each region's requests are
//! decided by its gateways against token-bucket assignments their agent carves out of its holder,
//! with the shipped sub-lease code: the holder's sub-lease reservations (reserve, draw, give back,
//! withhold) and the pure sizing and timing rules of `allot_region_agent::global::sublease`
//! (demand, shares, time to live, renewal, cut on replacement, settle grace), the same calls the
//! agent's RLQS service makes. Gateways enforce assignments as Envoy's filter does
//! ([`EnforcedBucket`]) and deny without one (`DENY_ALL` no-assignment and expired behaviours).
//!
//! The agent-gateway link is local to the region: assignments arrive at once, reports every
//! `report_interval_ms`. A crashed agent loses its side (its holder and reservations are gone);
//! its gateways keep enforcing what they were given until it ends, as Envoy does.

use std::collections::VecDeque;

use allot_region_agent::global::holder::{Denial, PoolHolder, Reservation};
use allot_region_agent::global::sublease::{
    ASSIGNMENT_TTL_MS, BucketStrategy, CarveKind, Demand, EnforcedBucket, MIN_ASSIGNMENT_REQUESTS,
    Settlement, Spread, admissible_until_replaced, assignment_ttl_ms, carve_kind, deny_ttl_ms,
    renewal_due, settlement, share, wanted_requests,
};
use allot_shared::ids::LeaseId;

/// What an admit by a gateway was carved from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Source {
    /// Carved from the fallback allowance.
    pub fallback: bool,
    /// The window start of the first lease behind it (`None` in fallback).
    pub lease_window_start_ms: Option<u64>,
    /// The end of the first-ending lease behind it, in true time (`u64::MAX` in fallback).
    pub true_until_ms: u64,
}

/// A gateway's decision on one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Decided {
    Admitted(Source),
    /// No live assignment, or its bucket is empty.
    Denied,
}

/// What the agent side did in one tick.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Tended {
    /// Requests reported admitted beyond every carve (spent from the holder when it could).
    pub beyond_assignment: u64,
    /// A carve could not be made for lack of tokens held: the holder wants a renewal.
    pub awaiting: bool,
}

/// A carve handed to a gateway.
#[derive(Debug)]
struct Handed {
    reservation: Option<Reservation>,
    kind: CarveKind,
    requests: u64,
    used: u64,
    strategy: BucketStrategy,
    sent_at_ms: u64,
    ends_at_ms: u64,
}

/// What the agent last told a gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Told {
    Nothing,
    TokenBucket { sent_at_ms: u64, ttl_ms: u64 },
    DenyAll { until_ms: u64 },
}

#[derive(Debug)]
struct Gateway {
    enforced: Option<(EnforcedBucket, Source)>,
    allowed_unreported: u64,
    denied_unreported: u64,
    reported_at_ms: u64,
    /// The agent's side of this gateway's subscription.
    demand: Demand,
    told: Told,
    handed: VecDeque<Handed>,
}

/// One region's gateways for one tenant.
#[derive(Debug)]
pub(super) struct Gateways {
    report_interval_ms: u64,
    next: usize,
    members: Vec<Gateway>,
}

impl Gateways {
    pub(super) fn new(count: u64, report_interval_ms: u64, now_ms: u64) -> Self {
        let members = (0..count)
            .map(|_| Gateway {
                enforced: None,
                allowed_unreported: 0,
                denied_unreported: 0,
                reported_at_ms: now_ms,
                demand: Demand::default(),
                told: Told::Nothing,
                handed: VecDeque::new(),
            })
            .collect();
        Self {
            report_interval_ms,
            next: 0,
            members,
        }
    }

    /// The next gateway (round-robin) decides one request at `now_ms` on its own.
    pub(super) fn decide(&mut self, now_ms: u64) -> Decided {
        let count = self.members.len().max(1);
        let gateway = &mut self.members[self.next % count];
        self.next = (self.next + 1) % count;
        let admitted = match &mut gateway.enforced {
            Some((bucket, source)) => bucket.try_admit(now_ms).then_some(*source),
            None => None,
        };
        match admitted {
            Some(source) => {
                gateway.allowed_unreported += 1;
                Decided::Admitted(source)
            }
            None => {
                gateway.denied_unreported += 1;
                Decided::Denied
            }
        }
    }

    /// The agent crashed: its side is gone (the holder with it); gateways keep what they enforce.
    pub(super) fn agent_crashed(&mut self) {
        for gateway in &mut self.members {
            gateway.told = Told::Nothing;
            gateway.demand = Demand::default();
            // The reservations went with the holder.
            gateway.handed.clear();
        }
    }

    /// The agent's work for this tick, on its clock `now_ms`: reports that are due are spent from
    /// the carves they cover, ended carves withhold what they hold, and gateways whose assignment
    /// is due get a new one. `true_lease_end` gives a lease's end in true time.
    pub(super) fn tend(
        &mut self,
        holder: &mut PoolHolder,
        now_ms: u64,
        reachable: bool,
        true_lease_end: impl Fn(LeaseId) -> Option<u64>,
    ) -> Tended {
        let mut tended = Tended::default();
        let interval_ms = self.report_interval_ms;
        for gateway in &mut self.members {
            if now_ms >= gateway.reported_at_ms + interval_ms {
                tended.beyond_assignment += take_report(gateway, holder, now_ms, reachable);
            }
            settle_ended(gateway, holder, now_ms, interval_ms);
        }
        let total_wanted: u64 = self
            .members
            .iter()
            .map(|g| wanted_requests(g.demand.rate_milli_per_s(), ASSIGNMENT_TTL_MS))
            .sum();
        for gateway in &mut self.members {
            if is_due(gateway, now_ms) {
                tended.awaiting |= assign(
                    gateway,
                    holder,
                    now_ms,
                    reachable,
                    total_wanted,
                    &true_lease_end,
                );
            }
        }
        tended
    }
}

/// The agent takes a gateway's report: allowed requests are spent from its carves, oldest first;
/// what no carve holds is spent from the holder when it can. Returns the requests beyond every
/// carve.
fn take_report(
    gateway: &mut Gateway,
    holder: &mut PoolHolder,
    now_ms: u64,
    reachable: bool,
) -> u64 {
    let elapsed_ms = now_ms.saturating_sub(gateway.reported_at_ms).max(1);
    let (allowed, denied) = (gateway.allowed_unreported, gateway.denied_unreported);
    gateway.demand.record(allowed + denied, elapsed_ms);
    gateway.reported_at_ms = now_ms;
    gateway.allowed_unreported = 0;
    gateway.denied_unreported = 0;
    let mut left = allowed;
    for handed in gateway.handed.iter_mut() {
        let Some(reservation) = handed.reservation.as_mut() else {
            continue;
        };
        let drawn = holder.draw(reservation, left.min(handed.requests - handed.used), now_ms);
        handed.used += drawn;
        left -= drawn;
        if left == 0 {
            break;
        }
    }
    holder.note_demand(now_ms, denied);
    if left > 0 {
        // As the agent: beyond every assignment (here, after a restart), spent when it can be.
        let _ = holder.spend(left, now_ms, reachable);
    }
    left
}

/// Settles the carves whose assignments ended: given back once a report covered their end,
/// withheld when none did in time.
fn settle_ended(gateway: &mut Gateway, holder: &mut PoolHolder, now_ms: u64, interval_ms: u64) {
    while let Some(handed) = gateway.handed.front() {
        let Some(settled) = settlement(
            handed.ends_at_ms,
            gateway.reported_at_ms,
            now_ms,
            interval_ms,
        ) else {
            break;
        };
        if let Some(mut handed) = gateway.handed.pop_front()
            && let Some(reservation) = handed.reservation.take()
        {
            match settled {
                Settlement::GiveBack => holder.cancel(reservation),
                Settlement::Withhold => holder.withhold(reservation),
            }
        }
    }
}

fn is_due(gateway: &Gateway, now_ms: u64) -> bool {
    match gateway.told {
        Told::Nothing => true,
        Told::DenyAll { until_ms } => now_ms >= until_ms,
        Told::TokenBucket { sent_at_ms, ttl_ms } => {
            let (used, requests) = gateway
                .handed
                .back()
                .map_or((0, 0), |h| (h.used, h.requests));
            let wanted = wanted_requests(gateway.demand.rate_milli_per_s(), ASSIGNMENT_TTL_MS);
            renewal_due(sent_at_ms, ttl_ms, used, requests, wanted, now_ms)
        }
    }
}

/// Carves a gateway's next assignment and hands it over. Returns whether it waits for tokens.
///
/// Long by design: it takes one reservation and then either cancels it at one of several refusals
/// (another kind of carve in use, no usable lifetime, no spread) or hands it over, trimmed to what
/// its bucket admits; in one body every exit is seen to settle the reservation, where split it
/// would be passed between functions and could be dropped unsettled.
fn assign(
    gateway: &mut Gateway,
    holder: &mut PoolHolder,
    now_ms: u64,
    reachable: bool,
    total_wanted: u64,
    true_lease_end: &impl Fn(LeaseId) -> Option<u64>,
) -> bool {
    let rate = gateway.demand.rate_milli_per_s();
    let wanted = wanted_requests(rate, ASSIGNMENT_TTL_MS);
    let chunk = holder.config().chunk_tokens.max(1);
    let spendable = holder.spendable_tokens(now_ms, reachable).min(chunk);
    let given = share(spendable, wanted, total_wanted, MIN_ASSIGNMENT_REQUESTS);
    if given == 0 {
        return match holder.reserve_for_sublease(wanted.min(chunk), now_ms, reachable) {
            Ok(reservation) => {
                holder.cancel(reservation);
                false
            }
            Err(refusal) => match refusal.denial {
                Denial::AwaitingGrant | Denial::FallbackUnclaimed => true,
                _ => {
                    cut_replaced(gateway, holder, now_ms);
                    gateway.told = Told::DenyAll {
                        until_ms: now_ms + deny_ttl_ms(refusal.retry_after_ms),
                    };
                    gateway.enforced = None;
                    false
                }
            },
        };
    }
    let Ok(mut reservation) = holder.reserve_for_sublease(given, now_ms, reachable) else {
        return true;
    };
    // A carve of another kind waits until the older ones are settled, as the agent's does.
    let kind = carve_kind(holder, &reservation);
    if gateway
        .handed
        .front()
        .is_some_and(|older| older.kind != kind)
    {
        holder.cancel(reservation);
        return false;
    }
    let usable_ms = holder.usable_until_ms(&reservation).saturating_sub(now_ms);
    let Some(ttl_ms) = assignment_ttl_ms(given, rate, usable_ms) else {
        holder.cancel(reservation);
        return true;
    };
    let Some(Spread { strategy, ttl_ms }) = BucketStrategy::spreading(given, ttl_ms) else {
        holder.cancel(reservation);
        return false;
    };
    let requests = strategy.admissible_requests(ttl_ms);
    holder.give_back(&mut reservation, given - requests);
    let source = Source {
        fallback: reservation.is_fallback(),
        lease_window_start_ms: reservation
            .lease_parts()
            .first()
            .and_then(|(lease, _)| holder.lease_window_start_ms(*lease)),
        true_until_ms: reservation
            .lease_parts()
            .iter()
            .filter(|(_, tokens)| *tokens > 0)
            .filter_map(|(lease, _)| true_lease_end(*lease))
            .min()
            .unwrap_or(u64::MAX),
    };
    cut_replaced(gateway, holder, now_ms);
    gateway.handed.push_back(Handed {
        reservation: Some(reservation),
        kind,
        requests,
        used: 0,
        strategy,
        sent_at_ms: now_ms,
        ends_at_ms: now_ms + ttl_ms,
    });
    gateway.told = Told::TokenBucket {
        sent_at_ms: now_ms,
        ttl_ms,
    };
    gateway.enforced = Some((EnforcedBucket::new(strategy, ttl_ms, now_ms), source));
    false
}

/// The assignment in force is replaced now (it reaches the gateway at once here): its carve keeps
/// what the gateway could admit until the replacement.
fn cut_replaced(gateway: &mut Gateway, holder: &mut PoolHolder, now_ms: u64) {
    let Some(handed) = gateway.handed.back_mut() else {
        return;
    };
    if handed.ends_at_ms <= now_ms {
        return;
    }
    let keep = admissible_until_replaced(handed.strategy, handed.sent_at_ms, now_ms)
        .max(handed.used)
        .min(handed.requests);
    if let Some(reservation) = handed.reservation.as_mut() {
        holder.give_back(reservation, handed.requests - keep);
    }
    handed.requests = keep;
    handed.ends_at_ms = now_ms;
}
