//! Small dense linear algebra for PCA: Lanczos with full reorthogonalisation for the top
//! eigenpairs of a symmetric matrix, and cyclic Jacobi for the small projected problem.
//! Everything in f64, row-major.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use rayon::prelude::*;

/// y = A x for a symmetric m x m row-major matrix.
fn symv(a: &[f64], m: usize, x: &[f64], y: &mut [f64]) {
    y.par_chunks_mut(64).enumerate().for_each(|(c, ys)| {
        for (r, yv) in ys.iter_mut().enumerate() {
            let row = &a[(c * 64 + r) * m..(c * 64 + r + 1) * m];
            *yv = dot(row, x);
        }
    });
}

/// Dot product; uses AVX2+FMA when the processor has them (checked once at run time), so one
/// portable binary is fast on current x86-64 machines.
pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the features were just checked.
            return unsafe { dot_avx2(a, b) };
        }
    }
    dot_portable(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f64], b: &[f64]) -> f64 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_pd(); 4];
    let mut i = 0;
    while i + 16 <= n {
        for (k, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_pd(_mm256_loadu_pd(pa.add(i + 4 * k)), _mm256_loadu_pd(pb.add(i + 4 * k)), *a);
        }
        i += 16;
    }
    let sum = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
    let mut lanes = [0.0f64; 4];
    _mm256_storeu_pd(lanes.as_mut_ptr(), sum);
    let mut total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    while i < n {
        total += a[i] * b[i];
        i += 1;
    }
    total
}

/// acc += a * x in float32 (AVX2+FMA when available).
pub fn axpy_f32(acc: &mut [f32], a: f32, x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the features were just checked.
            unsafe { axpy_f32_avx2(acc, a, x) };
            return;
        }
    }
    acc.iter_mut().zip(x).for_each(|(s, v)| *s = v.mul_add(a, *s));
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_f32_avx2(acc: &mut [f32], a: f32, x: &[f32]) {
    acc.iter_mut().zip(x).for_each(|(s, v)| *s = v.mul_add(a, *s));
}

/// Eight independent accumulators, so the compiler can vectorise the loop (a plain `sum()`
/// is a serial dependency chain).
#[inline(always)]
fn dot_portable(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f64; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        let x: &[f64; 8] = x.try_into().unwrap();
        let y: &[f64; 8] = y.try_into().unwrap();
        for k in 0..8 {
            acc[k] = x[k].mul_add(y[k], acc[k]);
        }
    }
    let mut tail = 0.0;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Eigen-decomposition of a small symmetric k x k matrix by cyclic Jacobi.
/// Returns (eigenvalues descending, eigenvectors as columns of a row-major k x k matrix).
pub fn jacobi_eigh(a: &[f64], k: usize) -> (Vec<f64>, Vec<f64>) {
    let mut a = a.to_vec();
    let mut v = vec![0.0; k * k];
    for i in 0..k {
        v[i * k + i] = 1.0;
    }
    for _sweep in 0..100 {
        let off: f64 = (0..k).flat_map(|i| (0..k).filter(move |&j| j != i).map(move |j| (i, j))).map(|(i, j)| a[i * k + j].powi(2)).sum();
        let diag: f64 = (0..k).map(|i| a[i * k + i].powi(2)).sum();
        if off <= 1e-30 * diag.max(1e-300) {
            break;
        }
        for p in 0..k {
            for q in p + 1..k {
                let apq = a[p * k + q];
                if apq.abs() < 1e-300 {
                    continue;
                }
                let app = a[p * k + p];
                let aqq = a[q * k + q];
                let theta = (aqq - app) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for r in 0..k {
                    let arp = a[r * k + p];
                    let arq = a[r * k + q];
                    a[r * k + p] = c * arp - s * arq;
                    a[r * k + q] = s * arp + c * arq;
                }
                for r in 0..k {
                    let apr = a[p * k + r];
                    let aqr = a[q * k + r];
                    a[p * k + r] = c * apr - s * aqr;
                    a[q * k + r] = s * apr + c * aqr;
                }
                for r in 0..k {
                    let vrp = v[r * k + p];
                    let vrq = v[r * k + q];
                    v[r * k + p] = c * vrp - s * vrq;
                    v[r * k + q] = s * vrp + c * vrq;
                }
            }
        }
    }
    let mut order: Vec<usize> = (0..k).collect();
    order.sort_by(|&i, &j| a[j * k + j].partial_cmp(&a[i * k + i]).unwrap_or(std::cmp::Ordering::Equal));
    let vals = order.iter().map(|&i| a[i * k + i]).collect();
    let mut vecs = vec![0.0; k * k];
    for (new, &old) in order.iter().enumerate() {
        for r in 0..k {
            vecs[r * k + new] = v[r * k + old];
        }
    }
    (vals, vecs)
}

