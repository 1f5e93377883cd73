//! The unintegrated reference embedding `X_pre` that scib-metrics' `Benchmarker.prepare`
//! builds for PCR comparison when no pre-integrated embedding is given:
//!
//! ```python
//! sc.tl.pca(adata, svd_solver="arpack", use_highly_variable=False)   # benchmark/_core.py
//! ```
//!
//! i.e. a zero-centred PCA of `X` exactly as stored (no normalisation, every gene),
//! 50 components (`min(n_obs, n_vars) - 1` when that is smaller), the projections
//! `(X - mean) V`. PCR then uses all of these components, so only the subspace
//! matters (not the signs). Here the top eigenvectors of the covariance are found
//! by thick-restart Lanczos on the implicit, centred covariance operator
//! (`X^T (X v - 1 mean.v) / (n - 1)`), never forming the genes x genes matrix;
//! ARPACK's implicitly restarted Lanczos in scanpy converges to the same subspace.

use rayon::prelude::*;

use super::linalg::lanczos_largest_magnitude;

/// scanpy's default number of components for `n` cells and `g` genes.
pub fn scanpy_n_comps(n: usize, g: usize) -> usize {
    let min_dim = n.min(g);
    if 50 >= min_dim {
        min_dim.saturating_sub(1)
    } else {
        50
    }
}

/// A sparse matrix in CSR form (row offsets, column indices, values).
pub struct Csr<'a> {
    pub indptr: &'a [usize],
    pub indices: &'a [u32],
    pub data: &'a [f32],
    pub n_rows: usize,
    pub n_cols: usize,
}

impl Csr<'_> {
    fn row(&self, i: usize) -> (&[u32], &[f32]) {
        let (a, b) = (self.indptr[i], self.indptr[i + 1]);
        (&self.indices[a..b], &self.data[a..b])
    }
}

/// Zero-centred PCA projections of `x` (n x n_comps, row-major f32) and the variances.
pub fn pca_projections(x: &Csr, n_comps: usize, seed: u64) -> (Vec<f32>, Vec<f64>) {
    let (n, g) = (x.n_rows, x.n_cols);
    assert!(n >= 2 && n_comps >= 1 && n_comps < g.min(n) + 1);
    let mut mean = vec![0f64; g];
    for i in 0..n {
        let (idx, val) = x.row(i);
        for (&j, &v) in idx.iter().zip(val) {
            mean[j as usize] += v as f64;
        }
    }
    mean.iter_mut().for_each(|m| *m /= n as f64);
    let chunk = n.div_ceil(rayon::current_num_threads().max(1) * 4).max(256);
    let matvec = |v: &[f64], y: &mut [f64]| {
        let mv: f64 = mean.iter().zip(v).map(|(a, b)| a * b).sum();
        // u = X_c v, then y = X_c^T u / (n - 1) = X^T u / (n - 1) (u sums to zero)
        let u: Vec<f64> = (0..n)
            .into_par_iter()
            .map(|i| {
                let (idx, val) = x.row(i);
                idx.iter().zip(val).map(|(&j, &a)| a as f64 * v[j as usize]).sum::<f64>() - mv
            })
            .collect();
        let acc = (0..n.div_ceil(chunk))
            .into_par_iter()
            .map(|c| {
                let mut acc = vec![0f64; g];
                for i in c * chunk..((c + 1) * chunk).min(n) {
                    let (idx, val) = x.row(i);
                    for (&j, &a) in idx.iter().zip(val) {
                        acc[j as usize] += a as f64 * u[i];
                    }
                }
                acc
            })
            .reduce(
                || vec![0f64; g],
                |mut a, b| {
                    a.iter_mut().zip(&b).for_each(|(p, q)| *p += q);
                    a
                },
            );
        let s: f64 = u.iter().sum();
        for j in 0..g {
            y[j] = (acc[j] - mean[j] * s) / (n - 1) as f64;
        }
    };
    let (vals, vecs) = lanczos_largest_magnitude(g, n_comps, matvec, seed);
    // vecs: g x n_comps row-major
    let offset: Vec<f64> = (0..n_comps)
        .map(|c| (0..g).map(|j| mean[j] * vecs[j * n_comps + c]).sum())
        .collect();
    let mut out = vec![0f32; n * n_comps];
    out.par_chunks_mut(n_comps).enumerate().for_each(|(i, row)| {
        let (idx, val) = x.row(i);
        let mut acc = vec![0f64; n_comps];
        for (&j, &a) in idx.iter().zip(val) {
            let vr = &vecs[j as usize * n_comps..(j as usize + 1) * n_comps];
            for c in 0..n_comps {
                acc[c] += a as f64 * vr[c];
            }
        }
        for c in 0..n_comps {
            row[c] = (acc[c] - offset[c]) as f32;
        }
    });
    (out, vals)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dense check: the projections' covariance is diagonal with the top eigenvalues.
    #[test]
    fn pca_projections_diagonalise_covariance() {
        let (n, g) = (60usize, 12usize);
        let mut dense = vec![0f32; n * g];
        let mut s = 7u64;
        for v in dense.iter_mut() {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            *v = if u < 0.5 { 0.0 } else { (u * 10.0).floor() };
        }
        for i in 0..n {
            dense[i * g] += (i % 3) as f32 * 5.0;
        }
        let (mut indptr, mut indices, mut data) = (vec![0usize], vec![], vec![]);
        for i in 0..n {
            for j in 0..g {
                if dense[i * g + j] != 0.0 {
                    indices.push(j as u32);
                    data.push(dense[i * g + j]);
                }
            }
            indptr.push(data.len());
        }
        let x = Csr { indptr: &indptr, indices: &indices, data: &data, n_rows: n, n_cols: g };
        let k = 4;
        let (p, vals) = pca_projections(&x, k, 0);
        for a in 0..k {
            for b in 0..k {
                let cov: f64 = (0..n).map(|i| p[i * k + a] as f64 * p[i * k + b] as f64).sum::<f64>() / (n - 1) as f64;
                let want = if a == b { vals[a] } else { 0.0 };
                assert!((cov - want).abs() < 1e-3 * vals[0], "{a},{b}: {cov} vs {want}");
            }
        }
        assert!(vals.windows(2).all(|w| w[0] >= w[1]));
    }
}
