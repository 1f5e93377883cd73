//! Figures, drawn with plotters (SVG backend, and the bitmap backend for PNG).
//!
//! - [`results_table`]: the benchmark results table in the spirit of scib-metrics'
//!   `Benchmarker.plot_results_table` (embeddings as rows, metric columns grouped into bio
//!   conservation and batch correction, circles sized and coloured by value with PRGn
//!   normalised per column at mean +- 2.5 sd as plottable's `normed_cmap`, aggregate
//!   scores as YlGnBu bars);
//! - [`geometry_figure`]: the three panels of `scfoundry geometry`;
//! - [`confusion_figure`]: the confusion matrix of `scfoundry transfer` (counts, coloured by
//!   the share of each true label).
//!
//! SVG text needs no font. The PNG needs a TrueType font, read once at run time (DejaVu
//! Sans from the usual system folders, or $SCFOUNDRY_FONT); without one the PNG is skipped
//! with a warning and the SVG is still written.

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::FontStyle;

use crate::metrics::{AggregateScores, MetricKind};
use crate::progress::warn;

pub mod curves;

pub(crate) const FAMILY: &str = "sans-serif";

/// Register a TrueType font with plotters for bitmap output; false if none was found.
pub(crate) fn font_ready() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| {
        let dirs = ["/usr/share/fonts/truetype/dejavu", "/usr/share/fonts/dejavu", "/usr/share/fonts/TTF", "/usr/local/share/fonts", "/Library/Fonts"];
        let mut regular: Vec<std::path::PathBuf> = std::env::var_os(crate::env::EnvVars::FONT).map(|p| vec![p.into()]).unwrap_or_default();
        regular.extend(dirs.iter().map(|d| Path::new(d).join("DejaVuSans.ttf")));
        let Some(bytes) = regular.iter().find_map(|p| std::fs::read(p).ok()) else { return false };
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        if plotters::style::register_font(FAMILY, FontStyle::Normal, bytes).is_err() {
            return false;
        }
        if let Some(b) = dirs.iter().find_map(|d| std::fs::read(Path::new(d).join("DejaVuSans-Bold.ttf")).ok()) {
            let _ = plotters::style::register_font(FAMILY, FontStyle::Bold, Box::leak(b.into_boxed_slice()));
        }
        true
    })
}

type Rgb = (u8, u8, u8);

fn hex(s: &str) -> Rgb {
    let v = u32::from_str_radix(s.trim_start_matches('#'), 16).unwrap_or(0);
    ((v >> 16) as u8, (v >> 8) as u8, v as u8)
}

/// Linear interpolation in a list of evenly spaced colour stops; t clipped to [0, 1].
fn cmap(stops: &[&str], t: f64) -> RGBColor {
    let t = if t.is_nan() { 0.5 } else { t.clamp(0.0, 1.0) };
    let x = t * (stops.len() - 1) as f64;
    let i = (x.floor() as usize).min(stops.len() - 2);
    let f = x - i as f64;
    let (a, b) = (hex(stops[i]), hex(stops[i + 1]));
    let m = |p: u8, q: u8| (p as f64 + (q as f64 - p as f64) * f).round() as u8;
    RGBColor(m(a.0, b.0), m(a.1, b.1), m(a.2, b.2))
}

/// matplotlib's PRGn and YlGnBu.
const PRGN: [&str; 11] = ["#40004b", "#762a83", "#9970ab", "#c2a5cf", "#e7d4e8", "#f7f7f7", "#d9f0d3", "#a6dba0", "#5aae61", "#1b7837", "#00441b"];
const YLGNBU: [&str; 9] = ["#ffffd9", "#edf8b1", "#c7e9b4", "#7fcdbb", "#41b6c4", "#1d91c0", "#225ea8", "#253494", "#081d58"];

fn is_dark(c: &RGBColor) -> bool {
    (0.299 * c.0 as f64 + 0.587 * c.1 as f64 + 0.114 * c.2 as f64) < 140.0
}

