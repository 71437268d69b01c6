//! The journal's bookkeeping, below every part that changes what it keeps: whether the agent keeps
//! state at all (its state directory), the changes counted since the last write, and the one
//! writer. Writing and restoring the journal is `persistence.rs`, above the parts it reads.

use std::sync::atomic::{AtomicU64, Ordering};

use super::Agent;
use crate::state_dir::StateDir;

/// Whether the agent keeps state, and what the journal has not written yet.
#[derive(Default)]
pub(super) struct Journaling {
    /// Set once at startup.
    dir: std::sync::OnceLock<StateDir>,
    /// Changes the journal must keep, counted; and the count the last journal written saw.
    generation: AtomicU64,
    written: AtomicU64,
    /// One journal writer at a time (the periodic write and fallback claims), held by tasks of
    /// their own from the snapshot to the end of the write.
    writer: tokio::sync::Mutex<()>,
}

impl Journaling {
    /// Keeps state in `dir` from now on; `false` when a directory was set before (it stays).
    pub(super) fn set_dir(&self, dir: StateDir) -> bool {
        self.dir.set(dir).is_ok()
    }

    /// The state directory, if any.
    pub(super) fn dir(&self) -> Option<&StateDir> {
        self.dir.get()
    }

    /// Whether the agent keeps state (fallback then goes by durable claims).
    pub(super) fn keeps_state(&self) -> bool {
        self.dir.get().is_some()
    }

    /// The changes counted so far, when the last journal written did not see them all.
    pub(super) fn unwritten(&self) -> Option<u64> {
        let generation = self.generation.load(Ordering::Relaxed);
        (generation != self.written.load(Ordering::Relaxed)).then_some(generation)
    }

    /// A journal taken after `generation` changes were counted is on disk.
    pub(super) fn mark_written(&self, generation: u64) {
        self.written.fetch_max(generation, Ordering::Relaxed);
    }

    /// Waits to be the one writer; it stays so while the guard lives.
    pub(super) async fn writer(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.writer.lock().await
    }
}

impl Agent {
    /// Notes a change the journal must keep (a spend, a grant, an acknowledged report, new terms).
    pub(super) fn note_change(&self) {
        if self.journaling.keeps_state() {
            self.journaling.generation.fetch_add(1, Ordering::Relaxed);
        }
    }
}
