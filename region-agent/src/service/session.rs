//! This run of the agent, as the allocator knows it: an incarnation minted at start, started at the
//! allocator as soon as it is reached (and always before a pool's terms are fetched), ended when
//! the agent stops with every fallback admit reported.
//!
//! Why: an agent keeps its fallback count in memory. A run that crashes during a partition takes
//! with it the fallback it admitted and had not reported, and the ledger never learns of it. A run
//! that restores its state directory's journal recovers it from the journal's claims. A run that
//! cannot asks the allocator how the previous run of its agent id ended; the allocator answers
//! with the start of the latest run that followed an unclean end, and a window containing it
//! counts its allowance as used ([`crate::global::driver::take_over_window`]). It fails closed for
//! the rest of that window (for a monthly pool, the month), never open.

use std::sync::atomic::{AtomicBool, Ordering};

use allot_shared::ids::AgentIncarnation;

use super::Agent;
use crate::allocator_client::{AgentSession, AgentSessionStarted, AllocatorClient, ClientError};
use crate::global::driver::Inherited;

/// This run's session.
pub(super) struct Session {
    incarnation: AgentIncarnation,
    /// When this run started, epoch ms (the agent's clock).
    started_at_ms: u64,
    /// The allocator's answer to this run's start.
    started: tokio::sync::OnceCell<AgentSessionStarted>,
    /// Whether the state directory gave back a journal: its claims then cover the previous run.
    journal_restored: AtomicBool,
}

impl Session {
    /// A run started at `now_ms`, with `random` bits for its incarnation.
    pub(super) fn new(now_ms: u64, random: u128) -> Self {
        Self {
            incarnation: AgentIncarnation::from_parts(now_ms, random),
            started_at_ms: now_ms,
            started: tokio::sync::OnceCell::new(),
            journal_restored: AtomicBool::new(false),
        }
    }

    pub(super) fn note_journal_restored(&self) {
        self.journal_restored.store(true, Ordering::Relaxed);
    }
}

impl Agent {
    /// This run's incarnation.
    pub fn incarnation(&self) -> AgentIncarnation {
        self.session.incarnation
    }

    fn session_message(&self) -> AgentSession {
        AgentSession {
            region: self.settings.region.clone(),
            agent_id: self.settings.agent_id.clone(),
            incarnation: self.session.incarnation,
        }
    }

    /// Starts this run's session at `allocator`, once (concurrent callers wait for the one call).
    pub(super) async fn start_session(
        &self,
        allocator: &AllocatorClient,
    ) -> Result<AgentSessionStarted, ClientError> {
        self.session
            .started
            .get_or_try_init(|| async {
                let started = allocator
                    .start_session(&self.session_message())
                    .await?
                    // An allocator that keeps no sessions cannot say: as if not clean.
                    .unwrap_or(AgentSessionStarted {
                        predecessor_ended_cleanly: false,
                        started_at_ms: self.session.started_at_ms,
                        unclean_since_ms: Some(self.session.started_at_ms),
                    });
                if started.unclean_since_ms.is_some()
                    && !self.session.journal_restored.load(Ordering::Relaxed)
                {
                    tracing::warn!(
                        unclean_since_ms = started.unclean_since_ms,
                        "a run of this agent ended uncleanly and this one has no journal: the \
                         fallback allowance of the window containing that run's successor's \
                         start counts as used"
                    );
                }
                Ok(started)
            })
            .await
            .copied()
    }

    /// Starts this run's session if it has not started yet (the upkeep round's step: a run whose
    /// pools all came from its journal fetches no terms, yet must be known to the allocator before
    /// it could crash unseen).
    pub(super) async fn keep_session_started(&self) {
        if self.session.started.initialized() {
            return;
        }
        let Some(allocator) = self.allocator.clone() else {
            return;
        };
        if let Err(error) = self.start_session(&allocator).await {
            tracing::debug!(%error, "session not started yet");
        }
    }

    /// What a holder created now, not restored from a journal, takes over (with the ledger's
    /// count from the pool's terms): the latest instant a window may hold fallback admits nobody
    /// reported, if any.
    pub(super) fn inherited(
        &self,
        ledger_fallback: Option<allot_shared::wire::FallbackInWindow>,
    ) -> Inherited {
        let unclean_start_ms = if self.session.journal_restored.load(Ordering::Relaxed) {
            // The journal's claims cover the previous run, and that run's journal the one before.
            None
        } else {
            match self.session.started.get() {
                Some(started) => started.unclean_since_ms,
                None => Some(self.session.started_at_ms),
            }
        };
        Inherited {
            ledger_fallback,
            unclean_start_ms,
        }
    }

    /// Whether this run's session started at the allocator.
    pub(super) fn session_started(&self) -> bool {
        self.session.started.initialized()
    }

    /// Ends this run's session at the allocator (the caller found every fallback admit reported).
    /// Whether it ended.
    pub(super) async fn close_session(&self) -> bool {
        let (Some(allocator), Some(_)) = (self.allocator.clone(), self.session.started.get())
        else {
            return false;
        };
        match allocator.end_session(&self.session_message()).await {
            Ok(ended) => ended,
            Err(error) => {
                tracing::warn!(%error, "the session did not end at the allocator");
                false
            }
        }
    }
}
