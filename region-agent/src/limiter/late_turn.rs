//! Deadlines that lose a tie to work already done.
//!
//! A timer and the reply it guards can become ready in the same turn of the runtime, typically
//! after this thread was held up (both fell due while it was), and then the task whose timer fired
//! may run before the task that reads the reply off the socket, or before the decision that ends
//! and frees a place. Counted as missed, such a wait answers `LIMITER_UNAVAILABLE` for a store that
//! answered in time but for this thread. So when a limiter wait expires it looks once more, behind
//! the tasks this worker has queued and those its next look at the I/O driver wakes (one turn:
//! bounded, and only when late already).

use std::future::Future;
use std::pin::{Pin, pin};
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;

/// Least lateness that says this thread was held up: tokio's timers fire up to a millisecond late
/// on their own.
const HELD_UP_AT_LEAST: Duration = Duration::from_millis(2);

/// Whether a timer over `span` that ended `late` after it was due says this thread was held up:
/// late by half its span, and by more than timers are late on their own.
pub(crate) fn was_held_up(late: Duration, span: Duration) -> bool {
    late >= (span / 2).max(HELD_UP_AT_LEAST)
}

/// `work`'s output if it ends by `deadline`, or in the turn of the runtime after its timer fired.
pub(crate) async fn within<F: Future>(deadline: Instant, work: F) -> Option<F::Output> {
    let mut work = pin!(work);
    match tokio::time::timeout_at(deadline, work.as_mut()).await {
        Ok(output) => Some(output),
        Err(_elapsed) => one_more_look(work).await,
    }
}

/// Polls `work`, which has not finished, once more behind the tasks this worker has queued:
/// `yield_now` defers this task until after the runtime's next look at its I/O driver.
async fn one_more_look<F: Future + ?Sized>(mut work: Pin<&mut F>) -> Option<F::Output> {
    tokio::task::yield_now().await;
    std::future::poll_fn(|cx| match work.as_mut().poll(cx) {
        Poll::Ready(output) => Poll::Ready(Some(output)),
        Poll::Pending => Poll::Ready(None),
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::monotonic_now;

    #[tokio::test(start_paused = true)]
    async fn work_done_in_the_turn_its_deadline_fired_is_taken() {
        let deadline = monotonic_now() + Duration::from_millis(5);
        let (reply, replied) = tokio::sync::oneshot::channel();
        let waiting = tokio::spawn(within(deadline, replied));
        // The waiting task sets its timer first, so it runs first when both fire.
        tokio::task::yield_now().await;
        tokio::spawn(async move {
            tokio::time::sleep_until(deadline).await;
            let _ = reply.send(7);
        });
        let output = waiting.await.expect("ends");
        assert_eq!(output.and_then(Result::ok), Some(7), "the reply is taken");
        assert_eq!(monotonic_now(), deadline);
    }

    /// Pending when first polled, ready when polled again.
    struct ReadyOnSecondPoll(bool);

    impl Future for ReadyOnSecondPoll {
        type Output = ();
        fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<()> {
            if self.0 {
                return Poll::Ready(());
            }
            self.0 = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }

    #[tokio::test(start_paused = true)]
    async fn work_past_its_deadline_is_polled_once_more() {
        let past = monotonic_now();
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(within(past, ReadyOnSecondPoll(false)).await, Some(()));
    }

    #[tokio::test(start_paused = true)]
    async fn work_still_pending_after_its_deadline_is_not_waited_for() {
        let deadline = monotonic_now() + Duration::from_millis(5);
        assert_eq!(within(deadline, std::future::pending::<()>()).await, None);
        assert_eq!(
            monotonic_now(),
            deadline,
            "answered at the deadline, not later"
        );
    }
}
