//! A drill's report in three forms: a terminal table, JSON for machines, and a self-contained HTML
//! page with SVG plots (plotters) per drill: admitted per window against G and the bound, stranded
//! and fallback tokens over time, and each region's share of what was admitted.

use allot_shared::lease::{LeaseClamping, overshoot_tokens};
use plotters::prelude::*;

use super::results::{DrillReport, RegionWindow, WindowRecord};

/// Windows listed one by one in a table; longer runs print a summary.
pub const MAX_TABLE_WINDOWS: usize = 60;

impl DrillReport {
    /// The bound of `window`, summed over tenants (with its lost-record term).
    pub fn window_bound(&self, window: &WindowRecord) -> u64 {
        // The design's terms over the pools' own limits, with the window's limits in their place
        // (they differ only where an override was in force).
        let tenants = self.scenario.tenants;
        (self.bound.total_tokens() * tenants - self.bound.limit_tokens * tenants)
            + window.limit_tokens
            + window.lost_grant_record_tokens
    }

    /// The report for machines: the scenario, the seed, the bound's terms, every window with its
    /// regions, convergence and the violations. Deterministic: the same run gives the same bytes.
    pub fn json(&self) -> serde_json::Value {
        let s = &self.scenario;
        let windows: Vec<serde_json::Value> = self
            .windows
            .iter()
            .map(|w| {
                let regions: Vec<serde_json::Value> = s
                    .regions
                    .iter()
                    .zip(&w.regions)
                    .map(|(plan, r)| {
                        let mut value = serde_json::json!(r);
                        value["region"] = serde_json::json!(plan.region);
                        value["admitted"] = serde_json::json!(r.admitted());
                        value
                    })
                    .collect();
                let admitted = w.sum(RegionWindow::admitted);
                serde_json::json!({
                    "offsetMs": w.offset_ms,
                    "admitted": admitted,
                    "limit": w.limit_tokens,
                    "overshoot": overshoot_tokens(admitted, w.limit_tokens),
                    "bound": self.window_bound(w),
                    "lostGrantRecordTokens": w.lost_grant_record_tokens,
                    "regions": regions,
                })
            })
            .collect();
        let convergence = self.convergence.map(|c| {
            let after: serde_json::Map<String, serde_json::Value> = s
                .regions
                .iter()
                .enumerate()
                .map(|(r, plan)| (plan.region.clone(), serde_json::json!(c.after_ms[r])))
                .collect();
            serde_json::json!({ "healedAtMs": c.healed_at_ms, "limitMs": c.limit_ms,
                                "afterMs": after })
        });
        serde_json::json!({
            "name": s.name,
            "about": s.about,
            "seed": self.seed,
            "tenants": s.tenants,
            "limit": s.limit_tokens,
            "windowMs": s.window_ms,
            "calendar": s.calendar.as_ref().map(|c| serde_json::json!({
                "unit": c.unit, "timeZone": c.time_zone, "start": c.start,
            })),
            "chunk": s.chunk_tokens,
            "leaseTtlMs": s.lease_ttl_ms,
            "fallbackPerRegion": s.fallback_per_region_tokens,
            "clamped": s.clamping == LeaseClamping::Clamped,
            "durationMs": s.duration_ms,
            "bound": {
                "limitTokens": self.bound.limit_tokens,
                "unclampedCarryOverTokens": self.bound.unclamped_carry_over_tokens,
                "fallbackAllowanceTokens": self.bound.fallback_allowance_tokens,
                "lostGrantRecordTokens": self.bound.lost_grant_record_tokens,
                "totalTokens": self.bound.total_tokens(),
            },
            "windows": windows,
            "convergence": convergence,
            "passed": self.passed(),
            "violations": self.violations,
            "violationsNotListed": self.violations_not_listed,
        })
    }

