//! Coalescing: decisions of one slot (one tenant's hash tag) that arrive while the slot's calls
//! are in flight wait for one of them to end, and then go together in one call of the library's
//! coalesced function, in arrival order. Each is still decided all or nothing and answered on its
//! own, exactly as that many calls one after another at one instant would decide it; what they
//! share is the call: one round trip, one read of the server's clock, and one read and one write
//! of every key they have in common (a hot tenant's own rule), instead of one each.
//!
//! A slot has at most `calls_in_flight` calls in flight at once (1 by default,
//! [`DEFAULT_CALLS_IN_FLIGHT_PER_SLOT`]). A decision that arrives while fewer are in flight, and
//! nothing of its slot waits, is sent at once, alone, by its caller: coalescing never delays a
//! decision that could go now, and costs a lone call nothing but a map entry. When a call ends,
//! what waited meanwhile is sent by a task of its own, one coalesced call at a time (at most
//! [`MAX_REQUESTS_PER_CALL`] each), until nothing waits. Between two calls the task chooses what
//! goes first ([`SEND_FIRST_AT`]): when a near-full call waits, it is sent before the last call's
//! decisions are answered, so the server does not sit idle while their callers run; when some but
//! fewer wait, the answered callers get one turn of the runtime first, and their next decisions
//! join the call; when none wait, the place in flight is given back. A call's fixed cost is spread
//! over more decisions that way (a call of 64 costs the server about two fifths of what 64 lone
//! calls cost), and what it costs a decision is a turn of the runtime. A decision whose caller
//! stopped waiting (its deadline passed) before its call was sent is dropped from the queue
//! unsent; one already sent runs to its end, as an ambiguous call would. Bounded (I10): at most
//! [`MAX_WAITING_PER_SLOT`] decisions wait per slot (past it a decision is sent alone), and a
//! slot's queue exists only while a call of it is in flight.
//!
//! Calls of one slot in flight together are each atomic, like concurrent lone calls: the server
//! runs one and then the other, and no decision's outcome depends on which went first beyond what
//! concurrent lone calls allow. Decisions are sent in arrival order (a decision never goes alone
//! while older ones of its slot wait).
//!
//! What a failed coalesced call means for each of its decisions is what it would mean for one call
//! ([`StoreError`]): not executed, ambiguous (each caller handles it with its own decision record)
//! or rejected; a request refused for its own arguments or state is refused alone.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

use super::redis_calls::Calls;
use super::store::StoreError;

/// Most decisions waiting behind one slot's call in flight (I10); past it a decision is sent alone.
pub const MAX_WAITING_PER_SLOT: usize = 256;

/// Most decisions one coalesced call carries (the library's own limit).
pub const MAX_REQUESTS_PER_CALL: usize = 64;

/// Calls of one slot in flight at once by default (module docs; chosen on the hot-tenant
/// benchmark, docs/limiter.md: a second call in flight halves the calls' size, and costs the
/// server more per decision than its latency gains are worth).
pub const DEFAULT_CALLS_IN_FLIGHT_PER_SLOT: usize = 1;

/// Decisions waiting when a call ends from which the next call is sent before the ended call's
/// decisions are answered; below it they are answered first, and their callers get a turn to
/// join the next call (module docs; chosen on the hot-tenant benchmark, docs/limiter.md).
pub const SEND_FIRST_AT: usize = 48;

/// Most calls of one slot a store may keep in flight at once (I10).
pub const MAX_CALLS_IN_FLIGHT_PER_SLOT: usize = 8;

/// One decision's call: its keys and arguments, and where its reply goes.
struct Waiting {
    keys: Vec<String>,
    args: Vec<String>,
    reply: oneshot::Sender<Result<Vec<i64>, StoreError>>,
}

/// A slot with calls in flight.
struct Slot {
    /// Its calls in flight (1 to the coalescer's bound), lone or coalesced.
    calls_in_flight: usize,
    /// Decisions waiting for one of them to end, oldest first.
    waiting: Vec<Waiting>,
}

