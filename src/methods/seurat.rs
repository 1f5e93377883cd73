//! Seurat v3 anchor-based integration with CCA anchors.
//!
//! Stuart T, Butler A, Hoffman P, et al., Comprehensive Integration of Single-Cell Data,
//! Cell 2019, doi:10.1016/j.cell.2019.05.031. Upstream: satijalab/seurat, `R/integration.R`
//! (`FindIntegrationAnchors`, `FindAnchors`, `FindAnchorPairs`, `FilterAnchors`,
//! `ScoreAnchors`, `TopDimFeatures`, `IntegrateData` -> `PairwiseIntegrateReference`,
//! `RunIntegration`, `FindIntegrationMatrix`, `FindWeights`, `TransformDataMatrix`,
//! `CountAnchors`, `BuildSampleTree`), `R/dimensional_reduction.R` (`RunCCA`, `L2Dim`) and
//! `src/integration.cpp` (`FindWeightsC`). Written from a reading of that code, not copied.
//!
//! The steps, each a pure function on arrays below:
//! 1. features: per-batch variable genes ranked, then [`select_integration_features`];
//! 2. per batch, [`scale_data`] (centre, unit variance, clip at 10) of the log-normalised data;
//! 3. for every pair of batches: [`cca`] (SVD of the cross-product of the per-cell
//!    standardised matrices), L2-normalised canonical vectors, [`find_anchor_pairs`] (mutual
//!    nearest neighbours, `k.anchor`), [`filter_anchors`] (the partner must be among the
//!    `k.filter` nearest in the L2-normalised expression of the top CCA-loading genes) and
//!    [`score_anchors`] (shared neighbours, rescaled between the 0.01 and 0.9 quantiles);
//! 4. the merge order: [`sample_tree`] (complete-linkage clustering of 1 / anchor similarity);
//! 5. each merge: PCA of the scaled merged data, [`anchor_weights`] (Gaussian kernel on the
//!    distance to the `k.weight` nearest anchors, times the anchor score) and [`correct`]
//!    (the query minus the weighted anchor difference vectors);
//! 6. the integrated data is scaled and reduced by PCA (`npcs`) -> the embedding.
//!
//! Departures from R are listed in `docs/seurat.md`. Memory: the selected features are held
//! dense (cells x features, float32); neighbour searches are exact and blocked per query cell,
//! so no cells x cells matrix is ever formed (the CCA cross-product is applied implicitly).

use rayon::prelude::*;

use crate::linalg::jacobi_eigh;
use crate::metrics::linalg::lanczos_largest_magnitude;
use crate::metrics::neighbors::NeighborsResults;

#[derive(Debug, thiserror::Error)]
pub enum SeuratError {
    #[error("seurat: {0}")]
    Input(String),
}

type Result<T> = std::result::Result<T, SeuratError>;

/// Seurat's defaults (`FindIntegrationAnchors`, `IntegrateData`, `RunPCA`).
#[derive(Debug, Clone)]
pub struct SeuratOptions {
    /// `anchor.features` (SelectIntegrationFeatures nfeatures).
    pub n_features: usize,
    /// `dims` = 1:30: CCA components for the anchors and PCA components for the weights.
    pub dims: usize,
    pub k_anchor: usize,
    pub k_filter: usize,
    pub k_score: usize,
    pub max_features: usize,
    pub k_weight: usize,
    pub sd_weight: f64,
    /// `ScaleData(scale.max = 10)`.
    pub scale_max: f64,
    /// Components of the final PCA (`RunPCA(npcs = 30)`).
    pub npcs: usize,
    /// Seed of the Lanczos start vectors (CCA and PCA); the result does not depend on it beyond
    /// the signs fixed below and rounding.
    pub seed: u64,
}

impl Default for SeuratOptions {
    fn default() -> Self {
        SeuratOptions { n_features: 2000, dims: 30, k_anchor: 5, k_filter: 200, k_score: 30, max_features: 200, k_weight: 100, sd_weight: 1.0, scale_max: 10.0, npcs: 30, seed: 0 }
    }
}

/// One anchor: a cell of the first dataset, a cell of the second, and its score in [0, 1].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Anchor {
    pub cell1: u32,
    pub cell2: u32,
    pub score: f64,
}

// ---------------------------------------------------------------------------------------------
// Features

/// `SelectIntegrationFeatures`: `ranked[b]` lists the variable features of batch `b`, most
/// variable first. Features are ordered by the number of batches in which they are variable
/// (most first); the features above the tie value at position `n` come first, ordered by their
/// median rank over the batches that list them, then the tied features by median rank until
/// `n` are chosen. Ties in median rank keep the order of first appearance (R's stable sort by
/// name differs; see docs/seurat.md).
pub fn select_integration_features(ranked: &[Vec<usize>], n: usize) -> Vec<usize> {
    use std::collections::BTreeMap;
    let mut count: BTreeMap<usize, usize> = BTreeMap::new();
    let mut ranks: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    for list in ranked {
        for (r, &f) in list.iter().enumerate() {
            *count.entry(f).or_default() += 1;
            ranks.entry(f).or_default().push((r + 1) as f64);
        }
    }
    if count.is_empty() || n == 0 {
        return Vec::new();
    }
    let mut by_count: Vec<(usize, usize)> = count.iter().map(|(&f, &c)| (f, c)).collect();
    by_count.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let tie_val = by_count[n.min(by_count.len()) - 1].1;
    let median = |f: usize| -> f64 {
        let mut v = ranks[&f].clone();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let m = v.len();
        if m % 2 == 1 {
            v[m / 2]
        } else {
            (v[m / 2 - 1] + v[m / 2]) / 2.0
        }
    };
    let mut above: Vec<(usize, f64)> = by_count.iter().filter(|x| x.1 > tie_val).map(|x| (x.0, median(x.0))).collect();
    above.sort_by(|a, b| a.1.partial_cmp(&b.1).unwrap().then(a.0.cmp(&b.0)));
    let mut tied: Vec<(usize, f64)> = by_count.iter().filter(|x| x.1 == tie_val).map(|x| (x.0, median(x.0))).collect();
    tied.sort_by(|a, b| a.1.partial_cmp(&b.1).unwrap().then(a.0.cmp(&b.0)));
    let mut out: Vec<usize> = above.into_iter().map(|x| x.0).collect();
    let room = n.saturating_sub(out.len());
    out.extend(tied.into_iter().take(room).map(|x| x.0));
    out
}

// ---------------------------------------------------------------------------------------------
// Scaling and small linear algebra

