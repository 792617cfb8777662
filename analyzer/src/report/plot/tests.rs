//! The plots checked against pictures known by construction: the SVG parsed
//! back (tick labels, legend, lines, threshold), the PNG decoded (each
//! cell's colour read back on the colour bar).

use plotters::prelude::{IntoFont, RGBColor};

use super::axis::Scale;
use super::font::FAMILY;
use super::heatmap::{self, Binned, Heatmap, HeatmapLayout, MAX_BINS, NO_DATA};
use super::line::{self, LIMIT_COLOR, Limit, LimitValue, Line, LineChart, LineLayout, PALETTE};

// === the SVG, parsed ===

#[derive(Debug)]
struct Text {
    x: f64,
    y: f64,
    anchor: String,
    text: String,
}

#[derive(Debug)]
struct Polyline {
    stroke: String,
    points: Vec<(f64, f64)>,
}

fn attr(n: roxmltree::Node<'_, '_>, name: &str) -> f64 {
    n.attribute(name)
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

fn parse(svg: &str) -> (Vec<Text>, Vec<Polyline>) {
    let doc = roxmltree::Document::parse(svg).expect("plotters writes well-formed SVG");
    let texts = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .map(|n| Text {
            x: attr(n, "x"),
            y: attr(n, "y"),
            anchor: n.attribute("text-anchor").unwrap_or("start").to_owned(),
            text: n.text().unwrap_or("").trim().to_owned(),
        })
        .collect();
    let lines = doc
        .descendants()
        .filter(|n| n.has_tag_name("polyline"))
        .map(|n| Polyline {
            stroke: n.attribute("stroke").unwrap_or("").to_uppercase(),
            points: n
                .attribute("points")
                .unwrap_or("")
                .split_whitespace()
                .filter_map(|p| {
                    let (x, y) = p.split_once(',')?;
                    Some((x.parse().ok()?, y.parse().ok()?))
                })
                .collect(),
        })
        .collect();
    (texts, lines)
}

fn hex(c: RGBColor) -> String {
    format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
}

/// The x-axis tick labels: texts just below the plot area, within its width.
fn x_tick_labels<'a>(texts: &'a [Text], l: &LineLayout) -> Vec<&'a Text> {
    let (xs, ys) = &l.plot;
    texts
        .iter()
        .filter(|t| {
            t.y > f64::from(ys.end)
                && t.y < f64::from(ys.end) + 30.0
                && t.x >= f64::from(xs.start) - 1.0
                && t.x <= f64::from(xs.end) + 1.0
        })
        .collect()
}

/// The y-axis tick labels: right-aligned texts left of the plot area.
fn y_tick_labels<'a>(texts: &'a [Text], l: &LineLayout) -> Vec<&'a Text> {
    let (xs, ys) = &l.plot;
    texts
        .iter()
        .filter(|t| {
            t.anchor == "end"
                && t.x < f64::from(xs.start)
                && t.y >= f64::from(ys.start) - 1.0
                && t.y <= f64::from(ys.end) + 1.0
        })
        .collect()
}

fn jaccard_chart(lines: Vec<Line>) -> LineChart {
    LineChart {
        title: vec!["Mean churn-free top-k Jaccard by layer".to_owned()],
        y_desc: "mean churn-free Jaccard".to_owned(),
        scale: Scale::Agreement,
        lines,
        limits: vec![Limit {
            label: "threshold 0.8: a verdict below".to_owned(),
            value: LimitValue::Constant(0.8),
        }],
    }
}

fn flat(name: &str, value: f64, layers: i32) -> Line {
    Line {
        name: name.to_owned(),
        points: (0..layers).map(|l| (l, value)).collect(),
    }
}

/// Four healthy groups 0.95 to 0.98 and one that collapses to 0.3 at layer 2.
fn healthy_and_collapsed() -> Vec<Line> {
    let mut lines: Vec<Line> = [0.95, 0.96, 0.97, 0.98]
        .iter()
        .map(|&v| flat(&format!("healthy {v}"), v, 4))
        .collect();
    lines.push(Line {
        name: "collapsed".to_owned(),
        points: vec![(0, 0.97), (1, 0.97), (2, 0.3), (3, 0.35)],
    });
    lines
}

