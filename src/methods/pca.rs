//! PCA on raw counts: scanpy's standard recipe, streamed over row blocks.
//!
//! `sc.pp.normalize_total(target_sum=1e4)`, `sc.pp.log1p`, `sc.pp.highly_variable_genes(
//! flavor="seurat", n_top_genes=2000)`, `sc.pp.pca(n_comps=50, zero_center=True)` on the
//! highly variable genes (Wolf et al. 2018, https://github.com/scverse/scanpy).
//!
//! Three passes over the rows, never densifying the matrix and with memory independent of
//! the number of cells (apart from one size factor per cell):
//! 1. per-cell totals and per-gene mean/variance of the normalised values (for the HVGs);
//! 2. the HVG Gram matrix and means of log1p values -> the covariance (m x m, m = HVGs);
//! 3. the top eigenvectors (Lanczos, seeded) and the projection of every cell.
//!
//! Numerics follow scanpy: normalisation and log1p in float32 as scanpy does on float32
//! data, statistics accumulated in float64, variances with ddof = 1, seurat-flavour
//! dispersion bins cut like `pd.cut(means, 20)`.

use rayon::prelude::*;

use crate::anndata::{CsrBlock, Matrix};
use crate::error::{Error, Result};
use crate::linalg::top_eigh;
use crate::progress::Reporter;

#[derive(Debug, Clone)]
pub struct PcaOptions {
    pub n_comps: usize,
    pub n_top_genes: usize,
    pub target_sum: f32,
    pub seed: u64,
    /// Require non-negative integers (raw counts).
    pub check_counts: bool,
    /// Approximate stored values read per block.
    pub block_nnz: u64,
}

impl Default for PcaOptions {
    fn default() -> Self {
        PcaOptions { n_comps: 50, n_top_genes: 2000, target_sum: 1e4, seed: 0, check_counts: true, block_nnz: 4_000_000 }
    }
}

/// Names used in error messages.
pub struct Names<'a> {
    pub obs: &'a [String],
    pub var: &'a [String],
}

/// Result of the seurat-flavour highly-variable-gene selection.
#[derive(Debug, Clone)]
pub struct Hvg {
    /// log1p of the mean of normalised counts.
    pub means: Vec<f64>,
    /// log of the dispersion (variance / mean), NaN where the variance is 0.
    pub dispersions: Vec<f64>,
    pub dispersions_norm: Vec<f64>,
    pub selected: Vec<bool>,
}

