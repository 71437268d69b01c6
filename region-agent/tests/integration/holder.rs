//! The global tier's pool holder: partitions spend leases, then the fallback allowance, then deny;
//! stale epochs are ignored; renewals follow demand with single flight; and, over random event
//! sequences, nothing is admitted past the grants and the allowance of its window.

use std::collections::HashMap;
use std::num::NonZeroU64;

use allot_region_agent::global::*;
use allot_shared::ids::{Epoch, LeaseId};
use allot_shared::window::{Window, WindowSpec};
use proptest::prelude::*;

const MINUTE: u64 = 60_000;

fn config(fallback: u64) -> HolderConfig {
    HolderConfig {
        window: WindowSpec::Fixed(NonZeroU64::new(MINUTE).expect("non-zero")),
        chunk_tokens: 100,
        lease_ttl_ms: 15_000,
        fallback_per_region_tokens: fallback,
        expiry_margin_ms: 50,
        clock_margin_ms: 0,
        round_trip_ms: 50,
        renewal_patience_ms: 200,
        fallback_claim_block_tokens: 0,
        settle_debt_tokens: 0,
    }
}

fn grant(n: u128, epoch: u64, granted: u64, now: u64) -> LeaseGrant {
    let window = Window::containing(now, NonZeroU64::new(MINUTE).expect("non-zero"));
    LeaseGrant {
        lease_id: LeaseId::from_parts(now, n),
        epoch: Epoch(epoch),
        granted_tokens: granted,
        window,
        expires_at_ms: (now + 15_000).min(window.end_ms),
        retry_after_ms: if granted == 0 { window.end_ms - now } else { 0 },
        returnable: false,
    }
}

/// The partition story: held leases first, then the fallback allowance, then a denial until the
/// window ends; after the heal, the fallback admits are reported for their window.
#[test]
fn a_partition_spends_leases_then_fallback_then_denies() {
    let mut holder = PoolHolder::new(config(3));
    let t0 = 10 * MINUTE + 1_000;
    assert_eq!(
        holder.accept(grant(1, 1, 2, t0), t0),
        GrantVerdict::Accepted
    );
    assert!(matches!(holder.spend(1, t0, false), Spend::Leased(_)));
    assert!(matches!(holder.spend(1, t0, false), Spend::Leased(_)));
    for _ in 0..3 {
        assert_eq!(
            holder.spend(1, t0 + 1, false),
            Spend::Fallback {
                window_start_ms: 10 * MINUTE
            }
        );
    }
    assert_eq!(
        holder.spend(1, t0 + 2, false),
        Spend::Denied {
            denial: Denial::FallbackSpent,
            retry_after_ms: MINUTE - 1_002
        }
    );
    // The lease expires while cut off: no token is spent at or after its end.
    let mut holder = PoolHolder::new(config(0));
    holder.accept(grant(2, 1, 100, t0), t0);
    let end = t0 + 15_000;
    assert!(matches!(holder.spend(1, end - 51, false), Spend::Leased(_)));
    assert_eq!(
        holder.spend(1, end - 50, false),
        Spend::Denied {
            denial: Denial::FailClosed,
            retry_after_ms: 11 * MINUTE - (end - 50)
        },
        "a pool without fallback fails closed once its lease is over"
    );
    assert_eq!(holder.stranded_tokens(), 99);
    let report = holder.pending_report(end);
    assert_eq!(report.leases.len(), 1);
    assert!(report.leases[0].final_line && report.leases[0].spent_tokens == 1);
}

/// A lease the allocator takes back, ended before its window, says in its final line what it left
/// unspent; the same lease taken over from a crashed run's journal says nothing (what was spent
/// after the snapshot is unknown), nor does a lease the allocator does not take back.
#[test]
fn a_returnable_lease_gives_back_what_it_left_unspent() {
    let t0 = 40 * MINUTE + 1_000;
    let mut holder = PoolHolder::new(config(0));
    let returnable = LeaseGrant {
        returnable: true,
        ..grant(1, 1, 10, t0)
    };
    let end = returnable.expires_at_ms;
    assert!(end < returnable.window.end_ms);
    assert_eq!(holder.accept(returnable, t0), GrantVerdict::Accepted);
    for _ in 0..3 {
        assert!(matches!(holder.spend(1, t0, false), Spend::Leased(_)));
    }
    let journal = holder.snapshot(None);
    let line = holder.pending_report(end).leases[0];
    assert_eq!(
        (line.final_line, line.spent_tokens, line.unspent_tokens),
        (true, 3, 7)
    );
    let mut restarted = PoolHolder::new(config(0));
    restarted.restore(&journal);
    let line = restarted.pending_report(end).leases[0];
    assert_eq!(
        (line.final_line, line.spent_tokens, line.unspent_tokens),
        (true, 3, 0)
    );
    let mut plain = PoolHolder::new(config(0));
    plain.accept(grant(2, 1, 10, t0), t0);
    let line = plain.pending_report(end).leases[0];
    assert_eq!((line.final_line, line.unspent_tokens), (true, 0));
}

#[test]
fn fallback_admits_are_reported_once_per_window_after_the_heal() {
    let mut holder = PoolHolder::new(config(5));
    let t0 = 20 * MINUTE;
    for _ in 0..4 {
        assert!(matches!(holder.spend(1, t0, false), Spend::Fallback { .. }));
    }
    let report = holder.pending_report(t0 + 10);
    assert_eq!(
        report.fallback,
        vec![FallbackLine {
            window_start_ms: t0,
            admitted_tokens: 4
        }]
    );
    holder.acknowledge(&report, t0 + 10);
    assert!(
        holder.pending_report(t0 + 20).is_empty(),
        "nothing new to say"
    );
    assert!(matches!(
        holder.spend(1, t0 + 30, false),
        Spend::Fallback { .. }
    ));
    assert_eq!(
        holder.pending_report(t0 + 40).fallback[0].admitted_tokens,
        5,
        "cumulative"
    );
}

