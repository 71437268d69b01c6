//! `allot drill NAME --vary PARAMETER=V1,V2,...`: one drill run with each value of one design
//! parameter (over a range of seeds), and what the value costs: the overshoot of the worst window
//! above `G`, and the requests denied while the pool still had tokens to grant. The figures behind
//! "how long a partition may last" and "how long a lease should live" (docs/drills.md), as a table,
//! JSON, and an SVG of bars: each value is its own configuration, so nothing is drawn between them.

use plotters::prelude::*;

use super::results::{DrillReport, RegionWindow};
use super::scenario::{Fault, Scenario};
use super::{SeedRange, run_with};

/// Most values one sweep takes (I10).
pub const MAX_VALUES: usize = 32;

/// The design parameter a sweep varies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parameter {
    /// The length of the drill's first partition, ms (0: no partition), from its start.
    PartitionMs,
    /// The pool's lease TTL, ms.
    LeaseTtlMs,
    /// The pool's chunk, tokens.
    Chunk,
    /// The pool's fallback allowance per region, tokens.
    FallbackPerRegion,
}

impl Parameter {
    fn name(self) -> &'static str {
        match self {
            Parameter::PartitionMs => "partition-ms",
            Parameter::LeaseTtlMs => "lease-ttl-ms",
            Parameter::Chunk => "chunk",
            Parameter::FallbackPerRegion => "fallback-per-region",
        }
    }
}

/// `--vary PARAMETER=V1,V2,...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vary {
    /// What varies.
    pub parameter: Parameter,
    /// Its values, in the order given.
    pub values: Vec<u64>,
}

impl std::str::FromStr for Vary {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let (name, values) = text.split_once('=').ok_or(
            "--vary: PARAMETER=V1,V2,... (partition-ms, lease-ttl-ms, chunk, fallback-per-region)",
        )?;
        let parameter = [
            Parameter::PartitionMs,
            Parameter::LeaseTtlMs,
            Parameter::Chunk,
            Parameter::FallbackPerRegion,
        ]
        .into_iter()
        .find(|p| p.name() == name.trim())
        .ok_or_else(|| {
            format!(
                "--vary: unknown parameter {name:?} (partition-ms, lease-ttl-ms, chunk, fallback-per-region)"
            )
        })?;
        let values = values
            .split(',')
            .map(|v| {
                v.trim()
                    .parse::<u64>()
                    .map_err(|_| format!("--vary: {v:?} is not a whole number"))
            })
            .collect::<Result<Vec<u64>, String>>()?;
        if values.is_empty() || values.len() > MAX_VALUES {
            return Err(format!("--vary: 1 to {MAX_VALUES} values"));
        }
        Ok(Self { parameter, values })
    }
}

/// `scenario` with `parameter` at `value`, checked as a scenario file would be.
pub fn with_value(
    scenario: &Scenario,
    parameter: Parameter,
    value: u64,
) -> Result<Scenario, String> {
    let mut varied = scenario.clone();
    match parameter {
        Parameter::PartitionMs => {
            let index = varied
                .faults
                .iter()
                .position(|fault| matches!(fault, Fault::Partition { .. }))
                .ok_or_else(|| format!("drill {} has no partition to vary", scenario.name))?;
            if value == 0 {
                varied.faults.remove(index);
            } else if let Fault::Partition {
                from_ms, until_ms, ..
            } = &mut varied.faults[index]
            {
                *until_ms = from_ms.saturating_add(value);
            }
        }
        Parameter::LeaseTtlMs => varied.lease_ttl_ms = value,
        Parameter::Chunk => varied.chunk_tokens = value,
        Parameter::FallbackPerRegion => varied.fallback_per_region_tokens = value,
    }
    varied
        .validate()
        .map_err(|e| format!("--vary {}={value}: {e}", parameter.name()))?;
    Ok(varied)
}

