//! Geometry of an embedding, as pure functions (used by `scfoundry geometry`):
//!
//! - [`sample_pair_distances`]: Euclidean distances of uniformly sampled pairs of cells
//!   (all pairs when there are few), for the distance distribution;
//! - [`histogram`]: equal-width bins;
//! - [`levina_bickel`]: the local intrinsic-dimension MLE of Levina & Bickel,
//!   "Maximum Likelihood Estimation of Intrinsic Dimension", NIPS 2004:
//!   `m_k(x) = [ 1/(k-1) * sum_{j<k} log(T_k(x) / T_j(x)) ]^-1` from the distances
//!   `T_j` to the j-th neighbour (self excluded); the global estimate averages the
//!   inverses, `[mean_x 1/m_k(x)]^-1` (MacKay & Ghahramani's correction, 2005);
//! - [`knn_overlap`]: per cell, the neighbours shared by two kNN lists of the same cells
//!   at k (self excluded): the preserved fraction `|A ∩ B| / k` and the Jaccard index
//!   `|A ∩ B| / |A ∪ B|`.

use rand::{Rng, SeedableRng};

use super::neighbors::NeighborsResults;

fn dist(x: &[f32], d: usize, i: usize, j: usize) -> f32 {
    let (a, b) = (&x[i * d..(i + 1) * d], &x[j * d..(j + 1) * d]);
    a.iter().zip(b).map(|(p, q)| (p - q) * (p - q)).sum::<f32>().sqrt()
}

/// Distances of `n_pairs` uniformly drawn pairs i != j (all pairs if fewer exist).
pub fn sample_pair_distances(x: &[f32], n: usize, d: usize, n_pairs: usize, seed: u64) -> Vec<f32> {
    assert!(n >= 2 && x.len() == n * d);
    let all = n * (n - 1) / 2;
    if all <= n_pairs {
        let mut out = Vec::with_capacity(all);
        for i in 0..n {
            for j in i + 1..n {
                out.push(dist(x, d, i, j));
            }
        }
        return out;
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n_pairs)
        .map(|_| {
            let i = rng.gen_range(0..n);
            let mut j = rng.gen_range(0..n - 1);
            if j >= i {
                j += 1;
            }
            dist(x, d, i, j)
        })
        .collect()
}

/// Equal-width histogram over [min, max] of the finite values: (edges, counts).
pub fn histogram(v: &[f64], bins: usize) -> (Vec<f64>, Vec<u64>) {
    let f: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    let (lo, hi) = f.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
    if f.is_empty() {
        return (vec![0.0, 1.0], vec![0]);
    }
    let hi = if hi > lo { hi } else { lo + 1.0 };
    let w = (hi - lo) / bins as f64;
    let edges = (0..=bins).map(|b| lo + w * b as f64).collect();
    let mut counts = vec![0u64; bins];
    for x in f {
        counts[(((x - lo) / w) as usize).min(bins - 1)] += 1;
    }
    (edges, counts)
}

/// Levina-Bickel per-cell estimates at `k` (needs `nn.k > k`: column 0 is the cell itself),
/// NaN where a distance is 0 (duplicates); and the global estimate.
pub fn levina_bickel(nn: &NeighborsResults, k: usize) -> (Vec<f64>, f64) {
    assert!(k >= 2 && nn.k > k, "need k >= 2 and k + 1 stored neighbours");
    let per: Vec<f64> = (0..nn.n)
        .map(|i| {
            let t = &nn.row_dist(i)[1..=k];
            let tk = t[k - 1] as f64;
            if t[0] <= 0.0 || tk <= 0.0 {
                return f64::NAN;
            }
            let s: f64 = t[..k - 1].iter().map(|&tj| (tk / tj as f64).ln()).sum::<f64>() / (k - 1) as f64;
            if s > 0.0 {
                1.0 / s
            } else {
                f64::NAN
            }
        })
        .collect();
    let inv: Vec<f64> = per.iter().filter(|m| m.is_finite()).map(|m| 1.0 / m).collect();
    let global = if inv.is_empty() { f64::NAN } else { inv.len() as f64 / inv.iter().sum::<f64>() };
    (per, global)
}

/// Per cell (fraction of `a`'s k neighbours found among `b`'s, Jaccard index) at `k`, self
/// excluded from both lists. Both must hold the same cells with at least k + 1 neighbours.
pub fn knn_overlap(a: &NeighborsResults, b: &NeighborsResults, k: usize) -> Vec<(f64, f64)> {
    assert_eq!(a.n, b.n);
    assert!(a.k > k && b.k > k);
    (0..a.n)
        .map(|i| {
            let strip = |r: &[u32]| -> Vec<u32> {
                let mut v: Vec<u32> = r.iter().copied().filter(|&j| j as usize != i).take(k).collect();
                v.sort_unstable();
                v
            };
            let (p, q) = (strip(&a.row(i)[..k + 1]), strip(&b.row(i)[..k + 1]));
            let shared = p.iter().filter(|j| q.binary_search(j).is_ok()).count();
            let union = p.len() + q.len() - shared;
            (shared as f64 / k as f64, shared as f64 / union.max(1) as f64)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::exact_knn;

    /// Points uniform in a d-dimensional cube: the MLE is close to d.
    #[test]
    fn levina_bickel_recovers_dimension() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for dim in [2usize, 5] {
            let n = 3000;
            // embed in 10 dimensions (zeros beyond dim)
            let x: Vec<f32> = (0..n * 10).map(|t| if t % 10 < dim { rng.gen::<f32>() } else { 0.0 }).collect();
            let nn = exact_knn(&x, n, 10, 21);
            let (_, m) = levina_bickel(&nn, 20);
            assert!((m - dim as f64).abs() < 0.15 * dim as f64, "dim {dim}: {m}");
        }
    }

    #[test]
    fn overlap_identical_and_histogram() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let x: Vec<f32> = (0..200 * 3).map(|_| rng.gen()).collect();
        let nn = exact_knn(&x, 200, 3, 16);
        assert!(knn_overlap(&nn, &nn, 15).iter().all(|&(f, j)| f == 1.0 && j == 1.0));
        let (e, c) = histogram(&[0.0, 0.5, 1.0, 1.0], 2);
        assert_eq!(e, vec![0.0, 0.5, 1.0]);
        assert_eq!(c, vec![1, 3]);
        assert_eq!(sample_pair_distances(&x, 200, 3, 1_000_000, 0).len(), 200 * 199 / 2);
    }
}
