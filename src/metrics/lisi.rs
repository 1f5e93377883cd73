//! LISI (scib-metrics `metrics/_lisi.py`, `utils/_lisi.py`).
//!
//! Per cell: Gaussian kernel on the kNN *distances* (not squared) with the
//! precision beta found by binary search so that the entropy matches
//! log(perplexity) (tol 1e-5, at most 50 steps, start beta = 1); the cell itself
//! gets weight 0; Simpson index = sum_label (sum P)^2, LISI = 1 / Simpson.
//! Default perplexity = floor(k / 3). Computed in f32 like scib's JAX code.

use rayon::prelude::*;

use super::compact_codes;
use super::neighbors::NeighborsResults;

const TOL: f32 = 1e-5;
const MAX_TRIES: usize = 50;

/// (H, P) for one row at precision beta; `mask[j]` false drops the self edge.
fn hbeta(dist: &[f32], mask: &[bool], beta: f32, p: &mut [f32]) -> f32 {
    let mut sum_p = 0f32;
    for j in 0..dist.len() {
        p[j] = if mask[j] {
            (-dist[j] * beta).exp()
        } else {
            0.0
        };
        sum_p += p[j];
    }
    if sum_p == 0.0 {
        p.iter_mut().for_each(|v| *v = 0.0);
        return 0.0;
    }
    let mut dp = 0f32;
    for j in 0..dist.len() {
        dp += dist[j] * p[j];
    }
    let h = sum_p.ln() + beta * dp / sum_p;
    p.iter_mut().for_each(|v| *v /= sum_p);
    h
}

/// Simpson index of one cell (-1 where the kernel vanished, as scib does).
fn simpson_row(
    dist: &[f32],
    nbr_labels: &[u32],
    mask: &[bool],
    n_labels: usize,
    perplexity: f32,
) -> f32 {
    let k = dist.len();
    let mut p = vec![0f32; k];
    let logu = perplexity.ln();
    let mut beta = 1f32;
    let mut betamin = f32::NEG_INFINITY;
    let mut betamax = f32::INFINITY;
    let mut h = hbeta(dist, mask, beta, &mut p);
    let mut hdiff = h - logu;
    let mut tries = 0;
    while hdiff.abs() >= TOL && tries < MAX_TRIES {
        let new_beta = if hdiff > 0.0 {
            betamin = beta;
            if betamax == f32::INFINITY {
                beta * 2.0
            } else {
                (beta + betamax) / 2.0
            }
        } else {
            betamax = beta;
            if betamin == f32::NEG_INFINITY {
                beta / 2.0
            } else {
                (beta + betamin) / 2.0
            }
        };
        beta = new_beta;
        h = hbeta(dist, mask, beta, &mut p);
        hdiff = h - logu;
        tries += 1;
    }
    if h == 0.0 {
        return -1.0;
    }
    let mut sums = vec![0f32; n_labels];
    for j in 0..k {
        sums[nbr_labels[j] as usize] += p[j];
    }
    sums.iter().map(|s| s * s).sum()
}

/// Per-cell LISI (scib `lisi_knn`). `perplexity = None` means floor(k / 3).
pub fn lisi_knn(nn: &NeighborsResults, labels: &[u32], perplexity: Option<f64>) -> Vec<f64> {
    assert_eq!(labels.len(), nn.n);
    let (codes, n_labels) = compact_codes(labels);
    let perplexity = perplexity.unwrap_or((nn.k / 3) as f64) as f32;
    (0..nn.n)
        .into_par_iter()
        .map(|i| {
            let idx = nn.row(i);
            let mask: Vec<bool> = idx.iter().map(|&j| j as usize != i).collect();
            let nl: Vec<u32> = idx.iter().map(|&j| codes[j as usize]).collect();
            1.0 / simpson_row(nn.row_dist(i), &nl, &mask, n_labels, perplexity) as f64
        })
        .collect()
}

/// numpy `nanmedian`.
pub(crate) fn nanmedian(v: &[f64]) -> f64 {
    let mut w: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    if w.is_empty() {
        return f64::NAN;
    }
    w.sort_by(|a, b| a.total_cmp(b));
    let m = w.len();
    if m % 2 == 1 {
        w[m / 2]
    } else {
        (w[m / 2 - 1] + w[m / 2]) / 2.0
    }
}

/// iLISI: median per-cell LISI over batches; `scale` maps to (x - 1) / (B - 1).
pub fn ilisi_knn(
    nn: &NeighborsResults,
    batches: &[u32],
    perplexity: Option<f64>,
    scale: bool,
) -> f64 {
    let lisi = lisi_knn(nn, batches, perplexity);
    let med = nanmedian(&lisi);
    if scale {
        let nb = compact_codes(batches).1 as f64;
        (med - 1.0) / (nb - 1.0)
    } else {
        med
    }
}

/// cLISI: median per-cell LISI over labels; `scale` maps to (L - x) / (L - 1).
pub fn clisi_knn(
    nn: &NeighborsResults,
    labels: &[u32],
    perplexity: Option<f64>,
    scale: bool,
) -> f64 {
    let lisi = lisi_knn(nn, labels, perplexity);
    let med = nanmedian(&lisi);
    if scale {
        let nl = compact_codes(labels).1 as f64;
        (nl - med) / (nl - 1.0)
    } else {
        med
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{assert_close, load_case};
    use super::*;

    #[test]
    fn lisi_matches_scib() {
        for case in ["easy", "hard", "mixed", "edge"] {
            let f = load_case(case);
            let nn90 = &f.knn;
            assert_close(
                case,
                "ilisi_knn",
                ilisi_knn(nn90, &f.batches, None, true),
                f.metric("ilisi_knn"),
                1e-3,
            );
            assert_close(
                case,
                "clisi_knn",
                clisi_knn(nn90, &f.labels, None, true),
                f.metric("clisi_knn"),
                1e-3,
            );
            assert_close(
                case,
                "ilisi_knn_unscaled",
                ilisi_knn(nn90, &f.batches, None, false),
                f.metric("ilisi_knn_unscaled"),
                1e-3,
            );
            let nn15 = nn90.subset_k(15);
            assert_close(
                case,
                "ilisi_knn_k15",
                ilisi_knn(&nn15, &f.batches, None, true),
                f.metric("ilisi_knn_k15"),
                1e-3,
            );
            let ours = lisi_knn(nn90, &f.batches, None);
            let theirs = f.metric_list("lisi_batches_per_cell");
            let max = ours
                .iter()
                .zip(&theirs)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            eprintln!("{case} per-cell LISI max |diff| {max:e}");
            assert!(max < 1e-3);
        }
    }
}