/// plottable's `normed_cmap(col, PRGn, num_stds=2.5)`: the colour scale spans mean +- 2.5 sd
/// of the column (sample sd). A single embedding is coloured by the value itself on [0, 1];
/// a column without spread gets the neutral middle colour.
fn normer(col: &[f64]) -> impl Fn(f64) -> f64 {
    let v: Vec<f64> = col.iter().copied().filter(|x| x.is_finite()).collect();
    let m = v.iter().sum::<f64>() / v.len().max(1) as f64;
    let single = v.len() < 2;
    let sd = if v.len() > 1 { (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (v.len() - 1) as f64).sqrt() } else { 0.0 };
    move |x: f64| {
        if single {
            x
        } else if sd > 1e-12 {
            (x - (m - 2.5 * sd)) / (5.0 * sd)
        } else {
            0.5
        }
    }
}

/// What the results-table figure shows.
pub struct ResultsTable {
    pub title: String,
    pub subtitle: String,
    /// metric columns (clean name, group), in order
    pub metrics: Vec<(String, MetricKind)>,
    /// rows in display order: embedding, metric values, aggregates
    pub rows: Vec<(String, Vec<f64>, AggregateScores)>,
}

fn two_lines(s: &str) -> (String, String) {
    match s.split_once(' ') {
        Some((a, b)) => (a.to_string(), b.to_string()),
        None => (s.to_string(), String::new()),
    }
}

fn fmt2(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else {
        format!("{v:.2}")
    }
}

type DrawResult = Result<(), String>;

/// A figure that draws the same way on any plotters backend (SVG, PNG).
pub(crate) trait Figure {
    /// Width and height of the SVG in pixels; the PNG has twice as many each way.
    fn size(&self) -> (u32, u32);
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>, scale: f64) -> DrawResult;
}

