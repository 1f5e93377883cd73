//! Silhouette-based metrics: `silhouette_label`, `silhouette_batch`, `bras`
//! (scib-metrics `metrics/_silhouette.py`, `utils/_silhouette.py`).
//!
//! Distances are computed on the fly in tiles of `chunk_size` x `chunk_size`
//! cells, never as an n x n matrix; each pair of tiles is computed once and
//! summed both ways. Memory: O(n * n_clusters) sums + one tile per thread.

use rayon::prelude::*;

use super::compact_codes;
use super::dense::Dense;
use super::neighbors::{block_pair_rounds, tile_kernel, ColBlock, TileOp};

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
    silhouette_samples_on(&Dense::cpu(), x, n, d, labels, chunk_size, metric, between)
}

/// [`silhouette_samples`] with the Euclidean distance sums on `dense`'s device.
pub fn silhouette_samples_on(
    dense: &Dense,
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
    // Work in label-sorted order: each column tile then holds contiguous runs
    // of one label, summed in f32 over the run (<= COL_TILE terms) then in f64.
    let mut perm: Vec<usize> = (0..n).collect();
    perm.sort_by_key(|&i| codes[i]);
    let mut xs = Vec::with_capacity(n * d);
    for &i in &perm {
        xs.extend_from_slice(&x[i * d..(i + 1) * d]);
    }
    let cs: Vec<u32> = perm.iter().map(|&i| codes[i]).collect();
    // the Euclidean sums on the GPU where `dense` has one
    let on_gpu = if metric == Distance::Euclidean { dense.label_sums(&xs, n, d, &cs, n_clusters) } else { None };
    let sums = match on_gpu {
        Some(sums) => sums,
        None => {
            let t = std::time::Instant::now();
            let sums = label_sums(xs, n, d, &cs, n_clusters, chunk_size, metric);
            if metric == Distance::Euclidean {
                dense.record("label silhouette distances", n, "cpu", t);
            }
            sums
        }
    };
    let codes = &cs;
    let out_sorted: Vec<f64> = (0..n)
        .into_par_iter()
        .map(|r| {
            let own = codes[r] as usize;
            let s = &sums[r * n_clusters..(r + 1) * n_clusters];
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
                    tot / (n - freqs[own]) as f64
                }
            };
            nan_to_num((b - a) / a.max(b))
        })
        .collect();
    let mut out = vec![0f64; n];
    for (t, &i) in perm.iter().enumerate() {
        out[i] = out_sorted[t];
    }
    out
}

