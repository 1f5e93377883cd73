//! Harmony integration of a low-dimensional embedding (usually PCA) across batches.
//!
//! Korsunsky I, Millard N, Fan J, et al. "Fast, sensitive and accurate integration of
//! single-cell data with Harmony." Nature Methods 16, 1289-1296 (2019).
//! Upstream code followed here: harmonypy 2.1.0 (https://github.com/slowkow/harmonypy, the C++
//! backend `src/harmony.cpp`, itself a port of R harmony2, https://github.com/immunogenomics/harmony).
//!
//! The algorithm, step for step as harmonypy 2.1:
//! 1. cells are scaled to unit length (cosine geometry); K = min(round(N / 30), 100) centroids
//!    start from a k-means on the unit-length cells: K random cells, then each centroid is
//!    replaced by the winner of an exponential race (`-ln(u) / distance`, distance
//!    `2 (1 - cos)`) and 10 Lloyd steps follow (Armadillo's `kmeans`, empty clusters reseeded
//!    from the last cell of the largest-index cluster with two or more cells);
//! 2. soft assignments R = softmax(-dist / sigma); O (observed) and E (expected) cluster x
//!    batch totals;
//! 3. each Harmony iteration runs `max_iter_kmeans` passes of the R update: cells in a
//!    shuffled order, in blocks of `block_size` N; a block is taken out of O and E, its cells
//!    are reassigned with the diversity penalty `theta (ln(2E + 1) - ln(O + E + 1))` for each of
//!    the cell's batches, and put back (the distances stay fixed during these passes);
//! 4. the mixture-of-experts ridge correction: per cluster, a weighted ridge regression of the
//!    ORIGINAL coordinates on an intercept and the indicators of the batches the cluster
//!    holds (batches with a share of the cluster above `batch_prop_cutoff`, in covariates with
//!    at least two such batches), penalty `alpha E(k, b)` (lambda estimated, the default) or a
//!    fixed lambda; each cell loses the R-weighted batch terms; the intercepts, scaled to unit
//!    length, become the centroids of the next iteration, which first reassigns every cell
//!    without the diversity penalty;
//! 5. stop when the Harmony objective decreased by less than `epsilon_harmony` (relative), or
//!    after `max_iter_harmony` iterations. The k-means passes stop early when the sum of the
//!    last 3 objectives changed by less than `epsilon_cluster` (only checked from the fifth
//!    pass on, so never with harmonypy 2.1's default of 4 passes).
//!
//! Defaults are harmonypy 2.1's `run_harmony` (theta 2, lambda estimated with alpha 0.2,
//! sigma 0.1, block_size 0.05, 10 Harmony iterations, 4 k-means passes, epsilon_cluster 1e-3,
//! epsilon_harmony 1e-2, batch_prop_cutoff 1e-5, tau 0). [`HarmonyOptions::legacy`] gives the
//! defaults of harmonypy 0.0.x / R harmony 0.1 (lambda 1, 20 passes, 1e-5, 1e-4).
//!
//! Numerics follow harmonypy: float32 state, float64 sums for the objective and the ridge
//! systems (here solved by a dense Cholesky of the full system in float64; harmonypy
//! eliminates the block of one covariate first, the same solution up to float64 rounding).
//! Where this file differs, all in the last bits of float32 results: the large products
//! (cell-centroid similarities, ridge sums, corrections, Lloyd distances) go through
//! `matrixmultiply`, whose summation order differs from harmonypy's loops; the R update uses a
//! branch-free polynomial exp (within 3e-7 relative of libm's expf) so that its loop
//! vectorises, visits the cells of a block's batch in index order (harmonypy: shuffled order;
//! only the order of the f32 sums over a run changes, not which cells are in a block), and
//! sums the f64 objective terms in 4 partial sums; the ridge overlap totals of several batch
//! keys are summed in float64 (harmonypy: float32). With the randomness injected from
//! harmonypy ([`HarmonyInit`]), the corrected embedding agrees with harmonypy's to within
//! 1e-5 of the data scale (4e-7 to 8e-6 on the four fixtures, see `tests/it/harmony.rs`).
//!
//! Randomness: harmonypy draws from std::mt19937 through libstdc++'s distributions. Here the
//! default is our own seeded ChaCha8 stream (same algorithm, different draws, so results agree
//! with harmonypy in aggregate, not cell by cell); [`HarmonyInit`] injects the k-means start and
//! the update orders, which `scripts/harmony_reference.py` rebuilds from harmonypy's generator.

// Index loops over small dense arrays read closer to harmonypy's C++ than iterator chains.
#![allow(clippy::needless_range_loop)]

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

/// Cells per task, as harmonypy's `kCellsPerTask`: sums are formed over runs of this many cells.
const CELLS_PER_TASK: usize = 1024;
/// Cells per chunk of the large matrix products.
const GEMM_CHUNK: usize = 8192;
/// Cells ahead whose rows the R update prefetches (the block's cells are ~20 rows apart).
const PREFETCH_AHEAD: usize = 4;