fn series(polylines: &[Polyline], i: usize) -> Vec<&Polyline> {
    polylines
        .iter()
        .filter(|p| p.stroke == hex(PALETTE[i]) && p.points.len() > 2)
        .collect()
}

#[test]
fn layer_ticks_are_unique_sorted_integers_under_their_points() {
    let (svg, layout) = line::render(&jaccard_chart(healthy_and_collapsed())).unwrap();
    let (texts, polylines) = parse(&svg);
    let ticks = x_tick_labels(&texts, &layout);
    let values: Vec<i64> = ticks
        .iter()
        .map(|t| t.text.parse().expect("an integer label"))
        .collect();
    assert_eq!(values, [0, 1, 2, 3], "{ticks:?}");
    // Each line's vertex for layer L sits straight above the label L.
    let line = &series(&polylines, 0)[0];
    assert_eq!(line.points.len(), 4);
    for (tick, point) in ticks.iter().zip(&line.points) {
        assert!((tick.x - point.0).abs() <= 1.0, "{tick:?} vs {point:?}");
    }
}

#[test]
fn many_layers_get_a_tick_every_few_layers_never_a_repeat() {
    let chart = jaccard_chart(vec![flat("glm-5.1", 0.97, 78)]);
    let (svg, layout) = line::render(&chart).unwrap();
    let (texts, _) = parse(&svg);
    let values: Vec<i64> = x_tick_labels(&texts, &layout)
        .iter()
        .map(|t| t.text.parse().unwrap())
        .collect();
    assert_eq!(values.first(), Some(&0));
    assert!(values.len() <= 16, "{values:?}");
    assert!(values.windows(2).all(|w| w[1] - w[0] == 5), "{values:?}");
}

#[test]
fn the_legend_of_twelve_groups_lies_outside_the_plot_and_inside_the_canvas() {
    let lines: Vec<Line> = (0..12)
        .map(|i| {
            let model = if i < 6 {
                "synthetic/glm5-shaped"
            } else {
                "synthetic/deepseek-v32-shaped"
            };
            let kind = if i % 6 < 3 { "no_tool" } else { "tool" };
            let bucket = ["<=2048", "2049-4096", ">4096"][i % 3];
            flat(
                &format!("{model} / {kind} / {bucket}"),
                0.95 + 0.003 * i as f64,
                4,
            )
        })
        .collect();
    let names: Vec<String> = lines.iter().map(|l| l.name.clone()).collect();
    let (svg, layout) = line::render(&jaccard_chart(lines)).unwrap();
    let (texts, polylines) = parse(&svg);
    let (w, h) = layout.canvas;
    let style = (FAMILY, 15.0).into_font();
    let (xs, _) = &layout.plot;
    for name in &names {
        let found: Vec<&Text> = texts.iter().filter(|t| &t.text == name).collect();
        assert_eq!(found.len(), 1, "{name} once in the legend");
        let t = found[0];
        let width = f64::from(style.box_size(name).unwrap().0);
        assert!(t.x >= f64::from(xs.end), "{name} starts right of the plot");
        assert!(t.x + width <= f64::from(w), "{name} ends inside the canvas");
        assert!(t.y > 0.0 && t.y < f64::from(h));
    }
    // Each group has its own colour: one line in the plot, and one legend
    // sample (a two-point line) right of the plot.
    for (i, color) in PALETTE.iter().enumerate() {
        assert_eq!(series(&polylines, i).len(), 1, "group {i} has its colour");
        let samples: Vec<&Polyline> = polylines
            .iter()
            .filter(|p| p.stroke == hex(*color) && p.points.len() == 2)
            .collect();
        assert_eq!(samples.len(), 1, "group {i}");
        assert!(samples[0].points.iter().all(|q| q.0 > f64::from(xs.end)));
        assert!(samples[0].points.iter().all(|q| q.1 < f64::from(h)));
    }
}

