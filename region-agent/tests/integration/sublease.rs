//! Sub-leases over random inputs: an assignment written for a carve never lets a gateway admit more
//! than the carve, whatever its arrivals; and a holder's sub-lease reservations, drawn, cut short
//! and withheld in any order, never spend a token twice, never lose one, and never let the agent
//! hand out more than its leases plus the fallback allowance.

use std::num::NonZeroU64;

use allot_region_agent::global::sublease::{BucketStrategy, EnforcedBucket, Spread, share};
use allot_region_agent::global::*;
use allot_shared::ids::{Epoch, LeaseId};
use allot_shared::window::{Window, WindowSpec};
use proptest::prelude::*;

const MINUTE: u64 = 60_000;

fn config(fallback: u64) -> HolderConfig {
    HolderConfig {
        window: WindowSpec::Fixed(NonZeroU64::new(MINUTE).expect("non-zero")),
        chunk_tokens: 500,
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Whatever the carve, time to live and arrivals, an enforced assignment admits at most its
    /// carve, and only within its time to live.
    #[test]
    fn an_assignment_never_admits_beyond_its_carve(
        requests in 1u64..5_000,
        ttl_ms in 1u64..120_000,
        gaps in prop::collection::vec(0u64..400, 1..2_000),
    ) {
        let Some(Spread { strategy, ttl_ms }) = BucketStrategy::spreading(requests, ttl_ms) else {
            prop_assert!(requests < 2 || ttl_ms < 1_000, "{} over {} ms is assignable", requests, ttl_ms);
            return Ok(());
        };
        prop_assert!(ttl_ms % 1_000 == 0 && strategy.fill_interval_ms == 1_000, "whole seconds");
        prop_assert!(strategy.admissible_requests(ttl_ms) <= requests);
        let start_ms = 1_000_000;
        let mut bucket = EnforcedBucket::new(strategy, ttl_ms, start_ms);
        let mut now_ms = start_ms;
        let mut admitted = 0u64;
        for gap in gaps {
            now_ms += gap;
            if bucket.try_admit(now_ms) {
                prop_assert!(now_ms < start_ms + ttl_ms, "admitted after its time to live");
                admitted += 1;
            }
        }
        prop_assert!(admitted <= requests, "{} admitted of a carve of {}", admitted, requests);
    }

    /// Shares never exceed what is available, nor what was wanted.
    #[test]
    fn shares_stay_within_what_is_held(
        available in 0u64..1_000_000,
        wants in prop::collection::vec(1u64..100_000, 1..20),
    ) {
        let total: u64 = wants.iter().sum();
        let mut left = available;
        for wanted in &wants {
            let given = share(left, *wanted, total, 2);
            prop_assert!(given <= *wanted && given <= left);
            left -= given;
        }
    }

    /// Random sub-lease lifecycles on one holder: what is drawn is what the report says was
    /// spent, and leases never give more than they granted (drawn + held + withheld + unspent).
    #[test]
    fn sublease_reservations_conserve_every_token(
        ops in prop::collection::vec((0u8..5, 1u64..200, 0u64..3_000), 1..200),
        partitioned in any::<bool>(),
    ) {
        let fallback = 300;
        let mut holder = PoolHolder::new(config(fallback));
        let t0 = 10 * MINUTE + 1_000;
        let window = Window::containing(t0, NonZeroU64::new(MINUTE).expect("non-zero"));
        let mut granted = 0u64;
        if !partitioned {
            for n in 0..2u64 {
                let grant = LeaseGrant {
                    lease_id: LeaseId::from_parts(t0, u128::from(n) + 1),
                    epoch: Epoch(1),
                    granted_tokens: 400,
                    window,
                    expires_at_ms: (t0 + 15_000 + n * 10_000).min(window.end_ms),
                    retry_after_ms: 0,
                    returnable: false,
                };
                prop_assert_eq!(holder.accept(grant, t0), GrantVerdict::Accepted);
                granted += 400;
            }
        }
        let mut open: Vec<Reservation> = Vec::new();
        let mut drawn = 0u64;
        let mut now_ms = t0;
        for (op, tokens, advance) in ops {
            now_ms = (now_ms + advance).min(window.end_ms - 1);
            match op {
                0 => {
                    if let Ok(reservation) =
                        holder.reserve_for_sublease(tokens, now_ms, !partitioned)
                    {
                        open.push(reservation);
                    }
                }
                1 => {
                    if let Some(reservation) = open.last_mut() {
                        drawn += holder.draw(reservation, tokens, now_ms);
                    }
                }
                2 => {
                    if let Some(reservation) = open.last_mut() {
                        holder.give_back(reservation, tokens);
                    }
                }
                3 => {
                    if let Some(reservation) = open.pop() {
                        holder.withhold(reservation);
                    }
                }
                _ => {
                    if let Some(reservation) = open.pop() {
                        holder.cancel(reservation);
                    }
                }
            }
            let held: u64 = open.iter().map(Reservation::tokens).sum();
            prop_assert_eq!(holder.reserved_tokens(), held, "reservations are what is held");
        }
        for reservation in open.drain(..) {
            holder.withhold(reservation);
        }
        let report = holder.pending_report(window.end_ms + 1);
        let spent: u64 = report.leases.iter().map(|line| line.spent_tokens).sum();
        let fallback_admitted: u64 = report.fallback.iter().map(|line| line.admitted_tokens).sum();
        prop_assert_eq!(spent + fallback_admitted, drawn, "drawn is reported, once");
        prop_assert!(spent <= granted, "{} spent of {} granted", spent, granted);
        prop_assert!(fallback_admitted <= fallback);
        prop_assert!(report.leases.iter().all(|line| line.final_line), "every lease settles");
    }
}
