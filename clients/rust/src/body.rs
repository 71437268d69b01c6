//! The response body of a service behind [`crate::AllotLayer`]: the service's own, carrying the work
//! to do when it ends (release the request's concurrency slots, settle its metered cost), or the
//! problem+json of a refusal.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use allot_shared::contract::{AdmissionRequest, SettleRequest};
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use crate::client::AgentClient;

/// Calls that failed when a response ended: `allot_client_completion_failures_total{call}`.
pub const COMPLETION_FAILURES: &str = "allot_client_completion_failures_total";

pin_project_lite::pin_project! {
    /// A response body: the service's, which runs the request's completion once when it ends (or
    /// is dropped: the caller went away), or a refusal's problem+json.
    pub struct AllotBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project_lite::pin_project! {
    #[project = KindProjection]
    enum Kind<B> {
        Served {
            #[pin]
            body: B,
            completion: Option<Completion>,
        },
        Refused {
            bytes: Option<Bytes>,
        },
    }
}

impl<B> AllotBody<B> {
    pub(crate) fn served(body: B, completion: Option<Completion>) -> Self {
        Self {
            kind: Kind::Served { body, completion },
        }
    }

    pub(crate) fn refused(bytes: Bytes) -> Self {
        Self {
            kind: Kind::Refused {
                bytes: (!bytes.is_empty()).then_some(bytes),
            },
        }
    }
}

impl<B> Body for AllotBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            KindProjection::Served { body, completion } => {
                let frame = ready!(body.poll_frame(cx));
                if frame.is_none() {
                    // The response is whole: complete now, not whenever the body is dropped.
                    drop(completion.take());
                }
                Poll::Ready(frame)
            }
            KindProjection::Refused { bytes } => {
                Poll::Ready(bytes.take().map(|bytes| Ok(Frame::data(bytes))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Served { body, .. } => body.is_end_stream(),
            Kind::Refused { bytes } => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Served { body, .. } => body.size_hint(),
            Kind::Refused { bytes } => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
        }
    }
}

/// A metered request's actual cost, for the service to state (in the request's extensions of a
/// request admitted with [`crate::Admission::metered`]); settled when the response ends.
#[derive(Debug, Clone, Default)]
pub struct MeteredCost(Arc<AtomicU64>);

/// The meter's "not stated" value.
const UNSTATED: u64 = u64::MAX;

impl MeteredCost {
    pub(crate) fn new() -> Self {
        Self(Arc::new(AtomicU64::new(UNSTATED)))
    }

    /// States the actual cost, whole units (the last statement counts).
    pub fn set(&self, units: u64) {
        self.0.store(units.min(UNSTATED - 1), Ordering::Relaxed);
    }

    /// Adds `units` to the actual cost (for a response that counts as it streams).
    pub fn add(&self, units: u64) {
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |now| {
                let base = if now == UNSTATED { 0 } else { now };
                Some(base.saturating_add(units).min(UNSTATED - 1))
            });
    }

    /// The stated cost, if any.
    pub fn get(&self) -> Option<u64> {
        Some(self.0.load(Ordering::Relaxed)).filter(|&units| units != UNSTATED)
    }
}

/// What an admitted request owes the agent when its response ends: its concurrency slots back, its
/// actual cost when metered. Runs once, when dropped (the body ended, the caller went away, or the
/// service failed), on the runtime the request was served on; a heartbeat renewing its slots stops
/// then too.
pub struct Completion {
    client: AgentClient,
    request: AdmissionRequest,
    releases_slots: bool,
    meter: Option<MeteredCost>,
    runtime: tokio::runtime::Handle,
    /// Dropped with the completion, which stops the heartbeat.
    _heartbeat: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Completion {
    /// The completion of `request`, or `None` when it owes nothing. Starts a heartbeat that renews
    /// the request's slots every `renew_every` while it runs, when given.
    pub(crate) fn start(
        client: AgentClient,
        request: AdmissionRequest,
        releases_slots: bool,
        meter: Option<MeteredCost>,
        renew_every: Option<Duration>,
    ) -> Option<Self> {
        if !releases_slots && meter.is_none() {
            return None;
        }
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let heartbeat = renew_every
            .filter(|_| releases_slots)
            .map(|period| heartbeat(&runtime, client.clone(), request.clone(), period));
        Some(Self {
            client,
            request,
            releases_slots,
            meter,
            runtime,
            _heartbeat: heartbeat,
        })
    }
}

/// Renews `request`'s slots every `period` until the returned sender is dropped.
fn heartbeat(
    runtime: &tokio::runtime::Handle,
    client: AgentClient,
    request: AdmissionRequest,
    period: Duration,
) -> tokio::sync::oneshot::Sender<()> {
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    runtime.spawn(async move {
        loop {
            tokio::select! {
                _ = &mut stopped => return,
                () = tokio::time::sleep(period) => {}
            }
            if let Err(error) = client.renew(&request).await {
                metrics::counter!(COMPLETION_FAILURES, "call" => "renew").increment(1);
                tracing::warn!(%error, "could not renew a request's concurrency slots");
            }
        }
    });
    stop
}

impl Drop for Completion {
    fn drop(&mut self) {
        let client = self.client.clone();
        let request = self.request.clone();
        let releases_slots = self.releases_slots;
        let actual_cost_units = self.meter.as_ref().and_then(MeteredCost::get);
        self.runtime.spawn(async move {
            if releases_slots && let Err(error) = client.release(&request).await {
                metrics::counter!(COMPLETION_FAILURES, "call" => "release").increment(1);
                tracing::warn!(%error, "could not release a request's concurrency slots; they lapse with their lease");
            }
            if let Some(actual_cost_units) = actual_cost_units {
                let settlement = SettleRequest {
                    decision_id: request.request_id.clone(),
                    tenant_id: request.tenant_id.clone(),
                    actual_cost_units,
                };
                if let Err(error) = client.settle(&settlement).await {
                    metrics::counter!(COMPLETION_FAILURES, "call" => "settle").increment(1);
                    tracing::warn!(%error, "could not settle a metered request; its estimate stands");
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_meter_counts_what_the_service_states() {
        let meter = MeteredCost::new();
        assert_eq!(meter.get(), None, "unstated: the estimate stands");
        meter.add(3);
        meter.add(4);
        assert_eq!(meter.get(), Some(7));
        meter.set(2);
        assert_eq!(meter.get(), Some(2));
        meter.set(u64::MAX);
        assert_eq!(meter.get(), Some(u64::MAX - 1), "never reads as unstated");
    }
}