/// What a figure writes without a TrueType font (plotters lays text out with the font).
pub(crate) enum WithoutFont {
    /// The SVG all the same (text placed without metrics), no PNG.
    SvgOnly,
    /// No figure; the text says what is written instead.
    Nothing(&'static str),
}

const NO_FONT: &str = "no TrueType font found (DejaVu Sans, or set SCFOUNDRY_FONT=/path/to/font.ttf)";

/// Write `f` as an SVG and a PNG at twice the resolution.
pub(crate) fn write_figure<F: Figure>(f: &F, svg: &Path, png: &Path, without_font: WithoutFont) -> anyhow::Result<()> {
    let font = font_ready();
    if let (false, WithoutFont::Nothing(what)) = (font, &without_font) {
        warn(&format!("{NO_FONT}: {what}"));
        return Ok(());
    }
    let (w, h) = f.size();
    {
        let root = SVGBackend::new(svg, (w, h)).into_drawing_area();
        f.draw(&root, 1.0).map_err(|m| anyhow::anyhow!("drawing {}: {m}", svg.display()))?;
        root.present().map_err(|m| anyhow::anyhow!("writing {}: {m:?}", svg.display()))?;
    }
    if !font {
        warn(&format!("{NO_FONT}: the PNG figure is skipped, the SVG is written"));
        return Ok(());
    }
    let root = BitMapBackend::new(png, (w * 2, h * 2)).into_drawing_area();
    f.draw(&root, 2.0).map_err(|m| anyhow::anyhow!("drawing {}: {m}", png.display()))?;
    root.present().map_err(|m| anyhow::anyhow!("writing {}: {m:?}", png.display()))?;
    Ok(())
}

fn e<E: std::fmt::Debug>(err: E) -> String {
    format!("{err:?}")
}

fn draw_table<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, t: &ResultsTable, s: f64) -> DrawResult {
    let px = |v: f64| (v * s).round() as i32;
    let font = |size: f64| (FAMILY, size * s).into_font();
    let text = |txt: &str, x: f64, y: f64, size: f64, color: &RGBColor, h: HPos, bold: bool| {
        let f = if bold { font(size).style(FontStyle::Bold) } else { font(size) };
        root.draw(&Text::new(txt.to_string(), (px(x), px(y)), f.color(color).pos(Pos::new(h, VPos::Center)))).map_err(e)
    };
    let line = |x0: f64, y0: f64, x1: f64, y1: f64, color: RGBColor, w: f64| {
        root.draw(&PathElement::new(vec![(px(x0), px(y0)), (px(x1), px(y1))], ShapeStyle { color: color.to_rgba(), filled: false, stroke_width: (w * s).round().max(1.0) as u32 })).map_err(e)
    };
    root.fill(&WHITE).map_err(e)?;
    let grey = RGBColor(90, 90, 90);
    let light = RGBColor(200, 200, 200);
    let (left, name_w, col_w, agg_w, gap) = (20.0, 170.0, 78.0, 96.0, 14.0);
    text(&t.title, left, 22.0, 17.0, &BLACK, HPos::Left, true)?;
    text(&t.subtitle, left, 44.0, 11.5, &grey, HPos::Left, false)?;
    // column x centres
    let mut xs = Vec::new();
    let mut x = left + name_w;
    let mut prev: Option<MetricKind> = None;
    for (_, k) in &t.metrics {
        if prev.is_some_and(|p| p != *k) {
            x += gap;
        }
        xs.push(x + col_w / 2.0);
        x += col_w;
        prev = Some(*k);
    }
    let agg_x0 = x + gap;
    let agg_names = ["Batch correction", "Bio conservation", "Total"];
    let table_right = agg_x0 + agg_w * 3.0;
    // group headers
    let (gy, hy, top) = (78.0, 104.0, 128.0);
    let mut i = 0;
    while i < t.metrics.len() {
        let k = t.metrics[i].1;
        let j = (i..t.metrics.len()).find(|&j| t.metrics[j].1 != k).unwrap_or(t.metrics.len());
        let (x0, x1) = (xs[i] - col_w / 2.0 + 4.0, xs[j - 1] + col_w / 2.0 - 4.0);
        let name = match k {
            MetricKind::BioConservation => "Bio conservation",
            MetricKind::BatchCorrection => "Batch correction",
        };
        text(name, (x0 + x1) / 2.0, gy, 13.0, &BLACK, HPos::Center, true)?;
        line(x0, gy + 11.0, x1, gy + 11.0, BLACK, 1.0)?;
        i = j;
    }
    text("Aggregate score", agg_x0 + agg_w * 1.5, gy, 13.0, &BLACK, HPos::Center, true)?;
    line(agg_x0 + 4.0, gy + 11.0, table_right - 4.0, gy + 11.0, BLACK, 1.0)?;
    // column headers
    text("Embedding", left, hy + 7.0, 12.0, &BLACK, HPos::Left, true)?;
    let header = |name: &str, cx: f64| -> DrawResult {
        let (a, b) = two_lines(name);
        if b.is_empty() {
            text(&a, cx, hy + 7.0, 11.5, &BLACK, HPos::Center, false)
        } else {
            text(&a, cx, hy, 11.5, &BLACK, HPos::Center, false)?;
            text(&b, cx, hy + 14.0, 11.5, &BLACK, HPos::Center, false)
        }
    };
    for ((name, _), &cx) in t.metrics.iter().zip(&xs) {
        header(name, cx)?;
    }
    for (a, name) in agg_names.iter().enumerate() {
        header(name, agg_x0 + agg_w * (a as f64 + 0.5))?;
    }
    line(left, top, table_right, top, BLACK, 1.0)?;
    // rows
    let rh = 42.0;
    let norms: Vec<_> = (0..t.metrics.len()).map(|m| normer(&t.rows.iter().map(|r| r.1[m]).collect::<Vec<_>>())).collect();
    for (r, (name, vals, agg)) in t.rows.iter().enumerate() {
        let cy = top + rh * (r as f64 + 0.5);
        text(name, left, cy, 13.0, &BLACK, HPos::Left, true)?;
        for (m, &v) in vals.iter().enumerate() {
            if v.is_nan() {
                text("NaN", xs[m], cy, 11.0, &grey, HPos::Center, false)?;
                continue;
            }
            let c = cmap(&PRGN, norms[m](v));
            let rad = 7.0 + 11.0 * v.clamp(0.0, 1.0);
            root.draw(&Circle::new((px(xs[m]), px(cy)), px(rad), ShapeStyle { color: c.to_rgba(), filled: true, stroke_width: 0 })).map_err(e)?;
            root.draw(&Circle::new((px(xs[m]), px(cy)), px(rad), ShapeStyle { color: RGBColor(120, 120, 120).to_rgba(), filled: false, stroke_width: s.round().max(1.0) as u32 })).map_err(e)?;
            let tc = if rad >= 13.0 && is_dark(&c) { WHITE } else { BLACK };
            text(&fmt2(v), xs[m], cy, 10.5, &tc, HPos::Center, false)?;
        }
        for (a, v) in [agg.batch_correction, agg.bio_conservation, agg.total].into_iter().enumerate() {
            let x0 = agg_x0 + agg_w * a as f64 + 6.0;
            if v.is_nan() {
                text("NaN", x0 + agg_w / 2.0 - 6.0, cy, 11.0, &grey, HPos::Center, false)?;
                continue;
            }
            let w = (agg_w - 12.0) * v.clamp(0.0, 1.0);
            let c = cmap(&YLGNBU, v);
            root.draw(&Rectangle::new([(px(x0), px(cy - rh * 0.45)), (px(x0 + w), px(cy + rh * 0.45))], c.filled())).map_err(e)?;
            let tc = if is_dark(&c) && w > 34.0 { WHITE } else { BLACK };
            let (tx, h) = if w > 34.0 { (x0 + 4.0, HPos::Left) } else { (x0 + w + 3.0, HPos::Left) };
            text(&fmt2(v), tx, cy, 11.0, &tc, h, false)?;
        }
        let y = top + rh * (r as f64 + 1.0);
        if r + 1 < t.rows.len() {
            // dotted divider
            let mut xd = left;
            while xd < table_right {
                line(xd, y, (xd + 1.5).min(table_right), y, light, 1.0)?;
                xd += 6.0;
            }
        } else {
            line(left, y, table_right, y, BLACK, 1.0)?;
        }
    }
    line(agg_x0, top, agg_x0, top + rh * t.rows.len() as f64, BLACK, 1.0)?;
    Ok(())
}

