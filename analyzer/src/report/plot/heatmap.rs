//! Layer x query-token heatmaps, as PNG: the token axis binned to at most
//! [`MAX_BINS`] columns (a screen's worth, whatever the prompt length),
//! layer and token ticks, and a colour bar with its scale, its label and
//! the threshold marked on it.

use std::ops::Range;

use plotters::prelude::*;

use super::axis::{Ticked, index_ticks};
use super::text::{Align, Baseline, Canvas, Style};

/// Most token bins: one per pixel column of the plot area at most.
pub(crate) const MAX_BINS: usize = 1100;
const WIDTH: u32 = 1400;
const LEFT_LABELS: u32 = 70;
const BAR_COLUMN: u32 = 200;
/// Text heights (line box), in pixels.
const TITLE_PX: f32 = 20.0;
const TEXT_PX: f32 = 16.0;
const LINE_HEIGHT: i32 = 22;
/// Pixels per layer row, and the plot area's height bounds.
const ROW_PX: u32 = 22;
const PLOT_HEIGHT: (u32, u32) = (160, 624);
/// Colour of cells without a row (no informative query token there).
pub(crate) const NO_DATA: RGBColor = RGBColor(0xd9, 0xd9, 0xd9);

/// Values per (layer, token) averaged into bins of whole tokens.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Binned {
    /// Layers with rows, ascending: the heatmap's rows, top to bottom.
    pub(crate) layers: Vec<i32>,
    pub(crate) first_token: i32,
    pub(crate) last_token: i32,
    /// Tokens per bin.
    pub(crate) bin_width: i32,
    pub(crate) bins: usize,
    /// Mean per (layer, bin), layer-major; `None` where no row fell.
    pub(crate) cells: Vec<Option<f64>>,
    /// Rows averaged in.
    pub(crate) rows: usize,
    /// Rows left out because their value was not finite.
    pub(crate) not_finite: usize,
}

impl Binned {
    /// Bins `(layer, token, value)` rows into at most `max_bins` bins of
    /// equal whole-token width over the tokens present; `None` without a
    /// finite row.
    pub(crate) fn from_rows(
        rows: impl IntoIterator<Item = (i32, i32, f64)>,
        max_bins: usize,
    ) -> Option<Binned> {
        let mut not_finite = 0;
        let rows: Vec<(i32, i32, f64)> = rows
            .into_iter()
            .filter(|r| {
                let finite = r.2.is_finite();
                not_finite += usize::from(!finite);
                finite
            })
            .collect();
        let first_token = rows.iter().map(|r| r.1).min()?;
        let last_token = rows.iter().map(|r| r.1).max()?;
        let mut layers: Vec<i32> = rows.iter().map(|r| r.0).collect();
        layers.sort_unstable();
        layers.dedup();
        let span = usize::try_from(i64::from(last_token) - i64::from(first_token) + 1).ok()?;
        let bin_width = span.div_ceil(max_bins.max(1));
        let bins = span.div_ceil(bin_width);
        let mut sums = vec![(0.0, 0usize); layers.len() * bins];
        for &(layer, token, value) in &rows {
            let (Ok(l), Ok(offset)) = (
                layers.binary_search(&layer),
                usize::try_from(i64::from(token) - i64::from(first_token)),
            ) else {
                continue;
            };
            let cell = &mut sums[l * bins + offset / bin_width];
            cell.0 += value;
            cell.1 += 1;
        }
        Some(Binned {
            layers,
            first_token,
            last_token,
            bin_width: i32::try_from(bin_width).ok()?,
            bins,
            cells: sums
                .into_iter()
                .map(|(s, n)| (n > 0).then(|| s / n as f64))
                .collect(),
            rows: rows.len(),
            not_finite,
        })
    }

    /// The mean of the bin at `(layer index, bin)`.
    pub(crate) fn cell(&self, layer: usize, bin: usize) -> Option<f64> {
        self.cells.get(layer * self.bins + bin).copied().flatten()
    }

