//! The process-wide Prometheus recorder, set up once for every service: histograms in seconds
//! (buckets from half a millisecond to 2.5 s), except the size metrics a service names, which get
//! power-of-two count buckets.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Histogram buckets of latencies, seconds.
pub const LATENCY_BUCKETS_SECONDS: [f64; 12] = [
    0.000_5, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];
/// Histogram buckets of sizes (items per batch), counts.
pub const SIZE_BUCKETS: [f64; 8] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0];

/// Installs the process-wide recorder on first use and returns its handle (for `/metrics`); the
/// histograms named in `size_metrics` count items, every other one seconds. Later calls return
/// the same handle, whatever they name. `None` when another recorder is already installed (pass
/// that recorder's handle around instead).
pub fn prometheus(size_metrics: &[&str]) -> Option<PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let mut builder = PrometheusBuilder::new()
                .set_buckets(&LATENCY_BUCKETS_SECONDS)
                .ok()?;
            for name in size_metrics {
                builder = builder
                    .set_buckets_for_metric(Matcher::Full((*name).to_owned()), &SIZE_BUCKETS)
                    .ok()?;
            }
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).ok()?;
            Some(handle)
        })
        .clone()
}