/// Seurat-flavour HVG selection from per-gene mean and variance (ddof 1) of normalised
/// counts, as scanpy's `highly_variable_genes(flavor="seurat", n_top_genes=n)`.
pub fn hvg_seurat(mean: &[f64], var: &[f64], n_top: usize) -> Hvg {
    let g = mean.len();
    let mut means = Vec::with_capacity(g);
    let mut disp = Vec::with_capacity(g);
    for i in 0..g {
        let m = if mean[i] == 0.0 { 1e-12 } else { mean[i] };
        let d = var[i] / m;
        disp.push(if d == 0.0 { f64::NAN } else { d.ln() });
        means.push(m.ln_1p());
    }
    // pd.cut(means, 20): equal-width edges over [min, max], the first lowered by 0.1% of the range
    let n_bins = 20;
    let (mn, mx) = means.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
    let mut edges: Vec<f64>;
    if mn == mx {
        let (lo, hi) = if mn != 0.0 { (mn - 0.001 * mn.abs(), mx + 0.001 * mx.abs()) } else { (-0.001, 0.001) };
        let step = (hi - lo) / n_bins as f64;
        edges = (0..=n_bins).map(|i| lo + step * i as f64).collect();
        edges[n_bins] = hi;
    } else {
        let step = (mx - mn) / n_bins as f64;
        edges = (0..=n_bins).map(|i| mn + step * i as f64).collect();
        edges[n_bins] = mx;
        edges[0] -= (mx - mn) * 0.001;
    }
    let bin_of = |x: f64| -> usize {
        // searchsorted(edges, x, side="left") - 1, i.e. edges[b] < x <= edges[b+1]
        let i = edges.partition_point(|&e| e < x);
        i.clamp(1, n_bins) - 1
    };
    let bins: Vec<usize> = means.iter().map(|&x| bin_of(x)).collect();
    // per-bin mean and sample std of non-NaN dispersions
    let mut cnt = vec![0usize; n_bins];
    let mut sum = vec![0.0f64; n_bins];
    for i in 0..g {
        if !disp[i].is_nan() {
            cnt[bins[i]] += 1;
            sum[bins[i]] += disp[i];
        }
    }
    let avg: Vec<f64> = (0..n_bins).map(|b| if cnt[b] > 0 { sum[b] / cnt[b] as f64 } else { f64::NAN }).collect();
    let mut ss = vec![0.0f64; n_bins];
    for i in 0..g {
        if !disp[i].is_nan() {
            ss[bins[i]] += (disp[i] - avg[bins[i]]).powi(2);
        }
    }
    let mut avg_used = avg.clone();
    let mut dev: Vec<f64> = (0..n_bins).map(|b| if cnt[b] > 1 { (ss[b] / (cnt[b] - 1) as f64).sqrt() } else { f64::NAN }).collect();
    for b in 0..n_bins {
        // a bin whose std is undefined: scanpy sets dev = avg, avg = 0 (normalised dispersion 1)
        if dev[b].is_nan() {
            dev[b] = avg[b];
            avg_used[b] = 0.0;
        }
    }
    let dispersions_norm: Vec<f64> = (0..g).map(|i| (disp[i] - avg_used[bins[i]]) / dev[bins[i]]).collect();
    let mut finite: Vec<f64> = dispersions_norm.iter().cloned().filter(|x| !x.is_nan()).collect();
    finite.sort_by(|a, b| b.partial_cmp(a).unwrap());
    let selected = if finite.is_empty() {
        vec![false; g]
    } else {
        let cut = finite[n_top.min(finite.len()) - 1];
        dispersions_norm.iter().map(|&x| !x.is_nan() && x >= cut).collect()
    };
    Hvg { means, dispersions: disp, dispersions_norm, selected }
}

/// A fitted PCA.
#[derive(Debug, Clone)]
pub struct PcaFit {
    pub n_obs: usize,
    /// Indices (into var) of the highly variable genes, in var order.
    pub hvg_genes: Vec<usize>,
    pub hvg: Hvg,
    /// Mean of log1p-normalised values per HVG.
    pub mean: Vec<f64>,
    /// n_comps x m, row-major.
    pub components: Vec<f64>,
    pub variance: Vec<f64>,
    pub variance_ratio: Vec<f64>,
    /// Per cell: total counts / target_sum (the divisor), float32 as scanpy.
    pub size_factors: Vec<f32>,
    pub target_sum: f32,
    /// Seconds spent in each phase, for the cost report.
    pub timings: Vec<(String, f64)>,
}

/// Genes per side of a Gram-matrix tile (256 x 256 f64 = 512 KiB, cache-sized).
const TILE: usize = 256;

/// log1p-normalised values of the HVGs for a range of rows, with each row's offsets at the
/// tile boundaries (entries are sorted by HVG index).
struct HvgRows {
    n_rows: usize,
    idx: Vec<u32>,
    val: Vec<f64>,
    /// n_rows x (n_tiles + 1) offsets into idx/val
    tile_off: Vec<u32>,
}

impl HvgRows {
    fn build(b: &CsrBlock, ra: usize, rb: usize, sf: &[f32], hvg_index: &[u32], nt: usize) -> HvgRows {
        let mut out = HvgRows { n_rows: rb - ra, idx: Vec::new(), val: Vec::new(), tile_off: Vec::with_capacity((rb - ra) * (nt + 1)) };
        let mut row: Vec<(u32, f64)> = Vec::new();
        for i in ra..rb {
            let (idx, vals) = b.row(i);
            row.clear();
            for (&j, &v) in idx.iter().zip(vals) {
                let h = hvg_index[j as usize];
                if h != u32::MAX {
                    row.push((h, normalise(v, sf[i]).ln_1p() as f64));
                }
            }
            row.sort_unstable_by_key(|p| p.0);
            let base = out.idx.len();
            let mut t = 0;
            out.tile_off.push(base as u32);
            for (k, &(h, v)) in row.iter().enumerate() {
                while (h as usize) >= (t + 1) * TILE {
                    t += 1;
                    out.tile_off.push((base + k) as u32);
                }
                out.idx.push(h);
                out.val.push(v);
            }
            while t < nt {
                t += 1;
                out.tile_off.push(out.idx.len() as u32);
            }
        }
        out
    }
}

