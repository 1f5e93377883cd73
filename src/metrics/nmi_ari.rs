//! NMI (arithmetic normalisation) and ARI, as scikit-learn's
//! `normalized_mutual_info_score(average_method="arithmetic")` and
//! `adjusted_rand_score`, which scib-metrics calls.

use std::collections::HashMap;

use super::compact_codes;

type Contingency = (HashMap<(u32, u32), u64>, Vec<u64>, Vec<u64>);

/// Sparse contingency table: (row code, col code) -> count, plus margins.
fn contingency(a: &[u32], b: &[u32]) -> Contingency {
    assert_eq!(a.len(), b.len());
    let (ca, na) = compact_codes(a);
    let (cb, nb) = compact_codes(b);
    let mut table: HashMap<(u32, u32), u64> = HashMap::new();
    let mut ra = vec![0u64; na];
    let mut rb = vec![0u64; nb];
    for i in 0..a.len() {
        *table.entry((ca[i], cb[i])).or_insert(0) += 1;
        ra[ca[i] as usize] += 1;
        rb[cb[i] as usize] += 1;
    }
    (table, ra, rb)
}

/// sklearn `entropy`: -sum (p_i) (ln c_i - ln n).
fn entropy(counts: &[u64], n: f64) -> f64 {
    -counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| (c as f64 / n) * ((c as f64).ln() - n.ln()))
        .sum::<f64>()
}

/// Mutual information as sklearn's `mutual_info_score` (entries in row-major
/// order, per-entry |mi| < eps set to 0, result clipped at 0).
fn mutual_info(table: &HashMap<(u32, u32), u64>, ra: &[u64], rb: &[u64]) -> f64 {
    if ra.len() == 1 || rb.len() == 1 {
        return 0.0;
    }
    let mut entries: Vec<(&(u32, u32), &u64)> = table.iter().collect();
    entries.sort_unstable_by_key(|e| *e.0);
    let total: f64 = ra.iter().sum::<u64>() as f64;
    let (log_sa, log_sb) = (
        (ra.iter().sum::<u64>() as f64).ln(),
        (rb.iter().sum::<u64>() as f64).ln(),
    );
    let mut mi = 0f64;
    for (&(i, j), &c) in entries {
        let c = c as f64;
        let c_nm = c / total;
        let outer = ra[i as usize] as f64 * rb[j as usize] as f64;
        let log_outer = -outer.ln() + log_sa + log_sb;
        let v = c_nm * (c.ln() - total.ln()) + c_nm * log_outer;
        mi += if v.abs() < f64::EPSILON { 0.0 } else { v };
    }
    mi.max(0.0)
}

/// Normalised mutual information with arithmetic mean of the entropies.
pub fn nmi(labels_true: &[u32], labels_pred: &[u32]) -> f64 {
    let n = labels_true.len();
    let (table, ra, rb) = contingency(labels_true, labels_pred);
    if (ra.len() == 1 && rb.len() == 1) || n == 0 {
        return 1.0;
    }
    let mi = mutual_info(&table, &ra, &rb);
    if mi == 0.0 {
        return 0.0;
    }
    let nf = n as f64;
    let norm = (entropy(&ra, nf) + entropy(&rb, nf)) / 2.0;
    mi / norm
}

/// Adjusted Rand index (pair-confusion form, exact integer counts).
pub fn ari(labels_true: &[u32], labels_pred: &[u32]) -> f64 {
    let n = labels_true.len() as i128;
    let (table, ra, rb) = contingency(labels_true, labels_pred);
    let sum_squares: i128 = table.values().map(|&c| (c as i128) * (c as i128)).sum();
    // C[0,1] = sum_ij n_ij * n_.j - sum_squares ; C[1,0] = sum_ij n_ij * n_i. - sum_squares
    let mut c01: i128 = -sum_squares;
    let mut c10: i128 = -sum_squares;
    for (&(i, j), &c) in &table {
        c01 += c as i128 * rb[j as usize] as i128;
        c10 += c as i128 * ra[i as usize] as i128;
    }
    let tp = sum_squares - n;
    let c00 = n * n - c01 - c10 - sum_squares;
    let (tn, fp, fnn) = (c00, c01, c10);
    if fnn == 0 && fp == 0 {
        return 1.0;
    }
    let (tn, fp, fnn, tp) = (tn as f64, fp as f64, fnn as f64, tp as f64);
    2.0 * (tp * tn - fnn * fp) / ((tp + fnn) * (fnn + tn) + (tp + fp) * (fp + tn))
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{assert_close, load_case};
    use super::*;

    #[test]
    fn nmi_ari_match_sklearn() {
        for case in ["easy", "hard", "mixed", "edge"] {
            let f = load_case(case);
            let km = f.u32_list("kmeans_labels_scib");
            assert_close(
                case,
                "nmi_labels_vs_kmeans",
                nmi(&f.labels, &km),
                f.metric("nmi_labels_vs_kmeans"),
                1e-9,
            );
            assert_close(
                case,
                "ari_labels_vs_kmeans",
                ari(&f.labels, &km),
                f.metric("ari_labels_vs_kmeans"),
                1e-9,
            );
            assert_close(
                case,
                "nmi_labels_vs_batches",
                nmi(&f.labels, &f.batches),
                f.metric("nmi_labels_vs_batches"),
                1e-9,
            );
            assert_close(
                case,
                "ari_labels_vs_batches",
                ari(&f.labels, &f.batches),
                f.metric("ari_labels_vs_batches"),
                1e-9,
            );
        }
    }

    #[test]
    fn trivial_cases() {
        assert_eq!(nmi(&[0, 0, 0], &[1, 1, 1]), 1.0);
        assert_eq!(ari(&[0, 0, 1, 1], &[5, 5, 2, 2]), 1.0);
        assert_eq!(nmi(&[0, 0, 1, 1], &[5, 5, 2, 2]), 1.0);
    }
}
