//! Principal component regression comparison (scib-metrics
//! `metrics/_pcr_comparison.py`, `utils/_pcr.py`, `utils/_pca.py`).
//!
//! PCR(X, batch) = sum_j R²_j var_j / sum_j var_j over the first `n_comps`
//! principal components (all of them by default), where R²_j is the R² of the
//! linear regression of PC j on the one-hot batch (the Benchmarker passes
//! `categorical=True`; the centred one-hot regression without intercept that
//! scib does equals a regression with intercept, so R²_j = between-batch sum of
//! squares / total sum of squares of PC j).
//!
//! With all components, sum_j R²_j var_j = trace(between-batch scatter)/(n-1)
//! exactly, so no PCA is needed; with `n_comps = Some(k)` the PCA is done on
//! the d x d covariance in f64.

use super::compact_codes;
use super::linalg::symmetric_eigen;

/// Per-batch means (centred, i.e. minus the global mean) and counts, plus the
/// total sum of squares; all f64.
fn batch_stats(x: &[f32], n: usize, d: usize, batches: &[u32]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (codes, nb) = compact_codes(batches);
    let mut mean = vec![0f64; d];
    for i in 0..n {
        for j in 0..d {
            mean[j] += x[i * d + j] as f64;
        }
    }
    mean.iter_mut().for_each(|m| *m /= n as f64);
    let mut bm = vec![0f64; nb * d];
    let mut cnt = vec![0f64; nb];
    for i in 0..n {
        let b = codes[i] as usize;
        cnt[b] += 1.0;
        for j in 0..d {
            bm[b * d + j] += x[i * d + j] as f64 - mean[j];
        }
    }
    for b in 0..nb {
        for j in 0..d {
            bm[b * d + j] /= cnt[b];
        }
    }
    (mean, bm, cnt)
}

/// PCR of `x` (n x d) on categorical `batches` (scib `principal_component_regression(..., categorical=True)`).
pub fn principal_component_regression(
    x: &[f32],
    n: usize,
    d: usize,
    batches: &[u32],
    n_comps: Option<usize>,
) -> f64 {
    assert_eq!(x.len(), n * d);
    assert_eq!(batches.len(), n);
    let (mean, bm, cnt) = batch_stats(x, n, d, batches);
    let max_comps = n.min(d);
    let k = n_comps.unwrap_or(max_comps);
    assert!(k >= 1 && k <= max_comps, "n_comps must be in 1..=min(n, d)");
    if k == max_comps {
        pcr_all_components(x, n, d, &mean, &bm, &cnt)
    } else {
        pcr_pca(x, n, d, &mean, &bm, &cnt, k)
    }
}

/// All components span the centred data: closed form.
fn pcr_all_components(x: &[f32], n: usize, d: usize, mean: &[f64], bm: &[f64], cnt: &[f64]) -> f64 {
    let nb = cnt.len();
    {
        let mut tss = 0f64;
        for i in 0..n {
            for j in 0..d {
                let t = x[i * d + j] as f64 - mean[j];
                tss += t * t;
            }
        }
        let mut between = 0f64;
        for b in 0..nb {
            between += cnt[b] * bm[b * d..(b + 1) * d].iter().map(|v| v * v).sum::<f64>();
        }
        between / tss
    }
}

/// PCA on the covariance, regression on the top-k components.
fn pcr_pca(x: &[f32], n: usize, d: usize, mean: &[f64], bm: &[f64], cnt: &[f64], k: usize) -> f64 {
    let nb = cnt.len();
    // covariance (d x d), eigen-decomposition, top-k components
    let mut cov = vec![0f64; d * d];
    let mut row = vec![0f64; d];
    for i in 0..n {
        for j in 0..d {
            row[j] = x[i * d + j] as f64 - mean[j];
        }
        for a in 0..d {
            let ra = row[a];
            for b in a..d {
                cov[a * d + b] += ra * row[b];
            }
        }
    }
    for a in 0..d {
        for b in a..d {
            let v = cov[a * d + b] / (n as f64 - 1.0);
            cov[a * d + b] = v;
            cov[b * d + a] = v;
        }
    }
    let (w, v) = symmetric_eigen(&cov, d);
    let mut num = 0f64;
    let mut den = 0f64;
    for c in (d - k..d).rev() {
        let var = w[c];
        let tss_c = var * (n as f64 - 1.0);
        let mut between = 0f64;
        for b in 0..nb {
            let proj: f64 = (0..d).map(|j| bm[b * d + j] * v[j * d + c]).sum();
            between += cnt[b] * proj * proj;
        }
        let r2 = (1.0 - (tss_c - between) / tss_c).max(0.0);
        num += r2 * var;
        den += var;
    }
    num / den
}

/// PCR comparison (scib `pcr_comparison`): with `scale`, (pcr_pre - pcr_post) /
/// pcr_pre clipped at 0 (higher = more batch variance removed); otherwise
/// pcr_post - pcr_pre.
#[allow(clippy::too_many_arguments)]
pub fn pcr_comparison(
    x_pre: &[f32],
    d_pre: usize,
    x_post: &[f32],
    d_post: usize,
    n: usize,
    batches: &[u32],
    n_comps: Option<usize>,
    scale: bool,
) -> f64 {
    let pre = principal_component_regression(x_pre, n, d_pre, batches, n_comps);
    let post = principal_component_regression(x_post, n, d_post, batches, n_comps);
    if scale {
        ((pre - post) / pre).max(0.0)
    } else {
        post - pre
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{assert_close, load_case};
    use super::*;

    #[test]
    fn pcr_matches_scib() {
        for case in ["easy", "hard", "mixed", "edge"] {
            let f = load_case(case);
            let (n, d) = (f.n, f.d);
            assert_close(
                case,
                "pcr_pre",
                principal_component_regression(&f.x_pre, n, f.d_pre, &f.batches, None),
                f.metric("pcr_pre"),
                1e-3,
            );
            assert_close(
                case,
                "pcr_post",
                principal_component_regression(&f.embedding, n, d, &f.batches, None),
                f.metric("pcr_post"),
                1e-3,
            );
            assert_close(
                case,
                "pcr_post_5comps",
                principal_component_regression(&f.embedding, n, d, &f.batches, Some(5)),
                f.metric("pcr_post_5comps"),
                1e-3,
            );
            // the full eigen path with all components must agree with the closed form
            let full_eig = {
                let (mean, bm, cnt) = batch_stats(&f.embedding, n, d, &f.batches);
                pcr_pca(&f.embedding, n, d, &mean, &bm, &cnt, d.min(n))
            };
            assert!((full_eig - f.metric("pcr_post")).abs() < 1e-3);
            assert_close(
                case,
                "pcr_comparison",
                pcr_comparison(
                    &f.x_pre,
                    f.d_pre,
                    &f.embedding,
                    d,
                    n,
                    &f.batches,
                    None,
                    true,
                ),
                f.metric("pcr_comparison"),
                1e-3,
            );
            assert_close(
                case,
                "pcr_comparison_unscaled",
                pcr_comparison(
                    &f.x_pre,
                    f.d_pre,
                    &f.embedding,
                    d,
                    n,
                    &f.batches,
                    None,
                    false,
                ),
                f.metric("pcr_comparison_unscaled"),
                1e-3,
            );
        }
    }
}
