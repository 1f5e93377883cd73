//! The counts check: a method whose toml says `input_values = "raw_counts"` refuses a matrix
//! that does not hold counts, before any run folder exists. One function for every command
//! that embeds (embed, transfer, finetune, integrate); no method has its own copy.
//!
//! It reads a bounded sample of rows (at most [`SAMPLE_WINDOWS`] evenly spaced windows of
//! [`WINDOW_ROWS`] rows, fewer for wide dense matrices), never the whole matrix, and decides:
//!
//! - a negative value stops (scaled or centred data);
//! - values that look log-transformed stop: at least [`LOG_FRACTION`] of the sampled non-zero
//!   values are fractional **and** the largest is below [`LOG_MAX`]. log1p of counts per
//!   10,000 peaks near 9.2 and log1p of counts per million near 13.8, while counts, even the
//!   fractional ones of alevin-fry, kallisto or CellBender, reach the hundreds in any few
//!   hundred cells and are mostly whole numbers;
//! - other fractional values only warn: they may be legitimate fractional counts.
//!
//! Non-finite values are left to the readers that report them. `--skip-counts-check` turns
//! the check off; methods that normalise counts themselves in the task (pca, scvi_denovo,
//! seurat) still check every value there.

use crate::anndata::AnnData;
use crate::error::{Error, Result};
use crate::registry::Method;

/// Windows of rows read, spread evenly over the matrix.
pub const SAMPLE_WINDOWS: usize = 8;
/// Rows in a window.
pub const WINDOW_ROWS: usize = 64;
/// Stored values read at most (dense matrices read whole rows).
const MAX_VALUES: usize = 4_000_000;
/// Share of fractional non-zero values from which a matrix may be log-transformed.
pub const LOG_FRACTION: f64 = 0.9;
/// Largest value below which a mostly fractional matrix is taken as log-transformed.
pub const LOG_MAX: f32 = 20.0;

/// The flag that turns the check off (one spelling for every command).
pub const OVERRIDE: &str = "--skip-counts-check";

/// What the sample of rows held.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Sample {
    pub cells: usize,
    pub nonzero: usize,
    pub fractional: usize,
    pub max: f32,
    /// The first negative value: (value, row, column).
    pub negative: Option<(f32, usize, usize)>,
    /// The first fractional value: (value, row, column).
    pub first_fractional: Option<(f32, usize, usize)>,
}

impl Sample {
    /// Whether the values look log-transformed (see the module's rule).
    pub fn looks_log(&self) -> bool {
        self.nonzero > 0 && self.fractional as f64 >= LOG_FRACTION * self.nonzero as f64 && self.max < LOG_MAX
    }
}

/// The row windows the check reads: `(start, end)`, evenly spaced, at most
/// `SAMPLE_WINDOWS x WINDOW_ROWS` rows and about `MAX_VALUES` values of `n_cols` columns.
pub fn windows(n_rows: usize, n_cols: usize) -> Vec<(usize, usize)> {
    let per_window = WINDOW_ROWS.min((MAX_VALUES / SAMPLE_WINDOWS / n_cols.max(1)).max(1));
    if n_rows <= SAMPLE_WINDOWS * per_window {
        return if n_rows == 0 { vec![] } else { vec![(0, n_rows)] };
    }
    let step = n_rows / SAMPLE_WINDOWS;
    (0..SAMPLE_WINDOWS).map(|w| (w * step, (w * step + per_window).min(n_rows))).collect()
}

/// Read the sample of `x`.
pub fn sample(x: &crate::anndata::Matrix) -> Result<Sample> {
    let mut s = Sample::default();
    for (a, b) in windows(x.n_rows, x.n_cols) {
        let block = x.read_rows(a, b)?;
        s.cells += block.n_rows();
        for i in 0..block.n_rows() {
            let (idx, vals) = block.row(i);
            for (&j, &v) in idx.iter().zip(vals) {
                if !v.is_finite() || v == 0.0 {
                    continue;
                }
                s.nonzero += 1;
                s.max = s.max.max(v);
                if v < 0.0 && s.negative.is_none() {
                    s.negative = Some((v, a + i, j as usize));
                }
                if v.fract() != 0.0 {
                    s.fractional += 1;
                    if s.first_fractional.is_none() {
                        s.first_fractional = Some((v, a + i, j as usize));
                    }
                }
            }
        }
    }
    Ok(s)
}