#[test]
fn the_y_range_brackets_the_data_and_keeps_healthy_groups_apart() {
    let (svg, layout) = line::render(&jaccard_chart(healthy_and_collapsed())).unwrap();
    let (_, polylines) = parse(&svg);
    let (_, ys) = &layout.plot;
    let top = f64::from(ys.start);
    let bottom = f64::from(ys.end);
    let y_of = |i: usize| series(&polylines, i)[0].points[0].1;
    for i in 0..5 {
        for p in &series(&polylines, i)[0].points {
            assert!(p.1 >= top && p.1 <= bottom, "group {i}: {p:?} in {ys:?}");
        }
    }
    // 0.98 above 0.95, a fifth of the plot's height apart.
    let gap = y_of(0) - y_of(3);
    assert!(
        gap > 0.2 * (bottom - top),
        "0.95 at {}, 0.98 at {}: {gap} px of {}",
        y_of(0),
        y_of(3),
        bottom - top
    );
    // The collapse to 0.3 is inside the plot, below the threshold.
    let collapsed = &series(&polylines, 4)[0].points;
    assert!(collapsed[2].1 > y_of(0));
}

#[test]
fn the_threshold_line_sits_at_its_tick_label() {
    let (svg, layout) = line::render(&jaccard_chart(healthy_and_collapsed())).unwrap();
    let (texts, polylines) = parse(&svg);
    let label = y_tick_labels(&texts, &layout)
        .into_iter()
        .find(|t| t.text == "0.8")
        .expect("0.8 is a tick of the axis");
    let (xs, _) = &layout.plot;
    let dashes: Vec<&Polyline> = polylines
        .iter()
        .filter(|p| {
            p.stroke == hex(LIMIT_COLOR) && p.points.iter().all(|q| q.0 <= f64::from(xs.end))
        })
        .collect();
    assert!(dashes.len() > 10, "a dashed line across the plot");
    for d in &dashes {
        for q in &d.points {
            assert!(
                (q.1 - label.y).abs() <= 1.0,
                "{q:?} vs label at {}",
                label.y
            );
        }
    }
    let span = dashes.iter().flat_map(|d| &d.points).map(|q| q.0);
    let (lo, hi) = span.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    assert!(hi - lo > 0.9 * f64::from(xs.end - xs.start));
    assert!(
        texts
            .iter()
            .filter(|t| t.text == "threshold 0.8: a verdict below")
            .count()
            == 2,
        "labelled beside the line and in the legend"
    );
}

#[test]
fn a_log_chart_breaks_its_line_where_a_value_cannot_be_drawn() {
    let chart = LineChart {
        title: vec!["p95 relative L2 error".to_owned()],
        y_desc: "p95 relative L2 error".to_owned(),
        scale: Scale::Log,
        lines: vec![Line {
            name: "run".to_owned(),
            points: vec![(0, 1e-3), (1, 2e-3), (2, 0.0), (3, 0.3), (4, 0.4)],
        }],
        limits: vec![Limit {
            label: "threshold 0.1".to_owned(),
            value: LimitValue::Constant(0.1),
        }],
    };
    let (svg, layout) = line::render(&chart).unwrap();
    assert_eq!(layout.not_drawn, 1);
    let (texts, polylines) = parse(&svg);
    let pieces: Vec<usize> = polylines
        .iter()
        .filter(|p| p.stroke == hex(PALETTE[0]))
        .map(|p| p.points.len())
        .filter(|&n| n == 2)
        .collect();
    // Two segments of two points each (plus the legend sample).
    assert_eq!(pieces.len(), 3, "{polylines:?}");
    let tick = y_tick_labels(&texts, &layout)
        .into_iter()
        .find(|t| t.text == "0.1")
        .expect("0.1 is a tick");
    let dash = polylines
        .iter()
        .find(|p| p.stroke == hex(LIMIT_COLOR))
        .unwrap();
    assert!((dash.points[0].1 - tick.y).abs() <= 1.0);
}