/// The decisions waiting per slot.
pub(crate) struct Coalescer {
    /// Calls of one slot in flight at once (1 to [`MAX_CALLS_IN_FLIGHT_PER_SLOT`]).
    calls_in_flight: usize,
    /// By hash tag: present while a call of the slot is in flight, with what waits.
    slots: Mutex<HashMap<String, Slot>>,
    /// Decisions sent in coalesced calls of more than one.
    coalesced_decisions: AtomicU64,
    /// Coalesced calls of more than one decision.
    coalesced_calls: AtomicU64,
    /// Most calls of one slot seen in flight at once (tests).
    peak_calls_in_flight: AtomicUsize,
}

fn refs(keys: &[String]) -> Vec<&str> {
    keys.iter().map(String::as_str).collect()
}

impl Coalescer {
    /// A coalescer keeping at most `calls_in_flight` calls of a slot in flight, clamped to 1 to
    /// [`MAX_CALLS_IN_FLIGHT_PER_SLOT`].
    pub(crate) fn new(calls_in_flight: usize) -> Self {
        Self {
            calls_in_flight: calls_in_flight.clamp(1, MAX_CALLS_IN_FLIGHT_PER_SLOT),
            slots: Mutex::default(),
            coalesced_decisions: AtomicU64::new(0),
            coalesced_calls: AtomicU64::new(0),
            peak_calls_in_flight: AtomicUsize::new(0),
        }
    }

    fn slots(&self) -> MutexGuard<'_, HashMap<String, Slot>> {
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

    /// Most calls of one slot that were in flight at once, and slots with calls in flight now.
    #[cfg(test)]
    pub(crate) fn calls_in_flight(&self) -> (usize, usize) {
        (
            self.peak_calls_in_flight.load(Ordering::Relaxed),
            self.slots().len(),
        )
    }

    /// Decides one request of the slot `tag` (module docs): its reply, as a lone call's. The keys
    /// are copied only when the decision waits: one that goes at once is sent from the caller's.
    pub(crate) async fn decide(
        self: &Arc<Self>,
        calls: &Arc<Calls>,
        tag: &str,
        keys: &[&str],
        args: Vec<String>,
    ) -> Result<Vec<i64>, StoreError> {
        /// Whether the decision goes now (leading the slot's calls, or alone past a full queue)
        /// or waits for a call in flight to carry it.
        enum Turn {
            Lead(Vec<String>),
            Alone(Vec<String>),
            Queued(oneshot::Receiver<Result<Vec<i64>, StoreError>>),
        }
        let turn = {
            let mut slots = self.slots();
            match slots.get_mut(tag) {
                // Room for another call, and nothing older waits: it goes now.
                Some(slot)
                    if slot.calls_in_flight < self.calls_in_flight && slot.waiting.is_empty() =>
                {
                    self.take_place(slot);
                    Turn::Lead(args)
                }
                Some(slot) if slot.waiting.len() < MAX_WAITING_PER_SLOT => {
                    let (reply, answer) = oneshot::channel();
                    let keys = keys.iter().map(|key| (*key).to_owned()).collect();
                    slot.waiting.push(Waiting { keys, args, reply });
                    Turn::Queued(answer)
                }
                Some(_) => Turn::Alone(args),
                None => {
                    let mut slot = Slot {
                        calls_in_flight: 0,
                        waiting: Vec::new(),
                    };
                    self.take_place(&mut slot);
                    slots.insert(tag.to_owned(), slot);
                    Turn::Lead(args)
                }
            }
        };
        match turn {
            Turn::Alone(args) => calls.decide_one(keys, &args).await,
            Turn::Lead(args) => {
                // Sent from here, so a caller that stops waiting stops its own call as it would
                // without coalescing; however this ends, what waited meanwhile is handed on.
                let _hand_over = HandOver {
                    coalescer: self,
                    calls,
                    tag,
                };
                calls.decide_one(keys, &args).await
            }
            Turn::Queued(answer) => answer.await.unwrap_or_else(|_| {
                Err(StoreError::NotExecuted {
                    detail: "the coalesced call ended without an answer".to_owned(),
                })
            }),
        }
    }

