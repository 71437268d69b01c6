//! Request deadlines without a timer per request (I10).
//!
//! A `tokio::time::timeout` around every request registers a timer per request. When no earlier
//! timer is pending, which is the usual case on a busy server (the last request's timer was just
//! cancelled), registering one wakes the runtime's timer driver through a system call: the agent
//! benchmark counted one such write per decision, and a run of it 443,723 writes before this
//! module and 95,952 after (docs/benchmarks.md; the agent's CPU per decision moved less than runs
//! vary). A deadline of seconds needs no microsecond precision, so one task per
//! [`CoarseDeadlines`] publishes a coarse tick count and each request compares against it: a
//! request answered in its first poll costs a clock read and nothing else, and one that waits
//! registers with the tick's watch channel, not with the timer driver.
//!
//! Invariant: a deadline never passes early. A request given `limit` is cut off after at least
//! `limit` and at most `limit` plus two ticks (plus however late the ticking task runs).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use tokio::sync::watch;
use tokio::time::Instant;

/// Deadlines measured in ticks of `tick`, published by one task started on first use.
#[derive(Debug, Clone)]
pub struct CoarseDeadlines {
    tick: Duration,
    ticks: Arc<OnceLock<Ticks>>,
}

/// The published tick count: whole ticks since `origin`.
#[derive(Debug)]
struct Ticks {
    origin: Instant,
    published: watch::Receiver<u64>,
}

/// A deadline passed before the work finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the deadline passed")]
pub struct DeadlinePassed;

/// Shortest tick: finer ones would wake waiting requests more often than any deadline needs.
const MIN_TICK: Duration = Duration::from_millis(1);

impl CoarseDeadlines {
    /// Deadlines that pass within two `tick`s after they are due. The ticking task starts with the
    /// first deadline, on that caller's tokio runtime, and stops when every clone is dropped.
    pub fn new(tick: Duration) -> Self {
        Self {
            tick: tick.max(MIN_TICK),
            ticks: Arc::default(),
        }
    }

    /// Deadlines for limits of about `limit`: a sixteenth of it per tick, so a request is cut off
    /// at most an eighth of its limit late.
    pub fn for_limit(limit: Duration) -> Self {
        Self::new(limit / 16)
    }

    /// `work`'s output, or [`DeadlinePassed`] if `limit` passes first (then `work` is dropped).
    /// `work` is polled first on every wake-up, and the wait on the tick is only set up once `work`
    /// has had to wait: what is ready in its first poll costs a clock read and nothing else.
    pub async fn within<F: Future>(
        &self,
        limit: Duration,
        work: F,
    ) -> Result<F::Output, DeadlinePassed> {
        let ticks = self.ticks();
        // The current tick began at most one tick ago, hence the extra one: never early.
        let due_tick = ticks
            .now_tick(self.tick)
            .saturating_add(ticks_in(limit, self.tick))
            .saturating_add(1);
        let mut work = std::pin::pin!(work);
        let mut expiry: Option<Pin<Box<dyn Future<Output = ()> + Send>>> = None;
        std::future::poll_fn(|cx| {
            if let Poll::Ready(output) = work.as_mut().poll(cx) {
                return Poll::Ready(Ok(output));
            }
            let expiry = expiry.get_or_insert_with(|| {
                let mut published = ticks.published.clone();
                Box::pin(async move {
                    // An error means the ticking task is gone (its runtime is shutting down): the
                    // request is cut off rather than left without a bound.
                    let _ = published.wait_for(|&tick| tick >= due_tick).await;
                })
            });
            expiry.as_mut().poll(cx).map(|()| Err(DeadlinePassed))
        })
        .await
    }

    // Request deadlines are transport timing on tokio's clock, not decision time (architecture
    // invariant 1 is about the latter).
    #[allow(clippy::disallowed_methods)]
    fn ticks(&self) -> &Ticks {
        self.ticks.get_or_init(|| {
            let origin = Instant::now();
            let (publisher, published) = watch::channel(0);
            tokio::spawn(publish_ticks(origin, self.tick, publisher));
            Ticks { origin, published }
        })
    }
}

impl Ticks {
    fn now_tick(&self, tick: Duration) -> u64 {
        whole_ticks(self.origin.elapsed(), tick)
    }
}

/// How many whole ticks of `tick` fit in `span` (rounded down).
fn whole_ticks(span: Duration, tick: Duration) -> u64 {
    u64::try_from(span.as_nanos() / tick.as_nanos().max(1)).unwrap_or(u64::MAX)
}

/// How many ticks of `tick` cover `span` (rounded up).
fn ticks_in(span: Duration, tick: Duration) -> u64 {
    u64::try_from(span.as_nanos().div_ceil(tick.as_nanos().max(1))).unwrap_or(u64::MAX)
}

/// Publishes the whole ticks elapsed since `origin`, once a tick, until nobody listens. The count
/// comes from the clock, not from counting wake-ups, so a late wake-up never stretches a deadline.
async fn publish_ticks(origin: Instant, tick: Duration, publisher: watch::Sender<u64>) {
    let mut interval = tokio::time::interval_at(origin + tick, tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = interval.tick() => {
                publisher.send_replace(whole_ticks(origin.elapsed(), tick));
            }
            () = publisher.closed() => return,
        }
    }
}