// === the PNG, decoded ===

struct Image {
    width: usize,
    rgb: Vec<u8>,
}

impl Image {
    fn decode(png_bytes: &[u8]) -> Image {
        let decoder = png::Decoder::new(std::io::Cursor::new(png_bytes));
        let mut reader = decoder.read_info().unwrap();
        let mut rgb = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut rgb).unwrap();
        assert_eq!(info.color_type, png::ColorType::Rgb);
        rgb.truncate(info.buffer_size());
        Image {
            width: info.width as usize,
            rgb,
        }
    }

    fn at(&self, x: i32, y: i32) -> [u8; 3] {
        let i = (y as usize * self.width + x as usize) * 3;
        [self.rgb[i], self.rgb[i + 1], self.rgb[i + 2]]
    }
}

/// The value whose colour bar row is nearest in colour to `c`.
fn read_on_bar(img: &Image, l: &HeatmapLayout, range: (f64, f64), c: [u8; 3]) -> f64 {
    let x = (l.bar_x.start + l.bar_x.end) / 2;
    let (lo_y, hi_y) = l.bar_y;
    let distance = |p: [u8; 3]| -> i32 {
        p.iter()
            .zip(c)
            .map(|(&a, b)| (i32::from(a) - i32::from(b)).pow(2))
            .sum()
    };
    let y = (hi_y..=lo_y)
        .min_by_key(|&y| distance(img.at(x, y)))
        .unwrap();
    range.0 + (range.1 - range.0) * f64::from(lo_y - y) / f64::from(lo_y - hi_y)
}

fn known_value(layer: i32, token: i32) -> f64 {
    f64::from((layer * 7 + (token - 100) / 4) % 10) / 9.0
}

#[test]
fn each_cells_colour_reads_back_as_its_value_on_the_colour_bar() {
    // Four layers x 32 tokens, one bin per token; layer 1 has no rows for
    // tokens 110..114.
    let rows = (0..4).flat_map(|l| {
        (100..132)
            .filter(move |&t| l != 1 || !(110..114).contains(&t))
            .map(move |t| (l, t, known_value(l, t)))
    });
    let binned = Binned::from_rows(rows, MAX_BINS).unwrap();
    assert_eq!((binned.bins, binned.bin_width), (32, 1));
    let map = Heatmap {
        title: vec!["known".to_owned()],
        value_desc: "churn-free Jaccard".to_owned(),
        range: (0.0, 1.0),
        threshold: Some((0.8, "threshold 0.8".to_owned())),
        binned,
    };
    let (bytes, l) = heatmap::render(&map).unwrap();
    let img = Image::decode(&bytes);
    assert_eq!(img.width, l.canvas.0 as usize);
    assert!(l.canvas.0 <= 1600);
    let bar_h = f64::from(l.bar_y.0 - l.bar_y.1);
    for (i, layer) in [0, 1, 2, 3].into_iter().enumerate() {
        for bin in 0..32 {
            let token = 100 + bin as i32;
            let x = (l.x_edges[bin] + l.x_edges[bin + 1]) / 2;
            let y = (l.y_edges[i] + l.y_edges[i + 1]) / 2;
            let pixel = img.at(x, y);
            if layer == 1 && (110..114).contains(&token) {
                assert_eq!(pixel, [NO_DATA.0, NO_DATA.1, NO_DATA.2], "no row: grey");
                continue;
            }
            let want = known_value(layer, token);
            let read = read_on_bar(&img, &l, map.range, pixel);
            assert!(
                (read - want).abs() <= 2.0 / bar_h,
                "layer {layer} token {token}: {want} drawn, {read} read on the bar"
            );
        }
    }
    // Layer rows top to bottom in order, labelled by their layer.
    assert_eq!(l.layer_ticks, [0, 1, 2, 3]);
    assert!(l.y_edges.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(l.bar_ticks, ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]);
}

