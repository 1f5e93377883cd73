//! Silhouette-based metrics: `silhouette_label`, `silhouette_batch`, `bras`
//! (scib-metrics `metrics/_silhouette.py`, `utils/_silhouette.py`).
//!
//! Distances are computed on the fly in blocks of rows (`chunk_size`), never as
//! an n x n matrix: memory is O(chunk_size * n_clusters + n).

use rayon::prelude::*;

use super::compact_codes;
use super::neighbors::{tile_kernel, ColBlock, TileOp};

/// Distance used by the silhouette.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Distance {
    /// sqrt(sum (x-y)^2)  (scib default for silhouette_label / silhouette_batch)
    Euclidean,
    /// 1 - x.y / sqrt(x.x * y.y), clipped to [0, 2]  (BRAS default)
    Cosine,
}

/// How the "b" (between-cluster) term is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BetweenCluster {
    /// Standard silhouette: mean distance to the nearest other cluster.
    Nearest,
    /// BRAS: mean distance to all cells of all other clusters.
    MeanOther,
    /// BRAS: mean distance to the furthest other cluster.
    Furthest,
}

/// Per-observation silhouette (scib-metrics `silhouette_samples`).
///
/// `labels` are any u32 codes (re-coded internally). NaNs (singleton clusters,
/// a single cluster) become 0 like `jnp.nan_to_num`.
pub fn silhouette_samples(
    x: &[f32],
    n: usize,
    d: usize,
    labels: &[u32],
    chunk_size: usize,
    metric: Distance,
    between: BetweenCluster,
) -> Vec<f64> {
    assert_eq!(x.len(), n * d);
    assert_eq!(labels.len(), n);
    let (codes, n_clusters) = compact_codes(labels);
    let mut freqs = vec![0usize; n_clusters];
    for &c in &codes {
        freqs[c as usize] += 1;
    }
    let norms: Vec<f32> = match metric {
        Distance::Cosine => (0..n).map(|i| super::neighbors::dot(&x[i * d..(i + 1) * d], &x[i * d..(i + 1) * d])).collect(),
        Distance::Euclidean => Vec::new(),
    };
    let chunk = chunk_size.max(1);
    let mut out = vec![0f64; n];
    const COL_TILE: usize = 512;
    let op = match metric {
        Distance::Euclidean => TileOp::SqDist,
        Distance::Cosine => TileOp::Dot,
    };
    out.par_chunks_mut(chunk).enumerate().for_each(|(bi, out_chunk)| {
        let r0 = bi * chunk;
        let nr = out_chunk.len();
        let mut sums = vec![0f64; nr * n_clusters];
        let mut tile = vec![0f32; nr * (COL_TILE + 8)];
        let mut c0 = 0;
        while c0 < n {
            let c1 = (c0 + COL_TILE).min(n);
            let cb = ColBlock::new(x, d, c0, c1);
            tile_kernel(x, d, r0, nr, &cb, op, &mut tile);
            for ri in 0..nr {
                let r = r0 + ri;
                let s = &mut sums[ri * n_clusters..(ri + 1) * n_clusters];
                let row = &tile[ri * cb.ncp..ri * cb.ncp + cb.nc];
                for (cj, &v) in row.iter().enumerate() {
                    let c = c0 + cj;
                    let dist = match metric {
                        Distance::Euclidean => v.sqrt(),
                        Distance::Cosine => (1.0 - v / (norms[r] * norms[c]).sqrt()).clamp(0.0, 2.0),
                    };
                    s[codes[c] as usize] += dist as f64;
                }
            }
            c0 = c1;
        }
        let total: usize = n;
        for ri in 0..nr {
            let r = r0 + ri;
            let own = codes[r] as usize;
            let s = &sums[ri * n_clusters..(ri + 1) * n_clusters];
            let a = s[own] / (freqs[own] as f64 - 1.0);
            let b = match between {
                BetweenCluster::Nearest => {
                    let mut m = f64::INFINITY;
                    for c in 0..n_clusters {
                        if c != own {
                            m = m.min(s[c] / freqs[c] as f64);
                        }
                    }
                    m
                }
                BetweenCluster::Furthest => {
                    let mut m = f64::NEG_INFINITY;
                    for c in 0..n_clusters {
                        if c != own {
                            m = m.max(s[c] / freqs[c] as f64);
                        }
                    }
                    m
                }
                BetweenCluster::MeanOther => {
                    let tot: f64 = (0..n_clusters).filter(|&c| c != own).map(|c| s[c]).sum();
                    tot / (total - freqs[own]) as f64
                }
            };
            let sil = (b - a) / a.max(b);
            out_chunk[ri] = nan_to_num(sil);
        }
    });
    out
}

/// `jnp.nan_to_num` on float32: nan -> 0, +-inf -> +-f32::MAX.
fn nan_to_num(v: f64) -> f64 {
    if v.is_nan() {
        0.0
    } else if v == f64::INFINITY {
        f32::MAX as f64
    } else if v == f64::NEG_INFINITY {
        f32::MIN as f64
    } else {
        v
    }
}