/// Each cell's sum of distances to each label's cells (`n x n_clusters`), the cells (`xs`)
/// sorted by label (`cs`), on the CPU.
fn label_sums(mut xs: Vec<f32>, n: usize, d: usize, cs: &[u32], n_clusters: usize, chunk_size: usize, metric: Distance) -> Vec<f64> {
    if metric == Distance::Euclidean {
        // Euclidean distances come from dot products below (|a|^2 + |b|^2 - 2 a.b,
        // one multiply-add per term instead of a difference and a multiply-add,
        // as scib-metrics computes them too); centring first keeps the norms,
        // and so the cancellation, small. Distances do not change.
        let mut mean = vec![0f64; d];
        for row in xs.chunks_exact(d) {
            mean.iter_mut().zip(row).for_each(|(m, &v)| *m += v as f64);
        }
        let mean: Vec<f32> = mean.iter().map(|m| (m / n as f64) as f32).collect();
        xs.par_chunks_mut(d)
            .for_each(|row| row.iter_mut().zip(&mean).for_each(|(v, m)| *v -= m));
    }
    // squared norms of the rows (cosine and Euclidean both use them)
    let norms: Vec<f32> = (0..n)
        .map(|i| super::neighbors::dot(&xs[i * d..(i + 1) * d], &xs[i * d..(i + 1) * d]))
        .collect();
    // Tiles of S x S cells; each pair of tiles is computed once and summed both
    // ways (rows into the columns' labels, columns into the rows' labels).
    let s_tile = chunk_size.clamp(64, 2048).div_ceil(8) * 8;
    let nb = n.div_ceil(s_tile);
    let op = TileOp::Dot;
    let blocks: Vec<ColBlock> = (0..nb)
        .into_par_iter()
        .map(|b| ColBlock::new(&xs, d, b * s_tile, ((b + 1) * s_tile).min(n)))
        .collect();
    // label runs inside each tile: (label, start, end) relative to the tile
    let segments: Vec<Vec<(usize, usize, usize)>> = (0..nb)
        .map(|b| {
            let c0 = b * s_tile;
            let c1 = (c0 + s_tile).min(n);
            let mut segs = Vec::new();
            let mut a = c0;
            while a < c1 {
                let l = cs[a];
                let mut e = a;
                while e < c1 && cs[e] == l {
                    e += 1;
                }
                segs.push((l as usize, a - c0, e - c0));
                a = e;
            }
            segs
        })
        .collect();
    // per block: sums[i * n_clusters + l] = sum of distances from cell i to label l
    let sums: Vec<std::sync::Mutex<Vec<f64>>> = (0..nb)
        .map(|b| std::sync::Mutex::new(vec![0f64; (((b + 1) * s_tile).min(n) - b * s_tile) * n_clusters]))
        .collect();
    let x = &xs;
    for round in block_pair_rounds(nb) {
        round.par_iter().for_each_init(
            || (vec![0f32; s_tile * (s_tile + 8)], vec![0f32; s_tile + 8]),
            |(tile, acc), &(rb, cb)| {
                let (r0, c0) = (rb * s_tile, cb * s_tile);
                let cblk = &blocks[cb];
                let nr = ((rb + 1) * s_tile).min(n) - r0;
                let (nc, ncp) = (cblk.nc, cblk.ncp);
                tile_kernel(x, d, r0, nr, cblk, op, tile);
                distances_in_place(tile, nr, nc, ncp, &norms[r0..r0 + nr], &norms[c0..c0 + nc], metric, rb == cb);
                {
                    let mut sr = sums[rb].lock().unwrap();
                    for ri in 0..nr {
                        let srow = &mut sr[ri * n_clusters..(ri + 1) * n_clusters];
                        let row = &tile[ri * ncp..ri * ncp + nc];
                        for &(l, a, e) in &segments[cb] {
                            srow[l] += sum8(&row[a..e]) as f64;
                        }
                    }
                }
                if rb != cb {
                    let mut sc = sums[cb].lock().unwrap();
                    for &(l, a, e) in &segments[rb] {
                        let acc = &mut acc[..nc];
                        acc.iter_mut().for_each(|v| *v = 0.0);
                        for ri in a..e {
                            for (v, &t) in acc.iter_mut().zip(&tile[ri * ncp..ri * ncp + nc]) {
                                *v += t;
                            }
                        }
                        for (cj, &v) in acc.iter().enumerate() {
                            sc[cj * n_clusters + l] += v as f64;
                        }
                    }
                }
            },
        );
    }
    sums.into_iter().flat_map(|m| m.into_inner().unwrap()).collect()
}

