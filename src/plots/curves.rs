//! The training curves of `scfoundry finetune`: loss (left) and accuracy (right) per epoch,
//! training and validation, with the best epoch (the saved weights) marked.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::{write_figure, Figure, WithoutFont, FAMILY};

/// What the curves figure shows: one row per epoch.
pub struct CurvesFigure {
    pub title: String,
    pub epochs: Vec<usize>,
    pub train_loss: Vec<f64>,
    pub val_loss: Vec<Option<f64>>,
    pub train_acc: Vec<f64>,
    pub val_acc: Vec<Option<f64>>,
    pub best_epoch: usize,
}

fn e<E: std::fmt::Debug>(err: E) -> String {
    format!("{err:?}")
}

#[allow(clippy::too_many_arguments)]
fn panel<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, s: f64, caption: &str, ylabel: &str, epochs: &[usize], train: &[f64], val: &[Option<f64>], best: usize, yrange: Option<(f64, f64)>) -> Result<(), String> {
    let xmax = epochs.last().copied().unwrap_or(1).max(2) as f64;
    let vals: Vec<f64> = train.iter().copied().chain(val.iter().flatten().copied()).filter(|v| v.is_finite()).collect();
    let (y0, y1) = yrange.unwrap_or_else(|| {
        let hi = vals.iter().copied().fold(0.0f64, f64::max);
        (0.0, if hi > 0.0 { hi * 1.08 } else { 1.0 })
    });
    let mut ch = ChartBuilder::on(area)
        .caption(caption, (FAMILY, 15.0 * s))
        .margin((10.0 * s) as i32)
        .x_label_area_size((38.0 * s) as i32)
        .y_label_area_size((52.0 * s) as i32)
        .build_cartesian_2d(1f64..xmax, y0..y1)
        .map_err(e)?;
    ch.configure_mesh()
        .x_desc("epoch")
        .y_desc(ylabel)
        .label_style((FAMILY, 11.0 * s))
        .axis_desc_style((FAMILY, 12.0 * s))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(e)?;
    let sw = (2.0 * s) as u32;
    let blue = RGBColor(31, 119, 180);
    let orange = RGBColor(255, 127, 14);
    let grey = RGBColor(120, 120, 120);
    ch.draw_series(LineSeries::new([(best as f64, y0), (best as f64, y1)], ShapeStyle { color: grey.to_rgba(), filled: false, stroke_width: 1 }))
        .map_err(e)?
        .label(format!("best epoch ({best})"))
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + (16.0 * s) as i32, y)], grey));
    let tr: Vec<(f64, f64)> = epochs.iter().zip(train).map(|(&x, &y)| (x as f64, y)).collect();
    ch.draw_series(LineSeries::new(tr.clone(), ShapeStyle { color: blue.to_rgba(), filled: false, stroke_width: sw }))
        .map_err(e)?
        .label("training")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + (16.0 * s) as i32, y)], ShapeStyle { color: blue.to_rgba(), filled: false, stroke_width: sw }));
    ch.draw_series(tr.iter().map(|&p| Circle::new(p, (3.0 * s) as i32, blue.filled()))).map_err(e)?;
    let va: Vec<(f64, f64)> = epochs.iter().zip(val).filter_map(|(&x, y)| y.map(|y| (x as f64, y))).collect();
    if !va.is_empty() {
        ch.draw_series(LineSeries::new(va.clone(), ShapeStyle { color: orange.to_rgba(), filled: false, stroke_width: sw }))
            .map_err(e)?
            .label("validation")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + (16.0 * s) as i32, y)], ShapeStyle { color: orange.to_rgba(), filled: false, stroke_width: sw }));
        ch.draw_series(va.iter().map(|&p| Circle::new(p, (3.0 * s) as i32, orange.filled()))).map_err(e)?;
    }
    ch.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .legend_area_size((26.0 * s) as i32)
        .label_font((FAMILY, 10.0 * s))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(e)?;
    Ok(())
}

fn draw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, c: &CurvesFigure, s: f64) -> Result<(), String> {
    use plotters::style::text_anchor::{HPos, Pos, VPos};
    root.fill(&WHITE).map_err(e)?;
    let (title, body) = root.split_vertically((36.0 * s) as u32);
    title
        .draw(&Text::new(c.title.clone(), ((16.0 * s) as i32, (18.0 * s) as i32), (FAMILY, 15.0 * s).into_font().color(&BLACK).pos(Pos::new(HPos::Left, VPos::Center))))
        .map_err(e)?;
    let panels = body.split_evenly((1, 2));
    panel(&panels[0], s, "Cross-entropy loss", "loss", &c.epochs, &c.train_loss, &c.val_loss, c.best_epoch, None)?;
    panel(&panels[1], s, "Accuracy", "accuracy", &c.epochs, &c.train_acc, &c.val_acc, c.best_epoch, Some((0.0, 1.0)))?;
    Ok(())
}

impl Figure for CurvesFigure {
    fn size(&self) -> (u32, u32) {
        (960, 400)
    }
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>, scale: f64) -> Result<(), String> {
        draw(root, self, scale)
    }
}

/// Write the curves as SVG and PNG (skipped with a warning without a TrueType font, as the
/// other figures: plotters lays out axis labels with the font even for SVG).
pub fn curves_figure(c: &CurvesFigure, svg: &Path, png: &Path) -> anyhow::Result<()> {
    write_figure(c, svg, png, WithoutFont::Nothing("the curves figure is skipped; curves.tsv is written"))
}