    /// Cells without a row.
    pub(crate) fn empty_cells(&self) -> usize {
        self.cells.iter().filter(|c| c.is_none()).count()
    }
}

/// What a heatmap shows.
#[derive(Debug, Clone)]
pub(crate) struct Heatmap {
    /// First line: the title; further lines: what it is plotted from.
    pub(crate) title: Vec<String>,
    /// The colour bar's label: the value and its unit.
    pub(crate) value_desc: String,
    /// The values the colour bar spans (`lo` at the bottom).
    pub(crate) range: (f64, f64),
    /// A value marked on the colour bar, and its label.
    pub(crate) threshold: Option<(f64, String)>,
    pub(crate) binned: Binned,
}

/// Where a rendered heatmap put things, in pixels of the PNG.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HeatmapLayout {
    pub(crate) canvas: (u32, u32),
    pub(crate) plot: (Range<i32>, Range<i32>),
    /// Pixel edges of the bins (left to right) and of the layer rows (top
    /// to bottom), as plotters mapped them.
    pub(crate) x_edges: Vec<i32>,
    pub(crate) y_edges: Vec<i32>,
    /// The colour bar's pixel columns, and the pixel rows of its `lo` and
    /// `hi` ends.
    pub(crate) bar_x: Range<i32>,
    pub(crate) bar_y: (i32, i32),
    /// The tick labels: layers (top to bottom), tokens, colour bar.
    pub(crate) layer_ticks: Vec<i32>,
    pub(crate) token_ticks: Vec<i64>,
    pub(crate) bar_ticks: Vec<String>,
}

/// The colour of `v` on a colour bar spanning `range`: viridis, dark at
/// `lo`, yellow at `hi`.
pub(crate) fn color(v: f64, range: (f64, f64)) -> RGBColor {
    let h = ((v - range.0) / (range.1 - range.0)).clamp(0.0, 1.0);
    ViridisRGB::get_color(h)
}