fn table_size(t: &ResultsTable) -> (f64, f64) {
    let groups = 1 + t.metrics.windows(2).filter(|w| w[0].1 != w[1].1).count();
    let w = 20.0 + 170.0 + 78.0 * t.metrics.len() as f64 + 14.0 * groups as f64 + 96.0 * 3.0 + 20.0;
    let title_w = 20.0 + 9.5 * t.title.len().max(t.subtitle.len() * 6 / 10) as f64 + 20.0;
    (w.max(title_w), 128.0 + 42.0 * t.rows.len() as f64 + 24.0)
}

impl Figure for ResultsTable {
    fn size(&self) -> (u32, u32) {
        let (w, h) = table_size(self);
        (w.ceil() as u32, h.ceil() as u32)
    }
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>, scale: f64) -> DrawResult {
        draw_table(root, self, scale)
    }
}

/// Write the results table as SVG and PNG (PNG at twice the resolution).
pub fn results_table(t: &ResultsTable, svg: &Path, png: &Path) -> anyhow::Result<()> {
    write_figure(t, svg, png, WithoutFont::SvgOnly)
}

/// What the geometry figure shows.
pub struct GeometryFigure {
    pub title: String,
    /// pairwise-distance histogram: bin edges (len = counts + 1) and counts
    pub dist_edges: Vec<f64>,
    pub dist_counts: Vec<u64>,
    /// per-cell local intrinsic dimension histogram
    pub lid_edges: Vec<f64>,
    pub lid_counts: Vec<u64>,
    pub lid_label: String,
    /// (k, kNN overlap with PCA space, neighbourhood preservation) rows
    pub preservation: Vec<(usize, f64, f64)>,
    pub preservation_label: String,
    /// what the neighbourhoods are compared with
    pub reference: String,
}