    /// A terminal table: one line per window and region (a summary for long runs).
    ///
    /// Long by design: it writes the table top to bottom as it is printed (header with the bound's
    /// terms, a line per window and region, totals, convergence, verdict), and each line's format
    /// string sits beside the values it lays out; split, the column headings and the rows under
    /// them would be read in different places.
    pub fn table(&self) -> String {
        let s = &self.scenario;
        let mut out = format!(
            "drill {}: {}\n  seed {}  tenants {}  G={} window={} chunk={} ttl={}ms fallback/region={} leases {}\n  bound per tenant and window = {} (pool limits {} + carry-over {} + fallback {} + lost records {}{})\n",
            s.name,
            s.about,
            self.seed,
            s.tenants,
            s.limit_tokens,
            match &s.calendar {
                Some(calendar) => format!("{} in {}", calendar.unit, calendar.time_zone),
                None => format!("{}ms", s.window_ms),
            },
            s.chunk_tokens,
            s.lease_ttl_ms,
            s.fallback_per_region_tokens,
            match s.clamping {
                LeaseClamping::Clamped => "clamped",
                LeaseClamping::Unclamped => "unclamped",
            },
            self.bound.total_tokens(),
            self.bound.limit_tokens,
            self.bound.unclamped_carry_over_tokens,
            self.bound.fallback_allowance_tokens,
            self.bound.lost_grant_record_tokens,
            if self.bound.settle_debt_tokens > 0 {
                format!(" + settle debt {}", self.bound.settle_debt_tokens)
            } else {
                String::new()
            },
        );
        if self.windows.len() <= MAX_TABLE_WINDOWS {
            out.push_str(
                "  window  region  demand  leased  carried  fallback  denied  (tokens left)  granted  stranded\n",
            );
            for window in &self.windows {
                for (plan, r) in s.regions.iter().zip(&window.regions) {
                    out.push_str(&format!(
                        "  {:>5}s  {:<6}  {:>6}  {:>6}  {:>7}  {:>8}  {:>6}  {:>13}  {:>7}  {:>8}\n",
                        window.offset_ms / 1_000,
                        plan.region,
                        r.demand,
                        r.leased,
                        r.carried_over,
                        r.fallback,
                        r.denied(),
                        r.denied_while_tokens_left,
                        r.granted_tokens,
                        r.stranded_tokens,
                    ));
                    let extras = extras(r);
                    if !extras.is_empty() {
                        out.push_str(&format!("          {:<6}  {extras}\n", plan.region));
                    }
                }
                let admitted = window.sum(RegionWindow::consumed);
                let lost = window.lost_grant_record_tokens;
                out.push_str(&format!(
                    "  {:>5}s  total   admitted {} of G {} (overshoot {}, bound {}{})\n",
                    window.offset_ms / 1_000,
                    admitted,
                    window.limit_tokens,
                    overshoot_tokens(admitted, window.limit_tokens),
                    self.window_bound(window),
                    if lost > 0 {
                        format!(" with {lost} lost grant records")
                    } else {
                        String::new()
                    },
                ));
            }
        } else {
            out.push_str(&self.summary());
        }
        if let Some(c) = &self.convergence {
            let per_region: Vec<String> = s
                .regions
                .iter()
                .enumerate()
                .map(|(r, plan)| format!("{} {} ms", plan.region, c.after_ms[r]))
                .collect();
            out.push_str(&format!(
                "  converged after the heal at {} s: {} (limit {} ms)\n",
                c.healed_at_ms / 1_000,
                per_region.join(", "),
                c.limit_ms
            ));
        }
        if self.passed() {
            out.push_str("  PASS\n");
        } else {
            for v in &self.violations {
                out.push_str(&format!("  FAIL: {v}\n"));
            }
            if self.violations_not_listed > 0 {
                out.push_str(&format!(
                    "  FAIL: and {} more\n",
                    self.violations_not_listed
                ));
            }
        }
        out
    }

    fn summary(&self) -> String {
        let s = &self.scenario;
        let mut out = format!(
            "  {} windows; per region over the run:\n",
            self.windows.len()
        );
        for (r, plan) in s.regions.iter().enumerate() {
            let mut total = RegionWindow::default();
            for w in &self.windows {
                total.add(&w.regions[r]);
            }
            out.push_str(&format!(
                "  {:<6}  demand {}  admitted {} (leased {}, carried {}, fallback {})  denied {}  granted {}  stranded {} (left unspent {}, taken back {})\n",
                plan.region,
                total.demand,
                total.admitted(),
                total.leased,
                total.carried_over,
                total.fallback,
                total.denied(),
                total.granted_tokens,
                total.stranded_net_tokens(),
                total.stranded_tokens,
                total.returned_tokens
            ));
        }
        let worst = self
            .windows
            .iter()
            .max_by_key(|w| w.sum(RegionWindow::admitted));
        if let Some(w) = worst {
            let admitted = w.sum(RegionWindow::admitted);
            out.push_str(&format!(
                "  busiest window {}s: admitted {} of G {} (overshoot {}, bound {})\n",
                w.offset_ms / 1_000,
                admitted,
                w.limit_tokens,
                overshoot_tokens(admitted, w.limit_tokens),
                self.window_bound(w)
            ));
        }
        out
    }