/// Average silhouette width of the labels (scib `silhouette_label`);
/// `rescale` maps to (asw + 1) / 2.
pub fn silhouette_label(x: &[f32], n: usize, d: usize, labels: &[u32], rescale: bool, chunk_size: usize) -> f64 {
    let s = silhouette_samples(x, n, d, labels, chunk_size, Distance::Euclidean, BetweenCluster::Nearest);
    let asw = s.iter().sum::<f64>() / n as f64;
    if rescale {
        (asw + 1.0) / 2.0
    } else {
        asw
    }
}

/// Classic batch ASW (scib `silhouette_batch`, euclidean, nearest).
pub fn silhouette_batch(
    x: &[f32],
    n: usize,
    d: usize,
    labels: &[u32],
    batches: &[u32],
    rescale: bool,
    chunk_size: usize,
) -> f64 {
    silhouette_batch_with(x, n, d, labels, batches, rescale, chunk_size, Distance::Euclidean, BetweenCluster::Nearest)
}

/// BRAS (scib `bras`): batch silhouette with cosine distance and the
/// mean-over-other-batches between term, rescaled (1 - |s|).
pub fn bras(x: &[f32], n: usize, d: usize, labels: &[u32], batches: &[u32], chunk_size: usize) -> f64 {
    silhouette_batch_with(x, n, d, labels, batches, true, chunk_size, Distance::Cosine, BetweenCluster::MeanOther)
}

/// General batch silhouette: for every label with >1 batch and not one cell per
/// batch, silhouette of the batch codes within the label, |s| (and 1-|s| if
/// `rescale`), mean per label, then mean over labels. NaN if no label qualifies
/// (scib-metrics raises there).
#[allow(clippy::too_many_arguments)]
pub fn silhouette_batch_with(
    x: &[f32],
    n: usize,
    d: usize,
    labels: &[u32],
    batches: &[u32],
    rescale: bool,
    chunk_size: usize,
    metric: Distance,
    between: BetweenCluster,
) -> f64 {
    assert_eq!(labels.len(), n);
    assert_eq!(batches.len(), n);
    let mut uniq: Vec<u32> = labels.to_vec();
    uniq.sort_unstable();
    uniq.dedup();
    let mut group_means = Vec::new();
    for g in uniq {
        let rows: Vec<usize> = (0..n).filter(|&i| labels[i] == g).collect();
        let bsub: Vec<u32> = rows.iter().map(|&i| batches[i]).collect();
        let (_, nb) = compact_codes(&bsub);
        if nb == 1 || nb == rows.len() {
            continue;
        }
        let mut xs = Vec::with_capacity(rows.len() * d);
        for &i in &rows {
            xs.extend_from_slice(&x[i * d..(i + 1) * d]);
        }
        let s = silhouette_samples(&xs, rows.len(), d, &bsub, chunk_size, metric, between);
        let m = s
            .iter()
            .map(|v| {
                let a = v.abs();
                if rescale {
                    1.0 - a
                } else {
                    a
                }
            })
            .sum::<f64>()
            / s.len() as f64;
        group_means.push(m);
    }
    if group_means.is_empty() {
        return f64::NAN;
    }
    group_means.iter().sum::<f64>() / group_means.len() as f64
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{assert_close, load_case};
    use super::*;

    #[test]
    fn silhouettes_match_scib() {
        for case in ["easy", "hard", "mixed"] {
            let f = load_case(case);
            let (x, n, d) = (&f.embedding, f.n, f.d);
            let checks = [
                ("silhouette_label", silhouette_label(x, n, d, &f.labels, true, 256)),
                ("silhouette_label_raw", silhouette_label(x, n, d, &f.labels, false, 100)),
                ("silhouette_batch", silhouette_batch(x, n, d, &f.labels, &f.batches, true, 256)),
                (
                    "silhouette_batch_furthest",
                    silhouette_batch_with(x, n, d, &f.labels, &f.batches, true, 64, Distance::Euclidean, BetweenCluster::Furthest),
                ),
                (
                    "silhouette_batch_cosine_mean_other",
                    silhouette_batch_with(x, n, d, &f.labels, &f.batches, true, 256, Distance::Cosine, BetweenCluster::MeanOther),
                ),
                ("bras", bras(x, n, d, &f.labels, &f.batches, 256)),
                (
                    "bras_euclidean",
                    silhouette_batch_with(x, n, d, &f.labels, &f.batches, true, 256, Distance::Euclidean, BetweenCluster::MeanOther),
                ),
                (
                    "bras_furthest",
                    silhouette_batch_with(x, n, d, &f.labels, &f.batches, true, 256, Distance::Cosine, BetweenCluster::Furthest),
                ),
            ];
            for (name, ours) in checks {
                assert_close(case, name, ours, f.metric(name), 1e-3);
            }
        }
    }
}