    /// One more call of `slot` in flight (the caller checked there is room for it).
    fn take_place(&self, slot: &mut Slot) {
        slot.calls_in_flight += 1;
        debug_assert!(slot.calls_in_flight <= self.calls_in_flight);
        self.peak_calls_in_flight
            .fetch_max(slot.calls_in_flight, Ordering::Relaxed);
    }

    /// After a lone call of the slot: what waits is sent by a task of its own (the call's place
    /// in flight passes to it), or, when nothing waits, the slot has one call fewer in flight.
    fn hand_over(self: &Arc<Self>, calls: &Arc<Calls>, tag: &str) {
        if !self.still_waiting(tag) {
            return;
        }
        let (coalescer, calls, tag) = (self.clone(), calls.clone(), tag.to_owned());
        tokio::spawn(async move {
            // Should this task panic, its place in flight is given back.
            let mut slot = SlotGuard {
                coalescer: &coalescer,
                tag: &tag,
                armed: true,
            };
            coalescer.send_waiting(&calls, &tag).await;
            // Its place in flight is given back, and the slot may be another task's now.
            slot.armed = false;
        });
    }

    /// Whether decisions wait for the slot `tag`, for the call that just ended to send; when none
    /// do (callers that stopped waiting are dropped: never sent, so nothing of theirs is
    /// decided), that call's place in flight is given back.
    fn still_waiting(&self, tag: &str) -> bool {
        keep_waiting(&mut self.slots(), tag)
    }

    /// The next call's decisions for the slot `tag` (at most [`MAX_REQUESTS_PER_CALL`], the
    /// longest waiting first); none when nothing waits, and then the caller's place in flight is
    /// given back.
    fn next_call(&self, tag: &str) -> Vec<Waiting> {
        let mut slots = self.slots();
        if !keep_waiting(&mut slots, tag) {
            return Vec::new();
        }
        slots.get_mut(tag).map_or_else(Vec::new, |slot| {
            let take = slot.waiting.len().min(MAX_REQUESTS_PER_CALL);
            slot.waiting.drain(..take).collect()
        })
    }

    /// Sends what waits for the slot `tag`, a call at a time, until nothing does; then its place
    /// in flight is given back. Between two calls (module docs): with at least [`SEND_FIRST_AT`]
    /// waiting, the next call is taken and sent before the last one's decisions are answered
    /// (answering wakes their callers, and the server would sit idle while they ran ahead of the
    /// connection's writer); with some but fewer, they are answered first and their callers get a
    /// turn; with none, the place is given back before they are answered.
    async fn send_waiting(&self, calls: &Calls, tag: &str) {
        // The last call's decisions and replies, not yet answered.
        let mut done: Option<Answers> = None;
        loop {
            // Some waiting, but fewer than a near-full call: answer first and give their callers
            // a turn. (At least SEND_FIRST_AT: sent first, below. None: next_call gives the place
            // back before the answers, as nothing of the slot needs it.)
            if done.is_some() && (1..SEND_FIRST_AT).contains(&self.waiting(tag)) {
                drop(done.take());
                // One turn for the callers just answered: their next decisions join this call.
                tokio::task::yield_now().await;
            }
            let next = self.next_call(tag);
            if next.is_empty() {
                return;
            }
            // Polled in this order: the next call reaches the connection's writer first.
            let (replies, ()) = tokio::join!(biased; self.call(calls, &next), async move {
                drop(done)
            });
            done = Some(Answers::new(next, replies));
        }
    }

    /// Decisions waiting for the slot `tag`.
    fn waiting(&self, tag: &str) -> usize {
        self.slots().get(tag).map_or(0, |slot| slot.waiting.len())
    }

