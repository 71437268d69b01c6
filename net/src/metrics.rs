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

/// A counter or gauge whose label values are all known at start: [`export_at_zero`] exports it
/// with every combination of them.
#[derive(Debug, Clone, Copy)]
pub struct AtStart {
    /// Its name.
    pub name: &'static str,
    /// A gauge (set to 0), else a counter (incremented by 0).
    pub gauge: bool,
    /// Each label key with its every value (none: no labels).
    pub labels: &'static [(&'static str, &'static [&'static str])],
}

impl AtStart {
    /// A counter with `labels`.
    pub const fn counter(
        name: &'static str,
        labels: &'static [(&'static str, &'static [&'static str])],
    ) -> Self {
        Self {
            name,
            gauge: false,
            labels,
        }
    }

    /// A gauge with `labels`.
    pub const fn gauge(
        name: &'static str,
        labels: &'static [(&'static str, &'static [&'static str])],
    ) -> Self {
        Self {
            name,
            gauge: true,
            labels,
        }
    }

    /// Every label set it is exported with: one for each combination of the keys' values.
    pub fn label_sets(&self) -> Vec<Vec<metrics::Label>> {
        self.labels
            .iter()
            .fold(vec![Vec::new()], |sets, (key, values)| {
                sets.iter()
                    .flat_map(|set| {
                        values.iter().map(move |value| {
                            let mut longer = set.clone();
                            longer.push(metrics::Label::new(*key, *value));
                            longer
                        })
                    })
                    .collect()
            })
    }
}

/// Exports every metric of `metrics` at 0 through the installed recorder: counters incremented by
/// nothing, gauges set to 0. Call it once, when the recorder is installed and before anything
/// records: a gauge set here would otherwise overwrite a value.
pub fn export_at_zero(metrics: &[AtStart]) {
    for metric in metrics {
        for labels in metric.label_sets() {
            if metric.gauge {
                metrics::gauge!(metric.name, labels).set(0.0);
            } else {
                metrics::counter!(metric.name, labels).increment(0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_combination_of_label_values_is_exported() {
        let metric = AtStart::counter(
            "allot_test_total",
            &[("file", &["a", "b"]), ("outcome", &["ok", "failed"])],
        );
        let sets: Vec<Vec<(String, String)>> = metric
            .label_sets()
            .into_iter()
            .map(|set| {
                set.iter()
                    .map(|l| (l.key().to_owned(), l.value().to_owned()))
                    .collect()
            })
            .collect();
        assert_eq!(sets.len(), 4);
        assert!(sets.contains(&vec![
            ("file".to_owned(), "b".to_owned()),
            ("outcome".to_owned(), "failed".to_owned())
        ]));
        assert_eq!(
            AtStart::gauge("allot_test", &[]).label_sets(),
            vec![Vec::new()]
        );
    }
}