/// `ScaleData` on the rows `cells` of `x` (`n x f` row-major): each feature centred and divided
/// by its standard deviation (ddof 1) over those cells, values above `scale_max` clipped (R clips
/// only from above). A feature without variance scales to 0. Returns the scaled rows
/// (`cells.len() x f`, float64) and, per feature, whether it varies.
pub fn scale_data(x: &[f32], f: usize, cells: &[usize], scale_max: f64) -> (Vec<f64>, Vec<bool>) {
    let m = cells.len();
    let mut mean = vec![0f64; f];
    for &c in cells {
        for (j, v) in x[c * f..(c + 1) * f].iter().enumerate() {
            mean[j] += *v as f64;
        }
    }
    mean.iter_mut().for_each(|v| *v /= m.max(1) as f64);
    let mut ss = vec![0f64; f];
    for &c in cells {
        for (j, v) in x[c * f..(c + 1) * f].iter().enumerate() {
            ss[j] += (*v as f64 - mean[j]).powi(2);
        }
    }
    let sd: Vec<f64> = ss.iter().map(|s| if m > 1 { (s / (m - 1) as f64).sqrt() } else { 0.0 }).collect();
    let varies: Vec<bool> = sd.iter().map(|&s| s > 0.0 && s.is_finite()).collect();
    let mut out = vec![0f64; m * f];
    out.par_chunks_mut(f.max(1)).zip(cells.par_iter()).for_each(|(row, &c)| {
        for j in 0..f {
            if varies[j] {
                row[j] = ((x[c * f + j] as f64 - mean[j]) / sd[j]).min(scale_max);
            }
        }
    });
    (out, varies)
}

/// Rows of `a` (`n x d`) scaled to unit Euclidean length; zero rows stay zero (`L2Norm`).
pub fn l2_rows(a: &mut [f64], d: usize) {
    a.par_chunks_mut(d.max(1)).for_each(|r| {
        let s = r.iter().map(|v| v * v).sum::<f64>().sqrt();
        if s > 0.0 && s.is_finite() {
            r.iter_mut().for_each(|v| *v /= s);
        } else {
            r.iter_mut().for_each(|v| *v = 0.0);
        }
    });
}

/// y = A x for `A` row-major `r x c`.
fn matvec(a: &[f64], r: usize, c: usize, x: &[f64], y: &mut [f64]) {
    debug_assert_eq!(a.len(), r * c);
    y.par_iter_mut().enumerate().for_each(|(i, yi)| *yi = crate::linalg::dot(&a[i * c..(i + 1) * c], x));
}

/// y = A^T x for `A` row-major `r x c` (x of length r, y of length c).
fn matvec_t(a: &[f64], r: usize, c: usize, x: &[f64], y: &mut [f64]) {
    let chunk = 64usize;
    let parts: Vec<Vec<f64>> = (0..r.div_ceil(chunk))
        .into_par_iter()
        .map(|b| {
            let mut acc = vec![0f64; c];
            for i in b * chunk..((b + 1) * chunk).min(r) {
                let xi = x[i];
                if xi != 0.0 {
                    for (o, v) in acc.iter_mut().zip(&a[i * c..(i + 1) * c]) {
                        *o += xi * v;
                    }
                }
            }
            acc
        })
        .collect();
    y.iter_mut().for_each(|v| *v = 0.0);
    for p in parts {
        y.iter_mut().zip(p).for_each(|(o, v)| *o += v);
    }
}

/// The top singular triplets of an implicit `r x c` matrix M, given `mv` (x -> M x) and `mtv`
/// (y -> M^T y): eigen-decomposition of the Gram matrix on the smaller side (dense Jacobi when
/// that side is small, else Lanczos). Components with a singular value below 1e-8 of the largest
/// are dropped (the matrix has lower rank). Returns (sigma, U `r x k`, V `c x k`), row-major.
fn top_svd<F, G>(r: usize, c: usize, k: usize, mv: F, mtv: G, seed: u64) -> (Vec<f64>, Vec<f64>, Vec<f64>)
where
    F: Fn(&[f64], &mut [f64]) + Sync,
    G: Fn(&[f64], &mut [f64]) + Sync,
{
    let left = r <= c; // Gram on the rows: M M^T
    let m = r.min(c);
    let gram = |x: &[f64], y: &mut [f64]| {
        if left {
            let mut t = vec![0f64; c];
            mtv(x, &mut t);
            mv(&t, y);
        } else {
            let mut t = vec![0f64; r];
            mv(x, &mut t);
            mtv(&t, y);
        }
    };
    let k = k.min(m);
    let (vals, vecs): (Vec<f64>, Vec<f64>) = if m <= 64 || k + 1 >= m {
        // dense Gram from the basis vectors
        let mut g = vec![0f64; m * m];
        let mut e = vec![0f64; m];
        let mut y = vec![0f64; m];
        for j in 0..m {
            e.iter_mut().for_each(|v| *v = 0.0);
            e[j] = 1.0;
            gram(&e, &mut y);
            for i in 0..m {
                g[i * m + j] = y[i];
            }
        }
        for i in 0..m {
            for j in 0..i {
                let s = 0.5 * (g[i * m + j] + g[j * m + i]);
                g[i * m + j] = s;
                g[j * m + i] = s;
            }
        }
        let (w, v) = jacobi_eigh(&g, m);
        // columns -> first k columns, m x k
        let mut out = vec![0f64; m * k];
        for i in 0..m {
            for j in 0..k {
                out[i * k + j] = v[i * m + j];
            }
        }
        (w[..k].to_vec(), out)
    } else {
        lanczos_largest_magnitude(m, k, gram, seed)
    };
    let smax = vals.first().copied().unwrap_or(0.0).max(0.0).sqrt();
    let keep: Vec<usize> = (0..k).filter(|&j| vals[j] > 0.0 && vals[j].sqrt() > 1e-8 * smax).collect();
    let kk = keep.len();
    let sigma: Vec<f64> = keep.iter().map(|&j| vals[j].sqrt()).collect();
    let (n_other, mut small, mut other) = if left { (c, vec![0f64; r * kk], vec![0f64; c * kk]) } else { (r, vec![0f64; c * kk], vec![0f64; r * kk]) };
    for (jj, &j) in keep.iter().enumerate() {
        let vec_j: Vec<f64> = (0..m).map(|i| vecs[i * k + j]).collect();
        let mut o = vec![0f64; n_other];
        if left {
            mtv(&vec_j, &mut o);
        } else {
            mv(&vec_j, &mut o);
        }
        for i in 0..m {
            small[i * kk + jj] = vec_j[i];
        }
        for i in 0..n_other {
            other[i * kk + jj] = o[i] / sigma[jj];
        }
    }
    if left {
        (sigma, small, other)
    } else {
        (sigma, other, small)
    }
}

/// Canonical correlation vectors of a pair of datasets.
#[derive(Debug, Clone)]
pub struct Cca {
    /// Number of components (may be fewer than asked when a dataset has few cells).
    pub k: usize,
    /// Canonical vectors of the first dataset's cells, `n1 x k`.
    pub u: Vec<f64>,
    /// Canonical vectors of the second dataset's cells, `n2 x k`.
    pub v: Vec<f64>,
    /// Singular values of the cross-product.
    pub d: Vec<f64>,
}

/// Each row (cell) of `a` (`n x f`) centred and divided by its standard deviation (ddof 1)
/// over the features: Seurat's `Standardize` on the feature x cell matrix's columns.
pub fn standardize_rows(a: &mut [f64], f: usize) {
    a.par_chunks_mut(f.max(1)).for_each(|r| {
        let m = r.iter().sum::<f64>() / f as f64;
        let s = (r.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (f as f64 - 1.0)).sqrt();
        r.iter_mut().for_each(|v| *v = if s > 0.0 { (*v - m) / s } else { 0.0 });
    });
}