fn row_ranges(n: usize, parts: usize) -> Vec<(usize, usize)> {
    let parts = parts.max(1).min(n.max(1));
    (0..parts).map(|p| (p * n / parts, (p + 1) * n / parts)).collect()
}

fn threads() -> usize {
    rayon::current_num_threads().clamp(1, 8)
}

/// Check values of one block: finite always; non-negative integers when raw counts are required.
fn check_block(b: &CsrBlock, x: &Matrix, names: &Names, check_counts: bool) -> Result<()> {
    for i in 0..b.n_rows() {
        let (idx, vals) = b.row(i);
        for (&j, &v) in idx.iter().zip(vals) {
            let bad = !v.is_finite() || (check_counts && (v < 0.0 || v.fract() != 0.0));
            if !bad {
                continue;
            }
            let row = b.start_row + i;
            let col = j as usize;
            let cell = names.obs.get(row).cloned().unwrap_or_default();
            let gene = names.var.get(col).cloned().unwrap_or_default();
            if !v.is_finite() {
                return Err(Error::NonFinite { path: x.path.clone(), value: v, row, col, cell, gene });
            }
            let what = if v < 0.0 { "a negative value" } else { "a non-integer value" };
            let layer_hint = if x.field == "X" {
                "if raw counts are stored in a layer, pass `--layer counts` (or that layer's name); log-normalised data cannot be turned back into counts".to_string()
            } else {
                format!("{} does not hold raw counts either; pick the layer with integer counts", x.field)
            };
            return Err(Error::NotRawCounts {
                path: x.path.clone(),
                method: "pca".into(),
                what,
                value: v,
                row,
                col,
                cell,
                gene,
                hint: format!("pca normalises raw counts itself (normalize_total, log1p); {layer_hint}"),
            });
        }
    }
    Ok(())
}

/// Normalised value as scanpy computes it in float32: x / (total / target_sum).
#[inline]
fn normalise(v: f32, size: f32) -> f32 {
    v / size
}

