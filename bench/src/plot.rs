//! SVG plots (plotters' SVG backend: no font or bitmap dependencies).

use std::path::Path;

use plotters::prelude::*;

/// One named series of (x, y) points.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

const COLORS: [RGBColor; 8] = [
    RGBColor(0x2e, 0x7d, 0x32),
    RGBColor(0x15, 0x65, 0xc0),
    RGBColor(0xef, 0x6c, 0x00),
    RGBColor(0x6a, 0x1b, 0x9a),
    RGBColor(0xc6, 0x28, 0x28),
    RGBColor(0x00, 0x83, 0x8f),
    RGBColor(0x5d, 0x40, 0x37),
    RGBColor(0x75, 0x75, 0x75),
];

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// A line chart; `log_y` for figures spanning orders of magnitude (throughput of podman vs unshare).
pub fn line_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    log_y: bool,
) -> Result<(), String> {
    let pts = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        return Err("no points to plot".into());
    }
    if x0 == x1 {
        x1 = x0 + 1.0;
    }
    let root = SVGBackend::new(path, (760, 440)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut b = ChartBuilder::on(&root);
    b.caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64);
    if log_y {
        let lo = (y0.max(1e-3) / 1.5).max(1e-3);
        let mut chart = b
            .build_cartesian_2d(x0..x1, (lo..y1 * 1.5).log_scale())
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc(x_label)
            .y_desc(y_label)
            .draw()
            .map_err(err)?;
        draw_series(&mut chart, series)?;
    } else {
        let lo = if y0 >= 0.0 { 0.0 } else { y0 * 1.1 };
        let hi = if y1 <= 0.0 { 1.0 } else { y1 * 1.1 };
        let mut chart = b.build_cartesian_2d(x0..x1, lo..hi).map_err(err)?;
        chart
            .configure_mesh()
            .x_desc(x_label)
            .y_desc(y_label)
            .draw()
            .map_err(err)?;
        draw_series(&mut chart, series)?;
    }
    root.present().map_err(err)
}

fn draw_series<'a, DB: DrawingBackend + 'a, CT>(
    chart: &mut ChartContext<'a, DB, CT>,
    series: &[Series],
) -> Result<(), String>
where
    CT: plotters::coord::CoordTranslate<From = (f64, f64)>,
    DB::ErrorType: 'static,
{
    for (i, s) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))
            .map_err(err)?
            .label(s.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        chart
            .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(err)
}

/// Grouped bars: one group per category, one bar per system (`values[group][system]`, NaN = missing).
pub fn bar_chart(
    path: &Path,
    title: &str,
    y_label: &str,
    groups: &[String],
    systems: &[String],
    values: &[Vec<f64>],
) -> Result<(), String> {
    let max = values
        .iter()
        .flatten()
        .copied()
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    if groups.is_empty() || systems.is_empty() {
        return Err("no bars to plot".into());
    }
    let k = systems.len() as f64;
    let width = groups.len() as f64 * (k + 1.0);
    let root = SVGBackend::new(path, (760, 440)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..width, -(max * 0.1).max(1e-9)..(max * 1.15).max(1e-9))
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_label_formatter(&|_| String::new())
        .y_desc(y_label)
        .draw()
        .map_err(err)?;
    // Group names under the bars (inside the plot, below zero), centred on each group.
    let style = TextStyle::from(("sans-serif", 13).into_font()).pos(
        plotters::style::text_anchor::Pos::new(
            plotters::style::text_anchor::HPos::Center,
            plotters::style::text_anchor::VPos::Center,
        ),
    );
    chart
        .draw_series(groups.iter().enumerate().map(|(gi, g)| {
            let x = gi as f64 * (k + 1.0) + (k + 1.0) / 2.0;
            Text::new(g.clone(), (x, -max * 0.05), style.clone())
        }))
        .map_err(err)?;
    for (si, name) in systems.iter().enumerate() {
        let c = COLORS[si % COLORS.len()];
        let bars = values.iter().enumerate().filter_map(move |(gi, row)| {
            let v = *row.get(si)?;
            v.is_finite().then(|| {
                let x = gi as f64 * (k + 1.0) + 0.5 + si as f64;
                Rectangle::new([(x, 0.0), (x + 0.9, v)], c.filled())
            })
        });
        chart
            .draw_series(bars)
            .map_err(err)?
            .label(name.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_and_bar_charts_write_svg() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("l.svg");
        let s = vec![
            Series {
                name: "grove".into(),
                points: vec![(1.0, 100.0), (8.0, 250.0)],
            },
            Series {
                name: "podman".into(),
                points: vec![(1.0, 4.0), (8.0, 7.0)],
            },
        ];
        line_chart(&p, "t", "x", "y", &s, true).unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("podman"), "{svg}");
        let b = d.path().join("b.svg");
        let groups = vec!["read".to_string(), "untar".to_string()];
        let systems = vec!["plain".to_string(), "nodefs".to_string()];
        bar_chart(
            &b,
            "t",
            "MiB/s",
            &groups,
            &systems,
            &[vec![1.0, 2.0], vec![f64::NAN, 3.0]],
        )
        .unwrap();
        let svg = std::fs::read_to_string(&b).unwrap();
        assert!(svg.contains("nodefs") && svg.contains("untar"));
        assert!(line_chart(&p, "t", "x", "y", &[], false).is_err());
    }
}