fn hist_panel<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, s: f64, caption: &str, xlabel: &str, edges: &[f64], counts: &[u64], color: RGBColor) -> DrawResult {
    let (x0, x1) = (edges.first().copied().unwrap_or(0.0), edges.last().copied().unwrap_or(1.0));
    let x1 = if x1 > x0 { x1 } else { x0 + 1.0 };
    let ymax = counts.iter().copied().max().unwrap_or(1).max(1) as f64 * 1.08;
    let mut ch = ChartBuilder::on(area)
        .caption(caption, (FAMILY, 15.0 * s))
        .margin((10.0 * s) as i32)
        .x_label_area_size((38.0 * s) as i32)
        .y_label_area_size((52.0 * s) as i32)
        .build_cartesian_2d(x0..x1, 0f64..ymax)
        .map_err(e)?;
    ch.configure_mesh()
        .disable_x_mesh()
        .x_desc(xlabel)
        .y_desc("count")
        .label_style((FAMILY, 11.0 * s))
        .axis_desc_style((FAMILY, 12.0 * s))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .x_label_formatter(&|v| format!("{v:.3}").trim_end_matches('0').trim_end_matches('.').to_string())
        .draw()
        .map_err(e)?;
    ch.draw_series(counts.iter().enumerate().map(|(i, &c)| Rectangle::new([(edges[i], 0.0), (edges[i + 1], c as f64)], color.filled())))
        .map_err(e)?;
    Ok(())
}