#[test]
fn the_threshold_is_marked_on_the_colour_bar_at_its_value() {
    let rows = (0..2).flat_map(|l| (0..8).map(move |t| (l, t, 0.5)));
    let map = Heatmap {
        title: vec!["flat".to_owned()],
        value_desc: "churn-free Jaccard".to_owned(),
        range: (0.0, 1.0),
        threshold: Some((0.8, "threshold 0.8".to_owned())),
        binned: Binned::from_rows(rows, MAX_BINS).unwrap(),
    };
    let (bytes, l) = heatmap::render(&map).unwrap();
    let img = Image::decode(&bytes);
    let x = (l.bar_x.start + l.bar_x.end) / 2;
    let black: Vec<i32> = (l.bar_y.1..=l.bar_y.0)
        .filter(|&y| img.at(x, y) == [0, 0, 0])
        .collect();
    assert!(!black.is_empty(), "a black mark across the bar");
    let want = f64::from(l.bar_y.0) - 0.8 * f64::from(l.bar_y.0 - l.bar_y.1);
    for y in black {
        assert!(
            (f64::from(y) - want).abs() <= 1.5,
            "mark at {y}, 0.8 at {want}"
        );
    }
}

#[test]
fn bins_hold_the_mean_of_their_tokens() {
    // Tokens 0..10 into at most 4 bins: width 3, bins {0,1,2} {3,4,5} {6,7,8} {9}.
    let rows = (0..10).map(|t| (5, t, f64::from(t)));
    let b = Binned::from_rows(rows, 4).unwrap();
    assert_eq!((b.bins, b.bin_width, b.layers.as_slice()), (4, 3, &[5][..]));
    assert_eq!(
        (0..4).map(|bin| b.cell(0, bin)).collect::<Vec<_>>(),
        [Some(1.0), Some(4.0), Some(7.0), Some(9.0)]
    );
    let nan = Binned::from_rows([(0, 0, f64::NAN), (0, 1, 0.5)], 4).unwrap();
    assert_eq!((nan.rows, nan.not_finite), (1, 1));
    assert!(Binned::from_rows([(0, 0, f64::NAN)], 4).is_none());
}

#[test]
fn a_glm_sized_prefill_fits_a_screen_and_a_small_png() {
    // 78 layers x 8192 query tokens (GLM-5.1's prefill): healthy rows near
    // 0.95 with noise, a collapse at layer 40.
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut noise = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    let rows: Vec<(i32, i32, f64)> = (0..78)
        .flat_map(|l| (0..8192).map(move |t| (l, t)))
        .map(|(l, t)| {
            let base = if l == 40 { 0.4 } else { 0.95 };
            (l, t, base + 0.04 * (noise() - 0.5))
        })
        .collect();
    let binned = Binned::from_rows(rows, MAX_BINS).unwrap();
    assert_eq!((binned.bin_width, binned.bins), (8, 1024));
    let map = Heatmap {
        title: vec!["glm".to_owned()],
        value_desc: "churn-free Jaccard".to_owned(),
        range: (0.0, 1.0),
        threshold: Some((0.8, "threshold 0.8".to_owned())),
        binned,
    };
    let (bytes, l) = heatmap::render(&map).unwrap();
    assert!(l.canvas.0 <= 1600 && l.canvas.1 <= 1000, "{:?}", l.canvas);
    assert!(
        bytes.len() < 400_000,
        "{} bytes for 639k rows (the hand-drawn SVG took 2.1 MB for 16k)",
        bytes.len()
    );
    assert!(l.layer_ticks.windows(2).all(|w| w[0] < w[1]));
    assert!(l.layer_ticks.len() <= 16 && l.layer_ticks[0] == 0);
    assert!(l.token_ticks.windows(2).all(|w| w[0] < w[1]));
    // The collapsed layer reads back as about 0.4.
    let img = Image::decode(&bytes);
    let (x, y) = (
        (l.x_edges[500] + l.x_edges[501]) / 2,
        (l.y_edges[40] + l.y_edges[41]) / 2,
    );
    let read = read_on_bar(&img, &l, map.range, img.at(x, y));
    assert!((read - 0.4).abs() < 0.03, "{read}");
}