    /// One call of what waited: alone when it is one decision, else coalesced.
    async fn call(&self, calls: &Calls, waiting: &[Waiting]) -> Replies {
        if let [alone] = waiting {
            return Replies::Each(vec![
                calls.decide_one(&refs(&alone.keys), &alone.args).await,
            ]);
        }
        self.coalesced_calls.fetch_add(1, Ordering::Relaxed);
        self.coalesced_decisions
            .fetch_add(waiting.len() as u64, Ordering::Relaxed);
        let requests: Vec<(&[String], &[String])> = waiting
            .iter()
            .map(|waiting| (&waiting.keys[..], &waiting.args[..]))
            .collect();
        match calls.decide_many(&requests).await {
            Ok(replies) => Replies::Each(replies),
            Err(error) => Replies::Failed(error),
        }
    }
}

/// What a call of waiting decisions answered: a reply each, or the call's failure for all.
enum Replies {
    Each(Vec<Result<Vec<i64>, StoreError>>),
    Failed(StoreError),
}

/// A call's decisions and its replies, handed to them when this is dropped: however the sending
/// task goes on (it sends the next call before answering, and that call may fail or panic), the
/// decisions of a call that ran get what it decided.
struct Answers {
    waiting: Vec<Waiting>,
    replies: Option<Replies>,
}

impl Answers {
    fn new(waiting: Vec<Waiting>, replies: Replies) -> Self {
        Self {
            waiting,
            replies: Some(replies),
        }
    }
}

impl Drop for Answers {
    fn drop(&mut self) {
        if let Some(replies) = self.replies.take() {
            answer(std::mem::take(&mut self.waiting), replies);
        }
    }
}

/// Hands each waiting decision its reply.
fn answer(waiting: Vec<Waiting>, replies: Replies) {
    match replies {
        Replies::Each(replies) => {
            debug_assert_eq!(waiting.len(), replies.len(), "a reply per decision");
            for (waiting, reply) in waiting.into_iter().zip(replies) {
                let _ = waiting.reply.send(reply);
            }
        }
        Replies::Failed(error) => {
            for waiting in waiting {
                let _ = waiting.reply.send(Err(error.clone()));
            }
        }
    }
}

/// Called by one of `tag`'s calls in flight as it ends: drops the decisions of the slot's queue
/// whose callers stopped waiting, and says whether any are left for it to send. If none are, its
/// place in flight is given back (and the slot removed when no call of it is left in flight).
fn keep_waiting(slots: &mut HashMap<String, Slot>, tag: &str) -> bool {
    let Some(slot) = slots.get_mut(tag) else {
        return false;
    };
    slot.waiting.retain(|waiting| !waiting.reply.is_closed());
    if slot.waiting.is_empty() {
        leave(slots, tag);
        return false;
    }
    true
}

/// One call of `tag` is no longer in flight. With the last, the slot is removed and returned: its
/// waiting decisions (none when the call ended normally, having found nothing to send) are the
/// caller's to answer.
fn leave(slots: &mut HashMap<String, Slot>, tag: &str) -> Option<Slot> {
    let slot = slots.get_mut(tag)?;
    debug_assert!(
        slot.calls_in_flight >= 1,
        "a slot in the map has a call in flight"
    );
    slot.calls_in_flight = slot.calls_in_flight.saturating_sub(1);
    if slot.calls_in_flight == 0 {
        return slots.remove(tag);
    }
    None
}

/// Hands a slot on when its lone call ends, however it ends (answered, or its caller stopped
/// waiting).
struct HandOver<'a> {
    coalescer: &'a Arc<Coalescer>,
    calls: &'a Arc<Calls>,
    tag: &'a str,
}

impl Drop for HandOver<'_> {
    fn drop(&mut self) {
        self.coalescer.hand_over(self.calls, self.tag);
    }
}

/// Gives back a sending task's place in flight if it panics; if it was the slot's last call in
/// flight, the decisions still waiting are answered as not executed, and the slot's next decision
/// starts a queue again.
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
        let left = leave(&mut self.coalescer.slots(), self.tag);
        for waiting in left.into_iter().flat_map(|slot| slot.waiting) {
            let _ = waiting.reply.send(Err(StoreError::NotExecuted {
                detail: "the slot's coalesced calls stopped".to_owned(),
            }));
        }
    }
}
