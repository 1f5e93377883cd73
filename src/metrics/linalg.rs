//! Small dense linear algebra needed by the metrics (f64, column-major-free):
//! symmetric eigen-decomposition by Householder tridiagonalisation + implicit
//! QL (the EISPACK tred2/tql2 pair, as in JAMA).

use rayon::prelude::*;

// AVX2 and FMA where the processor has them
use crate::linalg::dot as dotf;

/// Eigen-decomposition of a symmetric `n x n` row-major matrix `a`.
/// Returns (eigenvalues ascending, eigenvectors as `v[row * n + col]`, column
/// `col` belongs to eigenvalue `col`).
pub fn symmetric_eigen(a: &[f64], n: usize) -> (Vec<f64>, Vec<f64>) {
    assert_eq!(a.len(), n * n);
    let mut v: Vec<Vec<f64>> = (0..n).map(|i| a[i * n..(i + 1) * n].to_vec()).collect();
    let mut d = vec![0f64; n];
    let mut e = vec![0f64; n];
    if n == 0 {
        return (d, Vec::new());
    }
    tred2(&mut v, &mut d, &mut e);
    tql2(&mut v, &mut d, &mut e);
    let mut out = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..n {
            out[i * n + j] = v[i][j];
        }
    }
    (d, out)
}

fn tred2(v: &mut [Vec<f64>], d: &mut [f64], e: &mut [f64]) {
    let n = d.len();
    d.copy_from_slice(&v[n - 1]);
    for i in (1..n).rev() {
        let mut scale = 0.0;
        let mut h = 0.0;
        for k in 0..i {
            scale += d[k].abs();
        }
        if scale == 0.0 {
            e[i] = d[i - 1];
            for j in 0..i {
                d[j] = v[i - 1][j];
                v[i][j] = 0.0;
                v[j][i] = 0.0;
            }
        } else {
            for k in 0..i {
                d[k] /= scale;
                h += d[k] * d[k];
            }
            let mut f = d[i - 1];
            let mut g = h.sqrt();
            if f > 0.0 {
                g = -g;
            }
            e[i] = scale * g;
            h -= f * g;
            d[i - 1] = f - g;
            for j in 0..i {
                e[j] = 0.0;
            }
            for j in 0..i {
                f = d[j];
                v[j][i] = f;
                g = e[j] + v[j][j] * f;
                for k in (j + 1)..i {
                    g += v[k][j] * d[k];
                    e[k] += v[k][j] * f;
                }
                e[j] = g;
            }
            f = 0.0;
            for j in 0..i {
                e[j] /= h;
                f += e[j] * d[j];
            }
            let hh = f / (h + h);
            for j in 0..i {
                e[j] -= hh * d[j];
            }
            for j in 0..i {
                f = d[j];
                g = e[j];
                for k in j..i {
                    v[k][j] -= f * e[k] + g * d[k];
                }
                d[j] = v[i - 1][j];
                v[i][j] = 0.0;
            }
        }
        d[i] = h;
    }
    for i in 0..n - 1 {
        v[n - 1][i] = v[i][i];
        v[i][i] = 1.0;
        let h = d[i + 1];
        if h != 0.0 {
            for k in 0..=i {
                d[k] = v[k][i + 1] / h;
            }
            for j in 0..=i {
                let mut g = 0.0;
                for k in 0..=i {
                    g += v[k][i + 1] * v[k][j];
                }
                for k in 0..=i {
                    v[k][j] -= g * d[k];
                }
            }
        }
        for k in 0..=i {
            v[k][i + 1] = 0.0;
        }
    }
    for j in 0..n {
        d[j] = v[n - 1][j];
        v[n - 1][j] = 0.0;
    }
    v[n - 1][n - 1] = 1.0;
    e[0] = 0.0;
}