/// Eigen-decomposition of a symmetric tridiagonal matrix (diagonal `d`, off-diagonal `e`,
/// `e[i]` coupling i and i+1) by the implicit QL algorithm with Wilkinson-like shifts.
/// Returns (eigenvalues descending, eigenvectors as columns of a row-major k x k matrix).
pub fn tridiag_eigh(d: &[f64], e: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let n = d.len();
    let mut d = d.to_vec();
    let mut e: Vec<f64> = e.iter().cloned().chain(std::iter::repeat(0.0)).take(n).collect();
    // z stored column-major for cache-friendly rotations: z[col * n + row]
    let mut z = vec![0.0; n * n];
    for i in 0..n {
        z[i * n + i] = 1.0;
    }
    for l in 0..n {
        let mut iter = 0;
        loop {
            let mut m = l;
            while m + 1 < n {
                let dd = d[m].abs() + d[m + 1].abs();
                if e[m].abs() <= f64::EPSILON * dd {
                    break;
                }
                m += 1;
            }
            if m == l {
                break;
            }
            iter += 1;
            if iter > 200 {
                break;
            }
            let mut g = (d[l + 1] - d[l]) / (2.0 * e[l]);
            let mut r = g.hypot(1.0);
            g = d[m] - d[l] + e[l] / (g + if g >= 0.0 { r.abs() } else { -r.abs() });
            let (mut s, mut c, mut p) = (1.0f64, 1.0f64, 0.0f64);
            let mut underflow = false;
            let mut i = m;
            while i > l {
                i -= 1;
                let f = s * e[i];
                let b = c * e[i];
                r = f.hypot(g);
                e[i + 1] = r;
                if r == 0.0 {
                    d[i + 1] -= p;
                    e[m] = 0.0;
                    underflow = true;
                    break;
                }
                s = f / r;
                c = g / r;
                g = d[i + 1] - p;
                r = (d[i] - g) * s + 2.0 * c * b;
                p = s * r;
                d[i + 1] = g + p;
                g = c * r - b;
                let (lo, hi) = z.split_at_mut((i + 1) * n);
                let zi = &mut lo[i * n..(i + 1) * n];
                let zi1 = &mut hi[..n];
                for k in 0..n {
                    let f = zi1[k];
                    zi1[k] = s * zi[k] + c * f;
                    zi[k] = c * zi[k] - s * f;
                }
            }
            if underflow {
                continue;
            }
            d[l] -= p;
            e[l] = g;
            e[m] = 0.0;
        }
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| d[b].partial_cmp(&d[a]).unwrap_or(std::cmp::Ordering::Equal));
    let vals = order.iter().map(|&i| d[i]).collect();
    let mut vecs = vec![0.0; n * n];
    for (new, &old) in order.iter().enumerate() {
        for r in 0..n {
            vecs[r * n + new] = z[old * n + r];
        }
    }
    (vals, vecs)
}

