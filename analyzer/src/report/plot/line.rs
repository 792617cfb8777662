//! Line charts by layer, as SVG: integer layer ticks, a value axis fitted to
//! the data and the limits (see [`Scale`]), each limit drawn as a labelled
//! dashed line, and the legend in its own column right of the plot, as wide
//! as its longest label (measured with the embedded font) and as tall as its
//! entries, so twelve groups neither cover the lines nor get cut off.

use std::ops::Range;

use plotters::prelude::*;

use super::axis::{Placed, Scale, Tick, Ticked, index_ticks};
use super::font::FAMILY;

/// Width of the plot column (axes included); the legend column comes on top.
const PLOT_WIDTH: u32 = 760;
/// Smallest canvas height; a longer legend makes it taller.
const MIN_HEIGHT: u32 = 480;
const TITLE_SIZE: f64 = 19.0;
const TEXT_SIZE: f64 = 15.0;
/// Height of a title line and of a legend entry.
const LINE_HEIGHT: i32 = 21;
/// Legend entry: the line sample, then the label.
const SAMPLE: (i32, i32) = (10, 42);
const LABEL_X: i32 = 50;
const LEGEND_PAD: i32 = 16;

/// Colours of the lines, in order: tab10 and two more, so twelve groups
/// each get their own; past that, colours repeat with the next marker.
pub(crate) const PALETTE: [RGBColor; 12] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0x17, 0xbe, 0xcf),
    RGBColor(0x39, 0x3b, 0x79),
    RGBColor(0xff, 0xbb, 0x78),
];
/// Colour of limit lines (thresholds): near black, apart from the axes'.
pub(crate) const LIMIT_COLOR: RGBColor = RGBColor(0x22, 0x22, 0x22);
const GRID_COLOR: RGBColor = RGBColor(0xe4, 0xe4, 0xe4);

/// One line: a name for the legend and a value per layer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Line {
    pub(crate) name: String,
    pub(crate) points: Vec<(i32, f64)>,
}

/// A limit the verdicts apply: a constant (one value) or per layer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Limit {
    /// Legend label, and for a constant the label beside the line.
    pub(crate) label: String,
    pub(crate) value: LimitValue,
}

/// The value of a [`Limit`].
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum LimitValue {
    /// The same at every layer: a horizontal line across the plot.
    Constant(f64),
    /// Per layer (a calibrated noise floor): a dashed line through them.
    PerLayer(Vec<(i32, f64)>),
}

/// What a line chart shows.
#[derive(Debug, Clone)]
pub(crate) struct LineChart {
    /// First line: the title; further lines: what it is plotted from.
    pub(crate) title: Vec<String>,
    pub(crate) y_desc: String,
    pub(crate) scale: Scale,
    pub(crate) lines: Vec<Line>,
    pub(crate) limits: Vec<Limit>,
}

/// Where a rendered chart put things, in pixels of the SVG; what tests and
/// callers check the picture against.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LineLayout {
    pub(crate) canvas: (u32, u32),
    /// The plot area (inside the axes).
    pub(crate) plot: (Range<i32>, Range<i32>),
    /// Left edge of the legend column.
    pub(crate) legend_x: i32,
    /// The value axis's range, in scale coordinates.
    pub(crate) y_range: (f64, f64),
    pub(crate) y_ticks: Vec<Tick>,
    pub(crate) x_ticks: Vec<i64>,
    /// Points that could not be drawn (non-finite, or 0 on a log axis).
    pub(crate) not_drawn: usize,
    /// Points beyond the axis's end, drawn at it.
    pub(crate) clamped: usize,
}

/// A point placed on the chart, or a gap where one could not be.
fn placed(scale: Scale, points: &[(i32, f64)]) -> Vec<(f64, Placed)> {
    points
        .iter()
        .map(|&(l, v)| (f64::from(l), scale.place(v)))
        .collect()
}