/// The counts check of `method` on `ad`'s matrix (X, or `layers/<layer>`): `Ok(None)` when it
/// passes or does not apply (a method that takes log-normalised values, or `skip`), `Ok(Some)`
/// with a warning for fractional values that may be counts, an error otherwise.
pub fn check(method: &Method, ad: &AnnData, layer: Option<&str>, skip: bool) -> Result<Option<String>> {
    if skip || !method.needs_raw_counts() {
        return Ok(None);
    }
    let x = ad.matrix(layer)?;
    let s = sample(&x)?;
    let at = |row: usize, col: usize| {
        format!("cell {row} ({}), gene {col} ({})", ad.obs_names.get(row).map(String::as_str).unwrap_or(""), ad.var_names.get(col).map(String::as_str).unwrap_or(""))
    };
    let detail = if let Some((v, row, col)) = s.negative {
        format!("holds a negative value ({v}) at {}", at(row, col))
    } else if s.looks_log() {
        format!(
            "looks log-transformed: {} of the {} non-zero values in {} sampled cells are fractional and the largest is {:.3} (counts are whole numbers and reach the hundreds)",
            s.fractional, s.nonzero, s.cells, s.max
        )
    } else {
        return Ok(s.first_fractional.map(|(v, row, col)| {
            format!(
                "counts check: {} holds fractional values ({} of {} sampled non-zero values, e.g. {v} at {}); let through as counts for {} (alevin-fry, kallisto and CellBender write fractional counts; methods that read every value in the task may still refuse them). If it is normalised data, use the raw counts instead",
                x.field,
                s.fractional,
                s.nonzero,
                at(row, col),
                method.name
            )
        }));
    };
    Err(Error::CountsCheck { path: ad.path.clone(), method: method.name.clone(), field: x.field.clone(), detail, hint: counts_hint(ad, &x.field) })
}

/// Where the counts may be in this file, and the override.
fn counts_hint(ad: &AnnData, field: &str) -> String {
    let layers = ad.group_keys("layers");
    let mut where_ = Vec::new();
    if let Some(l) = layers.iter().find(|l| l.as_str() == "counts" || l.as_str() == "raw_counts") {
        if field != format!("layers/{l}") {
            where_.push(format!("pass `--layer {l}` (this file has layers/{l})"));
        }
    } else if !layers.is_empty() {
        where_.push(format!("if one of its layers holds the counts, pass `--layer NAME` (layers: {})", layers.join(", ")));
    }
    if ad.file.link_exists("raw") && ad.file.group("raw").is_ok_and(|g| g.link_exists("X")) {
        where_.push("this file has raw/X (adata.raw): scfoundry reads X or a layer, so store it as a layer first (`adata.layers['counts'] = adata.raw.X`, when raw has the same genes) and pass `--layer counts`".into());
    }
    if where_.is_empty() {
        where_.push("embed the raw counts (the file before normalize_total/log1p); log-normalised values cannot be turned back into counts".into());
    }
    format!("{}; if the matrix does hold counts, pass {OVERRIDE} to skip the counts check", where_.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_bounded_and_spread() {
        assert_eq!(windows(0, 10), vec![]);
        assert_eq!(windows(100, 10), vec![(0, 100)]);
        let w = windows(2_000_000, 30_000);
        assert_eq!(w.len(), SAMPLE_WINDOWS);
        let rows: usize = w.iter().map(|(a, b)| b - a).sum();
        assert!(rows * 30_000 <= MAX_VALUES + 30_000 * SAMPLE_WINDOWS, "{rows}");
        assert!(w.last().unwrap().0 > 1_500_000);
    }

    #[test]
    fn log_rule() {
        let s = |fractional, max| Sample { cells: 10, nonzero: 100, fractional, max, ..Default::default() };
        assert!(s(100, 9.2).looks_log());
        assert!(s(95, 13.8).looks_log());
        assert!(!s(30, 9.2).looks_log(), "mostly whole numbers are counts");
        assert!(!s(100, 250.0).looks_log(), "large fractional values are fractional counts");
        assert!(!Sample::default().looks_log());
    }
}