/// Convergence: every wanted Ritz pair's residual |beta_k s_ki| below this fraction of the
/// largest eigenvalue. 1e-8 is well below the precision of scanpy's float32 ARPACK.
const RESIDUAL_TOL: f64 = 1e-8;

/// The top `n` eigenpairs of a symmetric positive semi-definite m x m matrix.
/// Returns (eigenvalues descending, eigenvectors row-major n x m), each vector with its
/// largest-magnitude entry positive, so the result is deterministic for a given seed.
pub fn top_eigh(a: &[f64], m: usize, n: usize, seed: u64) -> (Vec<f64>, Vec<f64>) {
    assert!(n <= m && n > 0);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut rand_unit = |basis: &[Vec<f64>]| -> Vec<f64> {
        loop {
            let mut q: Vec<f64> = (0..m).map(|_| StandardNormal.sample(&mut rng)).collect();
            for _ in 0..2 {
                for b in basis {
                    let d = dot(&q, b);
                    q.iter_mut().zip(b).for_each(|(x, y)| *x -= d * y);
                }
            }
            let nrm = dot(&q, &q).sqrt();
            if nrm > 1e-8 {
                q.iter_mut().for_each(|x| *x /= nrm);
                return q;
            }
        }
    };
    let mut basis: Vec<Vec<f64>> = vec![rand_unit(&[])];
    let mut alpha: Vec<f64> = Vec::new();
    let mut beta: Vec<f64> = Vec::new();
    let mut w = vec![0.0; m];
    let scale = (0..m).map(|i| a[i * m + i]).fold(0.0f64, f64::max).max(1e-300);
    // Check convergence at geometrically spaced Krylov sizes: the check costs O(k^3).
    let mut next_check = (n + 10).min(m);
    let mut result: Option<(Vec<f64>, Vec<f64>)> = None;
    for j in 0..m {
        symv(a, m, &basis[j], &mut w);
        let aj = dot(&basis[j], &w);
        alpha.push(aj);
        // full reorthogonalisation, twice
        for _ in 0..2 {
            let coefs: Vec<f64> = basis.par_iter().map(|b| dot(&w, b)).collect();
            for (b, c) in basis.iter().zip(&coefs) {
                w.iter_mut().zip(b).for_each(|(x, y)| *x -= c * y);
            }
        }
        let bj = dot(&w, &w).sqrt();
        let k = j + 1;
        let last = k == m;
        if k >= next_check || last || (k >= n && bj < 1e-12 * scale) {
            next_check = (k + (k / 4).max(10)).min(m);
            // Ritz pairs of the tridiagonal T_k
            let (vals, vecs) = tridiag_eigh(&alpha, &beta[..k - 1]);
            let converged = last
                || bj < 1e-12 * scale
                || (0..n).all(|i| (bj * vecs[(k - 1) * k + i]).abs() <= RESIDUAL_TOL * vals[0].abs().max(1e-300));
            if converged {
                let mut out = vec![0.0; n * m];
                for i in 0..n {
                    let row = &mut out[i * m..(i + 1) * m];
                    for (r, b) in basis.iter().enumerate().take(k) {
                        let c = vecs[r * k + i];
                        row.iter_mut().zip(b).for_each(|(x, y)| *x += c * y);
                    }
                    let big = row.iter().cloned().fold(0.0f64, |acc, x| if x.abs() > acc.abs() { x } else { acc });
                    if big < 0.0 {
                        row.iter_mut().for_each(|x| *x = -*x);
                    }
                }
                if std::env::var_os(crate::env::EnvVars::PROFILE).is_some() {
                    eprintln!("profile: Lanczos converged after {k} steps (m = {m}, n = {n})");
                }
                result = Some((vals[..n].to_vec(), out));
                break;
            }
        }
        beta.push(bj);
        let next = if bj < 1e-12 * scale {
            // invariant subspace found: continue with a fresh direction (beta = 0 decouples T)
            *beta.last_mut().unwrap() = 0.0;
            rand_unit(&basis)
        } else {
            w.iter().map(|x| x / bj).collect()
        };
        basis.push(next);
    }
    result.expect("Lanczos reaches m steps at most")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random_psd(m: usize, seed: u64) -> Vec<f64> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let b: Vec<f64> = (0..m * m).map(|_| StandardNormal.sample(&mut rng)).collect();
        let mut a = vec![0.0; m * m];
        for i in 0..m {
            for j in 0..m {
                a[i * m + j] = (0..m).map(|t| b[i * m + t] * b[j * m + t] / (1.0 + t as f64)).sum();
            }
        }
        a
    }

    #[test]
    fn jacobi_reconstructs() {
        let m = 12;
        let a = random_psd(m, 1);
        let (vals, vecs) = jacobi_eigh(&a, m);
        for w in vals.windows(2) {
            assert!(w[0] >= w[1]);
        }
        for i in 0..m {
            for j in 0..m {
                let r: f64 = (0..m).map(|t| vecs[i * m + t] * vals[t] * vecs[j * m + t]).sum();
                assert!((r - a[i * m + j]).abs() < 1e-9 * vals[0], "{i},{j}");
            }
        }
    }

    #[test]
    fn tridiagonal_matches_jacobi() {
        let d = [4.0, 1.0, -2.0, 3.5, 0.5, 2.0];
        let e = [1.0, 0.3, -0.7, 2.0, 0.1];
        let k = d.len();
        let mut t = vec![0.0; k * k];
        for i in 0..k {
            t[i * k + i] = d[i];
            if i + 1 < k {
                t[i * k + i + 1] = e[i];
                t[(i + 1) * k + i] = e[i];
            }
        }
        let (vj, _) = jacobi_eigh(&t, k);
        let (vt, vecs) = tridiag_eigh(&d, &e);
        for i in 0..k {
            assert!((vj[i] - vt[i]).abs() < 1e-10, "{vj:?} vs {vt:?}");
            // T v = lambda v
            for r in 0..k {
                let tv: f64 = (0..k).map(|c| t[r * k + c] * vecs[c * k + i]).sum();
                assert!((tv - vt[i] * vecs[r * k + i]).abs() < 1e-9);
            }
        }
    }

    #[test]
    fn lanczos_matches_jacobi() {
        let m = 80;
        let a = random_psd(m, 2);
        let (vals_j, vecs_j) = jacobi_eigh(&a, m);
        let (vals, vecs) = top_eigh(&a, m, 10, 7);
        for i in 0..10 {
            assert!((vals[i] - vals_j[i]).abs() < 1e-8 * vals_j[0], "eigenvalue {i}: {} vs {}", vals[i], vals_j[i]);
            let c: f64 = (0..m).map(|r| vecs[i * m + r] * vecs_j[r * m + i]).sum();
            assert!(c.abs() > 1.0 - 1e-8, "eigenvector {i}: |cos| = {}", c.abs());
        }
    }

    #[test]
    fn dot_paths_agree() {
        for n in [0usize, 1, 7, 16, 17, 100, 2001] {
            let a: Vec<f64> = (0..n).map(|i| (i as f64 * 0.37).sin()).collect();
            let b: Vec<f64> = (0..n).map(|i| (i as f64 * 0.11).cos()).collect();
            let naive: f64 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!((dot(&a, &b) - naive).abs() < 1e-10 * (1.0 + naive.abs()), "n = {n}");
            assert!((dot_portable(&a, &b) - naive).abs() < 1e-10 * (1.0 + naive.abs()), "n = {n}");
        }
    }

    #[test]
    fn lanczos_is_deterministic_for_a_seed() {
        let a = random_psd(40, 3);
        assert_eq!(top_eigh(&a, 40, 5, 11), top_eigh(&a, 40, 5, 11));
    }
}