/// Passes 1 and 2 and the eigen-decomposition.
pub fn fit(x: &Matrix, names: &Names, opts: &PcaOptions, rep: &dyn Reporter) -> Result<PcaFit> {
    let n = x.n_rows;
    let g = x.n_cols;
    if n < 2 {
        return Err(Error::BadField {
            path: x.path.clone(),
            field: x.field.clone(),
            detail: format!("has {n} cell(s); PCA needs at least 2"),
            hint: None,
        });
    }
    let blocks = x.blocks(opts.block_nnz);
    let t = threads();
    let mut timings = Vec::new();
    let mut read_s = 0.0;
    let clock = std::time::Instant::now();

    // Pass 1: size factors and per-gene moments of normalised values.
    let p = rep.step("pass 1/3: gene statistics", n as u64, "cells");
    let mut size_factors = vec![0f32; n];
    let mut accs: Vec<(Vec<f64>, Vec<f64>)> = (0..t).map(|_| (vec![0.0; g], vec![0.0; g])).collect();
    for &(s, e) in &blocks {
        let rc = std::time::Instant::now();
        let b = x.read_rows(s, e)?;
        read_s += rc.elapsed().as_secs_f64();
        check_block(&b, x, names, opts.check_counts)?;
        let sf = &mut size_factors[s..e];
        sf.par_iter_mut().enumerate().for_each(|(i, out)| {
            let (_, vals) = b.row(i);
            let total: f64 = vals.iter().map(|&v| v as f64).sum();
            let total = total as f32;
            let total = if total == 0.0 { 1.0 } else { total };
            *out = total / opts.target_sum;
        });
        let ranges = row_ranges(b.n_rows(), t);
        accs.par_iter_mut().zip(ranges).for_each(|((sum, sq), (ra, rb))| {
            for i in ra..rb {
                let (idx, vals) = b.row(i);
                let size = sf[i];
                for (&j, &v) in idx.iter().zip(vals) {
                    // scanpy's seurat flavour works on expm1(log1p(x)) in float32, which is x
                    // within one float32 rounding; identical genes still get identical values
                    let ev = normalise(v, size) as f64;
                    sum[j as usize] += ev;
                    sq[j as usize] += ev * ev;
                }
            }
        });
        p.inc((e - s) as u64);
    }
    p.finish();
    timings.push(("gene statistics".to_string(), clock.elapsed().as_secs_f64()));
    let (mut sum, mut sq) = accs.pop().unwrap();
    for (s2, q2) in accs {
        sum.iter_mut().zip(&s2).for_each(|(a, b)| *a += b);
        sq.iter_mut().zip(&q2).for_each(|(a, b)| *a += b);
    }
    let nf = n as f64;
    let mean: Vec<f64> = sum.iter().map(|s| s / nf).collect();
    let var: Vec<f64> = (0..g).map(|j| ((sq[j] - nf * mean[j] * mean[j]) / (nf - 1.0)).max(0.0)).collect();
    let hvg = hvg_seurat(&mean, &var, opts.n_top_genes);
    let hvg_genes: Vec<usize> = (0..g).filter(|&j| hvg.selected[j]).collect();
    let m = hvg_genes.len();
    if m == 0 {
        return Err(Error::BadField {
            path: x.path.clone(),
            field: x.field.clone(),
            detail: "no gene varies across cells, so there are no highly variable genes".into(),
            hint: None,
        });
    }
    let max_comps = m.min(n - 1);
    if opts.n_comps > max_comps {
        return Err(Error::BadOption {
            option: "--n-comps".into(),
            detail: format!("{} components asked, but {n} cells and {m} highly variable genes allow at most {max_comps}", opts.n_comps),
            hint: Some(format!("pass `--n-comps {max_comps}` or fewer")),
        });
    }
    let mut hvg_index = vec![u32::MAX; g];
    for (h, &j) in hvg_genes.iter().enumerate() {
        hvg_index[j] = h as u32;
    }

    // Pass 2: Gram matrix of log1p values on HVGs and their sums. The Gram matrix is kept as
    // tiles of TILE x TILE genes (upper triangle only); threads own whole tiles, so updates
    // stay in cache and need no per-thread copies or merging.
    let p = rep.step("pass 2/3: covariance", n as u64, "cells");
    let nt = m.div_ceil(TILE);
    let pairs: Vec<(usize, usize)> = (0..nt).flat_map(|i| (i..nt).map(move |j| (i, j))).collect();
    let mut tiles: Vec<Vec<f64>> = pairs.iter().map(|_| vec![0.0; TILE * TILE]).collect();
    let mut hsum = vec![0.0f64; m];
    for &(s, e) in &blocks {
        let rc = std::time::Instant::now();
        let b = x.read_rows(s, e)?;
        read_s += rc.elapsed().as_secs_f64();
        let sf = &size_factors[s..e];
        let ranges = row_ranges(b.n_rows(), t);
        let hv: Vec<HvgRows> = ranges.par_iter().map(|&(ra, rb)| HvgRows::build(&b, ra, rb, sf, &hvg_index, nt)).collect();
        for part in &hv {
            for (&h, &v) in part.idx.iter().zip(&part.val) {
                hsum[h as usize] += v;
            }
        }
        tiles.par_iter_mut().zip(pairs.par_iter()).for_each(|(tile, &(ti, tj))| {
            for part in &hv {
                for r in 0..part.n_rows {
                    let off = &part.tile_off[r * (nt + 1)..(r + 1) * (nt + 1)];
                    let (a0, a1) = (off[ti] as usize, off[ti + 1] as usize);
                    let (b0, b1) = (off[tj] as usize, off[tj + 1] as usize);
                    // tiles are aligned to multiples of TILE = 256, so the low byte of an HVG
                    // index is its place in the tile (and no bounds check is needed)
                    let tile: &mut [[f64; TILE]] = tile.as_chunks_mut::<TILE>().0;
                    let mut pa = a0;
                    // two rows of the tile at a time share the loads of the other entries
                    while pa + 1 < a1 {
                        let (ha, hc) = (part.idx[pa] as u8 as usize, part.idx[pa + 1] as u8 as usize);
                        let (va, vc) = (part.val[pa], part.val[pa + 1]);
                        // on a diagonal tile row pa takes entries >= pa and row pa+1 entries
                        // >= pa+1: run both from pa+1 and add pa's own diagonal term here
                        let from = if ti == tj { pa + 1 } else { b0 };
                        if ti == tj {
                            tile[ha][ha] += va * va;
                        }
                        let (ra, rc) = if ha < hc {
                            let (lo, hi) = tile.split_at_mut(hc);
                            (&mut lo[ha], &mut hi[0])
                        } else {
                            let (lo, hi) = tile.split_at_mut(ha);
                            (&mut hi[0], &mut lo[hc])
                        };
                        for (&hb, &vb) in part.idx[from..b1].iter().zip(&part.val[from..b1]) {
                            let q = hb as u8 as usize;
                            ra[q] += va * vb;
                            rc[q] += vc * vb;
                        }
                        pa += 2;
                    }
                    if pa < a1 {
                        let ha = part.idx[pa] as u8 as usize;
                        let va = part.val[pa];
                        let from = if ti == tj { pa } else { b0 };
                        for (&hb, &vb) in part.idx[from..b1].iter().zip(&part.val[from..b1]) {
                            tile[ha][hb as u8 as usize] += va * vb;
                        }
                    }
                }
            }
        });
        p.inc((e - s) as u64);
    }
    p.finish();
    let mut gram = vec![0.0f64; m * m];
    for (tile, &(ti, tj)) in tiles.iter().zip(&pairs) {
        for a in 0..TILE.min(m - ti * TILE) {
            for b in 0..TILE.min(m - tj * TILE) {
                let (ga, gb) = (ti * TILE + a, tj * TILE + b);
                if gb >= ga {
                    gram[ga * m + gb] = tile[a * TILE + b];
                }
            }
        }
    }
    drop(tiles);
    let mu: Vec<f64> = hsum.iter().map(|s| s / nf).collect();
    // covariance, ddof = 1, full symmetric
    let mut cov = vec![0.0; m * m];
    for a in 0..m {
        for b in a..m {
            let c = (gram[a * m + b] - nf * mu[a] * mu[b]) / (nf - 1.0);
            cov[a * m + b] = c;
            cov[b * m + a] = c;
        }
    }
    drop(gram);
    let total_var: f64 = (0..m).map(|a| cov[a * m + a].max(0.0)).sum();
    timings.push(("covariance".to_string(), clock.elapsed().as_secs_f64()));
    let clock = std::time::Instant::now();
    let p = rep.step("eigenvectors", 1, "");
    let (variance, components) = top_eigh(&cov, m, opts.n_comps, opts.seed);
    p.inc(1);
    p.finish();
    let variance_ratio = variance.iter().map(|v| v / total_var).collect();
    timings.push(("eigenvectors".to_string(), clock.elapsed().as_secs_f64()));
    timings.push(("(reading, passes 1-2)".to_string(), read_s));
    Ok(PcaFit { n_obs: n, hvg_genes, hvg, mean: mu, components, variance, variance_ratio, size_factors, target_sum: opts.target_sum, timings })
}