/// What one value cost, over the seeds.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Point {
    /// The parameter's value.
    pub value: u64,
    /// Seeds run.
    pub seeds: u64,
    /// The worst window's admits above `G` (per tenant), mean over the seeds.
    pub overshoot_mean: f64,
    /// The same, the largest of any seed.
    pub overshoot_max: u64,
    /// The design bound's overshoot term (fallback and carry-over; `bound - G`).
    pub bound_overshoot: u64,
    /// Requests denied while the pool still had tokens to grant, per run, mean over the seeds:
    /// denied for want of a grant (the allocator unreachable and the allowance spent, or a grant
    /// that did not arrive in time) or by a static split.
    pub denied_while_tokens_left_mean: f64,
    /// Tokens stranded per run (granted, unspent when their lease ended), mean over the seeds.
    pub stranded_mean: f64,
    /// Seeds whose drill failed its checks.
    pub failed_seeds: u64,
}

/// Requests denied although the pool had tokens the region could have been granted.
fn denied_while_tokens_left(region: &RegionWindow) -> u64 {
    region.denied_fallback_spent + region.denied_awaiting + region.denied_while_tokens_left
}

/// The worst window's admits above `G`, per tenant.
fn worst_overshoot(report: &DrillReport) -> u64 {
    let tenants = report.scenario.tenants.max(1);
    report
        .windows
        .iter()
        .map(|window| {
            let admitted = window.sum(RegionWindow::admitted);
            admitted.saturating_sub(report.scenario.limit_tokens * tenants) / tenants
        })
        .max()
        .unwrap_or(0)
}

/// Runs `scenario` with every value of `vary`, over `seeds`.
pub async fn sweep(
    scenario: &Scenario,
    vary: &Vary,
    seeds: SeedRange,
) -> Result<Vec<Point>, String> {
    let mut points = Vec::with_capacity(vary.values.len());
    for &value in &vary.values {
        let varied = with_value(scenario, vary.parameter, value)?;
        let (mut overshoot_sum, mut overshoot_max, mut denied, mut stranded) =
            (0u64, 0u64, 0u64, 0u64);
        let (mut runs, mut failed_seeds, mut bound_overshoot) = (0u64, 0u64, 0u64);
        for seed in seeds.seeds() {
            let report = run_with(&varied, seed, varied.duration_ms).await?;
            let overshoot = worst_overshoot(&report);
            overshoot_sum += overshoot;
            overshoot_max = overshoot_max.max(overshoot);
            for window in &report.windows {
                denied += window.sum(denied_while_tokens_left);
                stranded += window
                    .sum(|r| r.stranded_tokens)
                    .saturating_sub(window.sum(|r| r.returned_tokens));
            }
            bound_overshoot = report.bound.total_tokens() - report.bound.limit_tokens;
            failed_seeds += u64::from(!report.passed());
            runs += 1;
        }
        let mean = |sum: u64| sum as f64 / runs.max(1) as f64;
        points.push(Point {
            value,
            seeds: runs,
            overshoot_mean: mean(overshoot_sum),
            overshoot_max,
            bound_overshoot,
            denied_while_tokens_left_mean: mean(denied),
            stranded_mean: mean(stranded),
            failed_seeds,
        });
    }
    Ok(points)
}

/// The sweep as a table.
pub fn table(scenario: &Scenario, vary: &Vary, points: &[Point]) -> String {
    let mut out = format!(
        "drill {} varying {} ({} seeds each)\n{:>14} {:>15} {:>14} {:>16} {:>24} {:>15} {:>7}\n",
        scenario.name,
        vary.parameter.name(),
        points.first().map_or(0, |p| p.seeds),
        vary.parameter.name(),
        "overshoot mean",
        "overshoot max",
        "bound's overshoot",
        "denied w/ tokens left",
        "stranded mean",
        "failed"
    );
    for p in points {
        out.push_str(&format!(
            "{:>14} {:>15.1} {:>14} {:>16} {:>24.1} {:>15.1} {:>7}\n",
            p.value,
            p.overshoot_mean,
            p.overshoot_max,
            p.bound_overshoot,
            p.denied_while_tokens_left_mean,
            p.stranded_mean,
            p.failed_seeds
        ));
    }
    out
}