/// `RunCCA` (standardize = TRUE): `a` (`n1 x f`) and `b` (`n2 x f`) hold the scaled data of
/// two datasets over the same features, cells in rows. Each cell is standardised over the
/// features, the cross-product M = A B^T (`n1 x n2`) is decomposed by a truncated SVD
/// (`num_cc` components), and each component's sign is set so that its first entry (the
/// first cell of `a`) is non-negative. M is never formed.
pub fn cca(a: &[f64], n1: usize, b: &[f64], n2: usize, f: usize, num_cc: usize, seed: u64) -> Cca {
    let mut a = a.to_vec();
    let mut b = b.to_vec();
    standardize_rows(&mut a, f);
    standardize_rows(&mut b, f);
    let mv = |x: &[f64], y: &mut [f64]| {
        // y = A (B^T x), x of length n2
        let mut t = vec![0f64; f];
        matvec_t(&b, n2, f, x, &mut t);
        matvec(&a, n1, f, &t, y);
    };
    let mtv = |x: &[f64], y: &mut [f64]| {
        // y = B (A^T x), x of length n1
        let mut t = vec![0f64; f];
        matvec_t(&a, n1, f, x, &mut t);
        matvec(&b, n2, f, &t, y);
    };
    let (d, mut u, mut v) = top_svd(n1, n2, num_cc, mv, mtv, seed);
    let k = d.len();
    for j in 0..k {
        if u[j] < 0.0 {
            for i in 0..n1 {
                u[i * k + j] = -u[i * k + j];
            }
            for i in 0..n2 {
                v[i * k + j] = -v[i * k + j];
            }
        }
    }
    Cca { k, u, v, d }
}

/// PCA of already-centred data `x` (`n x f`, float64) as `RunPCA` does on scaled data: the top
/// `npcs` right singular vectors; returns the cell scores (`n x k`, = U diag(d)) and k. The
/// sign of each component is set so that its largest-magnitude loading is positive.
pub fn pca_scores(x: &[f64], n: usize, f: usize, npcs: usize, seed: u64) -> (Vec<f64>, usize) {
    let mv = |v: &[f64], y: &mut [f64]| matvec(x, n, f, v, y);
    let mtv = |u: &[f64], y: &mut [f64]| matvec_t(x, n, f, u, y);
    let (d, u, v) = top_svd(n, f, npcs, mv, mtv, seed);
    let k = d.len();
    let mut scores = vec![0f64; n * k];
    for j in 0..k {
        let mut best = 0.0f64;
        for i in 0..f {
            let l = v[i * k + j];
            if l.abs() > best.abs() {
                best = l;
            }
        }
        let s = if best < 0.0 { -1.0 } else { 1.0 };
        for i in 0..n {
            scores[i * k + j] = s * u[i * k + j] * d[j];
        }
    }
    (scores, k)
}

// ---------------------------------------------------------------------------------------------
// Neighbours

/// Exact k nearest rows of `data` (`nd x d`) for every row of `query` (`nq x d`), Euclidean,
/// nearest first, ties by the smaller index. Blocked per query row: memory O(nd) per thread.
pub fn knn_query(data: &[f64], nd: usize, query: &[f64], nq: usize, d: usize, k: usize) -> NeighborsResults {
    let k = k.min(nd);
    let mut idx = vec![0u32; nq * k];
    let mut dist = vec![0f32; nq * k];
    if k == 0 {
        return NeighborsResults { indices: idx, distances: dist, n: nq, k };
    }
    idx.par_chunks_mut(k).zip(dist.par_chunks_mut(k)).enumerate().for_each(|(q, (ir, dr))| {
        let qv = &query[q * d..(q + 1) * d];
        let mut all: Vec<(f64, u32)> = (0..nd)
            .map(|j| {
                let r = &data[j * d..(j + 1) * d];
                let s: f64 = qv.iter().zip(r).map(|(a, b)| (a - b) * (a - b)).sum();
                (s, j as u32)
            })
            .collect();
        let cmp = |a: &(f64, u32), b: &(f64, u32)| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal).then(a.1.cmp(&b.1));
        if k < nd {
            all.select_nth_unstable_by(k - 1, cmp);
            all.truncate(k);
        }
        all.sort_by(cmp);
        for (t, (s, j)) in all.into_iter().enumerate() {
            ir[t] = j;
            dr[t] = s.sqrt() as f32;
        }
    });
    NeighborsResults { indices: idx, distances: dist, n: nq, k }
}

// ---------------------------------------------------------------------------------------------
// Anchors

/// `FindAnchorPairs`: (a, b) is an anchor when b is among the `k_anchor` nearest cells of a in
/// the second dataset (`nnab`) and a among the `k_anchor` nearest of b in the first (`nnba`).
/// Ordered by a, then by b's rank in a's list. `k_anchor` is capped at the neighbours stored.
pub fn find_anchor_pairs(nnab: &NeighborsResults, nnba: &NeighborsResults, k_anchor: usize) -> Vec<Anchor> {
    let k = k_anchor.min(nnab.k).min(nnba.k);
    let mut out = Vec::new();
    for a in 0..nnab.n {
        for &b in &nnab.row(a)[..k] {
            if nnba.row(b as usize)[..k].contains(&(a as u32)) {
                out.push(Anchor { cell1: a as u32, cell2: b, score: 1.0 });
            }
        }
    }
    out
}

/// R's `round` (half to even) for small non-negative halves.
fn round_half_even(x: f64) -> usize {
    let f = x.floor();
    let diff = x - f;
    let r = if diff > 0.5 {
        f + 1.0
    } else if diff < 0.5 {
        f
    } else if (f as i64) % 2 == 0 {
        f
    } else {
        f + 1.0
    };
    r as usize
}