/// Pass 3: project every cell; `sink(start_row, rows)` receives blocks of n_comps-wide rows.
pub fn transform(
    x: &Matrix,
    fit: &PcaFit,
    opts: &PcaOptions,
    rep: &dyn Reporter,
    sink: impl FnMut(usize, &[f32]) -> Result<()>,
) -> Result<()> {
    transform_rows(x, fit, opts, rep, 0, x.n_rows, sink)
}

/// Pass 3 over rows `start..end` only (one shard). Each cell's projection depends only on
/// its own row and the fit, so shards give exactly the bytes of the whole-data transform.
pub fn transform_rows(
    x: &Matrix,
    fit: &PcaFit,
    opts: &PcaOptions,
    rep: &dyn Reporter,
    start: usize,
    end: usize,
    sink: impl FnMut(usize, &[f32]) -> Result<()>,
) -> Result<()> {
    let mut hvg_index = vec![u32::MAX; x.n_cols];
    for (h, &j) in fit.hvg_genes.iter().enumerate() {
        hvg_index[j] = h as u32;
    }
    project_rows(x, fit, &hvg_index, &fit.size_factors, opts, rep, start, end, sink)
}

/// How the genes of other data (a query) map onto a fit's highly variable genes, by var name.
#[derive(Debug, Clone)]
pub struct GeneMap {
    /// Per column of the other data: its HVG position in the fit, or u32::MAX.
    pub hvg_index: Vec<u32>,
    /// Names of the fit's HVGs that the other data lacks (they count as zero there).
    pub missing: Vec<String>,
}