#[test]
fn stale_epochs_are_ignored_and_exhaustion_is_cached() {
    let mut holder = PoolHolder::new(config(0));
    let t0 = 5 * MINUTE;
    assert_eq!(
        holder.accept(grant(1, 7, 10, t0), t0),
        GrantVerdict::Accepted
    );
    assert_eq!(
        holder.accept(grant(2, 6, 10, t0), t0),
        GrantVerdict::StaleEpoch { highest: Epoch(7) }
    );
    assert_eq!(
        holder.available_tokens(t0),
        10,
        "the stale grant added nothing"
    );
    assert_eq!(
        holder.accept(grant(1, 7, 10, t0), t0),
        GrantVerdict::Duplicate
    );
    let exhausted = grant(3, 7, 0, t0 + 1_000);
    assert_eq!(
        holder.accept(exhausted, t0 + 1_000),
        GrantVerdict::Exhausted {
            until_ms: 6 * MINUTE
        }
    );
    for _ in 0..10 {
        assert!(matches!(
            holder.spend(1, t0 + 2_000, true),
            Spend::Leased(_)
        ));
    }
    assert_eq!(
        holder.spend(1, t0 + 2_000, true),
        Spend::Denied {
            denial: Denial::PoolExhausted,
            retry_after_ms: MINUTE - 2_000
        }
    );
    assert_eq!(
        holder.wants(t0 + 2_000),
        None,
        "no renewals while exhausted"
    );
    // The pool's terms changed (an override raised its limit): the next request asks again.
    let mut raised = holder.clone();
    raised.forget_exhaustion();
    assert!(matches!(
        raised.spend(1, t0 + 2_000, true),
        Spend::Denied {
            denial: Denial::AwaitingGrant,
            ..
        }
    ));
    assert!(raised.wants(t0 + 2_000).is_some(), "a renewal is wanted");
    let fresh = grant(4, 8, 0, 6 * MINUTE);
    assert!(matches!(
        holder.accept(fresh, 6 * MINUTE),
        GrantVerdict::Exhausted { .. }
    ));
}

#[test]
fn renewals_follow_demand_with_single_flight() {
    let mut holder = PoolHolder::new(config(0));
    let t0 = 3 * MINUTE;
    assert_eq!(holder.wants(t0), None, "no demand, no lease wanted");
    assert!(matches!(
        holder.spend(1, t0, true),
        Spend::Denied {
            denial: Denial::AwaitingGrant,
            ..
        }
    ));
    // One request so far: the rate, as if its second closed now, is a quarter token per second
    // (EWMA alpha 1/4): 3.75 tokens for a 15 s lease, rounded up.
    assert_eq!(
        holder.wants(t0),
        Some(4),
        "a quarter token/s for a 15 s lease"
    );
    holder.begin_renewal(t0);
    assert_eq!(holder.wants(t0), None, "one renewal at a time");
    holder.end_renewal();
    holder.accept(grant(1, 1, 4, t0), t0);
    // Demand of 40 tokens/s for a few seconds raises the ask, bounded by the chunk.
    let mut now = t0;
    for second in 0..5 {
        for _ in 0..40 {
            holder.spend(1, now, true);
        }
        if second == 0 {
            holder.accept(grant(2, 1, 100, now), now);
        }
        now += 1_000;
    }
    let want = holder.wants(now).expect("running low");
    assert!(want > 15 && want <= 100, "demand-weighted ask: {want}");
}

#[derive(Debug, Clone)]
enum Event {
    Grant { granted: u64, epoch_step: i8 },
    Spend { cost: u64, reachable: bool },
    Reserve { cost: u64, reachable: bool },
    Settle { which: usize, commit: bool },
    Advance { ms: u64 },
    Report,
}

fn events() -> impl Strategy<Value = Vec<Event>> {
    prop::collection::vec(
        prop_oneof![
            2 => (0u64..120, -1i8..3).prop_map(|(granted, epoch_step)| Event::Grant { granted, epoch_step }),
            5 => (1u64..6, any::<bool>()).prop_map(|(cost, reachable)| Event::Spend { cost, reachable }),
            4 => (1u64..40, any::<bool>()).prop_map(|(cost, reachable)| Event::Reserve { cost, reachable }),
            4 => (any::<usize>(), any::<bool>()).prop_map(|(which, commit)| Event::Settle { which, commit }),
            3 => (0u64..20_000).prop_map(|ms| Event::Advance { ms }),
            1 => Just(Event::Report),
        ],
        1..300,
    )
}

