//! Entries waiting for the next batch call to the allocator, sent by one sender at a time: what
//! is queued while a call is answered goes in the next call. Renewals and terms lookups each keep
//! one, with whether the allocator lacks their batch route.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use super::lock;
use crate::allocator_client::MissingRoute;

/// The entries waiting, and whether a sender runs. Bounded by what its users queue: at most one
/// entry per pool held (a renewal in flight, a lookup under way).
pub(super) struct BatchQueue<T> {
    waiting: Mutex<VecDeque<T>>,
    sender_running: AtomicBool,
    /// Whether the allocator lacks the batch route (its callers then send one call per entry).
    pub(super) batch_route: MissingRoute,
}

impl<T> Default for BatchQueue<T> {
    fn default() -> Self {
        Self {
            waiting: Mutex::new(VecDeque::new()),
            sender_running: AtomicBool::new(false),
            batch_route: MissingRoute::default(),
        }
    }
}

impl<T> BatchQueue<T> {
    /// Queues `entry`; true when no sender runs and the caller must start one.
    pub(super) fn push(&self, entry: T) -> bool {
        lock(&self.waiting).push_back(entry);
        !self.sender_running.swap(true, Ordering::AcqRel)
    }

    /// Up to `most` entries, oldest first.
    pub(super) fn take(&self, most: usize) -> Vec<T> {
        let mut waiting = lock(&self.waiting);
        let count = waiting.len().min(most);
        waiting.drain(..count).collect()
    }

    /// The sender found nothing waiting: true when it may stop. An entry queued between its look
    /// and this one found the sender running and started none, so it goes on for it.
    pub(super) fn stop_sender(&self) -> bool {
        self.sender_running.store(false, Ordering::Release);
        lock(&self.waiting).is_empty() || self.sender_running.swap(true, Ordering::AcqRel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_sender_runs_until_nothing_waits() {
        let queue = BatchQueue::default();
        assert!(queue.push(1), "the first entry starts a sender");
        assert!(!queue.push(2), "one sender at a time");
        assert!(!queue.push(3));
        assert_eq!(queue.take(2), vec![1, 2]);
        assert_eq!(queue.take(2), vec![3]);
        assert!(queue.stop_sender(), "nothing waits: the sender stops");
        assert!(queue.push(4), "the next entry starts a sender again");
        // An entry queued while the sender looked keeps it running.
        assert!(!queue.push(5));
        assert_eq!(queue.take(10), vec![4, 5]);
        assert!(!queue.push(6));
        assert!(
            !queue.stop_sender(),
            "the sender goes on for the late entry"
        );
        assert_eq!(queue.take(10), vec![6]);
        assert!(queue.stop_sender());
    }
}