/// Ask the CPU to bring x[start..start + len] into cache (a hint; no effect on results).
#[inline(always)]
fn prefetch_row(x: &[f32], start: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let end = (start + len).min(x.len());
        let mut i = start;
        while i < end {
            // SAFETY: the pointer is inside the slice; prefetching never faults.
            unsafe { std::arch::x86_64::_mm_prefetch(x.as_ptr().add(i) as *const i8, std::arch::x86_64::_MM_HINT_T0) };
            i += 16;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (x, start, len);
}

/// Number of past k-means objectives compared in the convergence check.
const WINDOW: usize = 3;

#[derive(Debug, thiserror::Error)]
pub enum HarmonyError {
    #[error("harmony: {0}")]
    Input(String),
    #[error("harmony: numerical error during {stage}: {what}")]
    Numerical { stage: &'static str, what: String },
}

type Result<T> = std::result::Result<T, HarmonyError>;

fn input<T>(msg: impl Into<String>) -> Result<T> {
    Err(HarmonyError::Input(msg.into()))
}

/// The ridge penalty of the batch terms.
#[derive(Debug, Clone, PartialEq)]
pub enum Lambda {
    /// `alpha * E(k, b)` for cluster k and batch b (harmonypy 2.1 and R harmony2 default).
    Estimate { alpha: f32 },
    /// Fixed: one value, one per batch key, one per batch, or the intercept's penalty followed
    /// by one per batch (as harmonypy's `lamb`).
    Fixed(Vec<f32>),
}

#[derive(Debug, Clone)]
pub struct HarmonyOptions {
    /// Diversity penalty: one value, one per batch key, or one per batch (each key's levels in
    /// increasing code order).
    pub theta: Vec<f32>,
    pub lambda: Lambda,
    /// Soft-clustering bandwidth: one value or one per cluster.
    pub sigma: Vec<f32>,
    /// Number of clusters; `None`: min(round(N / 30), 100).
    pub nclust: Option<usize>,
    /// Protection against over-correction of small batches (0: off).
    pub tau: f32,
    pub block_size: f32,
    pub max_iter_harmony: usize,
    pub max_iter_kmeans: usize,
    pub epsilon_cluster: f32,
    pub epsilon_harmony: f32,
    pub batch_prop_cutoff: f32,
    pub seed: u64,
}

impl Default for HarmonyOptions {
    /// harmonypy 2.1's `run_harmony` defaults.
    fn default() -> Self {
        HarmonyOptions {
            theta: vec![2.0],
            lambda: Lambda::Estimate { alpha: 0.2 },
            sigma: vec![0.1],
            nclust: None,
            tau: 0.0,
            block_size: 0.05,
            max_iter_harmony: 10,
            max_iter_kmeans: 4,
            epsilon_cluster: 1e-3,
            epsilon_harmony: 1e-2,
            batch_prop_cutoff: 1e-5,
            seed: 0,
        }
    }
}

impl HarmonyOptions {
    /// The defaults of harmonypy 0.0.x and R harmony 0.1: lambda 1, 20 k-means passes,
    /// epsilon_cluster 1e-5, epsilon_harmony 1e-4.
    pub fn legacy() -> Self {
        HarmonyOptions {
            lambda: Lambda::Fixed(vec![1.0]),
            max_iter_kmeans: 20,
            epsilon_cluster: 1e-5,
            epsilon_harmony: 1e-4,
            ..Default::default()
        }
    }
}

/// Randomness injected instead of drawn, to reproduce another implementation's run.
#[derive(Debug, Clone, Default)]
pub struct HarmonyInit {
    /// The k-means start, K x d row-major (row k: centroid k, before scaling to unit length):
    /// what harmonypy's `kmeans_init` returns. K must match the options.
    pub centroids: Option<Vec<f32>>,
    /// The cell order of each R-update pass, in the order they are used (one per k-means pass
    /// over all Harmony iterations); each a permutation of 0..n.
    pub orders: Option<Vec<Vec<u32>>>,
}

#[derive(Debug, Clone)]
pub struct HarmonyResult {
    /// Corrected embedding, n x d row-major.
    pub z_corr: Vec<f32>,
    /// Soft cluster assignments, n x K row-major.
    pub assignments: Vec<f32>,
    pub n_clusters: usize,
    /// Harmony iterations run.
    pub iterations: usize,
    /// The objective after initialisation and after each iteration.
    pub objective_harmony: Vec<f32>,
    /// The objective after initialisation and after each k-means pass.
    pub objective_kmeans: Vec<f32>,
    /// k-means passes in each iteration.
    pub kmeans_rounds: Vec<usize>,
    pub converged: bool,
}

// ------------------------------------------------------------------------------------------
// small numerical helpers (the arithmetic harmonypy uses)
// ------------------------------------------------------------------------------------------

/// Scale x to unit L2 norm; squares summed in f64; a zero vector is left unchanged.
fn scale_to_unit_length(x: &mut [f32]) {
    let sum: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    if sum == 0.0 {
        return;
    }
    let norm = sum.sqrt() as f32;
    for v in x.iter_mut() {
        *v /= norm;
    }
}

fn normalise_rows(x: &mut [f32], d: usize) {
    x.par_chunks_mut(d).for_each(scale_to_unit_length);
}

/// Sum of floats in two interleaved partial sums (arma::sum's order).
fn accumulate(x: &[f32]) -> f32 {
    let (mut a1, mut a2) = (0.0f32, 0.0f32);
    let mut j = 1;
    while j < x.len() {
        a1 += x[j - 1];
        a2 += x[j];
        j += 2;
    }
    if j - 1 < x.len() {
        a1 += x[j - 1];
    }
    a1 + a2
}

/// In-place softmax; false if the normaliser is not finite and positive.
fn softmax(x: &mut [f32]) -> bool {
    let mx = x.iter().fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    for v in x.iter_mut() {
        *v = (*v - mx).exp();
    }
    let total = accumulate(x);
    if !(total.is_finite() && total > 0.0) {
        return false;
    }
    for v in x.iter_mut() {
        *v /= total;
    }
    true
}

/// exp(x) for the shifted logits (x <= 0), branch-free so that loops over it vectorise:
/// Cephes' expf (range reduction by ln 2 in two parts, degree-6 polynomial, within 2 ulp of
/// glibc's expf), with x clamped at -87 (results below ~1.6e-38 are that instead of a
/// subnormal or 0, a difference below 1e-37 in assignments that sum to 1).
#[inline(always)]
fn exp_neg(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const ROUND: f32 = 12582912.0; // 1.5 * 2^23: adding it rounds to the nearest integer
    let x = if x > -87.0 { x } else { -87.0 };
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let bits = (t.to_bits() as i32 - 0x4B40_0000 + 127) << 23;
    y * f32::from_bits(bits as u32)
}

/// Maximum, in 8 lanes (exact: the order of a max does not matter).
fn max_of(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for l in 0..8 {
            lanes[l] = if c[l] > lanes[l] { c[l] } else { lanes[l] };
        }
    }
    let mut m = lanes.iter().fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    for &v in chunks.remainder() {
        if v > m {
            m = v;
        }
    }
    m
}

/// sum a_i b_i in f64, in 4 partial sums (f64 sums of f32 products: the order changes the
/// result by ~1e-16 relative, far below the f32 objective it feeds).
fn dot_f64(a: &[f32], b: &[f32]) -> f64 {
    let mut acc = [0.0f64; 4];
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + 4 <= n {
        for l in 0..4 {
            acc[l] += a[i + l] as f64 * b[i + l] as f64;
        }
        i += 4;
    }
    while i < n {
        acc[0] += a[i] as f64 * b[i] as f64;
        i += 1;
    }
    (acc[0] + acc[1]) + (acc[2] + acc[3])
}

/// sum a_i b_i c_i in f64, in 4 partial sums.
fn dot3_f64(a: &[f32], b: &[f32], c: &[f32]) -> f64 {
    let mut acc = [0.0f64; 4];
    let n = a.len().min(b.len()).min(c.len());
    let mut i = 0;
    while i + 4 <= n {
        for l in 0..4 {
            acc[l] += (a[i + l] as f64 * b[i + l] as f64) * c[i + l] as f64;
        }
        i += 4;
    }
    while i < n {
        acc[0] += (a[i] as f64 * b[i] as f64) * c[i] as f64;
        i += 1;
    }
    (acc[0] + acc[1]) + (acc[2] + acc[3])
}

fn objective_converged(old: f32, new: f32, eps: f32) -> bool {
    if !old.is_finite() || !new.is_finite() || !eps.is_finite() {
        return false;
    }
    if old == 0.0 {
        return new == 0.0;
    }
    let delta = (old - new) / old.abs();
    delta >= 0.0 && delta < eps
}

/// Python's round(): halves to even.
fn round_half_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 {
        2.0 * (x / 2.0).round()
    } else {
        r
    }
}

/// C (m x n) = alpha A (m x k) B (k x n) + beta C, row-major C, A and B given by strides.
#[allow(clippy::too_many_arguments)]
fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    alpha: f32,
    a: &[f32],
    rsa: usize,
    csa: usize,
    b: &[f32],
    rsb: usize,
    csb: usize,
    beta: f32,
    c: &mut [f32],
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(k == 0 || (a.len() > (m - 1) * rsa + (k - 1) * csa && b.len() > (k - 1) * rsb + (n - 1) * csb));
    assert!(c.len() >= m * n);
    // SAFETY: the asserts above keep every index inside the slices.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            alpha,
            a.as_ptr(),
            rsa as isize,
            csa as isize,
            b.as_ptr(),
            rsb as isize,
            csb as isize,
            beta,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

