//! Coalescing: decisions of one slot (one tenant's hash tag) that arrive while a call of that slot
//! is in flight wait for it, and then go together in one call of the library's coalesced function,
//! in arrival order. Each is still decided all or nothing and answered on its own, exactly as that
//! many calls one after another at one instant would decide it; what they share is the call: one
//! round trip, one read of the server's clock, and one read and one write of every key they have
//! in common (a hot tenant's own rule), instead of one each.
//!
//! The first decision of a slot with nothing in flight is sent at once, alone, by its caller:
//! coalescing never delays a decision that could go now, and costs a lone call nothing but a map
//! entry. When it ends, what waited meanwhile is sent by a task of its own, one coalesced call at
//! a time (at most [`MAX_REQUESTS_PER_CALL`] each), until nothing waits. A decision whose caller
//! stopped waiting (its deadline passed) before its call was sent is dropped from the queue unsent;
//! one already sent runs to its end, as an ambiguous call would. Bounded
//! (I10): at most [`MAX_WAITING_PER_SLOT`] decisions wait per slot (past it a decision is sent
//! alone), and a slot's queue exists only while a call of it is in flight.
//!
//! What a failed coalesced call means for each of its decisions is what it would mean for one call
//! ([`StoreError`]): not executed, ambiguous (each caller handles it with its own decision record)
//! or rejected; a request refused for its own arguments or state is refused alone.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

use super::redis_calls::Calls;
use super::store::StoreError;

/// Most decisions waiting behind one slot's call in flight (I10); past it a decision is sent alone.
pub const MAX_WAITING_PER_SLOT: usize = 256;

/// Most decisions one coalesced call carries (the library's own limit).
pub const MAX_REQUESTS_PER_CALL: usize = 64;

/// One decision's call: its keys and arguments, and where its reply goes.
struct Waiting {
    keys: Vec<String>,
    args: Vec<String>,
    reply: oneshot::Sender<Result<Vec<i64>, StoreError>>,
}

/// The decisions waiting per slot.
#[derive(Default)]
pub(crate) struct Coalescer {
    /// By hash tag: present while a call of the slot is in flight, with what waits for it.
    slots: Mutex<HashMap<String, Vec<Waiting>>>,
    /// Decisions sent in coalesced calls of more than one.
    coalesced_decisions: AtomicU64,
    /// Coalesced calls of more than one decision.
    coalesced_calls: AtomicU64,
}

fn refs(keys: &[String]) -> Vec<&str> {
    keys.iter().map(String::as_str).collect()
}

impl Coalescer {
    fn slots(&self) -> MutexGuard<'_, HashMap<String, Vec<Waiting>>> {
        self.slots
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// (decisions sent in coalesced calls, coalesced calls) so far.
    pub(crate) fn counts(&self) -> (u64, u64) {
        (
            self.coalesced_decisions.load(Ordering::Relaxed),
            self.coalesced_calls.load(Ordering::Relaxed),
        )
    }

    /// Decides one request of the slot `tag` (module docs): its reply, as a lone call's.
    pub(crate) async fn decide(
        self: &Arc<Self>,
        calls: &Arc<Calls>,
        tag: &str,
        keys: Vec<String>,
        args: Vec<String>,
    ) -> Result<Vec<i64>, StoreError> {
        let (reply, answer) = oneshot::channel();
        let waiting = Waiting { keys, args, reply };
        enum Turn {
            Queued,
            Full(Waiting),
            Lead(Waiting),
        }
        let turn = {
            let mut slots = self.slots();
            match slots.get_mut(tag) {
                Some(queue) if queue.len() < MAX_WAITING_PER_SLOT => {
                    queue.push(waiting);
                    Turn::Queued
                }
                Some(_) => Turn::Full(waiting),
                None => {
                    slots.insert(tag.to_owned(), Vec::new());
                    Turn::Lead(waiting)
                }
            }
        };
        if let Turn::Full(alone) = turn {
            return calls.decide_one(&refs(&alone.keys), &alone.args).await;
        }
        if let Turn::Lead(first) = turn {
            // Sent from here, so a caller that stops waiting stops its own call as it would
            // without coalescing; however this ends, what waited meanwhile is handed on.
            let _hand_over = HandOver {
                coalescer: self.clone(),
                calls: calls.clone(),
                tag: tag.to_owned(),
            };
            return calls.decide_one(&refs(&first.keys), &first.args).await;
        }
        answer.await.unwrap_or_else(|_| {
            Err(StoreError::NotExecuted {
                detail: "the coalesced call ended without an answer".to_owned(),
            })
        })
    }

