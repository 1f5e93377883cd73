//! Label transfer from a reference to a query embedding by a distance-weighted kNN vote, and
//! the scores of a transfer (accuracy, macro-F1, confusion matrix).
//!
//! The vote follows scArches' `weighted_knn_transfer` (Lotfollahi et al., "Mapping single-cell
//! data to reference atlases by transfer learning", Nature Biotechnology 40, 121-130 (2022);
//! https://github.com/theislab/scarches, `scarches/utils/knn.py`, originally by Lisa Sikkema):
//! for each query cell, its k nearest reference cells by Euclidean distance d_1..d_k (exact,
//! as sklearn's `KNeighborsTransformer(algorithm="brute", mode="distance")`), the Gaussian-like
//! kernel w_i = exp(-d_i / s) with s = (2 / std(d))^2 (population std over the k distances),
//! weights normalised to sum 1; the label with the largest total weight wins and its weight
//! share is the confidence (scArches reports 1 - confidence as "uncertainty").
//!
//! Ties, deterministic: neighbours at equal distance are taken in increasing reference index;
//! labels with equal total weight go to the smallest label code (scArches scans the sorted
//! unique labels and keeps the first strict maximum, the same rule). When all k distances are
//! equal (std 0) the weights are uniform (numpy gives exp(-d / inf) = 1 there too).
//!
//! Distances: ||q||^2 + ||r||^2 - 2 q.r in f64 (matrixmultiply), over blocks of query and
//! reference rows, keeping a bounded top-k per query row; memory is O(block^2 + n_query k),
//! never n_query x n_ref.
//!
//! Scores (in `metrics::classification`, re-exported here) follow scikit-learn:
//! `accuracy_score`, `f1_score(average="macro")` over the labels present in the truth or the
//! prediction, `confusion_matrix` (rows: truth, columns: prediction).

use rayon::prelude::*;

#[derive(Debug, Clone, PartialEq)]
pub struct TransferResult {
    /// Predicted label code per query cell.
    pub predicted: Vec<u32>,
    /// Weight share of the winning label, in (0, 1].
    pub confidence: Vec<f32>,
}

/// Exact k nearest reference rows of every query row (Euclidean), blocked.
/// Returns (indices, distances), n_query x k row-major, nearest first.
pub fn knn(ref_emb: &[f32], n_ref: usize, query_emb: &[f32], n_query: usize, d: usize, k: usize) -> (Vec<u32>, Vec<f32>) {
    assert_eq!(ref_emb.len(), n_ref * d, "reference embedding is not n_ref x d");
    assert_eq!(query_emb.len(), n_query * d, "query embedding is not n_query x d");
    assert!(k >= 1 && k <= n_ref, "k must be in 1..=n_ref (k = {k}, n_ref = {n_ref})");
    const QB: usize = 256;
    const RB: usize = 2048;
    let r64: Vec<f64> = ref_emb.iter().map(|&v| v as f64).collect();
    let rnorm: Vec<f64> = r64.chunks(d.max(1)).map(|r| r.iter().map(|v| v * v).sum()).collect();
    let mut idx = vec![0u32; n_query * k];
    let mut dist = vec![0f32; n_query * k];
    idx.par_chunks_mut(QB * k).zip(dist.par_chunks_mut(QB * k)).enumerate().for_each(|(qb, (idx_out, dist_out))| {
        let q0 = qb * QB;
        let m = idx_out.len() / k;
        let q64: Vec<f64> = query_emb[q0 * d..(q0 + m) * d].iter().map(|&v| v as f64).collect();
        let qnorm: Vec<f64> = q64.chunks(d.max(1)).map(|r| r.iter().map(|v| v * v).sum()).collect();
        // per query row: the best k so far as (squared distance, ref index), sorted
        let mut best: Vec<Vec<(f64, u32)>> = vec![Vec::with_capacity(k + 1); m];
        let mut block = vec![0.0f64; m * RB];
        for r0 in (0..n_ref).step_by(RB) {
            let nr = RB.min(n_ref - r0);
            let c = &mut block[..m * nr];
            c.iter_mut().for_each(|v| *v = 0.0);
            if d > 0 {
                // SAFETY: q64 is m x d, r64[r0..] holds nr rows of d, c is m x nr.
                unsafe {
                    matrixmultiply::dgemm(
                        m,
                        d,
                        nr,
                        1.0,
                        q64.as_ptr(),
                        d as isize,
                        1,
                        r64[r0 * d..].as_ptr(),
                        1,
                        d as isize,
                        0.0,
                        c.as_mut_ptr(),
                        nr as isize,
                        1,
                    );
                }
            }
            for (i, list) in best.iter_mut().enumerate() {
                for j in 0..nr {
                    let d2 = (qnorm[i] + rnorm[r0 + j] - 2.0 * c[i * nr + j]).max(0.0);
                    let cand = (d2, (r0 + j) as u32);
                    if list.len() == k {
                        let worst = list[k - 1];
                        if (cand.0, cand.1) >= (worst.0, worst.1) {
                            continue;
                        }
                        list.pop();
                    }
                    let pos = list.partition_point(|&(x, y)| (x, y) < (cand.0, cand.1));
                    list.insert(pos, cand);
                }
            }
        }
        for (i, list) in best.iter().enumerate() {
            for (t, &(d2, j)) in list.iter().enumerate() {
                idx_out[i * k + t] = j;
                dist_out[i * k + t] = d2.sqrt() as f32;
            }
        }
    });
    (idx, dist)
}

