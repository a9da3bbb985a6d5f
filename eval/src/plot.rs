//! Line charts as SVG (plotters): accuracy vs length (`eval --plot`) and the frontier's two
//! plots.

use crate::error::{EvalError, Result};
use plotters::prelude::*;
use std::path::Path;

/// One named line of `(x, y)` points (drawn in x order).
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// Draws `series` as lines with markers into an SVG file. `y_range` fixes the y axis (else it
/// spans the data).
pub fn line_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    y_range: Option<(f64, f64)>,
) -> Result<()> {
    let err = |e: String| EvalError::Input(format!("plot {}: {e}", path.display()));
    let pts = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::INFINITY,
        f64::NEG_INFINITY,
    );
    for &(x, y) in pts {
        if x.is_finite() && y.is_finite() {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y0 = y0.min(y);
            y1 = y1.max(y);
        }
    }
    if !x0.is_finite() {
        return Err(err("no finite points to plot".into()));
    }
    let pad = |a: f64, b: f64| {
        if b > a {
            (b - a) * 0.05
        } else {
            a.abs().max(1.0) * 0.05
        }
    };
    let (px, py) = (pad(x0, x1), pad(y0, y1));
    let (y0, y1) = y_range.unwrap_or((y0 - py, y1 + py));
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d((x0 - px)..(x1 + px), y0..y1)
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut p: Vec<(f64, f64)> = s
            .points
            .iter()
            .copied()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect();
        p.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(p.clone(), color.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?
            .label(s.label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(p.into_iter().map(|xy| Circle::new(xy, 4, color.filled())))
            .map_err(|e| err(e.to_string()))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerLeft)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}