/// Renders the heatmap; returns the PNG bytes and its layout.
///
/// plotters draws the cells, the axes, their tick marks and the colour bar;
/// every text is drawn afterwards by [`super::text`] (see there why).
///
/// # Errors
/// When plotters fails to draw, or the PNG cannot be encoded.
pub(crate) fn render(map: &Heatmap) -> Result<(Vec<u8>, HeatmapLayout), String> {
    // plotters measures even the empty tick labels.
    super::font::ensure_registered()?;
    let b = &map.binned;
    let rows_n = u32::try_from(b.layers.len()).unwrap_or(u32::MAX);
    let plot_h = (rows_n.saturating_mul(ROW_PX)).clamp(PLOT_HEIGHT.0, PLOT_HEIGHT.1);
    let title_h = LINE_HEIGHT * i32::try_from(map.title.len()).unwrap_or(1) + 14;
    let height = u32::try_from(title_h).unwrap_or(0) + plot_h + 80;
    let canvas = (WIDTH, height);
    let mut buffer = vec![0u8; WIDTH as usize * height as usize * 3];
    let label = Style::new(TEXT_PX);
    let mut texts: Vec<(String, (i32, i32), Style)> = map
        .title
        .iter()
        .enumerate()
        .map(|(i, line)| {
            let px = if i == 0 { TITLE_PX } else { TEXT_PX };
            let y = 8 + LINE_HEIGHT * i32::try_from(i).unwrap_or(0);
            (line.clone(), (12, y), Style::new(px))
        })
        .collect();

    let layout = {
        let root = BitMapBackend::with_buffer(&mut buffer, canvas).into_drawing_area();
        let e = |e: &dyn std::fmt::Display| format!("drawing a heatmap: {e}");
        root.fill(&WHITE).map_err(|x| e(&x))?;
        let (_, body) = root.split_vertically(title_h);
        let (main, bar_area) = body.split_horizontally(WIDTH - BAR_COLUMN);

        // Rows from the bottom: layer index i spans [n-1-i, n-i], so the
        // first layer is the top row, as a table reads.
        let n = b.layers.len();
        let row_of = |i: usize| (n - 1 - i) as f64;
        let layer_ticks: Vec<i32> = if n <= 16 {
            b.layers.clone()
        } else {
            let wanted = index_ticks(i64::from(b.layers[0]), i64::from(b.layers[n - 1]));
            b.layers
                .iter()
                .copied()
                .filter(|l| wanted.contains(&i64::from(*l)))
                .collect()
        };
        let layer_rows: Vec<usize> = layer_ticks
            .iter()
            .filter_map(|l| b.layers.binary_search(l).ok())
            .collect();
        let token_ticks = index_ticks(i64::from(b.first_token), i64::from(b.last_token));
        let x0 = f64::from(b.first_token);
        let x1 = x0 + (b.bins as f64) * f64::from(b.bin_width);
        // Token t spans [t, t + 1): its tick sits at its middle.
        let token_at = |t: i64| t as f64 + 0.5;
        let no_label = |_: &f64| String::new();
        let mut chart = ChartBuilder::on(&main)
            .margin_left(12)
            .margin_right(12)
            .margin_top(8)
            .x_label_area_size(56)
            .y_label_area_size(i32::try_from(LEFT_LABELS).unwrap_or(70))
            .build_cartesian_2d(
                Ticked {
                    range: x0..x1,
                    ticks: token_ticks.iter().map(|&t| token_at(t)).collect(),
                },
                Ticked {
                    range: 0.0..n as f64,
                    ticks: layer_rows.iter().map(|&i| row_of(i) + 0.5).collect(),
                },
            )
            .map_err(|x| e(&x))?;
        chart
            .configure_mesh()
            .disable_mesh()
            .x_label_formatter(&no_label)
            .y_label_formatter(&no_label)
            .draw()
            .map_err(|x| e(&x))?;
        let w = f64::from(b.bin_width);
        chart
            .draw_series((0..n).flat_map(|i| {
                (0..b.bins).map(move |bin| {
                    let left = x0 + bin as f64 * w;
                    let fill = b.cell(i, bin).map_or(NO_DATA, |v| color(v, map.range));
                    Rectangle::new(
                        [(left, row_of(i)), (left + w, row_of(i) + 1.0)],
                        fill.filled(),
                    )
                })
            }))
            .map_err(|x| e(&x))?;
        let x_edges: Vec<i32> = (0..=b.bins)
            .map(|bin| chart.backend_coord(&(x0 + bin as f64 * w, 0.0)).0)
            .collect();
        let y_edges: Vec<i32> = (0..=n)
            .map(|i| chart.backend_coord(&(x0, (n - i) as f64)).1)
            .collect();
        let (plot_x, plot_y) = chart.plotting_area().get_pixel_range();
        for &t in &token_ticks {
            let (x, _) = chart.backend_coord(&(token_at(t), 0.0));
            let at = label.at(Align::Middle, Baseline::Top);
            texts.push((t.to_string(), (x, plot_y.end + 8), at));
        }
        for (&l, &i) in layer_ticks.iter().zip(&layer_rows) {
            let (_, y) = chart.backend_coord(&(x0, row_of(i) + 0.5));
            let at = label.at(Align::End, Baseline::Center);
            texts.push((l.to_string(), (plot_x.start - 8, y), at));
        }
        let token_desc = if b.bin_width == 1 {
            "query token".to_owned()
        } else {
            format!("query token (bins of {} tokens, mean per bin)", b.bin_width)
        };
        let middle = (plot_x.start + plot_x.end) / 2;
        texts.push((
            token_desc,
            (middle, plot_y.end + 32),
            label.at(Align::Middle, Baseline::Top),
        ));
        texts.push((
            "layer".to_owned(),
            (plot_x.start - 52, (plot_y.start + plot_y.end) / 2),
            label.at(Align::Middle, Baseline::Top).upright(),
        ));

        // The colour bar: one band per pixel row, ticks on its right.
        let bar_ticks: Vec<f64> = (0..=5)
            .map(|i| map.range.0 + (map.range.1 - map.range.0) * f64::from(i) / 5.0)
            .collect();
        let mut bar = ChartBuilder::on(&bar_area)
            .margin_left(110)
            .margin_right(8)
            .margin_top(8)
            .x_label_area_size(56)
            .right_y_label_area_size(70)
            .build_cartesian_2d(
                0.0..1.0,
                Ticked {
                    range: map.range.0..map.range.1,
                    ticks: bar_ticks.clone(),
                },
            )
            .map_err(|x| e(&x))?;
        bar.configure_mesh()
            .disable_mesh()
            .disable_x_axis()
            .y_label_formatter(&no_label)
            .draw()
            .map_err(|x| e(&x))?;
        let (bar_x, bar_rows) = bar.plotting_area().get_pixel_range();
        let steps = usize::try_from(bar_rows.end - bar_rows.start)
            .unwrap_or(1)
            .max(1);
        let (lo, hi) = map.range;
        let at = |k: usize| lo + (hi - lo) * k as f64 / steps as f64;
        bar.draw_series((0..steps).map(|k| {
            Rectangle::new(
                [(0.0, at(k)), (1.0, at(k + 1))],
                color((at(k) + at(k + 1)) / 2.0, map.range).filled(),
            )
        }))
        .map_err(|x| e(&x))?;
        let bar_labels: Vec<String> = bar_ticks.iter().map(|v| format!("{v:.1}")).collect();
        for (v, text) in bar_ticks.iter().zip(&bar_labels) {
            let (_, y) = bar.backend_coord(&(1.0, *v));
            let at = label.at(Align::Start, Baseline::Center);
            texts.push((text.clone(), (bar_x.end + 10, y), at));
        }
        texts.push((
            map.value_desc.clone(),
            (bar_x.end + 48, (bar_rows.start + bar_rows.end) / 2),
            label.at(Align::Middle, Baseline::Top).upright(),
        ));
        let bar_y = (
            bar.backend_coord(&(0.0, lo)).1,
            bar.backend_coord(&(0.0, hi)).1,
        );
        if let Some((t, text)) = &map.threshold {
            let (left, y) = bar.backend_coord(&(0.0, *t));
            let right = bar.backend_coord(&(1.0, *t)).0;
            root.draw(&PathElement::new(
                vec![(left - 8, y), (right, y)],
                BLACK.stroke_width(2),
            ))
            .map_err(|x| e(&x))?;
            let at = label.at(Align::End, Baseline::Center);
            texts.push((text.clone(), (left - 12, y), at));
        }
        if b.empty_cells() > 0 {
            let (left, y) = bar.backend_coord(&(0.0, lo));
            let y = y + 26;
            root.draw(&Rectangle::new(
                [(left, y), (left + 22, y + 14)],
                NO_DATA.filled(),
            ))
            .map_err(|x| e(&x))?;
            let at = label.at(Align::End, Baseline::Center);
            texts.push(("no row".to_owned(), (left - 6, y + 7), at));
        }
        root.present().map_err(|x| e(&x))?;
        HeatmapLayout {
            canvas,
            plot: (plot_x, plot_y),
            x_edges,
            y_edges,
            bar_x,
            bar_y,
            layer_ticks,
            token_ticks,
            bar_ticks: bar_labels,
        }
    };
    let mut canvas_text = Canvas {
        rgb: &mut buffer,
        width: canvas.0,
        height: canvas.1,
    };
    for (s, at, style) in &texts {
        canvas_text.text(s, *at, *style)?;
    }
    Ok((encode_png(&buffer, canvas)?, layout))
}

/// The RGB buffer as PNG. Each layer's band repeats one pixel row, which the
/// "up" filter turns into zeros: a heatmap costs about one row per layer.
fn encode_png(rgb: &[u8], (w, h): (u32, u32)) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, w, h);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.set_compression(png::Compression::High);
    let fail = |e: png::EncodingError| format!("encoding a heatmap as PNG: {e}");
    let mut writer = encoder.write_header().map_err(fail)?;
    writer.write_image_data(rgb).map_err(fail)?;
    writer.finish().map_err(fail)?;
    Ok(out)
}