fn draw_geometry<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, g: &GeometryFigure, s: f64) -> DrawResult {
    root.fill(&WHITE).map_err(e)?;
    let (title, body) = root.split_vertically((52.0 * s) as u32);
    title
        .draw(&Text::new(g.title.clone(), ((16.0 * s) as i32, (17.0 * s) as i32), (FAMILY, 16.0 * s).into_font().style(FontStyle::Bold).color(&BLACK).pos(Pos::new(HPos::Left, VPos::Center))))
        .map_err(e)?;
    title
        .draw(&Text::new(format!("neighbourhoods compared with: {}", g.reference), ((16.0 * s) as i32, (39.0 * s) as i32), (FAMILY, 12.0 * s).into_font().color(&RGBColor(90, 90, 90)).pos(Pos::new(HPos::Left, VPos::Center))))
        .map_err(e)?;
    let panels = body.split_evenly((1, 3));
    hist_panel(&panels[0], s, "Pairwise distances (sampled pairs)", "Euclidean distance", &g.dist_edges, &g.dist_counts, RGBColor(70, 110, 170))?;
    hist_panel(&panels[1], s, "Local intrinsic dimension", &g.lid_label, &g.lid_edges, &g.lid_counts, RGBColor(120, 80, 160))?;
    let ks: Vec<f64> = g.preservation.iter().map(|p| p.0 as f64).collect();
    let kmax = ks.iter().copied().fold(1.0, f64::max) * 1.1;
    let mut ch = ChartBuilder::on(&panels[2])
        .caption("Neighbourhood preservation", (FAMILY, 15.0 * s))
        .margin((10.0 * s) as i32)
        .x_label_area_size((38.0 * s) as i32)
        .y_label_area_size((52.0 * s) as i32)
        .build_cartesian_2d(0f64..kmax, 0f64..1.0)
        .map_err(e)?;
    ch.configure_mesh()
        .x_desc("k (neighbours)")
        .y_desc("mean fraction shared")
        .label_style((FAMILY, 11.0 * s))
        .axis_desc_style((FAMILY, 12.0 * s))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(e)?;
    let blue = RGBColor(31, 119, 180);
    let orange = RGBColor(255, 127, 14);
    let sw = (2.0 * s) as u32;
    ch.draw_series(LineSeries::new(g.preservation.iter().map(|p| (p.0 as f64, p.1)), ShapeStyle { color: blue.to_rgba(), filled: false, stroke_width: sw }))
        .map_err(e)?
        .label(g.preservation_label.clone())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + (16.0 * s) as i32, y)], ShapeStyle { color: blue.to_rgba(), filled: false, stroke_width: sw }));
    ch.draw_series(g.preservation.iter().map(|p| Circle::new((p.0 as f64, p.1), (4.0 * s) as i32, blue.filled()))).map_err(e)?;
    ch.draw_series(LineSeries::new(g.preservation.iter().map(|p| (p.0 as f64, p.2)), ShapeStyle { color: orange.to_rgba(), filled: false, stroke_width: sw }))
        .map_err(e)?
        .label("Jaccard index of the two k-NN sets")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + (16.0 * s) as i32, y)], ShapeStyle { color: orange.to_rgba(), filled: false, stroke_width: sw }));
    ch.draw_series(g.preservation.iter().map(|p| Circle::new((p.0 as f64, p.2), (4.0 * s) as i32, orange.filled()))).map_err(e)?;
    ch.configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .legend_area_size((26.0 * s) as i32)
        .label_font((FAMILY, 10.0 * s))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(e)?;
    Ok(())
}

impl Figure for GeometryFigure {
    fn size(&self) -> (u32, u32) {
        (1380, 460)
    }
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>, scale: f64) -> DrawResult {
        draw_geometry(root, self, scale)
    }
}

/// Write the geometry figure as SVG and PNG.
pub fn geometry_figure(g: &GeometryFigure, svg: &Path, png: &Path) -> anyhow::Result<()> {
    write_figure(g, svg, png, WithoutFont::Nothing("the geometry figure is skipped; the TSV and JSON are written"))
}

/// What the confusion-matrix figure of `scfoundry transfer` shows.
pub struct ConfusionFigure {
    pub title: String,
    pub subtitle: String,
    /// Labels of the rows (truth) and columns (prediction), the same list.
    pub labels: Vec<String>,
    /// n x n row-major counts: row = true label, column = predicted label.
    pub counts: Vec<u64>,
}

/// matplotlib's Blues.
const BLUES: [&str; 9] = ["#f7fbff", "#deebf7", "#c6dbef", "#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c", "#08306b"];

fn short_label(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(max - 1).collect::<String>())
    }
}

/// Layout of the confusion figure in unscaled pixels: (label column width, header height, cell).
fn confusion_layout(c: &ConfusionFigure) -> (f64, f64, f64) {
    let longest = c.labels.iter().map(|l| short_label(l, 30).chars().count()).max().unwrap_or(4) as f64;
    let label_w = 30.0 + 6.6 * longest;
    (label_w, 80.0 + 6.6 * longest, 34.0)
}

fn confusion_size(c: &ConfusionFigure) -> (f64, f64) {
    let (label_w, header_h, cell) = confusion_layout(c);
    let n = c.labels.len() as f64;
    let w = 20.0 + label_w + cell * n + 150.0;
    let title_w = 40.0 + 8.5 * c.title.len().max(c.subtitle.len() * 7 / 10) as f64;
    (w.max(title_w), header_h + cell * n + 40.0)
}