fn tql2(v: &mut [Vec<f64>], d: &mut [f64], e: &mut [f64]) {
    let n = d.len();
    for i in 1..n {
        e[i - 1] = e[i];
    }
    e[n - 1] = 0.0;
    let mut f = 0.0;
    let mut tst1: f64 = 0.0;
    let eps = f64::EPSILON;
    for l in 0..n {
        tst1 = tst1.max(d[l].abs() + e[l].abs());
        let mut m = l;
        while m < n {
            if e[m].abs() <= eps * tst1 {
                break;
            }
            m += 1;
        }
        if m == n {
            m = n - 1;
        }
        if m > l {
            loop {
                let mut g = d[l];
                let mut p = (d[l + 1] - g) / (2.0 * e[l]);
                let mut r = p.hypot(1.0);
                if p < 0.0 {
                    r = -r;
                }
                d[l] = e[l] / (p + r);
                d[l + 1] = e[l] * (p + r);
                let dl1 = d[l + 1];
                let mut h = g - d[l];
                for i in (l + 2)..n {
                    d[i] -= h;
                }
                f += h;
                p = d[m];
                let mut c = 1.0;
                let mut c2 = c;
                let mut c3 = c;
                let el1 = e[l + 1];
                let mut s = 0.0;
                let mut s2 = 0.0;
                for i in (l..m).rev() {
                    c3 = c2;
                    c2 = c;
                    s2 = s;
                    g = c * e[i];
                    h = c * p;
                    r = p.hypot(e[i]);
                    e[i + 1] = s * r;
                    s = e[i] / r;
                    c = p / r;
                    p = c * d[i] - s * g;
                    d[i + 1] = h + s * (c * g + s * d[i]);
                    for row in v.iter_mut() {
                        h = row[i + 1];
                        row[i + 1] = s * row[i] + c * h;
                        row[i] = c * row[i] - s * h;
                    }
                }
                p = -s * s2 * c3 * el1 * e[l] / dl1;
                e[l] = s * p;
                d[l] = c * p;
                if e[l].abs() <= eps * tst1 {
                    break;
                }
            }
        }
        d[l] += f;
        e[l] = 0.0;
    }
    // sort ascending
    for i in 0..n.saturating_sub(1) {
        let mut k = i;
        let mut p = d[i];
        for j in (i + 1)..n {
            if d[j] < p {
                k = j;
                p = d[j];
            }
        }
        if k != i {
            d[k] = d[i];
            d[i] = p;
            for row in v.iter_mut() {
                row.swap(i, k);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eigen_reconstructs() {
        let n = 7;
        let mut a = vec![0f64; n * n];
        for i in 0..n {
            for j in 0..=i {
                let v = ((i * 31 + j * 17) % 11) as f64 - 5.0 + if i == j { 3.0 } else { 0.0 };
                a[i * n + j] = v;
                a[j * n + i] = v;
            }
        }
        let (w, v) = symmetric_eigen(&a, n);
        for c in 1..n {
            assert!(w[c] >= w[c - 1]);
        }
        // A v_c = w_c v_c and orthonormality
        for c in 0..n {
            for i in 0..n {
                let av: f64 = (0..n).map(|k| a[i * n + k] * v[k * n + c]).sum();
                assert!((av - w[c] * v[i * n + c]).abs() < 1e-10);
            }
            for c2 in 0..n {
                let dot: f64 = (0..n).map(|k| v[k * n + c] * v[k * n + c2]).sum();
                assert!((dot - if c == c2 { 1.0 } else { 0.0 }).abs() < 1e-10);
            }
        }
    }
}

/// The `k` eigenpairs of largest magnitude of a symmetric `m x m` operator
/// (given as `matvec(x, y)`: y = A x), by thick-restart Lanczos with full
/// reorthogonalisation (the role ARPACK's `eigsh(which="LM")` plays in
/// scib-metrics). Returns (eigenvalues, eigenvectors `m x k` row-major), in
/// decreasing magnitude.
pub fn lanczos_largest_magnitude<F>(
    m: usize,
    k: usize,
    matvec: F,
    seed: u64,
) -> (Vec<f64>, Vec<f64>)
where
    F: Fn(&[f64], &mut [f64]),
{
    use rand::{Rng, SeedableRng};
    assert!(k >= 1 && k < m);
    let ncv = (2 * k + 1).max(20).min(m);
    let keep = (k + (ncv - k) / 2).min(ncv - 1);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    // basis vectors, each of length m
    let mut v: Vec<Vec<f64>> = Vec::with_capacity(ncv + 1);
    let mut start: Vec<f64> = (0..m).map(|_| rng.gen::<f64>() - 0.5).collect();
    normalize(&mut start);
    v.push(start);
    let mut h = vec![0f64; ncv * ncv]; // projected matrix
    let mut j0 = 0usize;
    let mut w = vec![0f64; m];
    let mut result: Option<(Vec<f64>, Vec<f64>)> = None;
    for _ in 0..500 {
        let mut beta_last = 0.0;
        for j in j0..ncv {
            matvec(&v[j], &mut w);
            // full classical Gram-Schmidt against v[0..=j], repeated only where it lost too
            // much (DGKS with ARPACK's 0.717 test), parallel over the basis (dots) and over
            // rows (update); the second pass's dots are taken while the first pass's update
            // has the basis in cache
            let wnorm = dotf(&w, &w).sqrt();
            let mut coef: Vec<f64> = v[..=j].par_iter().map(|vi| dotf(vi, &w)).collect();
            let (c2, rnorm2) = subtract_then_project(&mut w, &v[..=j], &coef);
            if rnorm2.sqrt() <= 0.717 * wnorm {
                subtract_combination(&mut w, &v[..=j], &c2);
                coef.iter_mut().zip(&c2).for_each(|(a, b)| *a += b);
            }
            for i in 0..=j {
                h[i * ncv + j] = coef[i];
                h[j * ncv + i] = coef[i];
            }
            let mut beta = dotf(&w, &w).sqrt();
            if beta < 1e-13 {
                // invariant subspace: continue with a fresh random orthogonal direction
                let mut r: Vec<f64> = (0..m).map(|_| rng.gen::<f64>() - 0.5).collect();
                for _pass in 0..2 {
                    let c: Vec<f64> = v[..=j].par_iter().map(|vi| dotf(vi, &r)).collect();
                    subtract_combination(&mut r, &v[..=j], &c);
                }
                normalize(&mut r);
                w.copy_from_slice(&r);
                beta = 0.0;
            } else {
                w.iter_mut().for_each(|x| *x /= beta);
            }
            if j + 1 < ncv {
                h[(j + 1) * ncv + j] = beta;
                h[j * ncv + j + 1] = beta;
            } else {
                beta_last = beta;
            }
            if v.len() == j + 1 {
                v.push(w.clone());
            } else {
                v[j + 1].copy_from_slice(&w);
            }
        }
        let (theta, s) = symmetric_eigen(&h, ncv);
        let mut order: Vec<usize> = (0..ncv).collect();
        order.sort_by(|&a, &b| theta[b].abs().total_cmp(&theta[a].abs()));
        let scale = theta.iter().fold(0f64, |a, t| a.max(t.abs())).max(1e-300);
        let converged = order[..k]
            .iter()
            .all(|&c| (beta_last * s[(ncv - 1) * ncv + c]).abs() <= 1e-10 * scale);
        // Ritz vectors of the kept set
        let kept: Vec<usize> = order[..if converged { k } else { keep }].to_vec();
        let ritz = ritz_vectors(&v[..ncv], &s, ncv, &kept, m);
        if converged {
            let vals: Vec<f64> = kept.iter().map(|&c| theta[c]).collect();
            let mut vecs = vec![0f64; m * k];
            for (t, y) in ritz.iter().enumerate() {
                for i in 0..m {
                    vecs[i * k + t] = y[i];
                }
            }
            result = Some((vals, vecs));
            break;
        }
        // thick restart: [Ritz vectors, residual direction]
        let resid = v[ncv].clone();
        h.iter_mut().for_each(|x| *x = 0.0);
        for (t, &c) in kept.iter().enumerate() {
            h[t * ncv + t] = theta[c];
        }
        v.truncate(0);
        v.extend(ritz);
        v.push(resid);
        // column/row `keep` (the couplings beta * s_last) is re-derived by the
        // full Gram-Schmidt of the next expansion
        j0 = keep;
    }
    result.expect("Lanczos did not converge in 500 restarts")
}

/// `w -= sum_i c[i] * basis[i][o..o + w.len()]`, basis vector by basis vector (the block of
/// `w` stays in the first-level cache).
#[inline(always)]
fn block_update(w: &mut [f64], basis: &[Vec<f64>], c: &[f64], o: usize) {
    let len = w.len();
    for (vi, &ci) in basis.iter().zip(c) {
        for (x, &y) in w.iter_mut().zip(&vi[o..o + len]) {
            *x -= ci * y;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_update_avx2(w: &mut [f64], basis: &[Vec<f64>], c: &[f64], o: usize) {
    block_update(w, basis, c, o)
}

/// [`block_update`] with AVX2 and FMA when the processor has them.
fn block_update_fast(w: &mut [f64], basis: &[Vec<f64>], c: &[f64], o: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the features were just checked.
            return unsafe { block_update_avx2(w, basis, c, o) };
        }
    }
    block_update(w, basis, c, o)
}

/// w -= sum_i c[i] * basis[i], in parallel over blocks of rows.
fn subtract_combination(w: &mut [f64], basis: &[Vec<f64>], c: &[f64]) {
    const B: usize = 2048;
    w.par_chunks_mut(B).enumerate().for_each(|(bi, wc)| block_update_fast(wc, basis, c, bi * B));
}
/// w -= sum_i c[i] * basis[i]; returns the dots basis[i] . w and |w|^2 of the result, taken
/// block by block while the basis' block is in cache.
fn subtract_then_project(w: &mut [f64], basis: &[Vec<f64>], c: &[f64]) -> (Vec<f64>, f64) {
    const B: usize = 256;
    let nb = basis.len();
    let parts: Vec<Vec<f64>> = w
        .par_chunks_mut(B)
        .enumerate()
        .map(|(bi, wc)| {
            let (o, len) = (bi * B, wc.len());
            block_update_fast(wc, basis, c, o);
            let mut part: Vec<f64> = basis.iter().map(|vi| dotf(&vi[o..o + len], wc)).collect();
            part.push(dotf(wc, wc));
            part
        })
        .collect();
    // summed in block order: the same result whatever the number of threads
    let mut total = vec![0f64; nb + 1];
    for p in &parts {
        total.iter_mut().zip(p).for_each(|(x, y)| *x += y);
    }
    let r = total.pop().unwrap();
    (total, r)
}
/// Ritz vectors `y_t = sum_i s[i, kept[t]] * v_i`, as one matrix product
/// (kept x ncv) x (ncv x m) over column blocks of the basis: the basis is read
/// once per block instead of once per Ritz vector.
fn ritz_vectors(v: &[Vec<f64>], s: &[f64], ncv: usize, kept: &[usize], m: usize) -> Vec<Vec<f64>> {
    const B: usize = 4096;
    let nk = kept.len();
    // coefficients, kept x ncv row-major
    let mut coef = vec![0f64; nk * ncv];
    for (t, &c) in kept.iter().enumerate() {
        for i in 0..ncv {
            coef[t * ncv + i] = s[i * ncv + c];
        }
    }
    let blocks: Vec<Vec<f64>> = (0..m.div_ceil(B))
        .into_par_iter()
        .map(|b| {
            let (o, len) = (b * B, B.min(m - b * B));
            // the basis' columns o..o+len, ncv x len row-major
            let mut vb = vec![0f64; ncv * len];
            for (i, vi) in v.iter().enumerate() {
                vb[i * len..(i + 1) * len].copy_from_slice(&vi[o..o + len]);
            }
            let mut yb = vec![0f64; nk * len];
            // SAFETY: the pointers and strides describe the three row-major
            // buffers above, whose sizes are nk x ncv, ncv x len and nk x len.
            unsafe {
                matrixmultiply::dgemm(
                    nk, ncv, len, 1.0,
                    coef.as_ptr(), ncv as isize, 1,
                    vb.as_ptr(), len as isize, 1,
                    0.0,
                    yb.as_mut_ptr(), len as isize, 1,
                );
            }
            yb
        })
        .collect();
    (0..nk)
        .map(|t| {
            let mut y = Vec::with_capacity(m);
            for (b, yb) in blocks.iter().enumerate() {
                let len = B.min(m - b * B);
                y.extend_from_slice(&yb[t * len..(t + 1) * len]);
            }
            y
        })
        .collect()
}
fn normalize(x: &mut [f64]) {
    let n = dotf(x, x).sqrt();
    x.iter_mut().for_each(|v| *v /= n);
}

/// A sparse symmetric `m x m` matrix (row-major) with a clustered spectrum near 1, normalised
/// as D^-1/2 A D^-1/2 like a diffusion operator: the Lanczos tests' operator.
#[cfg(test)]
pub(crate) fn diffusion_like(m: usize) -> Vec<f64> {
    let mut a = vec![0f64; m * m];
    for i in 0..m {
        for t in 1..6 {
            let j = (i * 7 + t * 13) % m;
            if j != i {
                let w = 1.0 / (1.0 + ((i + j) % 5) as f64);
                a[i * m + j] += w;
                a[j * m + i] += w;
            }
        }
    }
    let deg: Vec<f64> = (0..m).map(|i| a[i * m..(i + 1) * m].iter().sum()).collect();
    for i in 0..m {
        for j in 0..m {
            a[i * m + j] /= (deg[i] * deg[j]).sqrt();
        }
    }
    a
}

#[cfg(test)]
mod lanczos_tests {
    use super::*;

    #[test]
    fn lanczos_matches_dense() {
        // sparse-ish symmetric matrix with a clustered spectrum near 1 (like a diffusion operator)
        let m = 300;
        let a = diffusion_like(m);
        let k = 40;
        let (w, _) = symmetric_eigen(&a, m);
        let mut order: Vec<usize> = (0..m).collect();
        order.sort_by(|&x, &y| w[y].abs().total_cmp(&w[x].abs()));
        let (lw, lv) = lanczos_largest_magnitude(
            m,
            k,
            |x: &[f64], y: &mut [f64]| {
                for i in 0..m {
                    y[i] = (0..m).map(|j| a[i * m + j] * x[j]).sum();
                }
            },
            1,
        );
        for t in 0..k {
            assert!(
                (lw[t].abs() - w[order[t]].abs()).abs() < 1e-8,
                "eigenvalue {t}: {} vs {}",
                lw[t],
                w[order[t]]
            );
            // residual of the Ritz pair
            let mut r = 0f64;
            for i in 0..m {
                let av: f64 = (0..m).map(|j| a[i * m + j] * lv[j * k + t]).sum();
                r += (av - lw[t] * lv[i * k + t]).powi(2);
            }
            assert!(r.sqrt() < 1e-7, "residual {t}: {}", r.sqrt());
        }
    }
}