impl GeneMap {
    /// Share of the fit's HVGs present in the other data.
    pub fn present_fraction(&self, n_hvg: usize) -> f64 {
        if n_hvg == 0 {
            return 0.0;
        }
        (n_hvg - self.missing.len()) as f64 / n_hvg as f64
    }
}

/// Map `var` (the other data's gene names) onto the HVGs of a fit made on data whose gene
/// names are `fit_var`.
pub fn align_genes(fit: &PcaFit, fit_var: &[String], var: &[String]) -> GeneMap {
    let pos: std::collections::HashMap<&str, usize> = var.iter().enumerate().map(|(j, n)| (n.as_str(), j)).collect();
    let mut hvg_index = vec![u32::MAX; var.len()];
    let mut missing = Vec::new();
    for (h, &g) in fit.hvg_genes.iter().enumerate() {
        let name = fit_var.get(g).map(String::as_str).unwrap_or("");
        match pos.get(name) {
            Some(&j) => hvg_index[j] = h as u32,
            None => missing.push(name.to_string()),
        }
    }
    GeneMap { hvg_index, missing }
}

/// Per-cell size factors of `x` (total counts over all its genes / target_sum, in float32 as
/// `fit` computes them), checking that the values are raw counts. Data projected with another
/// data's fit is normalised by its own totals, as `sc.pp.normalize_total` on it would.
pub fn size_factors(x: &Matrix, names: &Names, opts: &PcaOptions) -> Result<Vec<f32>> {
    let mut sf = vec![0f32; x.n_rows];
    for (s, e) in x.blocks(opts.block_nnz) {
        let b = x.read_rows(s, e)?;
        check_block(&b, x, names, opts.check_counts)?;
        sf[s..e].par_iter_mut().enumerate().for_each(|(i, out)| {
            let (_, vals) = b.row(i);
            let total: f64 = vals.iter().map(|&v| v as f64).sum();
            let total = total as f32;
            let total = if total == 0.0 { 1.0 } else { total };
            *out = total / opts.target_sum;
        });
    }
    Ok(sf)
}

/// Project every row of other data with a fit: its genes mapped by `map`, normalised by its own
/// `size_factors`. Genes of the fit that the data lacks contribute zero.
pub fn transform_mapped(
    x: &Matrix,
    fit: &PcaFit,
    map: &GeneMap,
    size_factors: &[f32],
    opts: &PcaOptions,
    rep: &dyn Reporter,
    sink: impl FnMut(usize, &[f32]) -> Result<()>,
) -> Result<()> {
    assert_eq!(map.hvg_index.len(), x.n_cols, "gene map is for other data");
    assert_eq!(size_factors.len(), x.n_rows, "one size factor per row");
    project_rows(x, fit, &map.hvg_index, size_factors, opts, rep, 0, x.n_rows, sink)
}