fn draw_confusion<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, c: &ConfusionFigure, s: f64) -> DrawResult {
    let px = |v: f64| (v * s).round() as i32;
    let font = |size: f64| (FAMILY, size * s).into_font();
    root.fill(&WHITE).map_err(e)?;
    let grey = RGBColor(90, 90, 90);
    let n = c.labels.len();
    let (label_w, header_h, cell) = confusion_layout(c);
    let (x0, y0) = (20.0 + label_w, header_h);
    let text = |txt: &str, x: f64, y: f64, size: f64, color: &RGBColor, h: HPos, bold: bool| {
        let f = if bold { font(size).style(FontStyle::Bold) } else { font(size) };
        root.draw(&Text::new(txt.to_string(), (px(x), px(y)), f.color(color).pos(Pos::new(h, VPos::Center)))).map_err(e)
    };
    text(&c.title, 20.0, 20.0, 16.0, &BLACK, HPos::Left, true)?;
    text(&c.subtitle, 20.0, 42.0, 11.5, &grey, HPos::Left, false)?;
    // column headers (predicted), rotated to read upwards
    text("predicted label", x0 + cell * n as f64 / 2.0, 64.0, 12.0, &BLACK, HPos::Center, true)?;
    for (j, l) in c.labels.iter().enumerate() {
        let f = font(11.0).transform(FontTransform::Rotate270).color(&BLACK).pos(Pos::new(HPos::Left, VPos::Center));
        root.draw(&Text::new(short_label(l, 30), (px(x0 + cell * (j as f64 + 0.5)), px(header_h - 6.0)), f)).map_err(e)?;
    }
    // row headers (truth)
    text("true label", 20.0, header_h - 12.0, 12.0, &BLACK, HPos::Left, true)?;
    let row_total: Vec<u64> = (0..n).map(|i| c.counts[i * n..(i + 1) * n].iter().sum()).collect();
    for (i, l) in c.labels.iter().enumerate() {
        let cy = y0 + cell * (i as f64 + 0.5);
        text(&short_label(l, 30), x0 - 8.0, cy, 11.0, &BLACK, HPos::Right, false)?;
        for j in 0..n {
            let v = c.counts[i * n + j];
            let frac = if row_total[i] > 0 { v as f64 / row_total[i] as f64 } else { 0.0 };
            let col = cmap(&BLUES, frac);
            let (cx0, cy0) = (x0 + cell * j as f64, y0 + cell * i as f64);
            root.draw(&Rectangle::new([(px(cx0), px(cy0)), (px(cx0 + cell), px(cy0 + cell))], col.filled())).map_err(e)?;
            if i == j {
                root.draw(&Rectangle::new([(px(cx0), px(cy0)), (px(cx0 + cell), px(cy0 + cell))], ShapeStyle { color: RGBColor(40, 40, 40).to_rgba(), filled: false, stroke_width: s.round().max(1.0) as u32 })).map_err(e)?;
            }
            if v > 0 {
                let tc = if is_dark(&col) { WHITE } else { BLACK };
                text(&v.to_string(), cx0 + cell / 2.0, cy0 + cell / 2.0, 10.5, &tc, HPos::Center, false)?;
            }
        }
        // support and recall beside the row
        let recall = if row_total[i] > 0 { format!("{:.2}", c.counts[i * n + i] as f64 / row_total[i] as f64) } else { "-".into() };
        text(&format!("n={}  recall {recall}", row_total[i]), x0 + cell * n as f64 + 8.0, cy, 10.5, &grey, HPos::Left, false)?;
    }
    // frame
    let (x1, y1) = (x0 + cell * n as f64, y0 + cell * n as f64);
    root.draw(&Rectangle::new([(px(x0), px(y0)), (px(x1), px(y1))], ShapeStyle { color: BLACK.to_rgba(), filled: false, stroke_width: s.round().max(1.0) as u32 })).map_err(e)?;
    text("colour: share of the row (true label); the diagonal is outlined", x0, y1 + 18.0, 10.5, &grey, HPos::Left, false)?;
    Ok(())
}