/// `TopDimFeatures(features.per.dim = 100, balanced = TRUE)` on feature loadings `load`
/// (`f x k`): for y = 1..100, the union over dimensions of the round(y/2) most positive and
/// round(y/2) most negative features; the largest y whose union has fewer than
/// max(2k, max_features) features is used. Returns feature indices (0..f) in order of first
/// appearance (dimension by dimension, positive then negative).
pub fn top_dim_features(load: &[f64], f: usize, k: usize, max_features: usize) -> Vec<usize> {
    let maxf = max_features.max(2 * k);
    // per dimension, features ordered by decreasing loading
    let orders: Vec<Vec<usize>> = (0..k)
        .map(|j| {
            let mut o: Vec<usize> = (0..f).collect();
            o.sort_by(|&a, &b| load[b * k + j].partial_cmp(&load[a * k + j]).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
            o
        })
        .collect();
    let union_for = |y: usize| -> Vec<usize> {
        let num = round_half_even(y as f64 / 2.0).min(f);
        let mut seen = vec![false; f];
        let mut out = Vec::new();
        for o in &orders {
            let pos = &o[..num];
            let neg: Vec<usize> = o[f - num..].iter().rev().copied().collect();
            let neg = if pos == neg.as_slice() { Vec::new() } else { neg };
            for &g in pos.iter().chain(neg.iter()) {
                if !seen[g] {
                    seen[g] = true;
                    out.push(g);
                }
            }
        }
        out
    };
    let mut best_y = 1;
    let mut best_n = 0usize;
    for y in 1..=100 {
        let n = union_for(y).len();
        if n >= maxf {
            break;
        }
        if n > best_n {
            best_n = n;
            best_y = y;
        }
    }
    union_for(best_y)
}

/// `FilterAnchors`: keep an anchor (a, b) when b is among the `k_filter` nearest cells of a in
/// the second dataset, in the space of `x1`/`x2` (cells in rows over the filter features,
/// already L2-normalised per cell). When either dataset has fewer than `k_filter` cells all
/// anchors are kept, as Seurat does (with a warning there).
pub fn filter_anchors(anchors: &[Anchor], x1: &[f64], n1: usize, x2: &[f64], n2: usize, d: usize, k_filter: usize) -> Vec<Anchor> {
    if n1.min(n2) < k_filter {
        return anchors.to_vec();
    }
    let nn = knn_query(x2, n2, x1, n1, d, k_filter);
    anchors.iter().filter(|a| nn.row(a.cell1 as usize).contains(&a.cell2)).copied().collect()
}

/// R's `quantile(type = 7)` of unsorted values.
pub fn quantile7(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let h = (s.len() - 1) as f64 * p;
    let lo = h.floor() as usize;
    let hi = (lo + 1).min(s.len() - 1);
    s[lo] + (h - lo as f64) * (s[hi] - s[lo])
}

/// `ScoreAnchors`: the score of (a, b) is the number of shared cells between a's neighbourhood
/// (its `k_score` nearest in its own dataset, itself included as `nnaa` holds it first, and its
/// `k_score` nearest in the other) and b's (likewise), with dataset-2 cells offset by `n1`.
/// Scores are rescaled so that the 0.01 quantile maps to 0 and the 0.9 quantile to 1, then
/// clipped to [0, 1]. When the two quantiles coincide (R would divide by zero) every score is 1.
pub fn score_anchors(anchors: &[Anchor], nnaa: &NeighborsResults, nnab: &NeighborsResults, nnba: &NeighborsResults, nnbb: &NeighborsResults, k_score: usize) -> Vec<Anchor> {
    if anchors.is_empty() {
        return Vec::new();
    }
    let n1 = nnaa.n as u32;
    let set_a = |a: usize| -> Vec<u32> {
        let mut s: Vec<u32> = nnaa.row(a)[..k_score.min(nnaa.k)].to_vec();
        s.extend(nnab.row(a)[..k_score.min(nnab.k)].iter().map(|&j| j + n1));
        s
    };
    let set_b = |b: usize| -> Vec<u32> {
        let mut s: Vec<u32> = nnba.row(b)[..k_score.min(nnba.k)].to_vec();
        s.extend(nnbb.row(b)[..k_score.min(nnbb.k)].iter().map(|&j| j + n1));
        s
    };
    let raw: Vec<f64> = anchors
        .iter()
        .map(|an| {
            let mut sa = set_a(an.cell1 as usize);
            sa.sort_unstable();
            sa.dedup();
            let mut sb = set_b(an.cell2 as usize);
            sb.sort_unstable();
            sb.dedup();
            sa.iter().filter(|x| sb.binary_search(x).is_ok()).count() as f64
        })
        .collect();
    let hi = quantile7(&raw, 0.9);
    let lo = quantile7(&raw, 0.01);
    anchors
        .iter()
        .zip(&raw)
        .map(|(an, &s)| {
            let score = if hi > lo { ((s - lo) / (hi - lo)).clamp(0.0, 1.0) } else { 1.0 };
            Anchor { score, ..*an }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Merge order

/// One merge of the sample tree: the datasets on the reference side and on the query side.
#[derive(Debug, Clone, PartialEq)]
pub struct Merge {
    pub reference: Vec<usize>,
    pub query: Vec<usize>,
}

/// `CountAnchors` + `BuildSampleTree` + the reference choice of `PairwiseIntegrateReference`.
/// `pair_anchors[i][j]` (i < j) is the number of anchors found between datasets i and j (one
/// direction; R counts both directions, so the similarity is 2 x that / min(n_i, n_j)).
/// Complete-linkage clustering of the distance 1 / similarity (a pair without anchors gets a
/// distance above every finite one), merges listed in R's `hclust$merge` order (at equal height
/// the first pair in row-major order merges first); in each merge the side with more cells is
/// the reference (the first side on a tie).
pub fn sample_tree(pair_anchors: &[Vec<usize>], sizes: &[usize]) -> Vec<Merge> {
    let b = sizes.len();
    let mut dist = vec![vec![0f64; b]; b];
    let mut max_finite = 0f64;
    for i in 0..b {
        for j in (i + 1)..b {
            let cnt = pair_anchors[i][j] as f64 * 2.0;
            let sim = cnt / sizes[i].min(sizes[j]).max(1) as f64;
            let d = if sim > 0.0 { 1.0 / sim } else { f64::INFINITY };
            if d.is_finite() {
                max_finite = max_finite.max(d);
            }
            dist[i][j] = d;
            dist[j][i] = d;
        }
    }
    let big = (max_finite + 1.0) * 2.0;
    for row in dist.iter_mut() {
        for v in row.iter_mut() {
            if v.is_infinite() {
                *v = big;
            }
        }
    }
    // clusters: (R id: negative singleton / positive step, members)
    let mut clusters: Vec<(i64, Vec<usize>)> = (0..b).map(|i| (-(i as i64) - 1, vec![i])).collect();
    let mut cd = dist.clone();
    let mut merges: Vec<(i64, i64)> = Vec::new();
    let mut members: Vec<Vec<usize>> = Vec::new();
    for step in 1..b {
        let m = clusters.len();
        let (mut bi, mut bj, mut bd) = (0, 1, f64::INFINITY);
        for i in 0..m {
            for j in (i + 1)..m {
                if cd[i][j] < bd {
                    bd = cd[i][j];
                    bi = i;
                    bj = j;
                }
            }
        }
        let (ida, idb) = (clusters[bi].0, clusters[bj].0);
        // R: singletons (negative) first; two singletons by index; two clusters by step
        let pair = match (ida < 0, idb < 0) {
            (true, true) => (ida.max(idb), ida.min(idb)),
            (true, false) => (ida, idb),
            (false, true) => (idb, ida),
            (false, false) => (ida.min(idb), ida.max(idb)),
        };
        merges.push(pair);
        let mut mem = clusters[bi].1.clone();
        mem.extend(clusters[bj].1.iter().copied());
        members.push(mem.clone());
        // complete linkage: new distance = max
        let newd: Vec<f64> = (0..m).map(|t| cd[bi][t].max(cd[bj][t])).collect();
        // replace bi by the new cluster, remove bj
        clusters[bi] = (step as i64, mem);
        for t in 0..m {
            cd[bi][t] = newd[t];
            cd[t][bi] = newd[t];
        }
        cd[bi][bi] = 0.0;
        clusters.remove(bj);
        cd.remove(bj);
        for row in cd.iter_mut() {
            row.remove(bj);
        }
    }
    let side = |id: i64| -> Vec<usize> {
        if id < 0 {
            vec![(-id - 1) as usize]
        } else {
            members[(id - 1) as usize].clone()
        }
    };
    merges
        .iter()
        .map(|&(x, y)| {
            let (r, q) = (side(x), side(y));
            let nr: usize = r.iter().map(|&d| sizes[d]).sum();
            let nq: usize = q.iter().map(|&d| sizes[d]).sum();
            if nq > nr {
                Merge { reference: q, query: r }
            } else {
                Merge { reference: r, query: q }
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Weights and correction

/// `FindWeights` + `FindWeightsC`. `nn` holds, for every query cell, its `k` nearest anchor
/// cells (indices into `anchor_cells`, the distinct query-side anchor cells) in the weight space.
/// The distances become 1 - d / d_k (d_k: the k-th, farthest, neighbour; when d_k is 0 every
/// distance counts as 1), and walking the neighbours nearest first, each anchor of that cell adds
/// 1 - exp(-dist x score / (2 / sd)^2), until k anchors are used. Each cell's weights are divided
/// by their sum (when the sum is 0, as for scores all 0, the used anchors get equal weights).
/// `rows_of[c]` lists the anchor rows whose query cell is `anchor_cells[c]`.
/// Returns, per query cell, (anchor row, weight) pairs summing to 1.
pub fn anchor_weights(nn: &NeighborsResults, rows_of: &[Vec<usize>], scores: &[f64], sd: f64) -> Vec<Vec<(usize, f64)>> {
    let k = nn.k;
    let denom = (2.0 / sd).powi(2);
    (0..nn.n)
        .into_par_iter()
        .map(|i| {
            let d = nn.row_dist(i);
            let dk = d[k - 1] as f64;
            let mut w: Vec<(usize, f64)> = Vec::new();
            'outer: for (t, &c) in nn.row(i).iter().enumerate() {
                let dist = if dk > 0.0 { 1.0 - d[t] as f64 / dk } else { 1.0 };
                for &row in &rows_of[c as usize] {
                    if w.len() >= k {
                        break 'outer;
                    }
                    w.push((row, 1.0 - (-dist * scores[row] / denom).exp()));
                }
            }
            let s: f64 = w.iter().map(|x| x.1).sum();
            if s > 0.0 {
                w.iter_mut().for_each(|x| x.1 /= s);
            } else {
                let e = 1.0 / w.len().max(1) as f64;
                w.iter_mut().for_each(|x| x.1 = e);
            }
            w
        })
        .collect()
}

/// `FindIntegrationMatrix` + `TransformDataMatrix` for one query cell: `q - sum_a w_a (q_a - r_a)`,
/// where (q_a - r_a) is row a of `integration` (`n_anchors x f`).
pub fn correct(q: &[f32], weights: &[(usize, f64)], integration: &[f64], f: usize) -> Vec<f32> {
    let mut out: Vec<f64> = q.iter().map(|&v| v as f64).collect();
    for &(a, w) in weights {
        for (o, v) in out.iter_mut().zip(&integration[a * f..(a + 1) * f]) {
            *o -= w * v;
        }
    }
    out.into_iter().map(|v| v as f32).collect()
}

// ---------------------------------------------------------------------------------------------
// The whole method

/// What was capped or skipped because a dataset is small, for the user and the provenance.
#[derive(Debug, Clone, Default)]
pub struct SeuratResult {
    /// `n x npcs` PCA of the integrated data, row-major.
    pub embedding: Vec<f32>,
    pub npcs: usize,
    /// Anchors per pair of batches after filtering (one direction).
    pub n_anchors: usize,
    pub merges: Vec<Merge>,
    pub notes: Vec<String>,
}

/// Anchors of one pair, in dataset-local cell indices, and the CCA width used.
struct PairAnchors {
    i: usize,
    j: usize,
    anchors: Vec<Anchor>,
    filtered: bool,
}

fn take_rows(x: &[f64], f: usize, rows: &[usize], cols: &[usize]) -> Vec<f64> {
    let mut out = Vec::with_capacity(rows.len() * cols.len());
    for &r in rows {
        out.extend(cols.iter().map(|&c| x[r * f + c]));
    }
    out
}

fn anchors_for_pair(x: &[f32], f: usize, cells: &[Vec<usize>], scaled: &[(Vec<f64>, Vec<bool>)], i: usize, j: usize, o: &SeuratOptions) -> PairAnchors {
    let (n1, n2) = (cells[i].len(), cells[j].len());
    // CheckFeatures: drop features without variance in either dataset
    let feats: Vec<usize> = (0..f).filter(|&g| scaled[i].1[g] && scaled[j].1[g]).collect();
    let fu = feats.len();
    let all1: Vec<usize> = (0..n1).collect();
    let all2: Vec<usize> = (0..n2).collect();
    let a = take_rows(&scaled[i].0, f, &all1, &feats);
    let b = take_rows(&scaled[j].0, f, &all2, &feats);
    let num_cc = o.dims.min(n1).min(n2).min(fu);
    let c = cca(&a, n1, &b, n2, fu, num_cc, o.seed);
    let k = c.k;
    if k == 0 {
        return PairAnchors { i, j, anchors: Vec::new(), filtered: false };
    }
    // feature loadings (ProjectDim on the scaled data and the raw canonical vectors)
    let mut load = vec![0f64; fu * k];
    for (rows, emb, n) in [(&a, &c.u, n1), (&b, &c.v, n2)] {
        for cidx in 0..n {
            let r = &rows[cidx * fu..(cidx + 1) * fu];
            let e = &emb[cidx * k..(cidx + 1) * k];
            for g in 0..fu {
                let rv = r[g];
                if rv != 0.0 {
                    for t in 0..k {
                        load[g * k + t] += rv * e[t];
                    }
                }
            }
        }
    }
    let mut e1 = c.u.clone();
    let mut e2 = c.v.clone();
    l2_rows(&mut e1, k);
    l2_rows(&mut e2, k);
    let kn = o.k_anchor.max(o.k_score);
    let nnaa = knn_query(&e1, n1, &e1, n1, k, kn + 1);
    let nnbb = knn_query(&e2, n2, &e2, n2, k, kn + 1);
    let nnab = knn_query(&e2, n2, &e1, n1, k, kn);
    let nnba = knn_query(&e1, n1, &e2, n2, k, kn);
    let pairs = find_anchor_pairs(&nnab, &nnba, o.k_anchor);
    let filtered = n1.min(n2) >= o.k_filter;
    let pairs = if filtered {
        let top: Vec<usize> = top_dim_features(&load, fu, k, o.max_features).into_iter().map(|t| feats[t]).collect();
        let d = top.len();
        let mut x1 = Vec::with_capacity(n1 * d);
        for &cidx in &cells[i] {
            x1.extend(top.iter().map(|&g| x[cidx * f + g] as f64));
        }
        let mut x2 = Vec::with_capacity(n2 * d);
        for &cidx in &cells[j] {
            x2.extend(top.iter().map(|&g| x[cidx * f + g] as f64));
        }
        l2_rows(&mut x1, d);
        l2_rows(&mut x2, d);
        filter_anchors(&pairs, &x1, n1, &x2, n2, d, o.k_filter)
    } else {
        pairs
    };
    let anchors = score_anchors(&pairs, &nnaa, &nnab, &nnba, &nnbb, o.k_score);
    PairAnchors { i, j, anchors, filtered }
}

/// Integrate the log-normalised data `x` (`n x f`, cells in rows, the selected features) over
/// the batches `batch` (codes 0..n_batches, named `names` in messages). Returns the PCA of the
/// integrated data.
pub fn integrate(x: &[f32], n: usize, f: usize, batch: &[u32], names: &[String], o: &SeuratOptions, progress: &dyn Fn(&str)) -> Result<SeuratResult> {
    let n_batches = names.len();
    if x.len() != n * f || batch.len() != n {
        return Err(SeuratError::Input(format!("data is {} values for {n} cells x {f} features and {} batch codes", x.len(), batch.len())));
    }
    if f < 2 {
        return Err(SeuratError::Input(format!("{f} feature(s) selected; CCA needs at least 2")));
    }
    let mut cells: Vec<Vec<usize>> = vec![Vec::new(); n_batches];
    for (c, &b) in batch.iter().enumerate() {
        cells[b as usize].push(c);
    }
    if let Some(b) = cells.iter().position(|c| c.len() < 2) {
        return Err(SeuratError::Input(format!("batch '{}' has {} cell(s); each batch needs at least 2 cells to be scaled", names[b], cells[b].len())));
    }
    let mut notes = Vec::new();
    let small: Vec<String> = (0..n_batches).filter(|&b| cells[b].len() <= o.dims).map(|b| format!("{} ({} cells)", names[b], cells[b].len())).collect();
    if !small.is_empty() {
        notes.push(format!(
            "{} batch(es) have at most {} cells (Seurat stops there: \"Max dimension too large\"); their pairs use min(dims, cells) CCA dimensions and the neighbour counts are capped at the cells available: batches {}",
            small.len(),
            o.dims,
            small.join(", ")
        ));
    }
    progress("scaling each batch");
    let scaled: Vec<(Vec<f64>, Vec<bool>)> = cells.par_iter().map(|c| scale_data(x, f, c, o.scale_max)).collect();
    let pairs: Vec<(usize, usize)> = (0..n_batches).flat_map(|i| ((i + 1)..n_batches).map(move |j| (i, j))).collect();
    progress(&format!("anchors for {} pairs of batches", pairs.len()));
    let found: Vec<PairAnchors> = pairs.par_iter().map(|&(i, j)| anchors_for_pair(x, f, &cells, &scaled, i, j, o)).collect();
    drop(scaled);
    let n_unfiltered = found.iter().filter(|p| !p.filtered).count();
    if n_unfiltered > 0 {
        notes.push(format!("{n_unfiltered} of {} pairs have a batch with fewer than k.filter = {} cells: all their anchors are kept (as Seurat does)", found.len(), o.k_filter));
    }
    let mut counts = vec![vec![0usize; n_batches]; n_batches];
    // global anchors in both directions: (dataset of cell1, cell1, dataset of cell2, cell2, score)
    let mut all: Vec<(usize, usize, usize, usize, f64)> = Vec::new();
    let mut n_anchors = 0;
    for p in &found {
        counts[p.i][p.j] = p.anchors.len();
        n_anchors += p.anchors.len();
        for a in &p.anchors {
            let (c1, c2) = (cells[p.i][a.cell1 as usize], cells[p.j][a.cell2 as usize]);
            all.push((p.i, c1, p.j, c2, a.score));
        }
    }
    let reversed: Vec<_> = all.iter().map(|&(d1, c1, d2, c2, s)| (d2, c2, d1, c1, s)).collect();
    all.extend(reversed);
    let sizes: Vec<usize> = cells.iter().map(|c| c.len()).collect();
    let merges = sample_tree(&counts, &sizes);
    let mut y = x.to_vec();
    let mut capped_k = 0usize;
    let mut no_anchor = 0usize;
    for (step, m) in merges.iter().enumerate() {
        progress(&format!("merge {}/{}", step + 1, merges.len()));
        let mut in_ref = vec![false; n_batches];
        let mut in_q = vec![false; n_batches];
        m.reference.iter().for_each(|&d| in_ref[d] = true);
        m.query.iter().for_each(|&d| in_q[d] = true);
        let anchors: Vec<(usize, usize, f64)> = all.iter().filter(|a| in_ref[a.0] && in_q[a.2]).map(|a| (a.1, a.3, a.4)).collect();
        let ref_cells: Vec<usize> = m.reference.iter().flat_map(|&d| cells[d].iter().copied()).collect();
        let q_cells: Vec<usize> = m.query.iter().flat_map(|&d| cells[d].iter().copied()).collect();
        if anchors.is_empty() {
            no_anchor += 1;
            continue;
        }
        // integration matrix: query anchor cell minus reference anchor cell
        let mut integ = vec![0f64; anchors.len() * f];
        for (a, &(r, q, _)) in anchors.iter().enumerate() {
            for g in 0..f {
                integ[a * f + g] = y[q * f + g] as f64 - y[r * f + g] as f64;
            }
        }
        let scores: Vec<f64> = anchors.iter().map(|a| a.2).collect();
        // weight space: PCA of the merged, scaled data (RunIntegration with weight.reduction NULL)
        let merged: Vec<usize> = ref_cells.iter().chain(q_cells.iter()).copied().collect();
        let (sc, _) = scale_data(&y, f, &merged, o.scale_max);
        let npcs = o.dims.min(merged.len() - 1).min(f);
        let (pcs, kp) = pca_scores(&sc, merged.len(), f, npcs, o.seed);
        drop(sc);
        let q_off = ref_cells.len();
        let q_pcs = &pcs[q_off * kp..];
        // distinct query-side anchor cells, in order of first appearance
        let mut pos_in_q = vec![usize::MAX; n];
        for (t, &c) in q_cells.iter().enumerate() {
            pos_in_q[c] = t;
        }
        let mut anchor_cells: Vec<usize> = Vec::new();
        let mut slot = std::collections::HashMap::new();
        let mut rows_of: Vec<Vec<usize>> = Vec::new();
        for (a, &(_, q, _)) in anchors.iter().enumerate() {
            let s = *slot.entry(q).or_insert_with(|| {
                anchor_cells.push(q);
                rows_of.push(Vec::new());
                anchor_cells.len() - 1
            });
            rows_of[s].push(a);
        }
        let mut k = o.k_weight.min(anchors.len());
        if k > anchor_cells.len() {
            k = anchor_cells.len();
            capped_k += 1;
        }
        let adata: Vec<f64> = anchor_cells.iter().flat_map(|&c| q_pcs[pos_in_q[c] * kp..(pos_in_q[c] + 1) * kp].iter().copied()).collect();
        let nn = knn_query(&adata, anchor_cells.len(), q_pcs, q_cells.len(), kp, k);
        let w = anchor_weights(&nn, &rows_of, &scores, o.sd_weight);
        let corrected: Vec<Vec<f32>> = q_cells.par_iter().zip(w.par_iter()).map(|(&c, wc)| correct(&y[c * f..(c + 1) * f], wc, &integ, f)).collect();
        for (&c, row) in q_cells.iter().zip(corrected) {
            y[c * f..(c + 1) * f].copy_from_slice(&row);
        }
    }
    if capped_k > 0 {
        notes.push(format!("{capped_k} merge(s) had fewer distinct anchor cells than k.weight = {} (Seurat stops there): k.weight was lowered to the anchor cells available", o.k_weight));
    }
    if no_anchor > 0 {
        notes.push(format!("{no_anchor} merge(s) found no anchors between their two sides: those query cells are left uncorrected"));
    }
    progress("PCA of the integrated data");
    let all_cells: Vec<usize> = (0..n).collect();
    let (sc, _) = scale_data(&y, f, &all_cells, o.scale_max);
    drop(y);
    let npcs = o.npcs.min(n - 1).min(f);
    let (pcs, k) = pca_scores(&sc, n, f, npcs, o.seed);
    Ok(SeuratResult { embedding: pcs.iter().map(|&v| v as f32).collect(), npcs: k, n_anchors, merges, notes })
}

/// Per-batch variable features for [`select_integration_features`]: for each batch, the
/// seurat-flavour dispersion ranking (scanpy's `highly_variable_genes(flavor="seurat")`, the
/// project's `hvg_seurat`) of the normalised values, most variable first, `n_top` at most.
/// `mean`/`var` are per batch and gene, of expm1 of the log-normalised data (ddof 1).
pub fn batch_variable_features(mean: &[f64], var: &[f64], n_top: usize) -> Vec<usize> {
    let h = crate::methods::pca::hvg_seurat(mean, var, n_top);
    let mut sel: Vec<usize> = (0..mean.len()).filter(|&g| h.selected[g]).collect();
    sel.sort_by(|&a, &b| h.dispersions_norm[b].partial_cmp(&h.dispersions_norm[a]).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
    sel.truncate(n_top);
    sel
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn rng(seed: u64) -> rand_chacha::ChaCha8Rng {
        rand_chacha::ChaCha8Rng::seed_from_u64(seed)
    }

    #[test]
    fn features_ranked_by_batch_count_then_median_rank() {
        // 7 is variable in all three, 3 and 5 in two, the rest in one
        let ranked = vec![vec![7, 3, 1, 5], vec![5, 7, 2], vec![3, 7, 5, 9]];
        let f = select_integration_features(&ranked, 3);
        // counts: 7:3, 5:3, 3:2 ... tie value at position 3 is 2 -> above: 7 (ranks 1,2,2 -> 2), 5 (4,1,3 -> 3)
        assert_eq!(f, vec![7, 5, 3]);
        let f = select_integration_features(&ranked, 4);
        // tie value 1: above it 7, 5, 3 by median rank (2, 3, 1.5); then 1 (rank 3), 2 (rank 3),
        // 9 (rank 4) -> 1 (by index on equal median)
        assert_eq!(f, vec![3, 7, 5, 1]);
    }

    #[test]
    fn mnn_anchors_on_a_crafted_case() {
        // dataset 1: cells at 0, 1, 10; dataset 2: cells at 0.1, 9.9, 20 (1-D)
        let a = vec![0.0, 1.0, 10.0];
        let b = vec![0.1, 9.9, 20.0];
        let nnab = knn_query(&b, 3, &a, 3, 1, 1);
        let nnba = knn_query(&a, 3, &b, 3, 1, 1);
        let an = find_anchor_pairs(&nnab, &nnba, 1);
        let pairs: Vec<(u32, u32)> = an.iter().map(|x| (x.cell1, x.cell2)).collect();
        // 0<->0.1 and 10<->9.9 are mutual; 1 -> 0.1 but 0.1 -> 0; 20 -> 10 but 10 -> 9.9
        assert_eq!(pairs, vec![(0, 0), (2, 1)]);
        // with k = 2: 1's two nearest in B are 0.1, 9.9; 0.1's two nearest in A are 0, 1 -> (1, 0) too
        let nnab = knn_query(&b, 3, &a, 3, 1, 2);
        let nnba = knn_query(&a, 3, &b, 3, 1, 2);
        let pairs: Vec<(u32, u32)> = find_anchor_pairs(&nnab, &nnba, 2).iter().map(|x| (x.cell1, x.cell2)).collect();
        // (2, 2) is not mutual: 10's two nearest in B are 9.9 and 0.1 (9.9 away), not 20 (10 away)
        assert_eq!(pairs, vec![(0, 0), (1, 0), (1, 1), (2, 1)]);
    }

    #[test]
    fn quantiles_match_r_type_7() {
        let v = [3.0, 1.0, 2.0, 10.0, 4.0];
        // R: quantile(c(3,1,2,10,4), c(0.01, 0.9)) = 1.04, 7.6
        assert!((quantile7(&v, 0.01) - 1.04).abs() < 1e-12);
        assert!((quantile7(&v, 0.9) - 7.6).abs() < 1e-12);
    }

    #[test]
    fn anchor_scores_count_shared_neighbours_and_rescale() {
        // two datasets of 4 cells on a line, B = A shifted a little: neighbourhoods agree
        let a: Vec<f64> = vec![0.0, 1.0, 2.0, 3.0];
        let b: Vec<f64> = vec![0.1, 1.1, 2.1, 3.1];
        let nnaa = knn_query(&a, 4, &a, 4, 1, 3);
        let nnbb = knn_query(&b, 4, &b, 4, 1, 3);
        let nnab = knn_query(&b, 4, &a, 4, 1, 2);
        let nnba = knn_query(&a, 4, &b, 4, 1, 2);
        let anchors = find_anchor_pairs(&nnab, &nnba, 1);
        assert_eq!(anchors.len(), 4);
        let scored = score_anchors(&anchors, &nnaa, &nnab, &nnba, &nnbb, 2);
        // A0: {A0, A1, B0, B1} vs B0: {A0, A1, B0, B1} -> 4 shared; A1: {A1, A0 (tie -> lower
        // index), B1, B0} vs B1: {A1, A2, B1, B0} -> 3; A2 vs B2 -> 3; A3 vs B3 -> 4.
        // quantiles of [4, 3, 3, 4]: 0.01 -> 3, 0.9 -> 4, so the scores are 1, 0, 0, 1
        let s: Vec<f64> = scored.iter().map(|x| x.score).collect();
        assert_eq!(s, vec![1.0, 0.0, 0.0, 1.0]);
    }

    #[test]
    fn weights_sum_to_one_and_favour_near_high_score_anchors() {
        let mut r = rng(5);
        let nq = 50;
        let na = 12;
        let d = 3;
        let q: Vec<f64> = (0..nq * d).map(|_| r.gen::<f64>()).collect();
        let anchors_pos: Vec<f64> = (0..na * d).map(|_| r.gen::<f64>()).collect();
        // every anchor cell has one or two anchor rows
        let mut rows_of = Vec::new();
        let mut scores = Vec::new();
        for c in 0..na {
            let mut rows = vec![scores.len()];
            scores.push(r.gen::<f64>());
            if c % 3 == 0 {
                rows.push(scores.len());
                scores.push(r.gen::<f64>());
            }
            rows_of.push(rows);
        }
        let nn = knn_query(&anchors_pos, na, &q, nq, d, 8);
        let w = anchor_weights(&nn, &rows_of, &scores, 1.0);
        for wc in &w {
            assert!(wc.len() <= 8);
            let s: f64 = wc.iter().map(|x| x.1).sum();
            assert!((s - 1.0).abs() < 1e-12, "weights sum to {s}");
            assert!(wc.iter().all(|x| x.1 >= 0.0));
        }
        // the farthest (k-th) neighbour contributes 0: dist = 1 - d_k / d_k
        let far = nn.row(0)[7] as usize;
        let near = nn.row(0)[0] as usize;
        let wf: f64 = w[0].iter().filter(|x| rows_of[far].contains(&x.0)).map(|x| x.1).sum();
        assert_eq!(wf, 0.0);
        // a nearer anchor with the same score weighs more than a farther one
        let scores1 = vec![1.0; scores.len()];
        let w1 = anchor_weights(&nn, &rows_of, &scores1, 1.0);
        let wn: f64 = w1[0].iter().filter(|x| rows_of[near].contains(&x.0)).map(|x| x.1).sum::<f64>() / rows_of[near].len() as f64;
        let second = nn.row(0)[5] as usize;
        let ws: f64 = w1[0].iter().filter(|x| rows_of[second].contains(&x.0)).map(|x| x.1).sum::<f64>() / rows_of[second].len() as f64;
        assert!(wn > ws, "{wn} <= {ws}");
    }

    #[test]
    fn correction_removes_a_constant_shift() {
        // query = reference + shift; anchors pair each query cell with its reference twin
        let mut r = rng(9);
        let n = 40;
        let f = 6;
        let refd: Vec<f32> = (0..n * f).map(|_| r.gen::<f32>() * 3.0).collect();
        let shift: Vec<f32> = (0..f).map(|g| g as f32 * 0.5 - 1.0).collect();
        let q: Vec<f32> = (0..n * f).map(|i| refd[i] + shift[i % f]).collect();
        let anchors: Vec<(usize, usize)> = (0..n).step_by(2).map(|c| (c, c)).collect();
        let mut integ = vec![0f64; anchors.len() * f];
        for (a, &(rc, qc)) in anchors.iter().enumerate() {
            for g in 0..f {
                integ[a * f + g] = q[qc * f + g] as f64 - refd[rc * f + g] as f64;
            }
        }
        let anchor_pos: Vec<f64> = anchors.iter().flat_map(|&(_, qc)| q[qc * f..(qc + 1) * f].iter().map(|&v| v as f64)).collect();
        let qd: Vec<f64> = q.iter().map(|&v| v as f64).collect();
        let nn = knn_query(&anchor_pos, anchors.len(), &qd, n, f, 10);
        let rows_of: Vec<Vec<usize>> = (0..anchors.len()).map(|a| vec![a]).collect();
        let w = anchor_weights(&nn, &rows_of, &vec![0.8; anchors.len()], 1.0);
        for c in 0..n {
            let out = correct(&q[c * f..(c + 1) * f], &w[c], &integ, f);
            for g in 0..f {
                assert!((out[g] - refd[c * f + g]).abs() < 1e-5, "cell {c} feature {g}: {} vs {}", out[g], refd[c * f + g]);
            }
        }
    }

    #[test]
    fn cca_recovers_a_shared_signal_and_is_orthonormal() {
        // two datasets whose cells share a 2-D latent structure over 40 features
        let mut r = rng(1);
        let f = 40;
        let load: Vec<f64> = (0..2 * f).map(|_| r.gen::<f64>() - 0.5).collect();
        let make = |n: usize, r: &mut rand_chacha::ChaCha8Rng| -> Vec<f64> {
            let mut x = vec![0f64; n * f];
            for c in 0..n {
                let z = [r.gen::<f64>() * 4.0 - 2.0, r.gen::<f64>() * 4.0 - 2.0];
                for g in 0..f {
                    x[c * f + g] = z[0] * load[g] + z[1] * load[f + g] + 0.05 * (r.gen::<f64>() - 0.5);
                }
            }
            x
        };
        let a = make(90, &mut r);
        let b = make(70, &mut r);
        let c = cca(&a, 90, &b, 70, f, 5, 0);
        assert_eq!(c.k, 5);
        // U and V have orthonormal columns
        for j in 0..5 {
            for l in 0..5 {
                let du: f64 = (0..90).map(|i| c.u[i * 5 + j] * c.u[i * 5 + l]).sum();
                let dv: f64 = (0..70).map(|i| c.v[i * 5 + j] * c.v[i * 5 + l]).sum();
                let e = if j == l { 1.0 } else { 0.0 };
                assert!((du - e).abs() < 1e-8 && (dv - e).abs() < 1e-8, "{j} {l}: {du} {dv}");
            }
        }
        // two strong components, then noise
        assert!(c.d[1] > 10.0 * c.d[2], "{:?}", c.d);
        assert!(c.u[0] >= 0.0);
        // Lanczos (above 64 cells) does not depend on its start vector
        let big_a = make(120, &mut r);
        let big_b = make(100, &mut r);
        let c1 = cca(&big_a, 120, &big_b, 100, f, 3, 1);
        let c2 = cca(&big_a, 120, &big_b, 100, f, 3, 2);
        for j in 0..3 {
            assert!((c1.d[j] - c2.d[j]).abs() < 1e-8 * c1.d[0]);
        }
    }

    #[test]
    fn sample_tree_merges_most_similar_first_into_the_larger() {
        // 0-1 share many anchors, 2 is far; sizes make 1 the reference of the first merge
        let mut counts = vec![vec![0usize; 3]; 3];
        counts[0][1] = 40;
        counts[0][2] = 2;
        counts[1][2] = 1;
        let m = sample_tree(&counts, &[20, 30, 25]);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0], Merge { reference: vec![1], query: vec![0] });
        assert_eq!(m[1], Merge { reference: vec![0, 1], query: vec![2] });
    }

    #[test]
    fn top_dim_features_balanced() {
        // 6 features, 1 dim: loadings 5,4,3,-1,-2,-6
        let load = vec![5.0, 4.0, 3.0, -1.0, -2.0, -6.0];
        // max features = max(2, 4) = 4 -> y=1: 0 genes, y=2: {0,5}, y=3: round(1.5)=2 -> {0,1,5,4} = 4 >= 4 stop
        let t = top_dim_features(&load, 6, 1, 4);
        assert_eq!(t, vec![0, 5]);
        let t = top_dim_features(&load, 6, 1, 5);
        assert_eq!(t, vec![0, 1, 5, 4]);
    }
}