/// Transfer labels from the reference to the query by scArches' weighted kNN vote.
///
/// `ref_labels` are codes in 0..n_labels. k larger than the reference is reduced to its size.
/// Panics on inconsistent lengths, k = 0, an empty reference, or a label code >= n_labels.
#[allow(clippy::too_many_arguments)]
pub fn transfer(
    ref_emb: &[f32],
    n_ref: usize,
    query_emb: &[f32],
    n_query: usize,
    d: usize,
    ref_labels: &[u32],
    n_labels: usize,
    k: usize,
) -> TransferResult {
    assert_eq!(ref_labels.len(), n_ref, "one label per reference cell");
    assert!(k >= 1, "k must be at least 1");
    assert!(n_ref >= 1, "the reference is empty");
    assert!(ref_labels.iter().all(|&l| (l as usize) < n_labels), "a reference label code is >= n_labels");
    let k = k.min(n_ref);
    let (idx, dist) = knn(ref_emb, n_ref, query_emb, n_query, d, k);
    let (predicted, confidence): (Vec<u32>, Vec<f32>) = (0..n_query)
        .into_par_iter()
        .map(|i| {
            let ds: Vec<f64> = dist[i * k..(i + 1) * k].iter().map(|&v| v as f64).collect();
            let w = kernel_weights(&ds);
            let mut votes = vec![0.0f64; n_labels];
            for (t, &j) in idx[i * k..(i + 1) * k].iter().enumerate() {
                votes[ref_labels[j as usize] as usize] += w[t];
            }
            // first strict maximum in label order: ties go to the smallest label
            let mut best = (0u32, f64::NEG_INFINITY);
            for (l, &v) in votes.iter().enumerate() {
                if v > best.1 {
                    best = (l as u32, v);
                }
            }
            (best.0, best.1 as f32)
        })
        .unzip();
    TransferResult { predicted, confidence }
}

/// scArches' weights: exp(-d / (2 / std(d))^2), normalised to sum 1.
pub fn kernel_weights(dist: &[f64]) -> Vec<f64> {
    let k = dist.len() as f64;
    let mean = dist.iter().sum::<f64>() / k;
    let std = (dist.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / k).sqrt();
    let w: Vec<f64> = if std > 0.0 {
        let s = (2.0 / std).powi(2);
        dist.iter().map(|v| (-v / s).exp()).collect()
    } else {
        vec![1.0; dist.len()]
    };
    let total: f64 = w.iter().sum();
    w.iter().map(|v| v / total).collect()
}

// The scores live with the other metrics, as pure functions; re-exported for callers here.
pub use crate::metrics::classification::{accuracy, confusion_matrix, macro_f1};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knn_exact_and_ties_by_index() {
        // reference on a line: 0, 1, 1 (dup), 3; query at 1 -> 1 (idx 1), 1 (idx 2), 0 or 3 ...
        let r = [0.0f32, 1.0, 1.0, 3.0];
        let (idx, dist) = knn(&r, 4, &[1.0], 1, 1, 3);
        assert_eq!(idx, vec![1, 2, 0]);
        assert_eq!(dist, vec![0.0, 0.0, 1.0]);
    }

    #[test]
    fn vote_ties_go_to_smallest_label() {
        // two neighbours at equal distance with labels 1 and 0 -> label 0, confidence 0.5
        let r = [-1.0f32, 1.0];
        let t = transfer(&r, 2, &[0.0], 1, 1, &[1, 0], 2, 2);
        assert_eq!(t.predicted, vec![0]);
        assert!((t.confidence[0] - 0.5).abs() < 1e-7);
    }

    #[test]
    fn scores_by_hand() {
        let truth = [0, 0, 1, 1, 2];
        let pred = [0, 1, 1, 1, 3];
        assert!((accuracy(&truth, &pred) - 0.6).abs() < 1e-12);
        // label 0: tp1 fn1 fp0 -> 2/3; label 1: tp2 fp1 -> 4/5; label 2: 0; label 3: 0
        assert!((macro_f1(&truth, &pred) - (2.0 / 3.0 + 0.8) / 4.0).abs() < 1e-12);
        let m = confusion_matrix(&truth, &pred, 4);
        assert_eq!(m[1], 1);
        assert_eq!(m[2 * 4 + 3], 1);
    }
}