/// Renders the chart; returns the SVG and its layout.
///
/// # Errors
/// When plotters fails to draw (a text it cannot lay out).
pub(crate) fn render(chart: &LineChart) -> Result<(String, LineLayout), String> {
    super::font::ensure_registered()?;
    let scale = chart.scale;
    let lines: Vec<Vec<(f64, Placed)>> = chart
        .lines
        .iter()
        .map(|l| placed(scale, &l.points))
        .collect();
    let limit_coords = |v: f64| scale.coordinate(v);
    let mut not_drawn = 0;
    let mut clamped = 0;
    for p in lines.iter().flatten() {
        match p.1 {
            Placed::Outside => not_drawn += 1,
            Placed::Clamped(_) => clamped += 1,
            Placed::At(_) => {}
        }
    }
    let layers: Vec<i32> = chart
        .lines
        .iter()
        .flat_map(|l| l.points.iter().map(|p| p.0))
        .chain(chart.limits.iter().flat_map(|l| match &l.value {
            LimitValue::Constant(_) => Vec::new(),
            LimitValue::PerLayer(p) => p.iter().map(|p| p.0).collect(),
        }))
        .collect();
    let first = layers.iter().copied().min().unwrap_or(0);
    let last = layers.iter().copied().max().unwrap_or(0).max(first);
    let x_ticks = index_ticks(i64::from(first), i64::from(last));
    let x_range = (f64::from(first) - 0.4)..(f64::from(last) + 0.4);

    let limit_values: Vec<f64> = chart
        .limits
        .iter()
        .flat_map(|l| match &l.value {
            LimitValue::Constant(v) => vec![*v],
            LimitValue::PerLayer(p) => p.iter().map(|p| p.1).collect(),
        })
        .filter_map(limit_coords)
        .collect();
    let (y0, y1) = scale.fit(
        lines
            .iter()
            .flatten()
            .filter_map(|p| match p.1 {
                Placed::At(u) | Placed::Clamped(u) => Some(u),
                Placed::Outside => None,
            })
            .chain(limit_values),
    );
    let y_ticks = scale.ticks(y0, y1);

    // Legend entries: lines, then limits.
    let entries: Vec<&str> = chart
        .lines
        .iter()
        .map(|l| l.name.as_str())
        .chain(chart.limits.iter().map(|l| l.label.as_str()))
        .collect();
    let text = (FAMILY, TEXT_SIZE).into_font().color(&BLACK);
    let title_style = (FAMILY, TITLE_SIZE).into_font().color(&BLACK);
    let widest = entries
        .iter()
        .map(|e| text_width(e, &text))
        .chain(chart.title.iter().skip(1).map(|t| {
            // Subtitles may run over the legend column, not past the canvas.
            text_width(t, &text).saturating_sub(PLOT_WIDTH)
        }))
        .max()
        .unwrap_or(0);
    let legend_w = u32::try_from(LABEL_X + LEGEND_PAD).unwrap_or(0) + widest;
    let title_h = LINE_HEIGHT * i32::try_from(chart.title.len()).unwrap_or(1) + 10;
    let entries_h = LINE_HEIGHT * i32::try_from(entries.len()).unwrap_or(0) + 40;
    let canvas = (
        PLOT_WIDTH + legend_w,
        MIN_HEIGHT.max(u32::try_from(title_h + entries_h).unwrap_or(MIN_HEIGHT)),
    );

    let mut svg = String::new();
    let layout = {
        let root = SVGBackend::with_string(&mut svg, canvas).into_drawing_area();
        let e = |e: &dyn std::fmt::Display| format!("drawing a line chart: {e}");
        root.fill(&WHITE).map_err(|x| e(&x))?;
        for (i, line) in chart.title.iter().enumerate() {
            let style = if i == 0 { &title_style } else { &text };
            root.draw_text(
                line,
                style,
                (12, 8 + LINE_HEIGHT * i32::try_from(i).unwrap_or(0)),
            )
            .map_err(|x| e(&x))?;
        }
        let (_, body) = root.split_vertically(title_h);
        let (plot_area, legend_area) = body.split_horizontally(PLOT_WIDTH);
        let tick_label = |u: &f64| {
            y_ticks
                .iter()
                .find(|t| (t.at - u).abs() < 1e-9)
                .map(|t| t.label.clone())
                .unwrap_or_default()
        };
        let x_label = |x: &f64| format!("{x:.0}");
        let mut plot = ChartBuilder::on(&plot_area)
            .margin(12)
            .x_label_area_size(46)
            .y_label_area_size(78)
            .build_cartesian_2d(
                Ticked {
                    range: x_range.clone(),
                    ticks: x_ticks.iter().map(|&t| t as f64).collect(),
                },
                Ticked {
                    range: y0..y1,
                    ticks: y_ticks.iter().map(|t| t.at).collect(),
                },
            )
            .map_err(|x| e(&x))?;
        plot.configure_mesh()
            .x_desc("layer")
            .y_desc(chart.y_desc.as_str())
            .x_label_formatter(&x_label)
            .y_label_formatter(&tick_label)
            .label_style(text.clone())
            .axis_desc_style(text.clone())
            .bold_line_style(GRID_COLOR)
            .draw()
            .map_err(|x| e(&x))?;

        for (i, points) in lines.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            // A point that cannot be drawn breaks the line.
            for segment in points.split(|p| p.1 == Placed::Outside) {
                let coords: Vec<(f64, f64)> = segment
                    .iter()
                    .filter_map(|&(x, p)| match p {
                        Placed::At(u) | Placed::Clamped(u) => Some((x, u)),
                        Placed::Outside => None,
                    })
                    .collect();
                plot.draw_series(LineSeries::new(
                    coords.iter().copied(),
                    color.stroke_width(2),
                ))
                .map_err(|x| e(&x))?;
                for c in &coords {
                    marker(&root, plot.backend_coord(c), i, color).map_err(|x| e(&x))?;
                }
            }
        }
        for limit in &chart.limits {
            let style = LIMIT_COLOR.stroke_width(2);
            let coords: Vec<(f64, f64)> = match &limit.value {
                LimitValue::Constant(v) => limit_coords(*v)
                    .map(|u| vec![(x_range.start, u), (x_range.end, u)])
                    .unwrap_or_default(),
                LimitValue::PerLayer(p) => p
                    .iter()
                    .filter_map(|&(l, v)| limit_coords(v).map(|u| (f64::from(l), u)))
                    .collect(),
            };
            plot.draw_series(DashedLineSeries::new(coords.iter().copied(), 9, 5, style))
                .map_err(|x| e(&x))?;
            if let (LimitValue::Constant(_), Some(&(_, u))) = (&limit.value, coords.first()) {
                // The line's own label, above its right end.
                let (x, y) = plot.backend_coord(&(x_range.end, u));
                let small = (FAMILY, TEXT_SIZE - 2.0)
                    .into_font()
                    .color(&LIMIT_COLOR)
                    .pos(plotters::style::text_anchor::Pos::new(
                        plotters::style::text_anchor::HPos::Right,
                        plotters::style::text_anchor::VPos::Bottom,
                    ));
                root.draw_text(&limit.label, &small, (x - 4, y - 3))
                    .map_err(|x| e(&x))?;
            }
        }

        let legend_x = legend_area.get_pixel_range().0.start;
        let legend_y = legend_area.get_pixel_range().1.start + 10;
        for (i, name) in entries.iter().enumerate() {
            let y = legend_y + LINE_HEIGHT * i32::try_from(i).unwrap_or(0) + LINE_HEIGHT / 2;
            let sample = vec![(legend_x + SAMPLE.0, y), (legend_x + SAMPLE.1, y)];
            if let Some(color) = (i < chart.lines.len()).then(|| PALETTE[i % PALETTE.len()]) {
                root.draw(&PathElement::new(sample, color.stroke_width(2)))
                    .map_err(|x| e(&x))?;
                marker(&root, (legend_x + (SAMPLE.0 + SAMPLE.1) / 2, y), i, color)
                    .map_err(|x| e(&x))?;
            } else {
                root.draw(&plotters::element::DashedPathElement::new(
                    sample,
                    9,
                    5,
                    LIMIT_COLOR.stroke_width(2),
                ))
                .map_err(|x| e(&x))?;
            }
            let left_center = text.pos(plotters::style::text_anchor::Pos::new(
                plotters::style::text_anchor::HPos::Left,
                plotters::style::text_anchor::VPos::Center,
            ));
            root.draw_text(name, &left_center, (legend_x + LABEL_X, y))
                .map_err(|x| e(&x))?;
        }
        root.present().map_err(|x| e(&x))?;
        LineLayout {
            canvas,
            plot: plot.plotting_area().get_pixel_range(),
            legend_x,
            y_range: (y0, y1),
            y_ticks: y_ticks.clone(),
            x_ticks,
            not_drawn,
            clamped,
        }
    };
    Ok((svg, layout))
}

/// Width of `s` in `style`, in pixels, as the embedded font lays it out.
pub(crate) fn text_width(s: &str, style: &TextStyle<'_>) -> u32 {
    style.font.box_size(s).map_or(0, |(w, _)| w)
}

/// A line's marker at pixel `at`: circle, triangle, square or cross, by
/// the line's index past the palette, so lines sharing a colour differ.
fn marker<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    at: (i32, i32),
    index: usize,
    color: RGBColor,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let fill = color.filled();
    match (index / PALETTE.len()) % 4 {
        0 => root.draw(&(EmptyElement::at(at) + Circle::new((0, 0), 4, fill))),
        1 => root.draw(&(EmptyElement::at(at) + TriangleMarker::new((0, 0), 5, fill))),
        2 => root.draw(&(EmptyElement::at(at) + Rectangle::new([(-3, -3), (3, 3)], fill))),
        _ => root.draw(&(EmptyElement::at(at) + Cross::new((0, 0), 4, color.stroke_width(2)))),
    }
}