    /// The drill's section of the HTML report: a heading, the table and three SVG plots.
    pub fn html_section(&self) -> Result<String, String> {
        let s = &self.scenario;
        let mut out = format!(
            "<section>\n<h2>{} <small>{}</small></h2>\n<p>{}</p>\n",
            escape(&s.name),
            if self.passed() { "PASS" } else { "FAIL" },
            escape(&s.about)
        );
        out.push_str(&self.admitted_plot()?);
        out.push_str(&self.stranded_fallback_plot()?);
        out.push_str(&self.share_plot()?);
        out.push_str(&format!(
            "<pre>{}</pre>\n</section>\n",
            escape(&self.table())
        ));
        Ok(out)
    }

    /// Each window's span, s from the first window's start: to the next window's start, the last
    /// to its own end (a calendar window's as long as the calendar makes it). The plots draw each
    /// window's value flat over its span.
    pub fn window_spans(&self) -> Vec<(u64, u64)> {
        let windows = self.scenario.windows().ok();
        self.windows
            .iter()
            .enumerate()
            .map(|(index, w)| {
                let end_ms = match (self.windows.get(index + 1), &windows) {
                    (Some(next), _) => next.offset_ms,
                    (None, Some(windows)) => {
                        let start_ms = windows.base_ms + w.offset_ms;
                        windows.spec.containing(start_ms).end_ms - windows.base_ms
                    }
                    (None, None) => w.offset_ms + self.scenario.window_ms,
                };
                (w.offset_ms / 1_000, end_ms / 1_000)
            })
            .collect()
    }

    /// A per-window quantity of every window, as a step over the window's span.
    fn steps(&self, of: &dyn Fn(&WindowRecord) -> u64) -> Vec<(u64, u64)> {
        self.windows
            .iter()
            .zip(self.window_spans())
            .flat_map(|(w, (start_s, end_s))| [(start_s, of(w)), (end_s, of(w))])
            .collect()
    }

    /// Admitted per window (each region and the total) against G and the bound.
    fn admitted_plot(&self) -> Result<String, String> {
        let s = &self.scenario;
        let mut series: Vec<(String, Vec<(u64, u64)>)> = vec![
            (
                "admitted".into(),
                self.steps(&|w| w.sum(RegionWindow::admitted)),
            ),
            ("G".into(), self.steps(&|w| w.limit_tokens)),
            ("bound".into(), self.steps(&|w| self.window_bound(w))),
        ];
        for (r, plan) in s.regions.iter().enumerate() {
            series.push((
                format!("admitted {}", plan.region),
                self.steps(&|w| w.regions[r].admitted()),
            ));
        }
        step_plot("admitted per window vs G and the bound", "tokens", &series)
    }

    fn stranded_fallback_plot(&self) -> Result<String, String> {
        let s = &self.scenario;
        let mut series = Vec::new();
        for (r, plan) in s.regions.iter().enumerate() {
            series.push((
                format!("stranded {}", plan.region),
                self.steps(&|w| w.regions[r].stranded_tokens),
            ));
            series.push((
                format!("fallback {}", plan.region),
                self.steps(&|w| w.regions[r].fallback),
            ));
        }
        step_plot("stranded and fallback tokens per window", "tokens", &series)
    }

    fn share_plot(&self) -> Result<String, String> {
        let s = &self.scenario;
        let series: Vec<(String, Vec<(u64, u64)>)> = s
            .regions
            .iter()
            .enumerate()
            .map(|(r, plan)| {
                let share = |w: &WindowRecord| {
                    w.regions[r].admitted() * 100 / w.sum(RegionWindow::admitted).max(1)
                };
                (format!("{} share", plan.region), self.steps(&share))
            })
            .collect();
        step_plot(
            "each region's share of what was admitted",
            "percent",
            &series,
        )
    }
}

