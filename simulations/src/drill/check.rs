//! The checks a drill's history must pass: per tenant and window, the invariants (admitted within
//! the bound with each of its terms, grants within the pool, leased spend within the grants,
//! fallback within the allowance, carry-over within its term, nothing spent past a lease's end);
//! over the whole run, the scenario's expected outcome.
//!
//! Windows are checked as they close, so a 1,000-tenant day keeps one window of per-tenant records
//! in memory, not a day's.

use allot_shared::lease::OvershootBound;
use allot_shared::overrides::PoolOverride;
use allot_shared::window::{Window, WindowSpec};

use super::results::{MAX_VIOLATION_LINES, RegionWindow, WindowRecord};
use super::scenario::{Expectation, Scenario};

/// Per-tenant records of the window in progress, checked and summed when it closes.
pub(super) struct TenantChecker {
    tenant_names: Vec<String>,
    region_names: Vec<String>,
    bound: OvershootBound,
    fallback_per_region_tokens: u64,
    spend_past_end_expected: bool,
    /// The first window's start, epoch ms: offsets are measured from it.
    base_ms: u64,
    /// Offset of the window in progress, ms since the start.
    offset_ms: u64,
    /// `[tenant][region]` of the window in progress.
    current: Vec<Vec<RegionWindow>>,
    /// Lost grant records per tenant in the window in progress.
    lost: Vec<u64>,
    /// How windows are cut (to find the window in progress from its offset).
    window_spec: Option<WindowSpec>,
    /// Each tenant's pool overrides, as the allocator stored them.
    overrides: Vec<Vec<PoolOverride>>,
    windows: Vec<WindowRecord>,
    /// What failed, at most [`MAX_VIOLATION_LINES`] lines.
    pub violations: Vec<String>,
    /// Failures beyond the listed lines.
    pub violations_not_listed: u64,
}

impl TenantChecker {
    pub(super) fn new(
        scenario: &Scenario,
        bound: OvershootBound,
        tenants: usize,
        regions: usize,
    ) -> Self {
        let tenant_names = if tenants == 1 {
            vec![String::new()]
        } else {
            (0..tenants).map(|t| format!("tenant t{t:05} ")).collect()
        };
        Self {
            tenant_names,
            region_names: scenario.regions.iter().map(|p| p.region.clone()).collect(),
            bound,
            fallback_per_region_tokens: scenario.fallback_per_region_tokens,
            spend_past_end_expected: scenario.expect == Expectation::SpendPastLeaseEnd,
            base_ms: scenario
                .windows()
                .map_or(super::results::START_MS, |windows| windows.base_ms),
            offset_ms: 0,
            current: vec![vec![RegionWindow::default(); regions]; tenants],
            lost: vec![0; tenants],
            window_spec: scenario.windows().ok().map(|windows| windows.spec),
            overrides: vec![Vec::new(); tenants],
            windows: Vec::new(),
            violations: Vec::new(),
            violations_not_listed: 0,
        }
    }

    /// The record of `tenant` in region `region` for the window in progress.
    pub(super) fn record(&mut self, tenant: usize, region: usize) -> &mut RegionWindow {
        &mut self.current[tenant][region]
    }

    /// Tokens granted to `tenant` in the window in progress, over all regions, and of them those
    /// taken back (grantable again).
    pub(super) fn granted_in_window(&self, tenant: usize) -> (u64, u64) {
        let records = &self.current[tenant];
        let granted: u64 = records.iter().map(|r| r.granted_tokens).sum();
        let returned: u64 = records.iter().map(|r| r.returned_tokens).sum();
        (granted, returned)
    }

    /// Records a grant (attributed to the window in progress, which is the window the allocator
    /// granted it in: grants are recorded when made).
    pub(super) fn add_granted(
        &mut self,
        tenant: usize,
        region: usize,
        window_start_ms: u64,
        tokens: u64,
    ) {
        debug_assert_eq!(
            window_start_ms - self.base_ms,
            self.offset_ms,
            "grants are made in the window in progress"
        );
        self.current[tenant][region].granted_tokens += tokens;
    }

    /// Takes `tenant`'s pool overrides as they stand now (made or ended).
    pub(super) fn set_overrides(&mut self, tenant: usize, overrides: Vec<PoolOverride>) {
        self.overrides[tenant] = overrides;
    }