#[allow(clippy::too_many_arguments)]
fn dgemm(m: usize, k: usize, n: usize, a: &[f64], rsa: usize, csa: usize, b: &[f64], rsb: usize, csb: usize, c: &mut [f64]) {
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    assert!(a.len() > (m - 1) * rsa + (k - 1) * csa && b.len() > (k - 1) * rsb + (n - 1) * csb);
    assert!(c.len() >= m * n);
    // SAFETY: as in sgemm.
    unsafe {
        matrixmultiply::dgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa as isize,
            csa as isize,
            b.as_ptr(),
            rsb as isize,
            csb as isize,
            1.0,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// Expand a per-batch parameter as harmonypy's `_per_batch`: one value, one per key, or one
/// per batch.
fn per_batch(values: &[f32], levels: &[usize], name: &str) -> Result<Vec<f32>> {
    let b: usize = levels.iter().sum();
    if values.len() == 1 {
        Ok(vec![values[0]; b])
    } else if values.len() == levels.len() {
        Ok(levels.iter().zip(values).flat_map(|(&l, &v)| std::iter::repeat_n(v, l)).collect())
    } else if values.len() == b {
        Ok(values.to_vec())
    } else {
        input(format!(
            "{name} must be one number, one per batch key ({}), or one per batch ({b}); got {} values",
            levels.len(),
            values.len()
        ))
    }
}

// ------------------------------------------------------------------------------------------
// the model
// ------------------------------------------------------------------------------------------

/// The (batch of key a, batch of key b) combinations present, and each cell's combination.
type KeyPair = (Vec<(u32, u32)>, Vec<u32>);

enum Randomness<'a> {
    Own(Box<ChaCha8Rng>),
    Injected { orders: &'a [Vec<u32>], next: usize },
}

struct Harmony<'a> {
    n: usize,
    d: usize,
    k: usize,
    nb: usize,
    ncov: usize,
    z_orig: &'a [f32],
    /// Corrected coordinates (n x d).
    z_corr: Vec<f32>,
    /// z_corr scaled to unit length, what the clustering sees.
    zn: Vec<f32>,
    /// Centroids, K x d, unit length.
    y: Vec<f32>,
    /// Assignments, n x K.
    r: Vec<f32>,
    /// Distances 2 (1 - cos), n x K.
    dist: Vec<f32>,
    /// Observed and expected totals, batch-major (b * K + k).
    o: Vec<f32>,
    e: Vec<f32>,
    pr_b: Vec<f32>,
    batch_sizes: Vec<f32>,
    sigma: Vec<f32>,
    theta: Vec<f32>,
    /// Per batch: None when lambda is estimated; the fixed penalties (intercept first).
    lambda: Option<Vec<f32>>,
    alpha: f32,
    /// Batch of each cell per key (global batch index), cell-major.
    cell_batches: Vec<u32>,
    batch_cov: Vec<usize>,
    /// Cells of each batch, in cell order.
    batch_cells: Vec<Vec<u32>>,
    /// For each pair of keys (a < b): the (batch_a, batch_b) pairs and the pair of each cell.
    pairs: Vec<KeyPair>,
    opts: &'a HarmonyOptions,
    objective_harmony: Vec<f32>,
    objective_kmeans: Vec<f32>,
    kmeans_rounds: Vec<usize>,
    update_error: f64,
    update_entropy: f64,
}

/// Harmony on an n x d row-major embedding with one code vector per batch key.
///
/// Codes need not be contiguous: the distinct codes of each key are numbered in increasing
/// order, as harmonypy numbers sorted labels.
pub fn harmonize(
    z: &[f32],
    n: usize,
    d: usize,
    batches: &[Vec<u32>],
    opts: &HarmonyOptions,
    init: Option<&HarmonyInit>,
) -> Result<HarmonyResult> {
    if z.len() != n * d {
        return input(format!("the embedding has {} values, not n x d = {n} x {d}", z.len()));
    }
    if n == 0 || d == 0 {
        return input("the embedding is empty");
    }
    if let Some(i) = z.iter().position(|v| !v.is_finite()) {
        return input(format!("the embedding has a non-finite value ({}) at cell {}, dimension {}", z[i], i / d, i % d));
    }
    if batches.is_empty() {
        return input("no batch key given");
    }
    let k = match opts.nclust {
        Some(k) => k,
        None => round_half_even(n as f64 / 30.0).min(100.0) as usize,
    };
    if k < 1 {
        return input(format!("nclust must be at least 1 (with {n} cells, min(round(N / 30), 100) is 0): pass the number of clusters"));
    }
    if k > n {
        return input(format!("nclust ({k}) must not exceed the number of cells ({n})"));
    }
    if !(opts.block_size > 0.0 && opts.block_size <= 1.0) {
        return input(format!("block_size must be in (0, 1], not {}", opts.block_size));
    }

    // Number the codes of each key in increasing order of the distinct codes present.
    let ncov = batches.len();
    let mut levels = Vec::with_capacity(ncov);
    let mut cell_batches = vec![0u32; n * ncov];
    let mut offset = 0usize;
    for (c, codes) in batches.iter().enumerate() {
        if codes.len() != n {
            return input(format!("batch key {c} has {} codes for {n} cells", codes.len()));
        }
        let mut distinct: Vec<u32> = codes.clone();
        distinct.sort_unstable();
        distinct.dedup();
        for (j, &code) in codes.iter().enumerate() {
            let rank = distinct.binary_search(&code).unwrap();
            cell_batches[j * ncov + c] = (offset + rank) as u32;
        }
        levels.push(distinct.len());
        offset += distinct.len();
    }
    let nb = offset;
    let mut batch_cov = Vec::with_capacity(nb);
    for (c, &l) in levels.iter().enumerate() {
        batch_cov.extend(std::iter::repeat_n(c, l));
    }
    let mut batch_cells = vec![Vec::new(); nb];
    for j in 0..n {
        for c in 0..ncov {
            batch_cells[cell_batches[j * ncov + c] as usize].push(j as u32);
        }
    }
    let n_b: Vec<f32> = batch_cells.iter().map(|c| c.len() as f32).collect();
    let pr_b: Vec<f32> = n_b.iter().map(|&x| x / n as f32).collect();

    let mut theta = per_batch(&opts.theta, &levels, "theta")?;
    if opts.tau > 0.0 {
        for (t, &nbb) in theta.iter_mut().zip(&n_b) {
            let q = nbb / (k as f32 * opts.tau);
            *t *= 1.0 - (-(q * q)).exp();
        }
    }
    let sigma = match opts.sigma.len() {
        1 => vec![opts.sigma[0]; k],
        l if l == k => opts.sigma.clone(),
        l => return input(format!("sigma must be one number or one per cluster ({k}), got {l} values")),
    };
    let (lambda, alpha) = match &opts.lambda {
        Lambda::Estimate { alpha } => {
            if !(alpha.is_finite() && *alpha >= 0.0) {
                return input("alpha must be finite and not negative");
            }
            (None, *alpha)
        }
        Lambda::Fixed(v) => {
            let full = if v.len() == nb + 1 && v.len() != 1 && v.len() != ncov {
                v.clone()
            } else {
                let mut full = vec![0.0];
                full.extend(per_batch(v, &levels, "lambda")?);
                full
            };
            if full.iter().any(|x| !x.is_finite() || *x < 0.0) {
                return input("lambda must be finite and not negative");
            }
            (Some(full), 0.0)
        }
    };

    // pairs of keys: the cells that share a batch of key a and a batch of key b
    let mut pairs = Vec::new();
    for a in 0..ncov {
        for b in a + 1..ncov {
            let mut index = std::collections::HashMap::new();
            let mut list: Vec<(u32, u32)> = Vec::new();
            let mut of_cell = vec![0u32; n];
            for j in 0..n {
                let key = (cell_batches[j * ncov + a], cell_batches[j * ncov + b]);
                let q = *index.entry(key).or_insert_with(|| {
                    list.push(key);
                    (list.len() - 1) as u32
                });
                of_cell[j] = q;
            }
            pairs.push((list, of_cell));
        }
    }

    let mut rand = match init.and_then(|i| i.orders.as_ref()) {
        Some(orders) => {
            for (i, o) in orders.iter().enumerate() {
                if o.len() != n || o.iter().any(|&c| c as usize >= n) {
                    return input(format!("injected order {i} is not a permutation of 0..{n}"));
                }
            }
            Randomness::Injected { orders, next: 0 }
        }
        None => Randomness::Own(Box::new(ChaCha8Rng::seed_from_u64(opts.seed))),
    };

    let mut zn = z.to_vec();
    normalise_rows(&mut zn, d);
    let mut h = Harmony {
        n,
        d,
        k,
        nb,
        ncov,
        z_orig: z,
        z_corr: z.to_vec(),
        zn,
        y: Vec::new(),
        r: vec![0.0; n * k],
        dist: vec![0.0; n * k],
        o: vec![0.0; nb * k],
        e: vec![0.0; nb * k],
        pr_b,
        batch_sizes: n_b,
        sigma,
        theta,
        lambda,
        alpha,
        cell_batches,
        batch_cov,
        batch_cells,
        pairs,
        opts,
        objective_harmony: Vec::new(),
        objective_kmeans: Vec::new(),
        kmeans_rounds: Vec::new(),
        update_error: 0.0,
        update_entropy: 0.0,
    };

    // initial clusters
    let mut y = match init.and_then(|i| i.centroids.as_ref()) {
        Some(c) => {
            if c.len() != k * d {
                return input(format!("injected centroids have {} values, not K x d = {k} x {d}", c.len()));
            }
            c.clone()
        }
        None => match &mut rand {
            Randomness::Own(rng) => kmeans_init(&h.zn, n, d, k, rng),
            // orders injected without a start: draw the start from our own stream
            Randomness::Injected { .. } => kmeans_init(&h.zn, n, d, k, &mut ChaCha8Rng::seed_from_u64(opts.seed)),
        },
    };
    normalise_rows(&mut y, d);
    h.y = y;
    h.assign_without_diversity("initialization")?;
    h.rebuild_o_e();
    h.compute_objective();
    h.objective_harmony.push(*h.objective_kmeans.last().unwrap());

    let mut converged = false;
    let mut iterations = 0;
    for _ in 0..opts.max_iter_harmony {
        iterations += 1;
        h.cluster(&mut rand)?;
        h.moe_correct_ridge()?;
        let m = h.objective_harmony.len();
        converged = objective_converged(h.objective_harmony[m - 2], h.objective_harmony[m - 1], opts.epsilon_harmony);
        if converged {
            break;
        }
    }
    if h.z_corr.iter().any(|v| !v.is_finite()) {
        return Err(HarmonyError::Numerical { stage: "return", what: "corrected coordinates must be finite".into() });
    }
    Ok(HarmonyResult {
        z_corr: h.z_corr,
        assignments: h.r,
        n_clusters: k,
        iterations,
        objective_harmony: h.objective_harmony,
        objective_kmeans: h.objective_kmeans,
        kmeans_rounds: h.kmeans_rounds,
        converged,
    })
}

/// harmonypy's k-means start on unit-length cells (n x d), with our own draws: K random
/// cells, an exponential race per centroid, 10 Lloyd steps. Returns K x d.
fn kmeans_init(x: &[f32], n: usize, d: usize, k: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    let mut y = vec![0.0f32; k * d];
    for i in 0..k {
        let u: f32 = rng.gen();
        let idx = ((u * n as f32).round() as usize).min(n - 1);
        y[i * d..(i + 1) * d].copy_from_slice(&x[idx * d..(idx + 1) * d]);
    }
    // similarities of every cell with every random pick (n x K)
    let mut sim = vec![0.0f32; n * k];
    sgemm(n, d, k, 1.0, x, d, 1, &y, 1, d, 0.0, &mut sim);
    let mut chosen = std::collections::BTreeSet::new();
    let mut prob = vec![0.0f32; n];
    let mut u = vec![0.0f32; n];
    for i in 0..k {
        for v in u.iter_mut() {
            *v = rng.gen();
        }
        let mut pmax = f32::NEG_INFINITY;
        for j in 0..n {
            let distance = ((1.0 - sim[j * k + i]) * 2.0).abs();
            prob[j] = -u[j].ln() / (distance + 1e-10);
            if prob[j] > pmax {
                pmax = prob[j];
            }
        }
        for &c in &chosen {
            prob[c] = pmax;
        }
        let argmin =
            |p: &[f32]| p.iter().enumerate().fold((0, f32::INFINITY), |(bi, bv), (j, &v)| if v < bv { (j, v) } else { (bi, bv) }).0;
        let mut best = argmin(&prob);
        while chosen.contains(&best) {
            prob[best] = prob.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            best = argmin(&prob);
        }
        chosen.insert(best);
        y[i * d..(i + 1) * d].copy_from_slice(&x[best * d..(best + 1) * d]);
    }
    // 10 Lloyd steps, as arma::kmeans(keep_existing, 1) ten times
    let xx: Vec<f32> = x.par_chunks(d).map(|r| r.iter().map(|v| v * v).sum()).collect();
    let mut assign = vec![0usize; n];
    for _ in 0..10 {
        let mm: Vec<f32> = y.chunks(d).map(|r| r.iter().map(|v| v * v).sum()).collect();
        sgemm(n, d, k, 1.0, x, d, 1, &y, 1, d, 0.0, &mut sim);
        assign.par_iter_mut().enumerate().for_each(|(j, a)| {
            let row = &sim[j * k..(j + 1) * k];
            let mut best = (0, f32::INFINITY);
            for g in 0..k {
                let dist = xx[j] + mm[g] - 2.0 * row[g];
                if dist < best.1 {
                    best = (g, dist);
                }
            }
            *a = best.0;
        });
        let mut sums = vec![0.0f64; k * d];
        let mut counts = vec![0usize; k];
        let mut last = vec![0usize; k];
        for j in 0..n {
            let g = assign[j];
            counts[g] += 1;
            last[g] = j;
            for (s, v) in sums[g * d..(g + 1) * d].iter_mut().zip(&x[j * d..(j + 1) * d]) {
                *s += *v as f64;
            }
        }
        let mut new = vec![0.0f32; k * d];
        for g in 0..k {
            if counts[g] > 0 {
                for a in 0..d {
                    new[g * d + a] = (sums[g * d + a] / counts[g] as f64) as f32;
                }
            }
        }
        let dead: Vec<usize> = (0..k).filter(|&g| counts[g] == 0).collect();
        if !dead.is_empty() {
            let live: Vec<usize> = (0..k).rev().filter(|&g| counts[g] >= 2).collect();
            for (i, &g) in dead.iter().enumerate() {
                let cell = if i < live.len() { last[live[i]] } else { rng.gen_range(0..n) };
                new[g * d..(g + 1) * d].copy_from_slice(&x[cell * d..(cell + 1) * d]);
            }
        }
        y = new;
    }
    y
}

/// One run of cells of one batch: positions [begin, end) of a cell list.
#[derive(Clone, Copy)]
struct Run {
    batch: usize,
    begin: usize,
    end: usize,
}

impl<'a> Harmony<'a> {
    /// dist = 2 (1 - y'x) for every cell and centroid; R = softmax(-dist / sigma).
    fn assign_without_diversity(&mut self, stage: &'static str) -> Result<()> {
        let (d, k) = (self.d, self.k);
        sgemm(self.n, d, k, 1.0, &self.zn, d, 1, &self.y, 1, d, 0.0, &mut self.dist);
        let sigma = &self.sigma;
        let bad = self.dist.par_chunks_mut(k).zip(self.r.par_chunks_mut(k)).map(|(dist, r)| {
            for g in 0..k {
                let distance = 2.0 * (1.0 - dist[g]);
                dist[g] = distance;
                r[g] = -distance / sigma[g];
            }
            !softmax(r)
        });
        if bad.reduce(|| false, |a, b| a || b) {
            return Err(HarmonyError::Numerical { stage, what: "assignment normalizers must be finite and positive".into() });
        }
        Ok(())
    }

    /// E = colsum(R) * Pr_b; O(b) = sum of R over the cells of batch b.
    fn rebuild_o_e(&mut self) {
        let k = self.k;
        let chunk_sums: Vec<Vec<f32>> = self
            .r
            .par_chunks(CELLS_PER_TASK * k)
            .map(|rows| {
                let mut acc = vec![0.0f32; k];
                for r in rows.chunks(k) {
                    for g in 0..k {
                        acc[g] += r[g];
                    }
                }
                acc
            })
            .collect();
        let mut totals = vec![0.0f32; k];
        for s in &chunk_sums {
            for g in 0..k {
                totals[g] += s[g];
            }
        }
        for b in 0..self.nb {
            for g in 0..k {
                self.e[b * k + g] = totals[g] * self.pr_b[b];
            }
        }
        self.o.iter_mut().for_each(|v| *v = 0.0);
        for b in 0..self.nb {
            for run in self.batch_cells[b].chunks(CELLS_PER_TASK) {
                let mut acc = vec![0.0f32; k];
                for &j in run {
                    let r = &self.r[j as usize * k..(j as usize + 1) * k];
                    for g in 0..k {
                        acc[g] += r[g];
                    }
                }
                for g in 0..k {
                    self.o[b * k + g] += acc[g];
                }
            }
        }
    }

    /// The k-means objective from R and the distances (used once, after initialisation).
    fn compute_objective(&mut self) {
        let k = self.k;
        let sigma = &self.sigma;
        let parts: Vec<(f64, f64)> = self
            .r
            .par_chunks(CELLS_PER_TASK * k)
            .zip(self.dist.par_chunks(CELLS_PER_TASK * k))
            .map(|(rr, dd)| {
                let (mut err, mut ent) = (0.0f64, 0.0f64);
                for (r, dist) in rr.chunks(k).zip(dd.chunks(k)) {
                    for g in 0..k {
                        err += r[g] as f64 * dist[g] as f64;
                        if r[g] > 0.0 {
                            ent += sigma[g] as f64 * (r[g] * r[g].ln()) as f64;
                        }
                    }
                }
                (err, ent)
            })
            .collect();
        let (mut err, mut ent) = (0.0, 0.0);
        for (a, b) in parts {
            err += a;
            ent += b;
        }
        self.record_objective(err, ent);
    }

    fn record_objective(&mut self, kmeans_error: f64, entropy: f64) {
        let k = self.k;
        let norm = 2000.0f32 / self.n as f32;
        let mut cross = 0.0f64;
        for b in 0..self.nb {
            for g in 0..k {
                let e = self.e[b * k + g];
                let o = self.o[b * k + g];
                let ratio = (o + e + 1.0) / (2.0 * e + 1.0);
                let term = ratio.ln() * self.theta[b] * self.sigma[g] * o;
                cross += term as f64;
            }
        }
        let v = (kmeans_error as f32 + entropy as f32 + cross as f32) * norm;
        self.objective_kmeans.push(v);
    }

    fn next_order(&mut self, rand: &mut Randomness) -> Result<Vec<u32>> {
        match rand {
            Randomness::Own(rng) => {
                let mut order: Vec<u32> = (0..self.n as u32).collect();
                order.shuffle(rng);
                Ok(order)
            }
            Randomness::Injected { orders, next } => {
                let o = orders.get(*next).cloned();
                *next += 1;
                o.ok_or_else(|| HarmonyError::Input(format!("the injected orders ran out after {} passes", *next - 1)))
            }
        }
    }

    fn cluster(&mut self, rand: &mut Randomness) -> Result<()> {
        if self.objective_harmony.len() > 1 {
            self.zn.copy_from_slice(&self.z_corr);
            normalise_rows(&mut self.zn, self.d);
            self.assign_without_diversity("cluster initialization")?;
            self.rebuild_o_e();
        }
        let mut rounds = 0;
        for i in 0..self.opts.max_iter_kmeans {
            let order = self.next_order(rand)?;
            self.update_r(&order)?;
            self.record_objective(self.update_error, self.update_entropy);
            if self.objective_kmeans.last().is_none_or(|v| !v.is_finite()) {
                return Err(HarmonyError::Numerical { stage: "assignment update", what: "objectives must be finite".into() });
            }
            rounds = i + 1;
            if i > WINDOW && self.kmeans_converged() {
                break;
            }
        }
        self.kmeans_rounds.push(rounds);
        self.objective_harmony.push(*self.objective_kmeans.last().unwrap());
        Ok(())
    }

    fn kmeans_converged(&self) -> bool {
        let ob = &self.objective_kmeans;
        let m = ob.len();
        if m <= WINDOW + 1 {
            return false;
        }
        let (mut old, mut new) = (0.0f32, 0.0f32);
        for i in 0..WINDOW {
            old += ob[m - 2 - i];
            new += ob[m - 1 - i];
        }
        (old - new).abs() / old.abs() < self.opts.epsilon_cluster
    }

    /// The cells of a block grouped by batch, once per key (stable), in runs of at most
    /// CELLS_PER_TASK cells; returns (cells, runs, runs of the first key).
    fn group_block(&self, cells: &[u32]) -> (Vec<u32>, Vec<Run>, usize) {
        let m = cells.len();
        let mut out = vec![0u32; m * self.ncov];
        let mut runs = Vec::new();
        let mut n_lead = 0;
        let mut counts = vec![0usize; self.nb];
        for c in 0..self.ncov {
            let batch_of = |j: u32| self.cell_batches[j as usize * self.ncov + c] as usize;
            let (first, last) = {
                let f = self.batch_cov.iter().position(|&x| x == c).unwrap();
                let l = self.batch_cov.iter().rposition(|&x| x == c).unwrap() + 1;
                (f, l)
            };
            for &j in cells {
                counts[batch_of(j)] += 1;
            }
            let runs_start = runs.len();
            let mut pos = c * m;
            for b in first..last {
                let cnt = counts[b];
                counts[b] = pos;
                let mut s = pos;
                while s < pos + cnt {
                    let e = (s + CELLS_PER_TASK).min(pos + cnt);
                    runs.push(Run { batch: b, begin: s, end: e });
                    s = e;
                }
                pos += cnt;
            }
            for &j in cells {
                let b = batch_of(j);
                out[counts[b]] = j;
                counts[b] += 1;
            }
            // Within a run, cells in increasing index: the R and distance rows are then read
            // in memory order (harmonypy keeps the shuffled order; only the order of the f32
            // sums over a run changes).
            for run in &runs[runs_start..] {
                out[run.begin..run.end].sort_unstable();
            }
            for b in first..last {
                counts[b] = 0;
            }
            if c == 0 {
                n_lead = runs.len();
            }
        }
        (out, runs, n_lead)
    }

    /// Sums of R over each run's cells (f32, in run order), runs in parallel.
    fn run_sums(&self, cells: &[u32], runs: &[Run]) -> Vec<Vec<f32>> {
        let k = self.k;
        runs.par_iter()
            .map(|run| {
                let mut acc = vec![0.0f32; k];
                let run_cells = &cells[run.begin..run.end];
                for (ci, &j) in run_cells.iter().enumerate() {
                    if let Some(&ahead) = run_cells.get(ci + PREFETCH_AHEAD) {
                        prefetch_row(&self.r, ahead as usize * k, k);
                    }
                    let r = &self.r[j as usize * k..(j as usize + 1) * k];
                    acc.iter_mut().zip(r).for_each(|(a, v)| *a += v);
                }
                acc
            })
            .collect()
    }

    /// Take runs out of (sign -1) or put them into (sign +1) O; the first `n_lead` runs
    /// (each cell once) also move E.
    fn move_runs(&mut self, runs: &[Run], sums: &[Vec<f32>], n_lead: usize, sign: f32) {
        let k = self.k;
        let mut totals = vec![0.0f32; k];
        for (ri, (run, acc)) in runs.iter().zip(sums).enumerate() {
            let o = &mut self.o[run.batch * k..(run.batch + 1) * k];
            if sign < 0.0 {
                o.iter_mut().zip(acc).for_each(|(x, a)| *x -= a);
            } else {
                o.iter_mut().zip(acc).for_each(|(x, a)| *x += a);
            }
            if ri < n_lead {
                totals.iter_mut().zip(acc).for_each(|(t, a)| *t += a);
            }
        }
        for b in 0..self.nb {
            let pr = self.pr_b[b];
            let e = &mut self.e[b * k..(b + 1) * k];
            if sign < 0.0 {
                e.iter_mut().zip(&totals).for_each(|(x, t)| *x -= t * pr);
            } else {
                e.iter_mut().zip(&totals).for_each(|(x, t)| *x += t * pr);
            }
        }
    }

    /// One pass of the R update over all cells in the given order, block by block.
    fn update_r(&mut self, order: &[u32]) -> Result<()> {
        let (n, k, ncov) = (self.n, self.k, self.ncov);
        let n_blocks = (1.0f64 / self.opts.block_size as f64).ceil() as usize;
        let per_block = ((n as f32 * self.opts.block_size) as usize).max(1);
        self.update_error = 0.0;
        self.update_entropy = 0.0;
        let mut bad_sum = false;
        let mut log_div = vec![0.0f32; self.nb * k];
        for i in 0..n_blocks {
            let lo = i * per_block;
            if lo >= n {
                break;
            }
            let hi = if i == n_blocks - 1 { n } else { ((i + 1) * per_block).min(n) };
            let (cells, runs, n_lead) = self.group_block(&order[lo..hi]);
            let sums = self.run_sums(&cells, &runs);
            self.move_runs(&runs, &sums, n_lead, -1.0);

            for b in 0..self.nb {
                for g in 0..k {
                    let e = self.e[b * k + g];
                    let o = self.o[b * k + g];
                    let diff = (2.0 * e + 1.0).ln() - (o + e + 1.0).ln();
                    log_div[b * k + g] = diff * self.theta[b];
                }
            }

            // reassign the block's cells with E and O frozen (runs in parallel)
            let this = &*self;
            #[allow(clippy::type_complexity)]
            let results: Vec<(Vec<f32>, Vec<f32>, f64, f64, bool, bool)> = runs[..n_lead]
                .par_iter()
                .map(|run| {
                    let lead = &log_div[run.batch * k..(run.batch + 1) * k];
                    let mut out = vec![0.0f32; (run.end - run.begin) * k];
                    let mut shifted = vec![0.0f32; k];
                    let mut sums = vec![0.0f32; k];
                    let (mut error, mut entropy) = (0.0f64, 0.0f64);
                    let (mut bad_norm, mut bad_col) = (false, false);
                    let run_cells = &cells[run.begin..run.end];
                    for (ci, &j) in run_cells.iter().enumerate() {
                        if let Some(&ahead) = run_cells.get(ci + PREFETCH_AHEAD) {
                            prefetch_row(&this.dist, ahead as usize * k, k);
                        }
                        let j = j as usize;
                        let dist = &this.dist[j * k..(j + 1) * k];
                        let logits = &mut out[ci * k..(ci + 1) * k];
                        for (((l, dv), sg), ld) in logits.iter_mut().zip(dist).zip(&this.sigma).zip(lead) {
                            *l = -dv / sg + ld;
                        }
                        for c in 1..ncov {
                            let b = this.cell_batches[j * ncov + c] as usize;
                            let div = &log_div[b * k..(b + 1) * k];
                            for g in 0..k {
                                logits[g] += div[g];
                            }
                        }
                        let mx = max_of(logits);
                        // exp(shifted) in place; shifted kept for the entropy term
                        for (l, sh) in logits.iter_mut().zip(shifted.iter_mut()) {
                            *sh = *l - mx;
                            *l = exp_neg(*sh);
                        }
                        let weighted = dot_f64(&this.sigma, logits);
                        let weighted_shifted = dot3_f64(&this.sigma, logits, &shifted);
                        let total = accumulate(logits);
                        if !(total.is_finite() && total > 0.0) {
                            bad_norm = true;
                            continue;
                        }
                        for (v, sm) in logits.iter_mut().zip(sums.iter_mut()) {
                            *v /= total;
                            *sm += *v;
                        }
                        let cell_error = dot_f64(logits, dist);
                        let col = accumulate(logits);
                        if !col.is_finite() || (col - 1.0).abs() > 1e-4 {
                            bad_col = true;
                        }
                        error += cell_error;
                        entropy += (weighted_shifted - (total as f64).ln() * weighted) / total as f64;
                    }
                    (out, sums, error, entropy, bad_norm, bad_col)
                })
                .collect();
            let mut sums = Vec::with_capacity(runs.len());
            for (run, (out, run_sum, error, entropy, bad_norm, bad_col)) in runs[..n_lead].iter().zip(results) {
                if bad_norm {
                    return Err(HarmonyError::Numerical {
                        stage: "assignment update",
                        what: "assignment normalizers must be finite and positive".into(),
                    });
                }
                bad_sum |= bad_col;
                for (ci, &j) in cells[run.begin..run.end].iter().enumerate() {
                    self.r[j as usize * k..(j as usize + 1) * k].copy_from_slice(&out[ci * k..(ci + 1) * k]);
                }
                self.update_error += error;
                self.update_entropy += entropy;
                sums.push(run_sum);
            }
            // put the block back: the lead runs' sums came from the reassignment, the other
            // keys' runs are summed again
            sums.extend(self.run_sums(&cells, &runs[n_lead..]));
            self.move_runs(&runs, &sums, n_lead, 1.0);
        }
        if bad_sum {
            return Err(HarmonyError::Numerical { stage: "assignment update", what: "assignment columns must sum to one".into() });
        }
        Ok(())
    }

    /// The mixture-of-experts ridge correction; updates z_corr and the centroids.
    fn moe_correct_ridge(&mut self) -> Result<()> {
        let (n, d, k, nb, ncov) = (self.n, self.d, self.k, self.nb, self.ncov);
        // the batches each cluster corrects
        let mut keeps: Vec<Vec<usize>> = vec![Vec::new(); k];
        let mut active = vec![false; k];
        for g in 0..k {
            let avg: Vec<f32> = (0..nb).map(|b| self.o[b * k + g] / self.batch_sizes[b]).collect();
            let mut cov_levels = vec![0usize; ncov];
            for b in 0..nb {
                if avg[b] > self.opts.batch_prop_cutoff {
                    cov_levels[self.batch_cov[b]] += 1;
                }
            }
            active[g] = cov_levels.iter().any(|&l| l > 1);
            keeps[g] = (0..nb).filter(|&b| avg[b] > self.opts.batch_prop_cutoff && cov_levels[self.batch_cov[b]] > 1).collect();
        }
        let mut used = vec![false; nb];
        for g in 0..k {
            if active[g] {
                for &b in &keeps[g] {
                    used[b] = true;
                }
            }
        }

        // RZ[b] = R_b' Z_b (K x d) and the totals of R over batch b (K), in f64
        let r = &self.r;
        let z = self.z_orig;
        let rz: Vec<Option<(Vec<f64>, Vec<f64>)>> = (0..nb)
            .into_par_iter()
            .map(|b| {
                if !used[b] {
                    return None;
                }
                let mut sums = vec![0.0f64; k * d];
                let mut tot = vec![0.0f64; k];
                for chunk in self.batch_cells[b].chunks(GEMM_CHUNK) {
                    let m = chunk.len();
                    let mut rb = vec![0.0f64; m * k];
                    let mut zb = vec![0.0f64; m * d];
                    for (i, &j) in chunk.iter().enumerate() {
                        let j = j as usize;
                        for g in 0..k {
                            rb[i * k + g] = r[j * k + g] as f64;
                            tot[g] += rb[i * k + g];
                        }
                        for a in 0..d {
                            zb[i * d + a] = z[j * d + a] as f64;
                        }
                    }
                    // (K x m) (m x d)
                    dgemm(k, m, d, &rb, 1, k, &zb, d, 1, &mut sums);
                }
                Some((sums, tot))
            })
            .collect();

        // several keys: intercept totals over cells with any kept batch, and batch overlaps
        let mut z_all = vec![0.0f64; k * d];
        let mut cov_sum = vec![0.0f64; k];
        let mut pair_sums: Vec<Vec<f64>> = Vec::new();
        if ncov > 1 {
            let mut kept = vec![false; nb * k];
            for g in 0..k {
                if active[g] {
                    for &b in &keeps[g] {
                        kept[b * k + g] = true;
                    }
                }
            }
            for chunk_start in (0..n).step_by(GEMM_CHUNK) {
                let m = GEMM_CHUNK.min(n - chunk_start);
                let mut rm = vec![0.0f64; m * k];
                let mut zb = vec![0.0f64; m * d];
                for i in 0..m {
                    let j = chunk_start + i;
                    let bs = &self.cell_batches[j * ncov..(j + 1) * ncov];
                    for g in 0..k {
                        if bs.iter().any(|&b| kept[b as usize * k + g]) {
                            rm[i * k + g] = r[j * k + g] as f64;
                            cov_sum[g] += rm[i * k + g];
                        }
                    }
                    for a in 0..d {
                        zb[i * d + a] = z[j * d + a] as f64;
                    }
                }
                dgemm(k, m, d, &rm, 1, k, &zb, d, 1, &mut z_all);
            }
            for (list, of_cell) in &self.pairs {
                let mut s = vec![0.0f64; list.len() * k];
                for j in 0..n {
                    let q = of_cell[j] as usize;
                    for g in 0..k {
                        s[q * k + g] += r[j * k + g] as f64;
                    }
                }
                pair_sums.push(s);
            }
        }

        // one ridge system per active cluster
        let solutions: Vec<Option<Vec<f64>>> = (0..k)
            .into_par_iter()
            .map(|g| {
                if !active[g] {
                    return Ok(None);
                }
                let keep = &keeps[g];
                let m = keep.len() + 1;
                let mut slot = vec![usize::MAX; nb];
                for (i, &b) in keep.iter().enumerate() {
                    slot[b] = i + 1;
                }
                let mut a = vec![0.0f64; m * m];
                let mut rhs = vec![0.0f64; m * d];
                let penalty = |b: usize| -> f64 {
                    match &self.lambda {
                        None => (self.alpha * self.e[b * k + g]) as f64,
                        Some(l) => l[b + 1] as f64,
                    }
                };
                let mut total = 0.0;
                for (i, &b) in keep.iter().enumerate() {
                    let (sums, tot) = rz[b].as_ref().unwrap();
                    let o = tot[g];
                    total += o;
                    a[i + 1] = o;
                    a[(i + 1) * m] = o;
                    a[(i + 1) * m + i + 1] = o + penalty(b);
                    rhs[(i + 1) * d..(i + 2) * d].copy_from_slice(&sums[g * d..(g + 1) * d]);
                }
                if ncov > 1 {
                    a[0] = cov_sum[g];
                    rhs[..d].copy_from_slice(&z_all[g * d..(g + 1) * d]);
                    for (p, (list, _)) in self.pairs.iter().enumerate() {
                        for (q, &(ba, bb)) in list.iter().enumerate() {
                            let (sa, sb) = (slot[ba as usize], slot[bb as usize]);
                            if sa == usize::MAX || sb == usize::MAX {
                                continue;
                            }
                            let overlap = pair_sums[p][q * k + g];
                            a[sa * m + sb] += overlap;
                            a[sb * m + sa] += overlap;
                        }
                    }
                } else {
                    a[0] = total;
                    for &b in keep {
                        let (sums, _) = rz[b].as_ref().unwrap();
                        for i in 0..d {
                            rhs[i] += sums[g * d + i];
                        }
                    }
                }
                if let Some(l) = &self.lambda {
                    if keep.len() == nb {
                        a[0] += l[0] as f64;
                    }
                }
                cholesky_solve(&mut a, m, &mut rhs, d)?;
                Ok(Some(rhs))
            })
            .collect::<Result<_>>()?;

        // correction directions M[b] (K x d), centroids from the intercepts
        let mut dirs: Vec<Option<Vec<f32>>> = (0..nb).map(|b| if used[b] { Some(vec![0.0f32; k * d]) } else { None }).collect();
        for g in 0..k {
            if let Some(w) = &solutions[g] {
                for a in 0..d {
                    self.y[g * d + a] = w[a] as f32;
                }
                for (i, &b) in keeps[g].iter().enumerate() {
                    let mb = dirs[b].as_mut().unwrap();
                    for a in 0..d {
                        mb[g * d + a] = w[(i + 1) * d + a] as f32;
                    }
                }
            }
        }
        self.apply_corrections(&dirs);
        normalise_rows(&mut self.y, d);
        Ok(())
    }

    /// z_corr(j) = z_orig(j) - sum over j's batches b of R(j) M[b], by combination of batches.
    fn apply_corrections(&mut self, dirs: &[Option<Vec<f32>>]) {
        let (n, d, k, ncov) = (self.n, self.d, self.k, self.ncov);
        let mut by_combination: Vec<u32> = (0..n as u32).collect();
        let cb = &self.cell_batches;
        by_combination
            .sort_by(|&a, &b| cb[a as usize * ncov..(a as usize + 1) * ncov].cmp(&cb[b as usize * ncov..(b as usize + 1) * ncov]));
        let mut groups: Vec<&[u32]> = Vec::new();
        let mut start = 0;
        for i in 1..=n {
            let differs = i == n || {
                let (a, b) = (by_combination[i - 1] as usize, by_combination[i] as usize);
                cb[a * ncov..(a + 1) * ncov] != cb[b * ncov..(b + 1) * ncov]
            };
            if differs {
                let group = &by_combination[start..i];
                for piece in group.chunks(GEMM_CHUNK) {
                    groups.push(piece);
                }
                start = i;
            }
        }
        let r = &self.r;
        let z = self.z_orig;
        let outputs: Vec<Vec<f32>> = groups
            .par_iter()
            .map(|cells| {
                let j0 = cells[0] as usize;
                let mut combined: Option<Vec<f32>> = None;
                for c in 0..ncov {
                    if let Some(m) = &dirs[cb[j0 * ncov + c] as usize] {
                        match &mut combined {
                            None => combined = Some(m.clone()),
                            Some(acc) => acc.iter_mut().zip(m).for_each(|(x, y)| *x += y),
                        }
                    }
                }
                let m = cells.len();
                let mut out = vec![0.0f32; m * d];
                for (i, &j) in cells.iter().enumerate() {
                    out[i * d..(i + 1) * d].copy_from_slice(&z[j as usize * d..(j as usize + 1) * d]);
                }
                if let Some(comb) = combined {
                    let mut rg = vec![0.0f32; m * k];
                    for (i, &j) in cells.iter().enumerate() {
                        rg[i * k..(i + 1) * k].copy_from_slice(&r[j as usize * k..(j as usize + 1) * k]);
                    }
                    // out -= (m x K) (K x d)
                    sgemm(m, k, d, -1.0, &rg, k, 1, &comb, d, 1, 1.0, &mut out);
                }
                out
            })
            .collect();
        for (cells, out) in groups.iter().zip(outputs) {
            for (i, &j) in cells.iter().enumerate() {
                self.z_corr[j as usize * d..(j as usize + 1) * d].copy_from_slice(&out[i * d..(i + 1) * d]);
            }
        }
    }
}

/// Solve A W = B in place (A m x m symmetric positive definite, row-major; B m x d, row-major)
/// by Cholesky in f64. Pivots below 1e-10 of the largest diagonal entry (or NaN) are singular.
#[allow(clippy::neg_cmp_op_on_partial_ord)]
fn cholesky_solve(a: &mut [f64], m: usize, b: &mut [f64], d: usize) -> Result<()> {
    let largest = (0..m).map(|i| a[i * m + i]).fold(0.0f64, f64::max);
    let min_pivot = 1e-10 * largest;
    // lower triangle L with A = L L'
    for c in 0..m {
        let mut s = a[c * m + c];
        for p in 0..c {
            s -= a[c * m + p] * a[c * m + p];
        }
        if !(s > min_pivot) {
            return Err(HarmonyError::Numerical {
                stage: "ridge correction",
                what: "ridge system is singular; lambda (or alpha) is zero or too small".into(),
            });
        }
        let l = s.sqrt();
        a[c * m + c] = l;
        for r in c + 1..m {
            let mut s = a[r * m + c];
            for p in 0..c {
                s -= a[r * m + p] * a[c * m + p];
            }
            a[r * m + c] = s / l;
        }
    }
    // forward: L Y = B
    for r in 0..m {
        for p in 0..r {
            let f = a[r * m + p];
            if f != 0.0 {
                for i in 0..d {
                    b[r * d + i] -= f * b[p * d + i];
                }
            }
        }
        let l = a[r * m + r];
        for i in 0..d {
            b[r * d + i] /= l;
        }
    }
    // backward: L' W = Y
    for r in (0..m).rev() {
        for p in r + 1..m {
            let f = a[p * m + r];
            if f != 0.0 {
                for i in 0..d {
                    b[r * d + i] -= f * b[p * d + i];
                }
            }
        }
        let l = a[r * m + r];
        for i in 0..d {
            b[r * d + i] /= l;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accumulate_matches_pairwise_order() {
        assert_eq!(accumulate(&[1.0, 2.0, 3.0]), 6.0);
        assert_eq!(accumulate(&[]), 0.0);
        assert_eq!(accumulate(&[5.0]), 5.0);
    }

    #[test]
    fn fast_exp_is_close_to_libm() {
        let mut worst = 0.0f64;
        let mut x = 0.0f32;
        while x > -87.0 {
            let (a, b) = (exp_neg(x) as f64, x.exp() as f64);
            worst = worst.max((a - b).abs() / b);
            x -= 0.001_37;
        }
        assert!(worst < 3e-7, "relative error {worst}");
        assert_eq!(exp_neg(0.0), 1.0);
        assert!(exp_neg(-200.0) < 2e-38 && exp_neg(-200.0) >= 0.0);
    }

    #[test]
    fn python_rounding() {
        assert_eq!(round_half_even(2.5), 2.0);
        assert_eq!(round_half_even(1.5), 2.0);
        assert_eq!(round_half_even(6.6667), 7.0);
    }

    #[test]
    fn cholesky_solves_small_system() {
        let mut a = vec![4.0, 2.0, 2.0, 3.0];
        let mut b = vec![2.0, 1.0];
        cholesky_solve(&mut a, 2, &mut b, 1).unwrap();
        // [4 2; 2 3] x = [2; 1] -> x = [0.5, 0]
        assert!((b[0] - 0.5).abs() < 1e-12 && b[1].abs() < 1e-12);
    }
}