/// What the test knows of one outstanding reservation.
struct Outstanding {
    reservation: Reservation,
    reserved_at: u64,
    /// The lease it was taken from first, or the fallback window.
    source: Spend,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Per window: admitted from leases never exceeds what those leases granted, no lease is spent
    /// (or reserved from) at or after its end, stale-epoch grants are never spent, and fallback
    /// stays within the allowance. Hence admitted <= granted + fallbackPerRegion in every window.
    /// Reservations: no token is reserved twice (reserved + spent never exceed a lease's grant),
    /// none is lost (granted = spent + stranded + still spendable once all are settled), a
    /// cancelled one is never reported spent, and reports carry committed spends only.
    #[test]
    fn the_holder_never_admits_past_its_grants_and_allowance(
        fallback in 0u64..20,
        start in 0u64..(1 << 40),
        events in events(),
    ) {
        let mut holder = PoolHolder::new(config(fallback));
        let mut now = start;
        let mut epoch: u64 = 5;
        let mut grants: HashMap<LeaseId, (LeaseGrant, bool)> = HashMap::new();
        let mut spent: HashMap<LeaseId, u64> = HashMap::new();
        let mut fallback_by_window: HashMap<u64, u64> = HashMap::new();
        let mut outstanding: Vec<Outstanding> = Vec::new();
        let mut taken_tokens = 0;
        for (n, event) in events.into_iter().enumerate() {
            match event {
                Event::Grant { granted, epoch_step } => {
                    let e = epoch.saturating_add_signed(i64::from(epoch_step)).max(1);
                    let g = grant(n as u128, e, granted, now);
                    let verdict = holder.accept(g, now);
                    let accepted = verdict == GrantVerdict::Accepted;
                    if accepted { epoch = epoch.max(e); }
                    if e < holder.highest_epoch().0 { prop_assert!(!accepted); }
                    grants.insert(g.lease_id, (g, accepted));
                    // A grant that arrives past its usable end is held by no one: stranded whole.
                    if accepted || verdict == GrantVerdict::AlreadyExpired {
                        taken_tokens += g.granted_tokens;
                    }
                }
                // `spend` is a reservation committed at once; done here in its two steps so the
                // test sees how a cost is split across leases.
                Event::Spend { cost, reachable } => match holder.reserve(cost, now, reachable) {
                    Ok(reservation) => {
                        let parts = reservation.lease_parts().to_vec();
                        match holder.commit(reservation) {
                            Spend::Leased(first) => {
                                prop_assert_eq!(Some(first), parts.first().map(|(id, _)| *id));
                                for (id, tokens) in parts {
                                    let (g, accepted) = grants[&id];
                                    prop_assert!(accepted, "only accepted grants are spent");
                                    prop_assert!(now < g.expires_at_ms - 50, "no spend within the margin of the end");
                                    prop_assert!(g.window.contains(now), "a clamped lease admits only in its window");
                                    let total = spent.entry(id).or_default();
                                    *total += tokens;
                                    prop_assert!(*total <= g.granted_tokens);
                                }
                            }
                            Spend::Fallback { window_start_ms } => {
                                prop_assert!(!reachable);
                                let total = fallback_by_window.entry(window_start_ms).or_default();
                                *total += cost;
                                prop_assert!(*total <= fallback);
                            }
                            Spend::Denied { .. } => prop_assert!(false, "a commit always spends"),
                        }
                    }
                    Err(Refusal { retry_after_ms, .. }) => prop_assert!(retry_after_ms >= 1),
                },
                Event::Reserve { cost, reachable } => match holder.reserve(cost, now, reachable) {
                    Ok(reservation) => {
                        prop_assert_eq!(reservation.tokens(), cost);
                        prop_assert!(cost <= 100, "never above a chunk");
                        if reservation.is_fallback() {
                            prop_assert!(!reachable || holder.allocator_silent(now));
                        }
                        // Where it came from, as a commit will say.
                        let source = match reservation.fallback_window_start_ms() {
                            Some(window_start_ms) => Spend::Fallback { window_start_ms },
                            None => Spend::Leased(reservation.lease_parts()[0].0),
                        };
                        let parts = reservation.lease_parts();
                        prop_assert_eq!(parts.is_empty(), reservation.is_fallback());
                        prop_assert_eq!(parts.iter().map(|(_, tokens)| tokens).sum::<u64>(), if parts.is_empty() { 0 } else { cost });
                        for (id, _) in parts {
                            let (g, accepted) = grants[id];
                            prop_assert!(accepted);
                            prop_assert!(now < g.expires_at_ms - 50, "no reservation within the margin of the end");
                        }
                        outstanding.push(Outstanding { reservation, reserved_at: now, source });
                    }
                    Err(Refusal { denial, retry_after_ms }) => {
                        prop_assert!(retry_after_ms >= 1);
                        prop_assert_eq!(denial == Denial::CostAboveChunk, cost > 100);
                    }
                },
                Event::Settle { which, commit } => {
                    if outstanding.is_empty() {
                        continue;
                    }
                    let settled = outstanding.swap_remove(which % outstanding.len());
                    prop_assert!(settled.reserved_at <= now);
                    if commit {
                        let parts = settled.reservation.lease_parts().to_vec();
                        let tokens = settled.reservation.tokens();
                        let spend = holder.commit(settled.reservation);
                        prop_assert_eq!(spend, settled.source);
                        match spend {
                            // Possibly across leases: each part counts on its own lease.
                            Spend::Leased(_) => {
                                for (id, tokens) in parts {
                                    *spent.entry(id).or_default() += tokens;
                                }
                            }
                            Spend::Fallback { window_start_ms } => {
                                let total = fallback_by_window.entry(window_start_ms).or_default();
                                *total += tokens;
                                prop_assert!(*total <= fallback);
                            }
                            Spend::Denied { .. } => prop_assert!(false, "a commit always spends"),
                        }
                    } else {
                        holder.cancel(settled.reservation);
                    }
                }
                Event::Advance { ms } => now += ms,
                Event::Report => {
                    let report = holder.pending_report(now);
                    for line in &report.leases {
                        prop_assert_eq!(line.spent_tokens, spent.get(&line.lease_id).copied().unwrap_or(0));
                    }
                    holder.acknowledge(&report, now);
                }
            }
            let reserved: u64 = outstanding.iter().map(|o| o.reservation.tokens()).sum();
            prop_assert_eq!(holder.reserved_tokens(), reserved);
            for (id, total) in &spent {
                prop_assert!(*total <= grants[id].0.granted_tokens, "no token spent twice");
            }
        }
        // None lost: once every reservation is cancelled, what was granted is spent, stranded, or
        // still spendable.
        for o in outstanding.drain(..) {
            holder.cancel(o.reservation);
        }
        prop_assert_eq!(holder.reserved_tokens(), 0);
        let _ = holder.pending_report(now);
        let spent_total: u64 = spent.values().sum();
        prop_assert_eq!(taken_tokens, spent_total + holder.stranded_tokens() + holder.available_tokens(now));
    }
}

/// Found by the `fallback` drill: in the last moments of a window, a clamped grant would end before
/// the agent may spend from it and be stranded whole, so the holder waits for the next window instead
/// of asking on every request.
#[test]
fn no_renewal_is_asked_for_when_the_window_ends_within_the_margin_and_a_round_trip() {
    let mut holder = PoolHolder::new(config(0));
    let window_end = 4 * MINUTE;
    // Margin 50 ms + round trip 50 ms: the last 100 ms of the window ask for nothing.
    let late = window_end - 100;
    holder.spend(1, late, true);
    assert_eq!(holder.wants(late), None);
    // A grant taken there anyway is stranded on arrival.
    assert_eq!(
        holder.accept(grant(1, 1, 10, late + 60), late + 60),
        GrantVerdict::AlreadyExpired
    );
    assert_eq!(holder.stranded_tokens(), 10);
    // Just before that stretch, and from the next window on, the holder asks again.
    let mut early = PoolHolder::new(config(0));
    early.spend(1, late - 1, true);
    assert!(early.wants(late - 1).is_some());
    holder.spend(1, window_end, true);
    assert!(holder.wants(window_end).is_some());
}