/// A tower layer that answers 503 (an empty body: [`crate::problem_for_plain_errors`] makes it
/// problem+json) to a request not answered within `limit`.
#[derive(Debug, Clone)]
pub struct DeadlineLayer {
    deadlines: CoarseDeadlines,
    limit: Duration,
}

impl DeadlineLayer {
    /// Requests cut off after `limit`, on deadlines of [`CoarseDeadlines::for_limit`].
    pub fn new(limit: Duration) -> Self {
        Self {
            deadlines: CoarseDeadlines::for_limit(limit),
            limit,
        }
    }
}

impl<S> tower::Layer<S> for DeadlineLayer {
    type Service = Deadline<S>;

    fn layer(&self, inner: S) -> Deadline<S> {
        Deadline {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`DeadlineLayer`] wraps around `S`.
#[derive(Debug, Clone)]
pub struct Deadline<S> {
    inner: S,
    layer: DeadlineLayer,
}

impl<S> tower::Service<Request> for Deadline<S>
where
    S: tower::Service<Request, Response = Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response, S::Error>> + Send>>;

    /// Always ready: the inner service's readiness (a place under the concurrency limit) is waited
    /// for in `call`, within the deadline, so a request queued for a place is cut off like one
    /// waiting for its answer.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request) -> Self::Future {
        use tower::ServiceExt;
        let answer = self.inner.clone().oneshot(request);
        let DeadlineLayer { deadlines, limit } = self.layer.clone();
        Box::pin(async move {
            match deadlines.within(limit, answer).await {
                Ok(answer) => answer,
                Err(DeadlinePassed) => Ok(StatusCode::SERVICE_UNAVAILABLE.into_response()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TICK: Duration = Duration::from_millis(100);

    #[tokio::test(start_paused = true)]
    async fn ready_work_is_answered_without_waiting() {
        let deadlines = CoarseDeadlines::new(TICK);
        assert_eq!(deadlines.within(TICK, async { 7 }).await, Ok(7));
    }

    #[tokio::test(start_paused = true)]
    async fn work_that_finishes_in_time_is_answered() {
        let deadlines = CoarseDeadlines::new(TICK);
        let work = async {
            tokio::time::sleep(Duration::from_millis(950)).await;
            "done"
        };
        assert_eq!(
            deadlines.within(Duration::from_secs(1), work).await,
            Ok("done")
        );
    }

    /// Every start offset within a tick and every limit: never early, at most two ticks late.
    #[tokio::test(start_paused = true)]
    #[allow(clippy::disallowed_methods)] // a test measuring the wait on tokio's (paused) clock
    async fn a_deadline_passes_after_its_limit_and_at_most_two_ticks_late() {
        let deadlines = CoarseDeadlines::new(TICK);
        for offset_ms in [0, 1, 37, 50, 99, 100, 163] {
            for limit_ms in [0, 1, 99, 100, 101, 250, 2_000] {
                tokio::time::sleep(Duration::from_millis(offset_ms)).await;
                let limit = Duration::from_millis(limit_ms);
                let started = Instant::now();
                let answer = deadlines.within(limit, std::future::pending::<()>()).await;
                let waited = started.elapsed();
                assert_eq!(answer, Err(DeadlinePassed));
                assert!(
                    waited >= limit,
                    "offset {offset_ms} ms, limit {limit_ms} ms: passed after {waited:?}"
                );
                assert!(
                    waited <= limit + 2 * TICK,
                    "offset {offset_ms} ms, limit {limit_ms} ms: passed after {waited:?}"
                );
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_ticking_task_starts_on_first_use_and_stops_when_the_deadlines_are_dropped() {
        let runtime = tokio::runtime::Handle::current().metrics();
        let deadlines = CoarseDeadlines::new(TICK);
        let clone = deadlines.clone();
        assert_eq!(runtime.num_alive_tasks(), 0);
        assert_eq!(deadlines.within(TICK, async {}).await, Ok(()));
        assert_eq!(runtime.num_alive_tasks(), 1);
        drop(deadlines);
        tokio::time::sleep(3 * TICK).await;
        assert_eq!(runtime.num_alive_tasks(), 1, "a clone still uses it");
        drop(clone);
        tokio::time::sleep(TICK).await;
        assert_eq!(runtime.num_alive_tasks(), 0);
    }

    #[test]
    fn ticks_round_down_and_up() {
        assert_eq!(whole_ticks(TICK - Duration::from_nanos(1), TICK), 0);
        assert_eq!(whole_ticks(TICK, TICK), 1);
        assert_eq!(whole_ticks(Duration::MAX, Duration::ZERO), u64::MAX);
        assert_eq!(ticks_in(Duration::ZERO, TICK), 0);
        assert_eq!(ticks_in(Duration::from_millis(1), TICK), 1);
        assert_eq!(ticks_in(TICK, TICK), 1);
        assert_eq!(ticks_in(TICK + Duration::from_nanos(1), TICK), 2);
        assert_eq!(ticks_in(Duration::MAX, Duration::from_nanos(1)), u64::MAX);
    }
}