/// Turn a tile of dot products into distances (see [`silhouette_samples`]); `diag`: the tile
/// pairs a block with itself, whose diagonal is a cell's distance to itself (0).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn distances_in_place_impl(tile: &mut [f32], nr: usize, nc: usize, ncp: usize, nrm_r: &[f32], nrm_c: &[f32], metric: Distance, diag: bool) {
    for ri in 0..nr {
        let row = &mut tile[ri * ncp..ri * ncp + nc];
        let nrm = nrm_r[ri];
        match metric {
            Distance::Euclidean => {
                for (v, &nc) in row.iter_mut().zip(nrm_c) {
                    *v = (nrm + nc - 2.0 * *v).max(0.0).sqrt();
                }
                if diag {
                    row[ri] = 0.0; // a cell's distance to itself, exactly
                }
            }
            Distance::Cosine => {
                for (v, &nc) in row.iter_mut().zip(nrm_c) {
                    *v = (1.0 - *v / (nrm * nc).sqrt()).clamp(0.0, 2.0);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn distances_in_place_avx2(tile: &mut [f32], nr: usize, nc: usize, ncp: usize, nrm_r: &[f32], nrm_c: &[f32], metric: Distance, diag: bool) {
    distances_in_place_impl(tile, nr, nc, ncp, nrm_r, nrm_c, metric, diag)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn distances_in_place_avx512(tile: &mut [f32], nr: usize, nc: usize, ncp: usize, nrm_r: &[f32], nrm_c: &[f32], metric: Distance, diag: bool) {
    distances_in_place_impl(tile, nr, nc, ncp, nrm_r, nrm_c, metric, diag)
}

/// [`distances_in_place_impl`], 16 or 8 lanes at a time where the processor has AVX-512 or AVX2.
#[allow(clippy::too_many_arguments)]
fn distances_in_place(tile: &mut [f32], nr: usize, nc: usize, ncp: usize, nrm_r: &[f32], nrm_c: &[f32], metric: Distance, diag: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the features were detected at run time.
            return unsafe { distances_in_place_avx512(tile, nr, nc, ncp, nrm_r, nrm_c, metric, diag) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the features were detected at run time.
            return unsafe { distances_in_place_avx2(tile, nr, nc, ncp, nrm_r, nrm_c, metric, diag) };
        }
    }
    distances_in_place_impl(tile, nr, nc, ncp, nrm_r, nrm_c, metric, diag)
}

/// Sum in eight interleaved partial sums (a single running sum is one chain of dependent
/// additions and does not vectorise).
#[inline]
fn sum8(v: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = v.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for l in 0..8 {
            acc[l] += c[l];
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
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
pub fn silhouette_label(
    x: &[f32],
    n: usize,
    d: usize,
    labels: &[u32],
    rescale: bool,
    chunk_size: usize,
) -> f64 {
    let s = silhouette_samples(
        x,
        n,
        d,
        labels,
        chunk_size,
        Distance::Euclidean,
        BetweenCluster::Nearest,
    );
    silhouette_label_from_samples(&s, rescale)
}

/// `silhouette_label` from precomputed `silhouette_samples` (euclidean, nearest).
pub fn silhouette_label_from_samples(sil: &[f64], rescale: bool) -> f64 {
    let asw = sil.iter().sum::<f64>() / sil.len() as f64;
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
    silhouette_batch_with(
        x,
        n,
        d,
        labels,
        batches,
        rescale,
        chunk_size,
        Distance::Euclidean,
        BetweenCluster::Nearest,
    )
}

/// BRAS (scib `bras`): batch silhouette with cosine distance and the
/// mean-over-other-batches between term, rescaled (1 - |s|).
pub fn bras(
    x: &[f32],
    n: usize,
    d: usize,
    labels: &[u32],
    batches: &[u32],
    chunk_size: usize,
) -> f64 {
    silhouette_batch_with(
        x,
        n,
        d,
        labels,
        batches,
        true,
        chunk_size,
        Distance::Cosine,
        BetweenCluster::MeanOther,
    )
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
        for case in ["easy", "hard", "mixed", "edge"] {
            let f = load_case(case);
            let (x, n, d) = (&f.embedding, f.n, f.d);
            let checks = [
                (
                    "silhouette_label",
                    silhouette_label(x, n, d, &f.labels, true, 256),
                ),
                (
                    "silhouette_label_raw",
                    silhouette_label(x, n, d, &f.labels, false, 100),
                ),
                (
                    "silhouette_batch",
                    silhouette_batch(x, n, d, &f.labels, &f.batches, true, 256),
                ),
                (
                    "silhouette_batch_furthest",
                    silhouette_batch_with(
                        x,
                        n,
                        d,
                        &f.labels,
                        &f.batches,
                        true,
                        64,
                        Distance::Euclidean,
                        BetweenCluster::Furthest,
                    ),
                ),
                (
                    "silhouette_batch_cosine_mean_other",
                    silhouette_batch_with(
                        x,
                        n,
                        d,
                        &f.labels,
                        &f.batches,
                        true,
                        256,
                        Distance::Cosine,
                        BetweenCluster::MeanOther,
                    ),
                ),
                ("bras", bras(x, n, d, &f.labels, &f.batches, 256)),
                (
                    "bras_euclidean",
                    silhouette_batch_with(
                        x,
                        n,
                        d,
                        &f.labels,
                        &f.batches,
                        true,
                        256,
                        Distance::Euclidean,
                        BetweenCluster::MeanOther,
                    ),
                ),
                (
                    "bras_furthest",
                    silhouette_batch_with(
                        x,
                        n,
                        d,
                        &f.labels,
                        &f.batches,
                        true,
                        256,
                        Distance::Cosine,
                        BetweenCluster::Furthest,
                    ),
                ),
            ];
            for (name, ours) in checks {
                assert_close(case, name, ours, f.metric(name), 1e-3);
            }
        }
    }
}