    /// After the slot's lone call: what waits is sent by a task of its own, or, when nothing
    /// waits, the slot has no call in flight any more.
    fn hand_over(self: &Arc<Self>, calls: &Arc<Calls>, tag: &str) {
        if !self.still_waiting(tag) {
            return;
        }
        let (coalescer, calls, tag) = (self.clone(), calls.clone(), tag.to_owned());
        tokio::spawn(async move {
            // Should this task panic, the slot's queue does not outlive it.
            let mut slot = SlotGuard {
                coalescer: &coalescer,
                tag: &tag,
                armed: true,
            };
            coalescer.send_waiting(&calls, &tag).await;
            // The queue is gone, and a new one of the same slot may be another task's now.
            slot.armed = false;
        });
    }

    /// Whether decisions wait for the slot `tag`; when none do (callers that stopped waiting are
    /// dropped: never sent, so nothing of theirs is decided), the slot has no call in flight any
    /// more.
    fn still_waiting(&self, tag: &str) -> bool {
        keep_waiting(&mut self.slots(), tag)
    }

    /// The next call's decisions for the slot `tag` (at most [`MAX_REQUESTS_PER_CALL`], the
    /// longest waiting first); none when nothing waits, and then the slot has no call in flight.
    fn next_call(&self, tag: &str) -> Vec<Waiting> {
        let mut slots = self.slots();
        if !keep_waiting(&mut slots, tag) {
            return Vec::new();
        }
        slots.get_mut(tag).map_or_else(Vec::new, |queue| {
            let take = queue.len().min(MAX_REQUESTS_PER_CALL);
            queue.drain(..take).collect()
        })
    }

    /// Sends what waits for the slot `tag`, a coalesced call at a time, until nothing does; then
    /// the slot has no call in flight.
    async fn send_waiting(&self, calls: &Calls, tag: &str) {
        loop {
            let next = self.next_call(tag);
            if next.is_empty() {
                return;
            }
            if let [alone] = &next[..] {
                let reply = calls.decide_one(&refs(&alone.keys), &alone.args).await;
                if let Some(alone) = next.into_iter().next() {
                    let _ = alone.reply.send(reply);
                }
                continue;
            }
            self.coalesced_calls.fetch_add(1, Ordering::Relaxed);
            self.coalesced_decisions
                .fetch_add(next.len() as u64, Ordering::Relaxed);
            let requests: Vec<(&[String], &[String])> = next
                .iter()
                .map(|waiting| (&waiting.keys[..], &waiting.args[..]))
                .collect();
            match calls.decide_many(&requests).await {
                Ok(replies) => {
                    for (waiting, reply) in next.into_iter().zip(replies) {
                        let _ = waiting.reply.send(reply);
                    }
                }
                Err(error) => {
                    for waiting in next {
                        let _ = waiting.reply.send(Err(error.clone()));
                    }
                }
            }
        }
    }
}

/// Drops the decisions of `tag`'s queue whose callers stopped waiting; whether any are left (if
/// none, the queue is removed: the slot has no call in flight).
fn keep_waiting(slots: &mut HashMap<String, Vec<Waiting>>, tag: &str) -> bool {
    let Some(queue) = slots.get_mut(tag) else {
        return false;
    };
    queue.retain(|waiting| !waiting.reply.is_closed());
    if queue.is_empty() {
        slots.remove(tag);
        return false;
    }
    true
}

/// Hands a slot on when its lone call ends, however it ends (answered, or its caller stopped
/// waiting).
struct HandOver {
    coalescer: Arc<Coalescer>,
    calls: Arc<Calls>,
    tag: String,
}

impl Drop for HandOver {
    fn drop(&mut self) {
        self.coalescer.hand_over(&self.calls, &self.tag);
    }
}

/// Removes a slot's queue if the task that sends its calls panics: the decisions still waiting
/// are answered as not executed, and the slot's next decision starts a queue again.
struct SlotGuard<'a> {
    coalescer: &'a Coalescer,
    tag: &'a str,
    /// Cleared once the task has emptied and removed the queue itself.
    armed: bool,
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let left = self.coalescer.slots().remove(self.tag);
        for waiting in left.into_iter().flatten() {
            let _ = waiting.reply.send(Err(StoreError::NotExecuted {
                detail: "the slot's coalesced calls stopped".to_owned(),
            }));
        }
    }
}