/// A renewal whose answer was lost is asked again with the same lease id (the allocator answers it
/// with the grant it may have committed); a refusal, or the answer arriving, ends that.
#[test]
fn a_lost_renewal_answer_is_asked_again_with_the_same_lease_id() {
    let mut holder = PoolHolder::new(config(0));
    let t0 = 10 * MINUTE + 1_000;
    let first = LeaseId::from_parts(t0, 1);
    let second = LeaseId::from_parts(t0 + 100, 2);
    assert_eq!(holder.renewal_lease_id(first, t0), first);
    holder.renewal_failed(first, true);
    assert_eq!(
        holder.renewal_lease_id(second, t0 + 100),
        first,
        "the lost one again"
    );
    // The answer to the retry arrives: the next renewal is a new lease.
    assert_eq!(
        holder.accept(grant(1, 1, 10, t0), t0 + 100),
        GrantVerdict::Accepted
    );
    assert_eq!(holder.renewal_lease_id(second, t0 + 100), second);
    // A refusal (the pool is gone, a 4xx) is final: nothing to recover.
    holder.renewal_failed(second, false);
    let third = LeaseId::from_parts(t0 + 200, 3);
    assert_eq!(holder.renewal_lease_id(third, t0 + 200), third);
}

/// A lost answer is asked for again only while the allocator surely keeps the grant's record (a
/// window, and at least a minute, past the end of the window the id was made in, less the clocks'
/// allowance); past that the id is given up, so a grant can never be taken twice under one id.
#[test]
fn a_lost_answer_is_given_up_once_its_record_may_be_gone() {
    let t0 = 10 * MINUTE + 1_000;
    let lost = LeaseId::from_parts(t0, 1);
    let until = allot_region_agent::global::holder::lost_answer_recoverable_until_ms(
        &config(0).window,
        lost,
    );
    // Made in [10 min, 11 min): kept until 12 min at least, less 10 s.
    assert_eq!(until, 12 * MINUTE - 10_000);
    let fresh = LeaseId::from_parts(until, 2);
    let mut holder = PoolHolder::new(config(0));
    holder.renewal_failed(lost, true);
    assert_eq!(holder.renewal_lease_id(fresh, until - 1), lost);
    assert_eq!(holder.renewal_lease_id(fresh, until), fresh, "given up");
    assert_eq!(
        holder.renewal_lease_id(LeaseId::from_parts(until + 1, 3), until + 1),
        LeaseId::from_parts(until + 1, 3),
        "and not asked for again"
    );
    // Hour-long windows keep it an hour past the window's end.
    let hourly = HolderConfig {
        window: WindowSpec::Fixed(NonZeroU64::new(60 * MINUTE).expect("non-zero")),
        ..config(0)
    };
    assert_eq!(
        allot_region_agent::global::holder::lost_answer_recoverable_until_ms(&hourly.window, lost),
        2 * 60 * MINUTE - 10_000
    );
    // Longer windows keep a record an hour after its commit, not a window after the window:
    // an id made at t0 is given up an hour later, less the clocks' allowance.
    let daily = HolderConfig {
        window: WindowSpec::Fixed(NonZeroU64::new(24 * 60 * MINUTE).expect("non-zero")),
        ..config(0)
    };
    assert_eq!(
        allot_region_agent::global::holder::lost_answer_recoverable_until_ms(&daily.window, lost),
        t0 + 60 * MINUTE - 10_000
    );
}

/// A lost answer asked again after a failover longer than the lease TTL comes back expired: it
/// is never spent, but it was granted, so the holder reports it final with nothing spent and the
/// ledger counts it stranded, not unreported (a lease whose final report never arrives).
#[test]
fn a_grant_answered_after_its_end_is_reported_final_with_nothing_spent() {
    let mut holder = PoolHolder::new(config(0));
    let t0 = 10 * MINUTE + 1_000;
    let lost = grant(7, 1, 17, t0);
    holder.renewal_failed(lost.lease_id, true);
    let answered_ms = lost.expires_at_ms + 1_000;
    assert_eq!(
        holder.accept(lost, answered_ms),
        GrantVerdict::AlreadyExpired
    );
    assert_eq!(holder.available_tokens(answered_ms), 0, "nothing to spend");
    let report = holder.pending_report(answered_ms);
    let line = report
        .leases
        .iter()
        .find(|line| line.lease_id == lost.lease_id)
        .expect("the late grant owes the ledger its final line");
    assert!(line.final_line);
    assert_eq!(line.spent_tokens, 0);
    // The same answer again is known.
    assert_eq!(
        holder.accept(lost, answered_ms + 1),
        GrantVerdict::Duplicate
    );
}

/// A grant's end is moved onto the agent's clock: the lease lasts what the allocator granted,
/// counted from when the agent asked, whatever the offset between the two clocks.
#[test]
fn a_lease_lasts_its_granted_length_on_the_agents_clock() {
    let issued_at = 10 * MINUTE + 1_000;
    let allocator_grant = grant(1, 1, 10, issued_at);
    assert_eq!(allocator_grant.expires_at_ms, issued_at + 15_000);
    // The agent's clock is 700 ms behind; it asked 20 ms (true time) before the grant was issued.
    let asked_at = issued_at - 700 - 20;
    let local = allocator_grant.on_agent_clock(issued_at, asked_at);
    assert_eq!(local.expires_at_ms, asked_at + 15_000);
    assert_eq!(
        local.window, allocator_grant.window,
        "the window stays the allocator's"
    );
    let mut holder = PoolHolder::new(config(0));
    assert_eq!(holder.accept(local, asked_at + 20), GrantVerdict::Accepted);
    // Spendable until 50 ms before the end on the agent's clock, not after.
    assert!(matches!(
        holder.spend(1, asked_at + 15_000 - 51, true),
        Spend::Leased(_)
    ));
    assert!(!matches!(
        holder.spend(1, asked_at + 15_000 - 50, true),
        Spend::Leased(_)
    ));
    // An allocator that does not say when it issued leaves the grant as it is.
    assert_eq!(allocator_grant.on_agent_clock(0, asked_at), allocator_grant);
}

