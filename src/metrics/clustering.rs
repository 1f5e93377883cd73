//! KMeans NMI/ARI (scib-metrics `metrics/_nmi_ari.py::nmi_ari_cluster_labels_kmeans`,
//! `utils/_kmeans.py`).
//!
//! scib-metrics runs its JAX KMeans with k = number of labels, k-means++
//! initialisation (2 + floor(ln k) local trials, candidates sampled without
//! replacement), n_init = 1, Lloyd iterations, on mean-centred data, empty
//! clusters collapsing to the (centred) origin. We do the same with a
//! ChaCha8 stream, so the clustering is reproducible per seed but not
//! bit-identical to JAX's PRNG: results agree with scib-metrics only up to the
//! randomness of the initialisation.

use rand::Rng;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::compact_codes;
use super::neighbors::sqdist;
use super::nmi_ari::{ari, nmi};

/// Result of [`kmeans`].
#[derive(Debug, Clone)]
pub struct KMeansResult {
    pub labels: Vec<u32>,
    /// k x d centroids (in the original, uncentred coordinates)
    pub centroids: Vec<f32>,
    pub inertia: f64,
    pub n_iter: usize,
}

fn assign(x: &[f32], n: usize, d: usize, c: &[f32], k: usize) -> (Vec<u32>, Vec<f32>) {
    (0..n)
        .into_par_iter()
        .map(|i| {
            let xi = &x[i * d..(i + 1) * d];
            let mut best = (f32::INFINITY, 0u32);
            for j in 0..k {
                let dd = sqdist(xi, &c[j * d..(j + 1) * d]);
                if dd < best.0 {
                    best = (dd, j as u32);
                }
            }
            (best.1, best.0)
        })
        .unzip()
}

/// Weighted sampling of `m` distinct indices proportional to `w`.
fn sample_without_replacement(rng: &mut ChaCha8Rng, w: &[f64], m: usize) -> Vec<usize> {
    let mut w = w.to_vec();
    let mut out = Vec::with_capacity(m);
    for _ in 0..m {
        let total: f64 = w.iter().sum();
        if total <= 0.0 {
            break;
        }
        let mut r = rng.gen::<f64>() * total;
        let mut pick = w.len() - 1;
        for (i, &wi) in w.iter().enumerate() {
            if r < wi {
                pick = i;
                break;
            }
            r -= wi;
        }
        // guard against rounding landing on a zero-weight tail entry
        while w[pick] == 0.0 && pick > 0 {
            pick -= 1;
        }
        out.push(pick);
        w[pick] = 0.0;
    }
    out
}

/// k-means++ + Lloyd (scib-metrics' KMeans defaults: max_iter 300, n_init 1).
pub fn kmeans(x: &[f32], n: usize, d: usize, k: usize, max_iter: usize, seed: u64) -> KMeansResult {
    assert_eq!(x.len(), n * d);
    assert!(k >= 1 && k <= n);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // centre the data
    let mut mean = vec![0f64; d];
    for i in 0..n {
        for j in 0..d {
            mean[j] += x[i * d + j] as f64;
        }
    }
    mean.iter_mut().for_each(|m| *m /= n as f64);
    let xc: Vec<f32> = (0..n * d)
        .map(|t| (x[t] as f64 - mean[t % d]) as f32)
        .collect();
    // k-means++
    let mut cent = vec![0f32; k * d];
    let first = rng.gen_range(0..n);
    cent[..d].copy_from_slice(&xc[first * d..(first + 1) * d]);
    let mut min_d: Vec<f64> = (0..n)
        .into_par_iter()
        .map(|i| sqdist(&xc[i * d..(i + 1) * d], &cent[..d]) as f64)
        .collect();
    let trials = 2 + (k as f64).ln() as usize;
    for c in 1..k {
        let cands = sample_without_replacement(&mut rng, &min_d, trials.min(n));
        let mut best: Option<(f64, usize, Vec<f64>)> = None;
        for &cand in &cands {
            let xc_c = &xc[cand * d..(cand + 1) * d];
            let nd: Vec<f64> = (0..n)
                .into_par_iter()
                .map(|i| min_d[i].min(sqdist(&xc[i * d..(i + 1) * d], xc_c) as f64))
                .collect();
            let pot: f64 = nd.iter().sum();
            if best.as_ref().is_none_or(|b| pot < b.0) {
                best = Some((pot, cand, nd));
            }
        }
        let (_, cand, nd) = best.unwrap_or_else(|| (0.0, rng.gen_range(0..n), min_d.clone()));
        cent[c * d..(c + 1) * d].copy_from_slice(&xc[cand * d..(cand + 1) * d]);
        min_d = nd;
    }
    // Lloyd
    let (mut labels, _) = assign(&xc, n, d, &cent, k);
    let mut n_iter = 0;
    for _ in 0..max_iter {
        n_iter += 1;
        let mut sums = vec![0f64; k * d];
        let mut counts = vec![0usize; k];
        for i in 0..n {
            let l = labels[i] as usize;
            counts[l] += 1;
            for j in 0..d {
                sums[l * d + j] += xc[i * d + j] as f64;
            }
        }
        for c in 0..k {
            let cnt = counts[c].max(1) as f64;
            for j in 0..d {
                cent[c * d + j] = (sums[c * d + j] / cnt) as f32;
            }
        }
        let (new_labels, _) = assign(&xc, n, d, &cent, k);
        let changed = new_labels != labels;
        labels = new_labels;
        if !changed {
            break;
        }
    }
    let (labels, dists) = assign(&xc, n, d, &cent, k);
    let inertia = dists.iter().map(|&v| v as f64).sum();
    let centroids = (0..k * d)
        .map(|t| (cent[t] as f64 + mean[t % d]) as f32)
        .collect();
    KMeansResult {
        labels,
        centroids,
        inertia,
        n_iter,
    }
}

