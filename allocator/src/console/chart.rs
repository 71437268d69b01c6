//! A pool's windows as an SVG chart: one group of bars per window (a window's quantities are
//! totals, so they are drawn as bars, never joined by sloped lines): what each region admitted,
//! stacked (its top above the G mark is the overshoot), then fallback admits, granted and
//! stranded, with the limit and the bound as horizontal marks across each window.

use plotters::prelude::*;

use crate::ledger::WindowRow;

/// Chart size, in pixels.
const SIZE_PX: (u32, u32) = (960, 320);

/// The bars drawn per window: label, colour, quantity.
type Series = (&'static str, RGBColor, fn(&WindowRow) -> u64);

const BARS: [Series; 3] = [
    ("admitted in fallback", RGBColor(230, 145, 20), |row| {
        row.fallback_admitted_tokens
    }),
    ("granted", RGBColor(120, 160, 120), |row| row.granted_tokens),
    ("stranded", RGBColor(150, 150, 150), |row| {
        row.stranded_tokens
    }),
];

/// The marks drawn across each window.
const MARKS: [Series; 2] = [
    ("bound", RGBColor(180, 35, 24), |row| row.bound_tokens),
    ("limit G", RGBColor(0, 0, 0), |row| row.limit_tokens),
];

/// The colours of the regions' stacked admits, in region order.
const REGION_COLOURS: [RGBColor; 6] = [
    RGBColor(31, 95, 191),
    RGBColor(94, 53, 177),
    RGBColor(0, 137, 123),
    RGBColor(173, 20, 87),
    RGBColor(85, 139, 47),
    RGBColor(93, 64, 55),
];

/// Slots per window on the x axis: a gap, the regions' stack, the bars, a gap.
const SLOTS_PER_WINDOW: u32 = BARS.len() as u32 + 3;

/// The chart of `windows` (newest first, as the ledger answers them), oldest on the left.
pub fn window_chart_svg(windows: &[WindowRow]) -> String {
    let mut svg = String::new();
    if let Err(error) = draw(&mut svg, windows) {
        tracing::warn!(%error, "window chart failed");
        svg = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\"><text x=\"10\" y=\"20\">chart unavailable</text></svg>",
            SIZE_PX.0, SIZE_PX.1
        );
    }
    svg
}

/// Draws `windows` into `svg`: each window's stacked regions, its bars and its marks, on one pair
/// of axes scaled to the largest of them.
///
/// Long by design: every series is drawn on the one chart whose y range is the largest value of all
/// of them, and each series' x position is a slot of the same layout per window (a gap, the stack,
/// the bars, a gap); split, the chart, its scale and that layout would be handed to every piece.
fn draw(svg: &mut String, windows: &[WindowRow]) -> Result<(), String> {
    let oldest_first: Vec<&WindowRow> = windows.iter().rev().collect();
    let slots = oldest_first.len().max(1) as u32;
    let y_max = oldest_first
        .iter()
        .flat_map(|row| {
            BARS.iter()
                .chain(&MARKS)
                .map(|(_, _, value_of)| value_of(row))
        })
        .max()
        .unwrap_or(0)
        .max(1)
        .saturating_mul(11)
        / 10
        + 1;
    let root = SVGBackend::with_string(svg, SIZE_PX).into_drawing_area();
    let fail = |e: &dyn std::fmt::Display| format!("window chart: {e}");
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .margin(10)
        .x_label_area_size(28)
        .y_label_area_size(60)
        .build_cartesian_2d(0u32..slots * SLOTS_PER_WINDOW, 0u64..y_max)
        .map_err(|e| fail(&e))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(1)
        .x_label_formatter(&|_| String::new())
        .x_desc("windows, oldest to newest")
        .y_desc("tokens")
        .draw()
        .map_err(|e| fail(&e))?;
    let mut regions: Vec<_> = oldest_first
        .iter()
        .flat_map(|row| row.admitted_tokens_by_region.keys())
        .collect();
    regions.sort();
    regions.dedup();
    for (index, region) in regions.iter().enumerate() {
        let colour = REGION_COLOURS[index % REGION_COLOURS.len()];
        let below: Vec<&_> = regions[..index].to_vec();
        chart
            .draw_series(oldest_first.iter().enumerate().map(|(slot, row)| {
                let x = slot as u32 * SLOTS_PER_WINDOW + 1;
                let admitted = |r: &&_| row.admitted_tokens_by_region.get(*r).copied().unwrap_or(0);
                let base: u64 = below.iter().map(admitted).sum();
                let top = base.saturating_add(admitted(region));
                Rectangle::new([(x, base), (x + 1, top)], colour.filled())
            }))
            .map_err(|e| fail(&e))?
            .label(format!("admitted in {region}"))
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour.filled()));
    }
    for (index, (name, colour, value_of)) in BARS.into_iter().enumerate() {
        chart
            .draw_series(oldest_first.iter().enumerate().map(|(slot, row)| {
                let x = slot as u32 * SLOTS_PER_WINDOW + 2 + index as u32;
                Rectangle::new([(x, 0), (x + 1, value_of(row))], colour.filled())
            }))
            .map_err(|e| fail(&e))?
            .label(name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour.filled()));
    }
    for (name, colour, value_of) in MARKS {
        chart
            .draw_series(oldest_first.iter().enumerate().map(|(slot, row)| {
                let x = slot as u32 * SLOTS_PER_WINDOW;
                PathElement::new(
                    vec![(x, value_of(row)), (x + SLOTS_PER_WINDOW, value_of(row))],
                    colour.stroke_width(2),
                )
            }))
            .map_err(|e| fail(&e))?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(start_ms: u64, admitted: u64, bound: u64) -> WindowRow {
        let region = |name| allot_shared::ids::RegionId::parse(name).expect("region");
        WindowRow {
            window_start_ms: start_ms,
            window_end_ms: start_ms + 60_000,
            limit_tokens: 100,
            granted_tokens: admitted,
            spent_tokens: admitted,
            admitted_tokens: admitted,
            admitted_tokens_by_region: [(region("eu"), admitted - 10), (region("us"), 10)].into(),
            bound_tokens: bound,
            ..WindowRow::default()
        }
    }

    #[test]
    fn draws_a_bar_group_per_window_and_a_mark_for_each_bound() {
        let svg = window_chart_svg(&[row(60_000, 90, 120), row(0, 40, 120)]);
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(svg.contains("bound") && svg.contains("limit G"), "legend");
        assert!(
            svg.contains("admitted in eu") && svg.contains("admitted in us"),
            "legend"
        );
        let rects = svg.matches("<rect").count();
        assert!(
            rects >= 2 * 5,
            "two stacked regions and three bars per window, got {rects} rects"
        );
        assert!(!svg.contains("<script"), "no script in a chart");
    }

    #[test]
    fn an_empty_ledger_still_draws() {
        assert!(window_chart_svg(&[]).starts_with("<svg"));
    }
}