impl Figure for ConfusionFigure {
    fn size(&self) -> (u32, u32) {
        let (w, h) = confusion_size(self);
        (w.ceil() as u32, h.ceil() as u32)
    }
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>, scale: f64) -> DrawResult {
        draw_confusion(root, self, scale)
    }
}

/// Write the confusion matrix as SVG and PNG (PNG at twice the resolution).
pub fn confusion_figure(c: &ConfusionFigure, svg: &Path, png: &Path) -> anyhow::Result<()> {
    write_figure(c, svg, png, WithoutFont::SvgOnly)
}

/// The ELBO curve of `integrate --method scvi_denovo`: per-cell ELBO (reconstruction + KL, lower
/// is better) per epoch, train and validation.
pub struct ElboCurve {
    pub title: String,
    pub train: Vec<f64>,
    pub validation: Option<Vec<f64>>,
}

fn draw_elbo<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, c: &ElboCurve, s: f64) -> DrawResult {
    root.fill(&WHITE).map_err(e)?;
    let all: Vec<f64> = c.train.iter().chain(c.validation.iter().flatten()).copied().filter(|v| v.is_finite()).collect();
    // the first epochs run far above the rest: the axis starts at the 2nd percentile of the
    // later half's minimum and ends at the 95th percentile of all values
    let mut sorted = all.clone();
    sorted.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let lo = sorted.first().copied().unwrap_or(0.0);
    let hi = sorted.get(((sorted.len() as f64 * 0.95) as usize).min(sorted.len().saturating_sub(1))).copied().unwrap_or(1.0);
    let pad = ((hi - lo) * 0.05).max(1e-6);
    let n = c.train.len().max(2) as f64;
    let mut ch = ChartBuilder::on(root)
        .caption(&c.title, (FAMILY, 14.0 * s))
        .margin((14.0 * s) as i32)
        .x_label_area_size((40.0 * s) as i32)
        .y_label_area_size((64.0 * s) as i32)
        .build_cartesian_2d(0f64..n - 1.0, (lo - pad)..(hi + pad))
        .map_err(e)?;
    ch.configure_mesh()
        .x_desc("epoch")
        .y_desc("ELBO per cell (reconstruction + KL; lower is better)")
        .label_style((FAMILY, 11.0 * s))
        .axis_desc_style((FAMILY, 12.0 * s))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(e)?;
    let w = (2.0 * s).round() as u32;
    let blue = RGBColor(40, 90, 170);
    let orange = RGBColor(220, 110, 30);
    let clip = |v: f64| v.min(hi + pad);
    ch.draw_series(LineSeries::new(c.train.iter().enumerate().map(|(i, &v)| (i as f64, clip(v))), blue.stroke_width(w)))
        .map_err(e)?
        .label("train")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], blue.stroke_width(w)));
    if let Some(v) = &c.validation {
        ch.draw_series(LineSeries::new(v.iter().enumerate().map(|(i, &v)| (i as f64, clip(v))), orange.stroke_width(w)))
            .map_err(e)?
            .label("validation")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], orange.stroke_width(w)));
    }
    ch.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).label_font((FAMILY, 11.0 * s)).draw().map_err(e)?;
    Ok(())
}

impl Figure for ElboCurve {
    fn size(&self) -> (u32, u32) {
        (820, 480)
    }
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>, scale: f64) -> DrawResult {
        draw_elbo(root, self, scale)
    }
}

/// Write the ELBO curve as SVG and PNG (PNG at twice the resolution); skipped with a warning
/// when no font is found.
pub fn elbo_curve(c: &ElboCurve, svg: &Path, png: &Path) -> anyhow::Result<()> {
    write_figure(c, svg, png, WithoutFont::Nothing("the ELBO figure is skipped; elbo.tsv is written"))
}