/// NMI and ARI between KMeans clusters (k = number of labels) and the labels.
pub fn nmi_ari_cluster_labels_kmeans(
    x: &[f32],
    n: usize,
    d: usize,
    labels: &[u32],
    seed: u64,
) -> (f64, f64) {
    let k = compact_codes(labels).1;
    let km = kmeans(x, n, d, k, 300, seed);
    (nmi(labels, &km.labels), ari(labels, &km.labels))
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::load_case;
    use super::*;

    /// KMeans is seeded with JAX's PRNG in scib-metrics and ChaCha8 here, so the
    /// initialisations differ and the Lloyd fixed point reached can differ
    /// (on `hard`, where one label is split into two far-apart sub-clusters,
    /// k-means lands in different local optima depending on the seed). The test
    /// therefore checks that scib-metrics' NMI/ARI lies within the range our
    /// KMeans produces over seeds 0..12, widened by 0.02. On data with one clear optimum (`easy`) they agree exactly.
    #[test]
    fn kmeans_nmi_ari_close_to_scib() {
        for case in ["easy", "hard", "mixed", "edge"] {
            let f = load_case(case);
            let mut rn = (f64::INFINITY, f64::NEG_INFINITY);
            let mut ra = (f64::INFINITY, f64::NEG_INFINITY);
            for seed in 0..12 {
                let (v, a) = nmi_ari_cluster_labels_kmeans(&f.embedding, f.n, f.d, &f.labels, seed);
                rn = (rn.0.min(v), rn.1.max(v));
                ra = (ra.0.min(a), ra.1.max(a));
            }
            let (sn, sa) = (f.metric("kmeans_nmi"), f.metric("kmeans_ari"));
            eprintln!("{case} kmeans over seeds 0..12: NMI [{:.4}, {:.4}] (scib {sn:.4}), ARI [{:.4}, {:.4}] (scib {sa:.4})", rn.0, rn.1, ra.0, ra.1);
            assert!(
                sn >= rn.0 - 0.02 && sn <= rn.1 + 0.02,
                "{case}: scib NMI outside our seed range"
            );
            assert!(
                sa >= ra.0 - 0.02 && sa <= ra.1 + 0.02,
                "{case}: scib ARI outside our seed range"
            );
        }
    }

    #[test]
    fn kmeans_is_deterministic_per_seed() {
        let f = load_case("hard");
        let a = kmeans(&f.embedding, f.n, f.d, 7, 300, 9);
        let b = kmeans(&f.embedding, f.n, f.d, 7, 300, 9);
        assert_eq!(a.labels, b.labels);
    }
}
