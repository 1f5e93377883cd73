//! Scores of a label prediction, as scikit-learn defines them: `accuracy_score`,
//! `f1_score(average="macro")`, `precision_recall_fscore_support(zero_division=0)` and
//! `confusion_matrix` (rows: truth, columns: prediction).
//!
//! Labels are u32 codes. Like scikit-learn without an explicit `labels=`, the per-label scores
//! and the macro average run over the labels present in the truth or the prediction; a label
//! that is in neither is left out (it would otherwise count as an F1 of 0).

/// Fraction of cells whose prediction equals the truth (sklearn's `accuracy_score`); 0 when empty.
pub fn accuracy(truth: &[u32], predicted: &[u32]) -> f64 {
    assert_eq!(truth.len(), predicted.len(), "one prediction per cell");
    if truth.is_empty() {
        return 0.0;
    }
    truth.iter().zip(predicted).filter(|(a, b)| a == b).count() as f64 / truth.len() as f64
}

/// Confusion matrix, n_labels x n_labels row-major: entry (t, p) counts cells of true label t
/// predicted as p (sklearn's `confusion_matrix(labels=range(n_labels))`).
pub fn confusion_matrix(truth: &[u32], predicted: &[u32], n_labels: usize) -> Vec<u64> {
    assert_eq!(truth.len(), predicted.len(), "one prediction per cell");
    let mut m = vec![0u64; n_labels * n_labels];
    for (&t, &p) in truth.iter().zip(predicted) {
        m[t as usize * n_labels + p as usize] += 1;
    }
    m
}

/// The scores of one label.
#[derive(Debug, Clone, PartialEq)]
pub struct LabelScores {
    pub label: u32,
    /// tp / (tp + fp); 0 when the label is never predicted (sklearn's `zero_division=0`).
    pub precision: f64,
    /// tp / (tp + fn); 0 when the label is not in the truth.
    pub recall: f64,
    /// 2 tp / (2 tp + fp + fn).
    pub f1: f64,
    /// Cells with this true label.
    pub support: u64,
    /// Cells predicted as this label.
    pub predicted: u64,
}

/// Per-label precision, recall, F1 and support over the labels present in the truth or the
/// prediction, in code order (sklearn's `precision_recall_fscore_support(zero_division=0)`).
pub fn per_label(truth: &[u32], predicted: &[u32]) -> Vec<LabelScores> {
    assert_eq!(truth.len(), predicted.len(), "one prediction per cell");
    let n = truth.iter().chain(predicted).map(|&l| l as usize + 1).max().unwrap_or(0);
    let m = confusion_matrix(truth, predicted, n);
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    (0..n)
        .filter_map(|l| {
            let tp = m[l * n + l];
            let support: u64 = m[l * n..(l + 1) * n].iter().sum();
            let pred: u64 = (0..n).map(|t| m[t * n + l]).sum();
            if support == 0 && pred == 0 {
                return None;
            }
            let (tp, fp, fneg) = (tp as f64, (pred - tp) as f64, (support - tp) as f64);
            Some(LabelScores {
                label: l as u32,
                precision: ratio(tp, tp + fp),
                recall: ratio(tp, tp + fneg),
                f1: ratio(2.0 * tp, 2.0 * tp + fp + fneg),
                support,
                predicted: pred,
            })
        })
        .collect()
}

/// Macro-averaged F1 over the labels present in the truth or the prediction (sklearn's
/// `f1_score(average="macro")`): per label 2 tp / (2 tp + fp + fn), then the plain mean.
pub fn macro_f1(truth: &[u32], predicted: &[u32]) -> f64 {
    let per = per_label(truth, predicted);
    if per.is_empty() {
        return 0.0;
    }
    per.iter().map(|s| s.f1).sum::<f64>() / per.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    // Values from scikit-learn 1.9.1, computed once:
    //   t = [0,0,0,1,1,2,2,2,2,4,4,5]; p = [0,1,0,1,1,2,0,3,2,4,1,3]
    //   accuracy_score(t, p), f1_score(t, p, average="macro"),
    //   precision_recall_fscore_support(t, p, zero_division=0), confusion_matrix(t, p)
    // Label 3 is only predicted, label 5 only true; code 6 is in neither and must be skipped.
    const T: [u32; 12] = [0, 0, 0, 1, 1, 2, 2, 2, 2, 4, 4, 5];
    const P: [u32; 12] = [0, 1, 0, 1, 1, 2, 0, 3, 2, 4, 1, 3];

    #[test]
    fn accuracy_and_macro_f1_match_sklearn() {
        assert_eq!(accuracy(&T, &P), 0.5833333333333334);
        assert!((macro_f1(&T, &P) - 0.4444444444444444).abs() < 1e-15);
    }

    #[test]
    fn per_label_matches_sklearn() {
        let s = per_label(&T, &P);
        assert_eq!(s.iter().map(|x| x.label).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4, 5]);
        let precision = [0.6666666666666666, 0.5, 1.0, 0.0, 1.0, 0.0];
        let recall = [0.6666666666666666, 1.0, 0.5, 0.0, 0.5, 0.0];
        let f1 = [0.6666666666666666, 0.6666666666666666, 0.6666666666666666, 0.0, 0.6666666666666666, 0.0];
        let support = [3, 2, 4, 0, 2, 1];
        for (i, x) in s.iter().enumerate() {
            assert!((x.precision - precision[i]).abs() < 1e-15, "precision of {i}");
            assert!((x.recall - recall[i]).abs() < 1e-15, "recall of {i}");
            assert!((x.f1 - f1[i]).abs() < 1e-15, "f1 of {i}");
            assert_eq!(x.support, support[i], "support of {i}");
        }
        assert_eq!(s.iter().map(|x| x.predicted).sum::<u64>(), 12);
    }

    #[test]
    fn confusion_matches_sklearn_and_skips_absent_codes() {
        let want: [[u64; 6]; 6] =
            [[2, 1, 0, 0, 0, 0], [0, 2, 0, 0, 0, 0], [1, 0, 2, 1, 0, 0], [0, 0, 0, 0, 0, 0], [0, 1, 0, 0, 1, 0], [0, 0, 0, 1, 0, 0]];
        assert_eq!(confusion_matrix(&T, &P, 6), want.concat());
        // a code in neither truth nor prediction changes nothing
        let t2: Vec<u32> = T.iter().map(|&x| if x == 5 { 7 } else { x }).collect();
        let p2: Vec<u32> = P.to_vec();
        assert_eq!(per_label(&t2, &p2).len(), 6);
    }

    #[test]
    fn empty_input_scores_zero() {
        assert_eq!(accuracy(&[], &[]), 0.0);
        assert_eq!(macro_f1(&[], &[]), 0.0);
        assert!(per_label(&[], &[]).is_empty());
    }
}