fn extras(r: &RegionWindow) -> String {
    let mut parts = Vec::new();
    if r.answers_lost > 0 {
        parts.push(format!(
            "answers lost {} (recovered {} tokens)",
            r.answers_lost, r.recovered_tokens
        ));
    }
    if r.unreported_tokens > 0 {
        parts.push(format!("unreported {}", r.unreported_tokens));
    }
    if r.returned_tokens > 0 {
        parts.push(format!("unspent tokens taken back {}", r.returned_tokens));
    }
    if r.denied_while_a_twentieth_left > 0 {
        parts.push(format!(
            "denied while over 5 % of G unheld {}",
            r.denied_while_a_twentieth_left
        ));
    }
    if r.spent_after_lease_end > 0 {
        parts.push(format!("spent after lease end {}", r.spent_after_lease_end));
    }
    if r.denied_unavailable > 0 {
        parts.push(format!("not served {}", r.denied_unavailable));
    }
    if r.denied_awaiting > 0 {
        parts.push(format!("denied awaiting a grant {}", r.denied_awaiting));
    }
    if r.waited > 0 {
        parts.push(format!("waited {} (max {} ms)", r.waited, r.max_wait_ms));
    }
    if r.denied_regional > 0 {
        parts.push(format!(
            "denied regionally after reserving {} ({} debited)",
            r.denied_regional, r.denials_that_debited
        ));
    }
    if r.charged_extra_tokens > 0 || r.written_off_tokens > 0 {
        parts.push(format!(
            "metered extra charged {}, written off {}",
            r.charged_extra_tokens, r.written_off_tokens
        ));
    }
    parts.join(", ")
}

/// Per-window quantities on one chart, as an SVG element: each window's value is a flat step over
/// the window, so nothing suggests a trend between windows that never happened.
fn step_plot(
    title: &str,
    unit: &str,
    series: &[(String, Vec<(u64, u64)>)],
) -> Result<String, String> {
    let x_max = series
        .iter()
        .flat_map(|(_, points)| points.iter().map(|p| p.0))
        .max()
        .unwrap_or(0)
        + 1;
    let y_max = series
        .iter()
        .flat_map(|(_, points)| points.iter().map(|p| p.1))
        .max()
        .unwrap_or(0)
        .max(1)
        * 11
        / 10
        + 1;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (720, 300)).into_drawing_area();
        let fail = |e: &dyn std::fmt::Display| format!("plot {title:?}: {e}");
        root.fill(&WHITE).map_err(|e| fail(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(0u64..x_max, 0u64..y_max)
            .map_err(|e| fail(&e))?;
        chart
            .configure_mesh()
            .x_desc("since the first window's start, s")
            .y_desc(unit)
            .draw()
            .map_err(|e| fail(&e))?;
        for (index, (name, points)) in series.iter().enumerate() {
            let color = Palette99::pick(index).to_rgba();
            chart
                .draw_series(LineSeries::new(
                    points.iter().copied(),
                    color.stroke_width(2),
                ))
                .map_err(|e| fail(&e))?
                .label(name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()
            .map_err(|e| fail(&e))?;
        root.present().map_err(|e| fail(&e))?;
    }
    Ok(format!("<figure>{svg}</figure>\n"))
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A self-contained HTML page with every report's section.
pub fn html(reports: &[DrillReport]) -> Result<String, String> {
    let mut body = String::new();
    let passed = reports.iter().filter(|r| r.passed()).count();
    for report in reports {
        body.push_str(&report.html_section()?);
    }
    Ok(format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Allot drills</title>\n<style>body{{font-family:sans-serif;max-width:60rem;margin:2rem auto}}pre{{font-size:12px;overflow-x:auto}}figure{{margin:1rem 0}}small{{color:#555}}</style></head>\n<body>\n<h1>Allot partition drills</h1>\n<p>{passed} of {} drills passed. Each plots admitted tokens per window against G and the bound (G + carry-over + fallback + lost records), stranded and fallback tokens, and each region's share. Reproduce with <code>allot drill --report FILE</code>.</p>\n{body}</body></html>\n",
        reports.len()
    ))
}
