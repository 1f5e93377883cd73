//! Aggregate scores as scib-metrics' `Benchmarker.get_results`:
//! optional min-max scaling of every metric across embeddings (sklearn
//! `MinMaxScaler`: a constant column becomes 0, NaN stays NaN), then the mean
//! of the batch-correction metrics, the mean of the bio-conservation metrics
//! (NaNs skipped like pandas' groupby mean), and
//! total = 0.4 * batch + 0.6 * bio.

/// Which group a metric belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum MetricKind {
    BatchCorrection,
    BioConservation,
}

/// Aggregates of one embedding.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AggregateScores {
    pub batch_correction: f64,
    pub bio_conservation: f64,
    pub total: f64,
}

/// Min-max scale each metric (column) across embeddings (rows).
pub fn min_max_scale(values: &[Vec<f64>]) -> Vec<Vec<f64>> {
    let m = values.first().map_or(0, |r| r.len());
    let mut out = values.to_vec();
    for j in 0..m {
        let col = values.iter().map(|r| r[j]).filter(|v| !v.is_nan());
        let (lo, hi) = col.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
        let range = if hi - lo == 0.0 || !(hi - lo).is_finite() {
            1.0
        } else {
            hi - lo
        };
        for r in out.iter_mut() {
            r[j] = (r[j] - lo) / range;
        }
    }
    out
}

fn nanmean(v: impl Iterator<Item = f64>) -> f64 {
    let (s, c) = v
        .filter(|x| !x.is_nan())
        .fold((0.0, 0usize), |(s, c), x| (s + x, c + 1));
    if c == 0 {
        f64::NAN
    } else {
        s / c as f64
    }
}

/// `values[e][m]` is metric `m` of embedding `e`; `kinds[m]` its group.
pub fn aggregate(kinds: &[MetricKind], values: &[Vec<f64>], min_max: bool) -> Vec<AggregateScores> {
    for r in values {
        assert_eq!(r.len(), kinds.len());
    }
    let vals = if min_max {
        min_max_scale(values)
    } else {
        values.to_vec()
    };
    vals.iter()
        .map(|r| {
            let batch = nanmean(
                r.iter()
                    .zip(kinds)
                    .filter(|(_, &k)| k == MetricKind::BatchCorrection)
                    .map(|(v, _)| *v),
            );
            let bio = nanmean(
                r.iter()
                    .zip(kinds)
                    .filter(|(_, &k)| k == MetricKind::BioConservation)
                    .map(|(v, _)| *v),
            );
            AggregateScores {
                batch_correction: batch,
                bio_conservation: bio,
                total: 0.4 * batch + 0.6 * bio,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{assert_close, load_case};
    use super::*;

    /// Benchmarker keeps the metric table in pandas with float32-derived values,
    /// so its means differ from ours at ~1e-8; 1e-6 is the tolerance.
    #[test]
    fn aggregate_matches_benchmarker() {
        for case in ["easy", "hard", "mixed", "edge"] {
            let f = load_case(case);
            for (scaled, key) in [(false, "raw"), (true, "scaled")] {
                let bm = &f.raw["benchmarker"][key];
                let types = bm["metric_types"].as_object().unwrap();
                let metric_cols: Vec<(&String, MetricKind)> = types
                    .iter()
                    .filter_map(|(c, t)| match t.as_str().unwrap() {
                        "Batch correction" => Some((c, MetricKind::BatchCorrection)),
                        "Bio conservation" => Some((c, MetricKind::BioConservation)),
                        _ => None,
                    })
                    .collect();
                let kinds: Vec<MetricKind> = metric_cols.iter().map(|(_, k)| *k).collect();
                let rows = bm["rows"].as_object().unwrap();
                // always feed the raw metric values; scaling is ours to do
                let raw_rows = f.raw["benchmarker"]["raw"]["rows"].as_object().unwrap();
                let embs: Vec<&String> = rows.keys().collect();
                let values: Vec<Vec<f64>> = embs
                    .iter()
                    .map(|e| {
                        metric_cols
                            .iter()
                            .map(|(c, _)| raw_rows[*e][*c].as_f64().unwrap_or(f64::NAN))
                            .collect()
                    })
                    .collect();
                let agg = aggregate(&kinds, &values, scaled);
                for (e, a) in embs.iter().zip(&agg) {
                    let r = &rows[*e];
                    let tag = format!("{key}/{e}");
                    assert_close(
                        case,
                        &format!("{tag} batch"),
                        a.batch_correction,
                        r["Batch correction"].as_f64().unwrap(),
                        1e-6,
                    );
                    assert_close(
                        case,
                        &format!("{tag} bio"),
                        a.bio_conservation,
                        r["Bio conservation"].as_f64().unwrap(),
                        1e-6,
                    );
                    assert_close(
                        case,
                        &format!("{tag} total"),
                        a.total,
                        r["Total"].as_f64().unwrap(),
                        1e-6,
                    );
                }
            }
        }
    }
}