/// A grant recovered by asking again with the same lease id after its answer was lost is the
/// original grant, answered later than it was issued: the agent times it from its second ask with
/// what was left of it then, so it is never spent past its end on the allocator's clock.
#[test]
fn a_recovered_grant_is_timed_from_what_was_left_when_it_was_answered() {
    let issued_at = 10 * MINUTE + 1_000;
    let allocator_grant = grant(1, 1, 10, issued_at);
    let true_end = allocator_grant.expires_at_ms;
    // The first answer was lost; the retry reaches the allocator 4 s later (the agent's clock 300 ms
    // ahead), and the allocator answers it at once with the stored grant.
    let answered_at = issued_at + 4_000;
    let asked_again_at = answered_at + 300 - 5;
    let local = allocator_grant.on_agent_clock(answered_at, asked_again_at);
    assert_eq!(
        local.expires_at_ms,
        asked_again_at + (true_end - answered_at)
    );
    // On the allocator's clock the agent's end falls before the true end.
    assert!(local.expires_at_ms - 300 <= true_end);
    // Timed from the issue instead (the defect), it would outlive the lease by the retry's delay.
    let timed_from_issue = allocator_grant.on_agent_clock(issued_at, asked_again_at);
    assert!(timed_from_issue.expires_at_ms - 300 > true_end);
    let mut holder = PoolHolder::new(config(0));
    assert_eq!(
        holder.accept(local, asked_again_at + 5),
        GrantVerdict::Accepted
    );
    assert!(!matches!(
        holder.spend(1, local.expires_at_ms - 50, true),
        Spend::Leased(_)
    ));
}

/// With a state directory, fallback is admitted only within a durable claim, which grows a block at
/// a time; a restarted holder takes over the journal: the window's allowance counts as used up to
/// the claim (whatever was admitted after the last journal), and the journaled admits and leases
/// are reported again.
#[test]
fn fallback_stays_within_durable_claims_and_a_restart_never_reopens_the_allowance() {
    let claims = HolderConfig {
        fallback_claim_block_tokens: 3,
        ..config(10)
    };
    let t0 = 30 * MINUTE + 100;
    let mut holder = PoolHolder::new(claims.clone());
    holder.accept(grant(1, 4, 2, t0), t0);
    assert!(matches!(holder.spend(2, t0, false), Spend::Leased(_)));
    // The lease is spent; cut off, a cost of 4 goes to fallback, which needs a claim first.
    assert_eq!(
        holder.reserve(4, t0, false).map(|_| ()),
        Err(Refusal {
            denial: Denial::FallbackUnclaimed,
            retry_after_ms: 1
        })
    );
    let claim = holder.fallback_claim_wanted(4, t0).expect("a claim");
    assert_eq!(claim, (30 * MINUTE, 7), "what is used, the cost, one block");
    let journal = holder.snapshot(Some(claim));
    holder.claim_durable(claim.0, claim.1);
    let first = holder.reserve(4, t0, false).expect("claimed");
    assert_eq!(
        holder.commit(first),
        Spend::Fallback {
            window_start_ms: 30 * MINUTE
        }
    );
    let second = holder.reserve(3, t0, false).expect("within the claim");
    assert_eq!(
        holder.commit(second),
        Spend::Fallback {
            window_start_ms: 30 * MINUTE
        }
    );
    assert_eq!(holder.fallback_claim_wanted(1, t0), Some((30 * MINUTE, 10)));

    // Killed here: the journal was written with the claim, before the 7 admits.
    let mut restarted = PoolHolder::new(claims.clone());
    restarted.restore(&journal);
    // 7 of the allowance of 10 count as used: 3 are left, after a claim.
    assert_eq!(
        restarted.fallback_claim_wanted(3, t0),
        Some((30 * MINUTE, 10))
    );
    restarted.claim_durable(30 * MINUTE, 10);
    let third = restarted
        .reserve(3, t0, false)
        .expect("the rest of the allowance");
    let _ = restarted.commit(third);
    assert_eq!(
        restarted.reserve(1, t0, false).map_err(|r| r.denial),
        Err(Denial::FallbackSpent),
        "never beyond the allowance, across the restart"
    );
    // The journaled lease owes its final line (2 spent); fallback reports what is known admitted.
    let report = restarted.pending_report(t0);
    assert_eq!(report.leases.len(), 1);
    assert!(report.leases[0].final_line && report.leases[0].spent_tokens == 2);
    assert_eq!(
        report.fallback,
        vec![FallbackLine {
            window_start_ms: 30 * MINUTE,
            admitted_tokens: 3
        }]
    );
}

