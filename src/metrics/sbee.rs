//! sBEE, the single-cell Batch Effect Evaluator (scib-metrics 0.6 `metrics/_sbee.py`;
//! Myradov et al. 2026). Offered, off by default, as in scib-metrics' Benchmarker.
//!
//! Per cell, the harmonic mean of two scores in [0, 1]:
//! - neighbourhood composition: 1 - the Jensen-Shannon distance (base 2) between the batch
//!   counts of the same-type cells among the first `min(k, cells of that type)` neighbours
//!   (self included, as the 90-NN lists are) and the batch counts of all cells of that type,
//!   both clipped at 1e-10 and normalised;
//! - distance: with `intra` the median Euclidean distance to the other cells of the same type and
//!   batch (0 for a group of one) and `inter` the median distance to the same-type cells of other
//!   batches (`intra` when there are none), `exp(-|1 - min(intra/inter, 1)| / 0.15)`; the ratio
//!   is undefined (and the cell scores 0, as scib-metrics' `np.where(denom > 0, ...)` gives for
//!   NaN) when either is 0.
//!
//! The score is the mean over (type, batch) groups within each type, then over types.

use rayon::prelude::*;

use super::compact_codes;
use super::neighbors::NeighborsResults;

/// scib-metrics' default sensitivity of the distance score.
pub const SENSITIVITY: f64 = 0.15;

fn median(v: &mut [f64]) -> f64 {
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    let (_, &mut hi, _) = v.select_nth_unstable_by(n / 2, f64::total_cmp);
    if n % 2 == 1 {
        hi
    } else {
        let lo = v[..n / 2].iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (lo + hi) / 2.0
    }
}

/// scipy's `jensenshannon(p, q, base=2)` after scib-metrics' clip at `eps` and normalisation.
fn js_distance(p: &[f64], q: &[f64]) -> f64 {
    const EPS: f64 = 1e-10;
    let norm = |v: &[f64]| {
        let c: Vec<f64> = v.iter().map(|&x| x.max(EPS)).collect();
        let s: f64 = c.iter().sum();
        let c: Vec<f64> = c.iter().map(|x| x / s).collect();
        // scipy normalises once more
        let s2: f64 = c.iter().sum();
        c.into_iter().map(|x| x / s2).collect::<Vec<f64>>()
    };
    let (p, q) = (norm(p), norm(q));
    let rel = |a: f64, m: f64| if a > 0.0 { a * (a / m).ln() } else { 0.0 };
    let mut js = 0.0;
    for (a, b) in p.iter().zip(&q) {
        let m = (a + b) / 2.0;
        js += rel(*a, m);
    }
    for (a, b) in p.iter().zip(&q) {
        let m = (a + b) / 2.0;
        js += rel(*b, m);
    }
    js /= 2f64.ln();
    (js / 2.0).sqrt()
}

fn euclid(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| {
        let t = *x as f64 - *y as f64;
        t * t
    }).sum::<f64>().sqrt()
}

/// Per-cell sBEE values (before the group means).
pub fn sbee_per_cell(nn: &NeighborsResults, emb: &[f32], d: usize, batches: &[u32], labels: &[u32], sensitivity: f64) -> Vec<f64> {
    let n = nn.n;
    assert_eq!(batches.len(), n);
    assert_eq!(labels.len(), n);
    assert_eq!(emb.len(), n * d);
    let (b, nb) = compact_codes(batches);
    let (l, nl) = compact_codes(labels);
    let mut type_count = vec![0usize; nl];
    let mut global = vec![0f64; nl * nb];
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); nl];
    for i in 0..n {
        type_count[l[i] as usize] += 1;
        global[l[i] as usize * nb + b[i] as usize] += 1.0;
        members[l[i] as usize].push(i);
    }
    let k = nn.k;
    (0..n)
        .into_par_iter()
        .map(|i| {
            let t = l[i] as usize;
            // neighbourhood composition
            let kk = k.min(type_count[t]);
            let mut local = vec![0f64; nb];
            for &j in &nn.indices[i * k..i * k + kk] {
                let j = j as usize;
                if l[j] as usize == t {
                    local[b[j] as usize] += 1.0;
                }
            }
            let js_score = 1.0 - js_distance(&local, &global[t * nb..(t + 1) * nb]);
            // distance ratio
            let xi = &emb[i * d..(i + 1) * d];
            let (mut same, mut other) = (Vec::new(), Vec::new());
            for &j in &members[t] {
                if j == i {
                    continue;
                }
                let dist = euclid(xi, &emb[j * d..(j + 1) * d]);
                if b[j] == b[i] {
                    same.push(dist);
                } else {
                    other.push(dist);
                }
            }
            let intra = if same.is_empty() { 0.0 } else { median(&mut same) };
            let inter = if other.is_empty() { intra } else { median(&mut other) };
            if intra == 0.0 || inter == 0.0 {
                // the ratio is NaN there, and so the harmonic mean; `np.where(denom > 0, ..)` gives 0
                return 0.0;
            }
            let ratio = intra / inter;
            let ratio_score = (-(1.0 - ratio.min(1.0)).abs() / sensitivity).exp();
            let denom = js_score + ratio_score;
            if denom > 0.0 {
                2.0 * js_score * ratio_score / denom
            } else {
                0.0
            }
        })
        .collect()
}

/// sBEE of an embedding: per-cell values averaged over (type, batch) groups, then over the
/// groups of each type, then over types. Higher is better mixed.
pub fn sbee(nn: &NeighborsResults, emb: &[f32], d: usize, batches: &[u32], labels: &[u32]) -> f64 {
    let per = sbee_per_cell(nn, emb, d, batches, labels, SENSITIVITY);
    let (b, nb) = compact_codes(batches);
    let (l, nl) = compact_codes(labels);
    let mut sum = vec![0f64; nl * nb];
    let mut cnt = vec![0usize; nl * nb];
    for i in 0..per.len() {
        let g = l[i] as usize * nb + b[i] as usize;
        sum[g] += per[i];
        cnt[g] += 1;
    }
    let mut total = 0.0;
    let mut types = 0usize;
    for t in 0..nl {
        let groups: Vec<f64> = (0..nb).filter(|&bb| cnt[t * nb + bb] > 0).map(|bb| sum[t * nb + bb] / cnt[t * nb + bb] as f64).collect();
        if !groups.is_empty() {
            total += groups.iter().sum::<f64>() / groups.len() as f64;
            types += 1;
        }
    }
    if types == 0 {
        f64::NAN
    } else {
        total / types as f64
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{assert_close, load_case};
    use super::*;

    #[test]
    fn sbee_matches_scib() {
        for case in ["easy", "hard", "mixed", "edge"] {
            let f = load_case(case);
            let ours = sbee(&f.knn, &f.embedding, f.d, &f.batches, &f.labels);
            assert_close(case, "sbee", ours, f.metric("sbee"), 1e-6);
        }
    }

    #[test]
    fn js_distance_of_equal_distributions_is_zero_and_of_disjoint_is_one() {
        assert!(js_distance(&[1.0, 2.0], &[2.0, 4.0]).abs() < 1e-7);
        assert!((js_distance(&[1.0, 0.0], &[0.0, 1.0]) - 1.0).abs() < 1e-4);
    }

    #[test]
    fn median_even_and_odd() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
