//! The background loops: reports; policy refresh with pool upkeep; and, with a state directory,
//! the journal.

use std::sync::Arc;
use std::time::Duration;

use super::Agent;

/// Longest one round of background work (reports, or policy and pool upkeep) may take; a round cut
/// short loses nothing (unacknowledged report lines stay pending).
pub const ROUND_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest the last round of reports at shutdown may take.
pub const FINAL_REPORT_TIMEOUT: Duration = Duration::from_secs(5);

impl Agent {
    /// Fetches the bundle this region should run and installs it if newer; tells the allocator what
    /// runs here.
    pub async fn refresh_policy(&self) {
        let Some(allocator) = self.allocator.as_ref() else {
            return;
        };
        let current = allocator.current_policy(&self.settings.region).await;
        self.note_allocator(&current);
        match current {
            Ok(Some(bundle)) => {
                if self.offer_bundle(bundle) {
                    self.save_bundle().await;
                }
                self.bundle.confirm(self.clock.now_ms());
                self.note_change();
            }
            Ok(None) => {}
            Err(error) => {
                tracing::warn!(%error, "policy refresh failed; keeping the bundle in force")
            }
        }
        self.refresh_overrides(allocator).await;
        let version = self.bundle.version();
        if let Err(error) = allocator
            .report_status(
                &self.settings.region,
                &self.settings.agent_id,
                version,
                &self.settings.pepper.fingerprint(),
            )
            .await
        {
            tracing::debug!(%error, "policy status not reported");
        }
    }

    /// Fetches the rule overrides when the allocator has a newer set, and lays them over the
    /// bundle in force; lays them again when one has ended.
    async fn refresh_overrides(&self, allocator: &crate::allocator_client::AllocatorClient) {
        let held = self.bundle.override_version();
        let answer = allocator.overrides(held).await;
        self.note_allocator(&answer);
        match answer {
            Ok(Some(set)) => {
                if self.offer_overrides(set) {
                    self.save_overrides().await;
                    self.note_change();
                }
            }
            Ok(None) => {}
            Err(error) => {
                tracing::warn!(%error, "override refresh failed; keeping the overrides in force")
            }
        }
        self.bundle.expire_overrides(self.clock.now_ms());
    }

    /// Runs the background loops until `shutdown` resolves: reports every `report_every`; the
    /// session's start (until it has started), policy refresh and pool upkeep every
    /// `policy_every`; with a state directory, the journal every
    /// [`JOURNAL_INTERVAL`](super::JOURNAL_INTERVAL) when something changed. The loops are
    /// independent (a slow allocator holds up neither the other loops nor shutdown), each round
    /// has [`ROUND_TIMEOUT`], and a last round of reports is sent within
    /// [`FINAL_REPORT_TIMEOUT`], then the journal written once more and the session ended (when
    /// every fallback admit is reported).
    pub async fn run_background(
        self: Arc<Self>,
        report_every: Duration,
        policy_every: Duration,
        shutdown: impl Future<Output = ()>,
    ) {
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let signal = async {
            shutdown.await;
            let _ = stop.send(true);
        };
        let reports = every(report_every, stopped.clone(), "reports", || {
            self.send_reports()
        });
        let upkeep = every(
            policy_every,
            stopped.clone(),
            "policy and pool upkeep",
            || async {
                self.keep_session_started().await;
                self.refresh_policy().await;
                self.maintain_pools().await;
            },
        );
        let journal = async {
            if self.state_dir().is_some() {
                every(super::JOURNAL_INTERVAL, stopped, "journal", || {
                    self.write_journal_if_changed()
                })
                .await;
            }
        };
        tokio::join!(signal, reports, upkeep, journal);
        if tokio::time::timeout(FINAL_REPORT_TIMEOUT, self.send_reports())
            .await
            .is_err()
        {
            tracing::warn!("the last reports did not reach the allocator before shutdown");
        }
        self.write_journal_if_changed().await;
        if tokio::time::timeout(FINAL_REPORT_TIMEOUT, self.end_session())
            .await
            .is_ok_and(|ended| ended)
        {
            tracing::info!("session ended cleanly: every fallback admit is reported");
        }
    }
}

/// Runs `round` every `period` until `stopped` turns true; a round is cut at [`ROUND_TIMEOUT`] or
/// at the stop.
async fn every<F, Fut>(
    period: Duration,
    mut stopped: tokio::sync::watch::Receiver<bool>,
    name: &'static str,
    round: F,
) where
    F: Fn() -> Fut,
    Fut: Future<Output = ()>,
{
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stopped.wait_for(|stop| *stop) => return,
            _ = ticks.tick() => {}
        }
        tokio::select! {
            _ = stopped.wait_for(|stop| *stop) => return,
            finished = tokio::time::timeout(ROUND_TIMEOUT, round()) => {
                if finished.is_err() {
                    tracing::warn!(round = name, "background round cut at its deadline");
                }
            }
        }
    }
}