#[derive(Debug, Clone)]
enum Crash {
    Reserve { cost: u64 },
    Settle { which: usize, commit: bool },
    Journal,
    Restart,
    Advance { ms: u64 },
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Fallback under durable claims, with crashes: whatever was journaled and whenever the agent
    /// restarts, the admits of a window over every incarnation stay within the allowance.
    #[test]
    fn crashes_never_reopen_a_windows_fallback_allowance(
        allowance in 1u64..30,
        block in 1u64..8,
        start in 0u64..(1 << 40),
        events in prop::collection::vec(prop_oneof![
            6 => (1u64..6).prop_map(|cost| Crash::Reserve { cost }),
            5 => (any::<usize>(), any::<bool>()).prop_map(|(which, commit)| Crash::Settle { which, commit }),
            2 => Just(Crash::Journal),
            1 => Just(Crash::Restart),
            2 => (0u64..30_000).prop_map(|ms| Crash::Advance { ms }),
        ], 1..200),
    ) {
        let config = HolderConfig { fallback_claim_block_tokens: block, ..config(allowance) };
        let mut holder = PoolHolder::new(config.clone());
        let mut journal = HolderSnapshot::default();
        let mut now = start;
        let mut outstanding: Vec<Reservation> = Vec::new();
        let mut admitted: HashMap<u64, u64> = HashMap::new();
        for event in events {
            match event {
                Crash::Reserve { cost } => match holder.reserve(cost, now, false) {
                    Ok(reservation) => outstanding.push(reservation),
                    Err(Refusal { denial: Denial::FallbackUnclaimed, .. }) => {
                        let claim = holder.fallback_claim_wanted(cost, now).expect("wanted");
                        // Written with the claim, then durable.
                        journal = holder.snapshot(Some(claim));
                        holder.claim_durable(claim.0, claim.1);
                        prop_assert!(claim.1 <= allowance);
                    }
                    Err(refusal) => prop_assert!(matches!(
                        refusal.denial,
                        Denial::FallbackSpent | Denial::CostAboveChunk | Denial::FallbackAtWindowEdge
                    )),
                },
                Crash::Settle { which, commit } => {
                    if outstanding.is_empty() { continue; }
                    let reservation = outstanding.swap_remove(which % outstanding.len());
                    if commit {
                        let tokens = reservation.tokens();
                        if let Spend::Fallback { window_start_ms } = holder.commit(reservation) {
                            let total = admitted.entry(window_start_ms).or_default();
                            *total += tokens;
                            prop_assert!(*total <= allowance, "{total} > {allowance} in one window");
                        }
                    } else {
                        holder.cancel(reservation);
                    }
                }
                Crash::Journal => journal = holder.snapshot(None),
                Crash::Restart => {
                    // Killed: reservations in flight are gone with the process.
                    outstanding.clear();
                    holder = PoolHolder::new(config.clone());
                    holder.restore(&journal);
                }
                Crash::Advance { ms } => now += ms,
            }
        }
    }
}

/// A settled metered request's extra cost: paid at once from the leases, owed up to the debt the
/// holder may carry, written off beyond it; the debt is paid from the next grant before anything
/// is reserved, and survives a restart through the journal.
#[test]
fn extra_cost_is_paid_then_owed_then_written_off_and_debt_is_paid_first() {
    let mut holder = PoolHolder::new(HolderConfig {
        settle_debt_tokens: 20,
        ..config(0)
    });
    let t0 = 5 * MINUTE + 1_000;
    holder.accept(grant(1, 1, 10, t0), t0);
    assert!(matches!(holder.spend(4, t0, true), Spend::Leased(_)));
    // 6 held: 6 paid, 20 owed, the rest (4) written off.
    let charged = holder.charge(30, t0);
    assert_eq!(
        charged,
        DebtCharge {
            paid_tokens: 6,
            owed_tokens: 20,
            written_off_tokens: 4
        }
    );
    assert_eq!(holder.debt_tokens(), 20);
    // Owing, every further extra is written off; nothing is held to reserve.
    assert_eq!(holder.charge(3, t0).written_off_tokens, 3);
    assert!(holder.reserve(1, t0, true).is_err(), "nothing held");
    // The next grant pays the debt first: 15 of 25, then 5 of what is left.
    holder.accept(grant(2, 1, 15, t0 + 1), t0 + 1);
    assert_eq!(holder.debt_tokens(), 5);
    assert!(holder.reserve(1, t0 + 1, true).is_err(), "debt first");
    let snapshot = holder.snapshot(None);
    assert_eq!(snapshot.debt_tokens, 5, "the journal keeps the debt");
    let mut restarted = PoolHolder::new(holder.config().clone());
    restarted.restore(&snapshot);
    assert_eq!(restarted.debt_tokens(), 5);
    holder.accept(grant(3, 1, 8, t0 + 2), t0 + 2);
    assert_eq!(holder.debt_tokens(), 0);
    assert_eq!(holder.available_tokens(t0 + 2), 3);
    let spent: u64 = holder
        .pending_report(t0 + 2)
        .leases
        .iter()
        .map(|line| line.spent_tokens)
        .sum();
    assert_eq!(
        spent,
        4 + 6 + 20,
        "the request, the extra paid, the debt paid"
    );
    assert!(
        !restarted.is_idle(t0 + 10 * POOL_IDLE_MS, POOL_IDLE_MS),
        "a holder owing debt is never forgotten"
    );
}

const POOL_IDLE_MS: u64 = 600_000;

#[derive(Debug, Clone)]
enum DebtEvent {
    Grant(u64),
    Spend(u64),
    Charge(u64),
    Advance(u64),
}