    /// The bound `tenant`'s window in progress is held to: its terms with the highest limit in
    /// force during the window.
    fn bound_of(&self, tenant: usize) -> OvershootBound {
        let overrides = &self.overrides[tenant];
        let Some(spec) = self.window_spec.as_ref().filter(|_| !overrides.is_empty()) else {
            return self.bound;
        };
        let window: Window = spec.containing(self.base_ms + self.offset_ms);
        OvershootBound {
            limit_tokens: allot_shared::overrides::window_limit(
                self.bound.limit_tokens,
                overrides,
                window,
            ),
            ..self.bound
        }
    }

    /// Records grant records a failover lost for `tenant` in the window in progress.
    pub(super) fn add_lost(&mut self, tenant: usize, tokens: u64) {
        self.lost[tenant] += tokens;
    }

    /// Closes the window in progress when `offset_ms` starts a new one.
    pub(super) fn roll_to(&mut self, offset_ms: u64) {
        if offset_ms != self.offset_ms {
            self.close();
            self.offset_ms = offset_ms;
        }
    }

    /// Closes the last window and returns every window's sums.
    pub(super) fn finish(&mut self) -> Vec<WindowRecord> {
        self.close();
        std::mem::take(&mut self.windows)
    }

    fn violation(&mut self, line: String) {
        if self.violations.len() < MAX_VIOLATION_LINES {
            self.violations.push(line);
        } else {
            self.violations_not_listed += 1;
        }
    }

    /// Checks the window in progress as it closes: each tenant's records against every invariant,
    /// then their sums over tenants kept as the window's record.
    ///
    /// Long by design: each tenant's figures (admitted, granted, leased, carried over, lost grant
    /// records) are summed once and checked against the one bound built from them, in the same pass
    /// that adds them to the window's sums; split, every invariant would sum the same records again
    /// or take them all as arguments.
    fn close(&mut self) {
        let regions = self.region_names.len();
        let mut sum = vec![RegionWindow::default(); regions];
        let mut lost_sum = 0;
        let at = self.offset_ms / 1_000;
        let current = std::mem::replace(
            &mut self.current,
            vec![vec![RegionWindow::default(); regions]; self.tenant_names.len()],
        );
        let lost = std::mem::replace(&mut self.lost, vec![0; self.tenant_names.len()]);
        let mut any = false;
        let limit_tokens: u64 = (0..current.len())
            .map(|t| self.bound_of(t).limit_tokens)
            .sum();
        for (t, records) in current.iter().enumerate() {
            let who = self.tenant_names[t].clone();
            let admitted: u64 = records.iter().map(RegionWindow::consumed).sum();
            let granted: u64 = records.iter().map(|r| r.granted_tokens).sum();
            // Tokens taken back are granted again: what the window's leases may spend is what
            // was granted less what came back.
            let returned: u64 = records.iter().map(|r| r.returned_tokens).sum();
            let leased: u64 = records.iter().map(|r| r.leased).sum();
            let carried: u64 = records.iter().map(|r| r.carried_over).sum();
            let bound = OvershootBound {
                lost_grant_record_tokens: lost[t],
                ..self.bound_of(t)
            };
            if !bound.holds(admitted) {
                self.violation(format!(
                    "{who}window {at}s admitted {admitted} > bound {}",
                    bound.total_tokens()
                ));
            }
            if granted.saturating_sub(returned) > bound.limit_tokens + lost[t] {
                self.violation(format!(
                    "{who}window {at}s granted {granted} > the pools' limits {} ({returned} of it taken back)",
                    bound.limit_tokens
                ));
            }
            if leased > granted {
                self.violation(format!(
                    "{who}window {at}s spent {leased} leased tokens of {granted} granted"
                ));
            }
            for (r, record) in records.iter().enumerate() {
                if record.fallback > self.fallback_per_region_tokens {
                    let region = self.region_names[r].clone();
                    self.violation(format!(
                        "{who}window {at}s region {region} admitted {} in fallback > allowance {}",
                        record.fallback, self.fallback_per_region_tokens
                    ));
                }
                if record.denials_that_debited > 0 {
                    let region = self.region_names[r].clone();
                    self.violation(format!(
                        "{who}window {at}s region {region}: {} regional denials debited the pool",
                        record.denials_that_debited
                    ));
                }
                if record.spent_after_lease_end > 0 && !self.spend_past_end_expected {
                    let region = self.region_names[r].clone();
                    self.violation(format!(
                        "{who}window {at}s region {region} spent {} tokens after their lease's end",
                        record.spent_after_lease_end
                    ));
                }
            }
            // Expected late spends (a clock beyond the margin) that crossed into this window are
            // carry-over of a clamped lease: the same fault, reported once.
            let late: u64 = records.iter().map(|r| r.spent_after_lease_end).sum();
            let excused = if self.spend_past_end_expected {
                late
            } else {
                0
            };
            if carried > bound.unclamped_carry_over_tokens + excused {
                self.violation(format!(
                    "{who}window {at}s carried over {carried} > term {}",
                    bound.unclamped_carry_over_tokens
                ));
            }
            for (total, record) in sum.iter_mut().zip(records) {
                any |= *record != RegionWindow::default();
                total.add(record);
            }
            lost_sum += lost[t];
        }
        if any || lost_sum > 0 {
            self.windows.push(WindowRecord {
                offset_ms: self.offset_ms,
                lost_grant_record_tokens: lost_sum,
                regions: sum,
                limit_tokens,
            });
        }
    }
}