/// Pass 3 proper: `hvg_index` maps columns of `x` to HVG positions, `sf` holds one size factor
/// per row of `x`.
#[allow(clippy::too_many_arguments)]
fn project_rows(
    x: &Matrix,
    fit: &PcaFit,
    hvg_index: &[u32],
    sf_all: &[f32],
    opts: &PcaOptions,
    rep: &dyn Reporter,
    start: usize,
    end: usize,
    mut sink: impl FnMut(usize, &[f32]) -> Result<()>,
) -> Result<()> {
    let nc = fit.variance.len();
    let m = fit.hvg_genes.len();
    // V transposed: m x nc, so a gene's loadings are contiguous (float32: the output is float32)
    let mut vt = vec![0.0f32; m * nc];
    for c in 0..nc {
        for h in 0..m {
            vt[h * nc + c] = fit.components[c * m + h] as f32;
        }
    }
    let offset: Vec<f64> = (0..nc).map(|c| (0..m).map(|h| fit.mean[h] * fit.components[c * m + h]).sum()).collect();
    let end = end.min(x.n_rows);
    let p = rep.step("pass 3/3: projection", end.saturating_sub(start) as u64, "cells");
    let blocks = x.blocks(opts.block_nnz).into_iter().filter_map(|(s, e)| {
        let (s, e) = (s.max(start), e.min(end));
        (s < e).then_some((s, e))
    });
    for (s, e) in blocks {
        let b = x.read_rows(s, e)?;
        let sf = &sf_all[s..e];
        let mut out = vec![0f32; (e - s) * nc];
        out.par_chunks_mut(nc).enumerate().for_each(|(i, row)| {
            row.iter_mut().for_each(|a| *a = 0.0);
            let (idx, vals) = b.row(i);
            for (&j, &v) in idx.iter().zip(vals) {
                let h = hvg_index[j as usize];
                if h != u32::MAX {
                    let lv = normalise(v, sf[i]).ln_1p();
                    crate::linalg::axpy_f32(row, lv, &vt[h as usize * nc..(h as usize + 1) * nc]);
                }
            }
            row.iter_mut().zip(&offset).for_each(|(o, off)| *o = (*o as f64 - off) as f32);
        });
        sink(s, &out)?;
        p.inc((e - s) as u64);
    }
    p.finish();
    Ok(())
}

/// The fit as a file, so a fit task and later projection tasks (other processes, other
/// nodes) share it. Floats are stored as their bit patterns: exact, unlike decimal JSON.
#[derive(serde::Serialize, serde::Deserialize)]
struct FitFile {
    format: String,
    n_obs: usize,
    hvg_genes: Vec<usize>,
    hvg_means: Vec<u64>,
    hvg_dispersions: Vec<u64>,
    hvg_dispersions_norm: Vec<u64>,
    hvg_selected: Vec<bool>,
    mean: Vec<u64>,
    components: Vec<u64>,
    variance: Vec<u64>,
    variance_ratio: Vec<u64>,
    size_factors: Vec<u32>,
    target_sum: u32,
    /// Seconds per phase of the fit (for the cost report; not needed to project).
    #[serde(default)]
    timings: Vec<(String, f64)>,
}

const FIT_FORMAT: &str = "scfoundry-pca-fit-v1";