fn debt_events() -> impl Strategy<Value = Vec<DebtEvent>> {
    prop::collection::vec(
        prop_oneof![
            (1u64..40).prop_map(DebtEvent::Grant),
            (1u64..10).prop_map(DebtEvent::Spend),
            (0u64..60).prop_map(DebtEvent::Charge),
            (1u64..20_000).prop_map(DebtEvent::Advance),
        ],
        1..60,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Over random grants, spends, settlements and time: every extra token is paid, owed or
    /// written off (none twice); the debt never exceeds what the holder may carry; a lease is
    /// never spent past its grant; and what the leases report spent is exactly the requests'
    /// spends plus the extra paid (at once, or later as debt).
    #[test]
    fn settle_debt_is_bounded_and_every_token_is_accounted_for(
        cap in 0u64..50,
        start in 0u64..(1 << 40),
        events in debt_events(),
    ) {
        let mut holder = PoolHolder::new(HolderConfig { settle_debt_tokens: cap, ..config(0) });
        let mut now = start;
        let (mut requests, mut extra, mut written_off) = (0u64, 0u64, 0u64);
        let mut granted: HashMap<LeaseId, u64> = HashMap::new();
        for (n, event) in events.into_iter().enumerate() {
            match event {
                DebtEvent::Grant(tokens) => {
                    let g = grant(n as u128, 1, tokens, now);
                    granted.insert(g.lease_id, tokens);
                    holder.accept(g, now);
                }
                DebtEvent::Spend(cost) => {
                    if let Spend::Leased(_) = holder.spend(cost, now, true) {
                        requests += cost;
                    }
                }
                DebtEvent::Charge(tokens) => {
                    let charged = holder.charge(tokens, now);
                    prop_assert_eq!(charged.paid_tokens + charged.owed_tokens + charged.written_off_tokens, tokens);
                    extra += tokens;
                    written_off += charged.written_off_tokens;
                }
                DebtEvent::Advance(ms) => now += ms,
            }
            prop_assert!(holder.debt_tokens() <= cap, "the debt stays within what may be carried");
        }
        let lines = holder.pending_report(now).leases;
        let mut spent = 0;
        for line in &lines {
            prop_assert!(line.spent_tokens <= granted[&line.lease_id], "never past a grant");
            spent += line.spent_tokens;
        }
        prop_assert_eq!(spent, requests + extra - written_off - holder.debt_tokens());
    }
}

/// The protocol's renewal, as the agent and the drills take it: one in flight at a time; an
/// unanswered renewal is asked again with its own lease id (so a grant committed but never
/// answered is recovered, not granted twice); a refusal or a gone pool forgets the id; a grant of
/// less than was wanted is partial, a stale epoch's grant is not held.
#[test]
fn the_renewal_steps_recover_lost_answers_and_ask_one_at_a_time() {
    use allot_region_agent::global::driver::{
        RenewalAnswer, RenewalOutcome, finish_renewal, start_renewal,
    };
    let mut holder = PoolHolder::new(config(0));
    let t0 = 3 * MINUTE;
    let fresh = |n: u128| LeaseId::from_parts(t0, n);
    assert_eq!(
        start_renewal(&mut holder, t0, fresh(1)),
        None,
        "no demand yet"
    );
    holder.spend(1, t0, true);
    let ask = start_renewal(&mut holder, t0, fresh(1)).expect("wanted");
    assert_eq!((ask.lease_id, ask.want_tokens), (fresh(1), 4));
    assert_eq!(
        start_renewal(&mut holder, t0, fresh(2)),
        None,
        "one in flight"
    );
    let outcome = finish_renewal(&mut holder, &ask, RenewalAnswer::Unanswered, t0 + 10);
    assert_eq!(outcome, RenewalOutcome::Failed);
    let again = start_renewal(&mut holder, t0 + 20, fresh(3)).expect("wanted again");
    assert_eq!(
        again.lease_id,
        fresh(1),
        "the unanswered id, not a fresh one"
    );
    let refused = finish_renewal(&mut holder, &again, RenewalAnswer::Refused, t0 + 30);
    assert_eq!(refused, RenewalOutcome::Failed);
    let next = start_renewal(&mut holder, t0 + 40, fresh(4)).expect("wanted");
    assert_eq!(next.lease_id, fresh(4), "a refusal forgets the id");
    let partial = LeaseGrant {
        lease_id: next.lease_id,
        ..grant(4, 2, next.want_tokens - 1, t0 + 40)
    };
    assert_eq!(
        finish_renewal(&mut holder, &next, RenewalAnswer::Granted(partial), t0 + 50),
        RenewalOutcome::Partial
    );
    assert!(matches!(holder.spend(1, t0 + 60, true), Spend::Leased(_)));
    // A grant of an older epoch than one already held is ignored.
    for _ in 0..2 {
        holder.spend(1, t0 + 4_000, true);
    }
    let stale_ask = start_renewal(&mut holder, t0 + 5_000, fresh(5)).expect("running low");
    let stale = LeaseGrant {
        lease_id: stale_ask.lease_id,
        ..grant(5, 1, 10, t0 + 5_000)
    };
    let outcome = finish_renewal(
        &mut holder,
        &stale_ask,
        RenewalAnswer::Granted(stale),
        t0 + 5_010,
    );
    assert_eq!(outcome, RenewalOutcome::StaleEpoch);
    assert!(!outcome.held());
}

/// A report round, as the agent and the drills take it: one part per window, every line in one
/// part; a part the allocator took is done with, one it did not take is owed again, whole.
#[test]
fn the_report_steps_split_by_window_and_keep_what_was_not_taken() {
    use allot_region_agent::global::driver::{finish_report, start_report};
    let mut holder = PoolHolder::new(config(5));
    let t0 = 3 * MINUTE;
    assert!(start_report(&mut holder, t0).is_empty(), "nothing owed yet");
    assert_eq!(
        holder.accept(grant(1, 1, 3, t0), t0),
        GrantVerdict::Accepted
    );
    assert!(matches!(holder.spend(2, t0 + 10, true), Spend::Leased(_)));
    // The next window: the old lease has ended; the allocator is cut off, so fallback admits.
    let t1 = t0 + MINUTE + 1_000;
    assert!(matches!(holder.spend(1, t1, false), Spend::Fallback { .. }));
    let parts = start_report(&mut holder, t1);
    let windows: Vec<u64> = parts.iter().map(|p| p.window_start_ms).collect();
    assert_eq!(
        windows,
        vec![t0, t0 + MINUTE],
        "oldest first, one part each"
    );
    assert_eq!(parts[0].lines.leases.len(), 1);
    assert!(
        parts[0].lines.leases[0].final_line,
        "the ended lease reports final"
    );
    assert_eq!(parts[0].lines.leases[0].spent_tokens, 2);
    assert_eq!(parts[1].lines.fallback.len(), 1);
    assert_eq!(parts[1].lines.fallback[0].admitted_tokens, 1);
    // Only the old window's part is taken: the fallback line is owed again, the final line not.
    finish_report(&mut holder, &parts[0], t1);
    let again = start_report(&mut holder, t1 + 10);
    assert_eq!(again.len(), 1);
    assert_eq!(again[0], parts[1]);
    finish_report(&mut holder, &again[0], t1 + 10);
    assert!(
        start_report(&mut holder, t1 + 20).is_empty(),
        "all reported"
    );
}

/// A holder of 1 s windows whose agent's clock may be `margin` ms off the allocator's.
fn skewed_config(fallback: u64, margin: u64) -> HolderConfig {
    HolderConfig {
        window: WindowSpec::Fixed(NonZeroU64::new(1_000).expect("non-zero")),
        clock_margin_ms: margin,
        ..config(fallback)
    }
}

/// Fallback opens the clock margin after a window's start and closes the clock margin plus the
/// expiry margin before its end; outside, the refusal says when it opens again.
#[test]
fn fallback_waits_out_the_clock_margin_at_a_windows_edges() {
    let mut holder = PoolHolder::new(skewed_config(10, 100));
    let start = 7_000;
    let refused_for = |holder: &mut PoolHolder, now: u64| match holder.reserve(1, now, false) {
        Err(Refusal {
            denial: Denial::FallbackAtWindowEdge,
            retry_after_ms,
        }) => retry_after_ms,
        other => panic!("at {now}: expected an edge refusal, got {other:?}"),
    };
    assert_eq!(refused_for(&mut holder, start), 100);
    assert_eq!(refused_for(&mut holder, start + 99), 1);
    assert!(matches!(
        holder.spend(1, start + 100, false),
        Spend::Fallback { .. }
    ));
    // The end: 100 ms of clock margin and 50 of expiry margin.
    assert!(matches!(
        holder.spend(1, start + 849, false),
        Spend::Fallback { .. }
    ));
    assert_eq!(
        refused_for(&mut holder, start + 850),
        250,
        "until the next window opens"
    );
    assert_eq!(refused_for(&mut holder, start + 1_050), 50);
    assert_eq!(holder.spendable_tokens(start + 900, false), 0);
    assert_eq!(holder.spendable_tokens(start + 500, false), 8);
    // A reservation (a sub-lease's) must be spent before the span closes.
    let reservation = holder
        .reserve_for_sublease(3, start + 500, false)
        .expect("fallback in the span");
    assert_eq!(holder.usable_until_ms(&reservation), start + 850);
    // Margins that take the whole window leave no fallback at all: it fails safe, not open.
    let mut closed = PoolHolder::new(skewed_config(10, 500));
    assert_eq!(closed.spendable_tokens(start + 500, false), 0);
    assert!(matches!(
        closed.reserve(1, start + 500, false),
        Err(Refusal {
            denial: Denial::FallbackAtWindowEdge,
            ..
        })
    ));
}

#[derive(Debug, Clone)]
enum Skewed {
    /// Real time moves on; the agent's clock is then `offset` ms off it (within the margin).
    Advance {
        ms: u64,
        offset: i64,
    },
    Reserve {
        cost: u64,
    },
    /// An outstanding reservation is committed or cancelled.
    Settle {
        which: usize,
        commit: bool,
    },
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Whatever the agent's clock reads within the margin of the allocator's (ahead, behind,
    /// stepping between), what it admits in fallback in any window of the allocator's clock stays
    /// within the allowance: every admit lands in the window its own clock named.
    #[test]
    fn fallback_stays_within_the_allowance_on_the_allocators_clock(
        allowance in 1u64..8,
        margin in 0u64..300,
        start in 0u64..(1 << 40),
        events in prop::collection::vec(prop_oneof![
            3 => (1u64..400, -300i64..300).prop_map(|(ms, offset)| Skewed::Advance { ms, offset }),
            4 => (1u64..3).prop_map(|cost| Skewed::Reserve { cost }),
            3 => (any::<usize>(), any::<bool>()).prop_map(|(which, commit)| Skewed::Settle { which, commit }),
        ], 1..300),
    ) {
        let config = skewed_config(allowance, margin);
        let mut holder = PoolHolder::new(config.clone());
        let bound = i64::try_from(margin).expect("a small margin");
        let mut real = start;
        let mut agent = start;
        let mut outstanding: Vec<(Reservation, u64)> = Vec::new();
        let mut admitted_by_real_window: HashMap<u64, u64> = HashMap::new();
        for event in events {
            match event {
                Skewed::Advance { ms, offset } => {
                    real += ms;
                    // The agent's clock never runs backwards, and stays within the margin.
                    agent = agent.max(real.saturating_add_signed(offset.clamp(-bound, bound)));
                }
                Skewed::Reserve { cost } => {
                    if let Ok(reservation) = holder.reserve(cost, agent, false) {
                        outstanding.push((reservation, real));
                    }
                }
                Skewed::Settle { which, commit } => {
                    if outstanding.is_empty() {
                        continue;
                    }
                    let (reservation, reserved_real) =
                        outstanding.swap_remove(which % outstanding.len());
                    let cost = reservation.tokens();
                    if !commit {
                        holder.cancel(reservation);
                        continue;
                    }
                    holder.commit(reservation);
                    // The request passes within the hold (the expiry margin) of its reservation:
                    // that whole span lies in one window of the allocator's clock.
                    let window = reserved_real - reserved_real % 1_000;
                    let passed_by = reserved_real + config.expiry_margin_ms - 1;
                    prop_assert_eq!(passed_by - passed_by % 1_000, window);
                    let count = admitted_by_real_window.entry(window).or_default();
                    *count += cost;
                    prop_assert!(
                        *count <= allowance,
                        "{} admitted in fallback in the allocator's window at {}, allowance {}",
                        *count, window, allowance
                    );
                }
            }
        }
    }
}

/// An allowance presumed used (an earlier run may have admitted it unreported) survives a restart
/// from the journal as presumed: still not spendable, and not owed to the ledger, so it never
/// keeps the restored run from ending cleanly.
#[test]
fn a_presumed_allowance_survives_the_journal_as_presumed() {
    let mut holder = PoolHolder::new(config(10));
    let now = 10 * MINUTE + 1_000;
    let window_start = 10 * MINUTE;
    holder.presume_fallback_used(window_start);
    assert!(holder.fallback_settled_from(window_start));
    let mut restored = PoolHolder::new(config(10));
    restored.restore(&holder.snapshot(None));
    assert_eq!(restored.spendable_tokens(now, false), 0, "still used");
    assert!(
        restored.fallback_settled_from(window_start),
        "nothing of it is owed to the ledger"
    );
}