/// The scenario's expected outcome, over the run's windows (summed over tenants: each tenant has
/// the same pool and demand, so the per-tenant figures scale by the tenant count). Long by design:
/// one short arm per expectation, read as a table.
pub(super) fn check_expectation(
    scenario: &Scenario,
    windows: &[WindowRecord],
    violations: &mut Vec<String>,
) {
    let tenants = scenario.tenants;
    let regions = scenario.regions.len() as u64;
    let limit = scenario.limit_tokens * tenants;
    let max_admitted = windows
        .iter()
        .map(|w| w.sum(RegionWindow::admitted))
        .max()
        .unwrap_or(0);
    let total =
        |field: fn(&RegionWindow) -> u64| -> u64 { windows.iter().map(|w| w.sum(field)).sum() };
    let total_fallback = total(|r| r.fallback);
    let total_carried = total(|r| r.carried_over);
    let denied_while_left = total(|r| r.denied_while_tokens_left);
    let spent_after_end = total(|r| r.spent_after_lease_end);
    if let Some(most_ms) = scenario.max_wait_ms {
        let waited_ms = windows
            .iter()
            .flat_map(|w| w.regions.iter().map(|r| r.max_wait_ms))
            .max()
            .unwrap_or(0);
        if waited_ms > most_ms {
            violations.push(format!(
                "a decision waited {waited_ms} ms for a grant, more than {most_ms} ms"
            ));
        }
    }
    match scenario.expect {
        Expectation::NoOvershoot => {
            if max_admitted > limit {
                violations.push(format!(
                    "expected no overshoot; a window admitted {max_admitted} > G {limit}"
                ));
            }
            if total_fallback + total_carried > 0 {
                violations.push("expected neither fallback nor carry-over".to_owned());
            }
            // Clamped leases strand what is held when the window ends: less than two chunks per
            // region (a holder asks for more only below its watermark, at most a chunk, and is
            // granted at most a chunk), plus what a crashed agent held.
            let stranded_cap = 2 * scenario.chunk_tokens * regions * tenants;
            let restarts = scenario
                .faults
                .iter()
                .filter(|f| matches!(f, super::scenario::Fault::AgentRestart { .. }))
                .count() as u64;
            for window in windows {
                let stranded = window.sum(|r| r.stranded_tokens);
                if stranded > stranded_cap * (1 + restarts) {
                    violations.push(format!(
                        "window {}s stranded {stranded} > 2 chunks x regions {stranded_cap}",
                        window.offset_ms / 1_000
                    ));
                }
            }
        }
        Expectation::FallbackWithinAllowance => {
            if total_fallback == 0 {
                violations.push("expected fallback admits during the fault".to_owned());
            }
            let most = limit + scenario.fallback_per_region_tokens * regions * tenants;
            if max_admitted > most {
                violations.push(format!(
                    "expected at most G + fallback x regions ({most}); a window admitted {max_admitted}"
                ));
            }
        }
        Expectation::OvershootWithinLostRecords => {
            // How much the failover loses, and whether that shows as an overshoot, depends on
            // where it falls in its window (the drills' tests show both for the scenario's own
            // seed); that any overshoot stays within what was lost is checked per window, for
            // every seed.
            if total_fallback + total_carried > 0 {
                violations.push("expected neither fallback nor carry-over".to_owned());
            }
        }
        Expectation::OvershootAcrossRegions => {
            if max_admitted <= limit || max_admitted > limit * regions {
                violations.push(format!(
                    "expected a window above G {limit} and within regions x G; the most was {max_admitted}"
                ));
            }
        }
        Expectation::DeniedWhileTokensLeft => {
            if max_admitted > limit {
                violations.push(format!("a window admitted {max_admitted} > G"));
            }
            if denied_while_left == 0 {
                violations.push("expected denials while the quota had tokens".to_owned());
            }
        }
        Expectation::NoDenialWhileTokensLeft => {
            if max_admitted > limit {
                violations.push(format!("a window admitted {max_admitted} > G"));
            }
            if denied_while_left > 0 {
                violations.push(format!(
                    "{denied_while_left} denials while the quota had tokens"
                ));
            }
        }
        Expectation::CarryOverWithinTerm => {
            if total_carried == 0 {
                violations.push("expected carry-over from unclamped leases".to_owned());
            }
        }
        Expectation::WithinBound => {}
        Expectation::OverrideHonoured => {
            if max_admitted <= limit {
                violations.push(format!(
                    "expected a window above G {limit} under a raised override; the most was {max_admitted}"
                ));
            }
        }
        Expectation::SpendPastLeaseEnd => {
            if spent_after_end == 0 {
                violations.push(
                    "expected the checker to see tokens spent after their lease's end".to_owned(),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drill::scenario::builtin;

    fn clamped() -> Scenario {
        builtin()
            .into_iter()
            .find(|scenario| scenario.name == "clamped")
            .expect("the clamped drill")
    }

    fn bound() -> OvershootBound {
        OvershootBound {
            limit_tokens: 1_000,
            unclamped_carry_over_tokens: 0,
            fallback_allowance_tokens: 200,
            lost_grant_record_tokens: 0,
            settle_debt_tokens: 0,
        }
    }

    /// One window for one tenant in region 0, checked.
    fn checked(record: RegionWindow) -> Vec<String> {
        let mut checker = TenantChecker::new(&clamped(), bound(), 1, 2);
        *checker.record(0, 0) = record;
        checker.finish();
        checker.violations
    }

    fn assert_violation(violations: &[String], needle: &str) {
        assert!(
            violations.iter().any(|v| v.contains(needle)),
            "no violation mentions {needle:?}: {violations:?}"
        );
    }

    #[test]
    fn a_window_within_g_passes() {
        let record = RegionWindow {
            demand: 990,
            leased: 990,
            granted_tokens: 1_000,
            ..RegionWindow::default()
        };
        assert_eq!(checked(record), Vec::<String>::new());
    }

    #[test]
    fn admits_beyond_the_bound_and_grants_beyond_g_are_caught() {
        let violations = checked(RegionWindow {
            leased: 1_150,
            fallback: 100,
            granted_tokens: 1_150,
            ..RegionWindow::default()
        });
        assert_violation(&violations, "admitted 1250 > bound 1200");
        assert_violation(&violations, "granted 1150 > the pools' limits 1000");
    }

    #[test]
    fn overspent_leases_fallback_beyond_the_allowance_and_late_spends_are_caught() {
        let violations = checked(RegionWindow {
            leased: 500,
            granted_tokens: 400,
            fallback: 101,
            spent_after_lease_end: 2,
            ..RegionWindow::default()
        });
        assert_violation(&violations, "spent 500 leased tokens of 400");
        assert_violation(&violations, "101 in fallback > allowance 100");
        assert_violation(&violations, "spent 2 tokens after their lease's end");
        let violations = checked(RegionWindow {
            denied_regional: 3,
            denials_that_debited: 1,
            ..RegionWindow::default()
        });
        assert_violation(&violations, "1 regional denials debited the pool");
        // What metered requests cost beyond their estimates counts against the bound.
        let violations = checked(RegionWindow {
            leased: 1_000,
            granted_tokens: 1_000,
            charged_extra_tokens: 250,
            ..RegionWindow::default()
        });
        assert_violation(&violations, "admitted 1250 > bound 1200");
    }

    #[test]
    fn violations_beyond_the_cap_are_counted_not_listed() {
        let mut checker = TenantChecker::new(&clamped(), bound(), 1, 2);
        for window in 0..(MAX_VIOLATION_LINES as u64 + 5) {
            checker.roll_to(window * 60_000);
            checker.record(0, 0).fallback = 101;
        }
        checker.finish();
        assert_eq!(checker.violations.len(), MAX_VIOLATION_LINES);
        assert_eq!(checker.violations_not_listed, 5);
    }
}
