//! Isolated label score, ASW variant (scib-metrics `metrics/_isolated_labels.py`).
//!
//! Isolated labels: labels present in at most `iso_threshold` batches; by
//! default the threshold is the minimum number of batches any label occurs in
//! (so the labels present in the fewest batches). The silhouette of *all*
//! labels (euclidean, nearest) is computed once, rescaled to (s + 1) / 2 if
//! `rescale`, averaged over the cells of each isolated label, then averaged.

use super::compact_codes;
use super::silhouette::{silhouette_samples, BetweenCluster, Distance};

/// Labels (original codes, sorted) present in at most `iso_threshold` batches
/// (default: the minimum over labels).
pub fn get_isolated_labels(
    labels: &[u32],
    batches: &[u32],
    iso_threshold: Option<usize>,
) -> Vec<u32> {
    let (lc, nl) = compact_codes(labels);
    let (bc, nb) = compact_codes(batches);
    let mut seen = vec![false; nl * nb];
    for i in 0..labels.len() {
        seen[lc[i] as usize * nb + bc[i] as usize] = true;
    }
    let counts: Vec<usize> = (0..nl)
        .map(|l| seen[l * nb..(l + 1) * nb].iter().filter(|&&s| s).count())
        .collect();
    let thr = iso_threshold.unwrap_or_else(|| counts.iter().copied().min().unwrap_or(0));
    let mut uniq: Vec<u32> = labels.to_vec();
    uniq.sort_unstable();
    uniq.dedup();
    uniq.into_iter()
        .zip(counts)
        .filter(|&(_, c)| c <= thr)
        .map(|(u, _)| u)
        .collect()
}

/// Isolated-label ASW (scib `isolated_labels`, chunk size 256).
pub fn isolated_labels(
    x: &[f32],
    n: usize,
    d: usize,
    labels: &[u32],
    batches: &[u32],
    rescale: bool,
    iso_threshold: Option<usize>,
) -> f64 {
    let s = silhouette_samples(
        x,
        n,
        d,
        labels,
        256,
        Distance::Euclidean,
        BetweenCluster::Nearest,
    );
    isolated_labels_from_silhouette(&s, labels, batches, rescale, iso_threshold)
}

/// Same score from precomputed label silhouettes (`silhouette_samples` with
/// euclidean / nearest, as `silhouette_label` uses), so a pipeline can compute
/// the O(n²) silhouette once for both metrics.
pub fn isolated_labels_from_silhouette(
    sil: &[f64],
    labels: &[u32],
    batches: &[u32],
    rescale: bool,
    iso_threshold: Option<usize>,
) -> f64 {
    let n = sil.len();
    assert_eq!(labels.len(), n);
    let iso = get_isolated_labels(labels, batches, iso_threshold);
    if iso.is_empty() {
        return f64::NAN;
    }
    let mut s = sil.to_vec();
    if rescale {
        s.iter_mut().for_each(|v| *v = (*v + 1.0) / 2.0);
    }
    let mut total = 0.0;
    for &l in &iso {
        let (sum, cnt) = (0..n)
            .filter(|&i| labels[i] == l)
            .fold((0.0, 0usize), |(a, c), i| (a + s[i], c + 1));
        total += sum / cnt as f64;
    }
    total / iso.len() as f64
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{assert_close, load_case};
    use super::*;

    #[test]
    fn isolated_labels_match_scib() {
        for case in ["easy", "hard", "mixed", "edge"] {
            let f = load_case(case);
            let v = isolated_labels(&f.embedding, f.n, f.d, &f.labels, &f.batches, true, None);
            assert_close(
                case,
                "isolated_labels",
                v,
                f.metric("isolated_labels"),
                1e-3,
            );
            let s = silhouette_samples(
                &f.embedding,
                f.n,
                f.d,
                &f.labels,
                256,
                Distance::Euclidean,
                BetweenCluster::Nearest,
            );
            assert_eq!(
                isolated_labels_from_silhouette(&s, &f.labels, &f.batches, true, None),
                v
            );
            let sl = super::super::silhouette::silhouette_label_from_samples(&s, true);
            assert_close(
                case,
                "silhouette_label (shared samples)",
                sl,
                f.metric("silhouette_label"),
                1e-3,
            );
        }
    }
}