/// The x axis both charts of the sweep share: one position per value.
struct Axes<'l> {
    x_desc: &'static str,
    x_range: std::ops::Range<f64>,
    labels: usize,
    x_label: &'l dyn Fn(&f64) -> String,
}

type BarChart<'a, 'b> = ChartContext<
    'a,
    SVGBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

impl Axes<'_> {
    /// A chart on `area` with these axes, values up to `top`.
    fn chart<'a, 'b>(
        &self,
        area: &'a DrawingArea<SVGBackend<'b>, plotters::coord::Shift>,
        caption: &str,
        y_desc: &str,
        top: f64,
    ) -> Result<BarChart<'a, 'b>, String> {
        let fail = |e: &dyn std::fmt::Display| format!("plot of the sweep: {e}");
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 15))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(55)
            .build_cartesian_2d(self.x_range.clone(), 0f64..top)
            .map_err(|e| fail(&e))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(self.labels)
            .x_label_formatter(self.x_label)
            .x_desc(self.x_desc)
            .y_desc(y_desc)
            .draw()
            .map_err(|e| fail(&e))?;
        Ok(chart)
    }
}

/// The sweep as an SVG: the worst window's overshoot (mean over seeds as bars, the largest seed's
/// as a mark, the bound's term as a line) and the denials while tokens were left, per value.
///
/// Long by design: the two panels are one figure: drawn on the halves of one drawing area, they
/// share its x axis, value labels and bar shape, closures over the sweep's points; split, those
/// closures would become parameters of each panel and the figure's layout would be read in pieces.
pub fn svg(scenario: &Scenario, vary: &Vary, points: &[Point]) -> Result<String, String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (720, 560)).into_drawing_area();
        let fail = |e: &dyn std::fmt::Display| format!("plot of the sweep: {e}");
        root.fill(&WHITE).map_err(|e| fail(&e))?;
        let (top, bottom) = root.split_vertically(280);
        let labels: Vec<String> = points.iter().map(|p| p.value.to_string()).collect();
        let count = points.len();
        let overshoot_top = points
            .iter()
            .map(|p| p.overshoot_max.max(p.bound_overshoot))
            .max()
            .unwrap_or(0) as f64
            * 1.6
            + 1.0;
        let denied_top = points
            .iter()
            .map(|p| p.denied_while_tokens_left_mean)
            .fold(0.0, f64::max)
            * 1.15
            + 1.0;
        let caption =
            |what: &str| format!("{}: {what} by {}", scenario.name, vary.parameter.name());
        // Value i sits at x = i; labels only at whole positions.
        let x_label = |x: &f64| {
            let nearest = x.round();
            if (x - nearest).abs() < 0.01 && nearest >= 0.0 {
                labels.get(nearest as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        };
        let x_range = -0.5f64..(count as f64 - 0.5);
        let axes = Axes {
            x_desc: vary.parameter.name(),
            x_range,
            labels: points.len(),
            x_label: &x_label,
        };
        let bar = |i: usize, height: f64, color: RGBColor| {
            let x = i as f64;
            Rectangle::new([(x - 0.35, 0.0), (x + 0.35, height)], color.filled())
        };
        {
            let mut chart = axes.chart(
                &top,
                &caption("worst window's overshoot above G"),
                "tokens per tenant",
                overshoot_top,
            )?;
            chart
                .draw_series(
                    points
                        .iter()
                        .enumerate()
                        .map(|(i, p)| bar(i, p.overshoot_mean, RGBColor(47, 111, 181))),
                )
                .map_err(|e| fail(&e))?
                .label("mean over seeds")
                .legend(|(x, y)| {
                    Rectangle::new(
                        [(x, y - 5), (x + 12, y + 5)],
                        RGBColor(47, 111, 181).filled(),
                    )
                });
            chart
                .draw_series(points.iter().enumerate().map(|(i, p)| {
                    Cross::new((i as f64, p.overshoot_max as f64), 5, BLACK.stroke_width(2))
                }))
                .map_err(|e| fail(&e))?
                .label("largest seed")
                .legend(|(x, y)| Cross::new((x + 6, y), 5, BLACK.stroke_width(2)));
            // The bound's term is a step per configuration, drawn across its own bar only.
            chart
                .draw_series(points.iter().enumerate().map(|(i, p)| {
                    let x = i as f64;
                    PathElement::new(
                        vec![
                            (x - 0.45, p.bound_overshoot as f64),
                            (x + 0.45, p.bound_overshoot as f64),
                        ],
                        RGBColor(180, 35, 24).stroke_width(2),
                    )
                }))
                .map_err(|e| fail(&e))?
                .label("the bound's term (bound - G)")
                .legend(|(x, y)| {
                    PathElement::new(
                        vec![(x, y), (x + 16, y)],
                        RGBColor(180, 35, 24).stroke_width(2),
                    )
                });
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperLeft)
                .draw()
                .map_err(|e| fail(&e))?;
        }
        {
            let mut chart = axes.chart(
                &bottom,
                &caption("requests denied while the pool had tokens"),
                "requests per run",
                denied_top,
            )?;
            chart
                .draw_series(
                    points.iter().enumerate().map(|(i, p)| {
                        bar(i, p.denied_while_tokens_left_mean, RGBColor(214, 120, 32))
                    }),
                )
                .map_err(|e| fail(&e))?;
        }
        root.present().map_err(|e| fail(&e))?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fallback() -> Scenario {
        super::super::builtin()
            .into_iter()
            .find(|s| s.name == "fallback")
            .expect("the built-in fallback drill")
    }

    #[test]
    fn a_vary_option_names_its_parameter_and_values() {
        let vary: Vary = "partition-ms=0, 30000,60000".parse().expect("valid");
        assert_eq!(vary.parameter, Parameter::PartitionMs);
        assert_eq!(vary.values, [0, 30_000, 60_000]);
        for (text, error) in [
            ("partition-ms", "PARAMETER=V1,V2"),
            ("ttl=1", "unknown parameter \"ttl\""),
            ("chunk=1,x", "\"x\" is not a whole number"),
        ] {
            let refused = text.parse::<Vary>().expect_err(text);
            assert!(refused.contains(error), "{text}: {refused}");
        }
    }

    #[test]
    fn a_value_changes_the_scenario_or_is_refused_naming_it() {
        let base = fallback();
        let none = with_value(&base, Parameter::PartitionMs, 0).expect("valid");
        assert!(
            !none
                .faults
                .iter()
                .any(|f| matches!(f, Fault::Partition { .. })),
            "0: no partition"
        );
        let shorter = with_value(&base, Parameter::PartitionMs, 10_000).expect("valid");
        assert!(shorter.faults.iter().any(|f| matches!(
            f,
            Fault::Partition { from_ms, until_ms, .. } if until_ms - from_ms == 10_000
        )));
        assert_eq!(
            with_value(&base, Parameter::LeaseTtlMs, 5_000)
                .expect("valid")
                .lease_ttl_ms,
            5_000
        );
        let refused = with_value(&base, Parameter::Chunk, 0).expect_err("a chunk of 0");
        assert!(refused.starts_with("--vary chunk=0: "), "{refused}");
    }

    /// Over every value and seed the worst window stays within the bound's term, and a longer
    /// partition denies more of what the pool could have granted.
    #[tokio::test]
    async fn longer_partitions_deny_more_and_never_pass_the_bound() {
        let vary: Vary = "partition-ms=10000,120000".parse().expect("valid");
        let points = sweep(&fallback(), &vary, SeedRange::first_n(3).expect("seeds"))
            .await
            .expect("runs");
        for point in &points {
            assert!(point.overshoot_max <= point.bound_overshoot, "{point:?}");
        }
        assert!(
            points[1].denied_while_tokens_left_mean > points[0].denied_while_tokens_left_mean,
            "{points:?}"
        );
        let svg = svg(&fallback(), &vary, &points).expect("plots");
        assert!(
            svg.starts_with("<svg") && svg.contains("120000"),
            "labelled"
        );
        assert!(table(&fallback(), &vary, &points).contains("partition-ms"));
    }
}