impl PcaFit {
    pub fn save(&self, path: &std::path::Path) -> Result<()> {
        let b = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<u64>>();
        let f = FitFile {
            format: FIT_FORMAT.into(),
            n_obs: self.n_obs,
            hvg_genes: self.hvg_genes.clone(),
            hvg_means: b(&self.hvg.means),
            hvg_dispersions: b(&self.hvg.dispersions),
            hvg_dispersions_norm: b(&self.hvg.dispersions_norm),
            hvg_selected: self.hvg.selected.clone(),
            mean: b(&self.mean),
            components: b(&self.components),
            variance: b(&self.variance),
            variance_ratio: b(&self.variance_ratio),
            size_factors: self.size_factors.iter().map(|x| x.to_bits()).collect(),
            target_sum: self.target_sum.to_bits(),
            timings: self.timings.clone(),
        };
        let text = serde_json::to_vec(&f).expect("fit serialises");
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text).map_err(|e| Error::Io { path: tmp.clone(), source: e })?;
        std::fs::rename(&tmp, path).map_err(|e| Error::Io { path: path.into(), source: e })
    }

    pub fn load(path: &std::path::Path) -> Result<PcaFit> {
        let text = std::fs::read(path).map_err(|e| Error::Io { path: path.into(), source: e })?;
        let f: FitFile = serde_json::from_slice(&text).map_err(|e| Error::Config {
            path: path.into(),
            detail: format!("not a PCA fit file: {e}"),
            hint: Some("the fit task writes it; run the fit task again".into()),
        })?;
        if f.format != FIT_FORMAT {
            return Err(Error::Config { path: path.into(), detail: format!("fit format {} (expected {FIT_FORMAT})", f.format), hint: None });
        }
        let d = |v: Vec<u64>| v.into_iter().map(f64::from_bits).collect::<Vec<f64>>();
        Ok(PcaFit {
            n_obs: f.n_obs,
            hvg_genes: f.hvg_genes,
            hvg: Hvg { means: d(f.hvg_means), dispersions: d(f.hvg_dispersions), dispersions_norm: d(f.hvg_dispersions_norm), selected: f.hvg_selected },
            mean: d(f.mean),
            components: d(f.components),
            variance: d(f.variance),
            variance_ratio: d(f.variance_ratio),
            size_factors: f.size_factors.into_iter().map(f32::from_bits).collect(),
            target_sum: f32::from_bits(f.target_sum),
            timings: f.timings,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hvg_single_gene_bin_gets_norm_one() {
        // one outlying gene alone in the top bin: scanpy gives it normalised dispersion 1
        let mut mean = vec![1.0; 10];
        let mut var = (0..10).map(|i| 1.0 + i as f64 * 0.1).collect::<Vec<_>>();
        mean[9] = 100.0;
        var[9] = 500.0;
        let h = hvg_seurat(&mean, &var, 3);
        assert!((h.dispersions_norm[9] - 1.0).abs() < 1e-12);
        assert_eq!(h.selected.iter().filter(|&&s| s).count(), 3);
    }

    #[test]
    fn hvg_zero_variance_is_nan_and_never_selected() {
        let mean = vec![0.0, 1.0, 2.0, 3.0];
        let var = vec![0.0, 1.0, 3.0, 2.0];
        let h = hvg_seurat(&mean, &var, 4);
        assert!(h.dispersions[0].is_nan());
        assert!(!h.selected[0]);
    }

    #[test]
    fn genes_align_by_name_and_missing_ones_are_listed() {
        let fit = PcaFit {
            n_obs: 2,
            hvg_genes: vec![0, 2, 3],
            hvg: hvg_seurat(&[1.0, 1.0, 1.0, 1.0], &[1.0, 2.0, 3.0, 4.0], 3),
            mean: vec![0.0; 3],
            components: vec![0.0; 3],
            variance: vec![1.0],
            variance_ratio: vec![1.0],
            size_factors: vec![1.0, 1.0],
            target_sum: 1e4,
            timings: vec![],
        };
        let fit_var: Vec<String> = ["A", "B", "C", "D"].iter().map(|s| s.to_string()).collect();
        // the query has C and A (in another order) and an extra gene, but not D
        let var: Vec<String> = ["X", "C", "A"].iter().map(|s| s.to_string()).collect();
        let map = align_genes(&fit, &fit_var, &var);
        assert_eq!(map.hvg_index, vec![u32::MAX, 1, 0]);
        assert_eq!(map.missing, vec!["D".to_string()]);
        assert!((map.present_fraction(3) - 2.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn fit_file_round_trips_bit_for_bit() {
        let fit = PcaFit {
            n_obs: 3,
            hvg_genes: vec![0, 2],
            hvg: hvg_seurat(&[0.1, 1.0 / 3.0, 2.0], &[0.5, 1.0, 0.0], 2),
            mean: vec![0.1 + 0.2, f64::MIN_POSITIVE],
            components: vec![1.0 / 7.0, -2.0 / 3.0],
            variance: vec![std::f64::consts::PI],
            variance_ratio: vec![1e-300],
            size_factors: vec![0.1, 1.0 / 3.0, 7.0],
            target_sum: 1e4,
            timings: vec![("gene statistics".into(), 0.5)],
        };
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("fit.json");
        fit.save(&p).unwrap();
        let back = PcaFit::load(&p).unwrap();
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back.components), bits(&fit.components));
        assert_eq!(bits(&back.mean), bits(&fit.mean));
        assert_eq!(bits(&back.hvg.dispersions), bits(&fit.hvg.dispersions), "NaN survives");
        assert_eq!(back.size_factors.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), fit.size_factors.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        assert_eq!(back.hvg_genes, fit.hvg_genes);
    }
}
