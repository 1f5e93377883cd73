//! Approximate k-nearest neighbours: NN-descent (Dong, Moses & Li, WWW 2011) started from a
//! random-projection forest, as pynndescent does (the index scib-metrics' Benchmarker uses).
//!
//! For millions of cells, where the exact blocked search ([`crate::metrics::exact_knn`], O(n² d))
//! takes hours on a small machine. Same output layout as the exact search: row `i` lists `k`
//! cells nearest first, **the cell itself included**, Euclidean distances.
//!
//! Shape of the algorithm (all steps are pure functions of the data and the seed):
//! 1. `n_trees` random-projection trees (split by the hyperplane half-way between two random
//!    points of the node, pynndescent's Euclidean split), leaves of at most `leaf_size` cells;
//!    every cell starts with its leaf mates from all trees (random cells fill short lists).
//! 2. NN-descent rounds: each cell's neighbour list carries a "new" flag per entry. Candidate
//!    lists are built from forward and reverse edges, at most `max_candidates` new and old ones
//!    per cell, chosen by a seeded hash priority. Each cell then compares itself with the
//!    candidates of its candidates (new-new and new-old pairs only) and keeps the `k` nearest.
//!    A round stops the search when fewer than `delta · n · k` lists changed entries.
//!
//! Determinism: every cell writes only its own list, and reads only the candidate lists frozen
//! at the start of the round, so the result does not depend on rayon's scheduling or the number
//! of threads: the same seed gives the same neighbours. Ties are broken by the smaller index.
//!
//! Memory: `n · k` (index, distance, flag) for the lists, `2 · n · max_candidates` u32 for the
//! candidate lists, `n_trees · 2n` u32 for the forest: about 1.8 GB at 1M cells and k = 90.

use rayon::prelude::*;
use std::cell::RefCell;

use super::neighbors::NeighborsResults;
use crate::formats::splitmix::{mix, GOLDEN};

/// Parameters of [`approx_knn`]. Defaults follow pynndescent where they matter for recall.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AnnParams {
    /// Seed of the forest, the random fill and the candidate sampling.
    pub seed: u64,
    /// Random-projection trees of the initial graph.
    pub n_trees: usize,
    /// Largest leaf of a tree.
    pub leaf_size: usize,
    /// Most new (and most old) candidates per cell and round (pynndescent: min(60, k)).
    pub max_candidates: usize,
    /// Most NN-descent rounds.
    pub max_iters: usize,
    /// Stop when fewer than `delta * n * k` list entries changed in a round (pynndescent: 0.001).
    pub delta: f64,
}

impl Default for AnnParams {
    fn default() -> Self {
        AnnParams { seed: 0, n_trees: 8, leaf_size: 64, max_candidates: 30, max_iters: 12, delta: 0.001 }
    }
}

/// What [`approx_knn`] did, for the results file.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct AnnReport {
    /// NN-descent rounds run.
    pub iterations: usize,
    /// List entries changed in each round.
    pub updates: Vec<u64>,
    /// Distance evaluations in all, forest included.
    pub distance_evals: u64,
}

const EMPTY: u32 = u32::MAX;

#[inline]
fn splitmix(z: u64) -> u64 {
    mix(z.wrapping_add(GOLDEN))
}

#[inline]
fn hash4(seed: u64, a: u64, b: u64, c: u64) -> u64 {
    splitmix(splitmix(splitmix(seed ^ a.wrapping_mul(0x632b_e59b_d9b4_e019)) ^ b) ^ c)
}

/// One cell's neighbour list: a max-heap on (distance, index) of at most k entries.
struct Lists {
    idx: Vec<u32>,
    dist: Vec<f32>,
    new: Vec<bool>,
    len: Vec<u32>,
    k: usize,
}

#[inline]
fn greater(da: f32, ia: u32, db: f32, ib: u32) -> bool {
    da > db || (da == db && ia > ib)
}

/// Push (d, j) into the heap slices (len entries used) unless it is not nearer than the
/// current worst of a full heap. The caller has checked that j is not in the list.
#[inline]
fn heap_push(idx: &mut [u32], dist: &mut [f32], new: &mut [bool], len: &mut u32, d: f32, j: u32) -> bool {
    let k = idx.len();
    let mut l = *len as usize;
    if l == k {
        if !greater(dist[0], idx[0], d, j) {
            return false;
        }
        // replace the root and sift down
        let mut p = 0usize;
        loop {
            let c1 = 2 * p + 1;
            if c1 >= k {
                break;
            }
            let c2 = c1 + 1;
            let c = if c2 < k && greater(dist[c2], idx[c2], dist[c1], idx[c1]) { c2 } else { c1 };
            if greater(dist[c], idx[c], d, j) {
                idx[p] = idx[c];
                dist[p] = dist[c];
                new[p] = new[c];
                p = c;
            } else {
                break;
            }
        }
        idx[p] = j;
        dist[p] = d;
        new[p] = true;
        return true;
    }
    // sift up
    let mut c = l;
    while c > 0 {
        let p = (c - 1) / 2;
        if !greater(d, j, dist[p], idx[p]) {
            break;
        }
        idx[c] = idx[p];
        dist[c] = dist[p];
        new[c] = new[p];
        c = p;
    }
    idx[c] = j;
    dist[c] = d;
    new[c] = true;
    l += 1;
    *len = l as u32;
    true
}

thread_local! {
    /// Per-thread visit stamps (one u32 per cell) and the current stamp.
    static STAMPS: RefCell<(Vec<u32>, u32, Vec<u32>)> = const { RefCell::new((Vec::new(), 0, Vec::new())) };
}

/// Run `f` with this thread's stamp array sized for n cells, a fresh stamp value and a
/// scratch list of candidates.
fn with_stamps<R>(n: usize, f: impl FnOnce(&mut [u32], u32, &mut Vec<u32>) -> R) -> R {
    STAMPS.with(|s| {
        let mut s = s.borrow_mut();
        let s = &mut *s;
        if s.0.len() != n {
            s.0 = vec![0; n];
            s.1 = 0;
        }
        if s.1 == u32::MAX {
            s.0.iter_mut().for_each(|v| *v = 0);
            s.1 = 0;
        }
        s.1 += 1;
        let st = s.1;
        f(&mut s.0, st, &mut s.2)
    })
}

/// Start gathering candidates for cell i: i and its current neighbours count as seen.
#[inline(always)]
fn mark_list(stamps: &mut [u32], st: u32, i: usize, idx: &[u32], len: u32, buf: &mut Vec<u32>) {
    stamps[i] = st;
    for &j in &idx[..len as usize] {
        stamps[j as usize] = st;
    }
    buf.clear();
}

/// Keep candidate j unless it was seen already.
#[inline(always)]
fn gather(stamps: &mut [u32], st: u32, buf: &mut Vec<u32>, j: u32) {
    let s = &mut stamps[j as usize];
    if *s != st {
        *s = st;
        buf.push(j);
    }
}

/// Offer every candidate in `cands` (may repeat, may hold `i` or current neighbours) to cell
/// i's list. Returns (changed entries, distance evaluations).
#[allow(clippy::too_many_arguments)]
fn offer(
    x: &[f32],
    d: usize,
    i: usize,
    cands: &mut dyn Iterator<Item = u32>,
    idx: &mut [u32],
    dist: &mut [f32],
    new: &mut [bool],
    len: &mut u32,
    stamps: &mut [u32],
    st: u32,
    buf: &mut Vec<u32>,
) -> (u64, u64) {
    mark_list(stamps, st, i, idx, *len, buf);
    for j in cands {
        gather(stamps, st, buf, j);
    }
    (measure(x, d, i, buf, idx, dist, new, len), buf.len() as u64)
}

/// Measure cell i against the gathered candidates `buf` (unseen, distinct) and keep the
/// nearer ones; returns the list entries changed. The rows are scattered over the matrix:
/// they are prefetched a few candidates ahead instead of waited for one at a time.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn measure_impl(
    x: &[f32],
    d: usize,
    i: usize,
    buf: &[u32],
    idx: &mut [u32],
    dist: &mut [f32],
    new: &mut [bool],
    len: &mut u32,
    sqdist: impl Fn(&[f32], &[f32]) -> f32,
) -> u64 {
    let xi = &x[i * d..(i + 1) * d];
    const AHEAD: usize = 6;
    for &j in buf.iter().take(AHEAD) {
        prefetch_row(x, d, j as usize);
    }
    let mut changed = 0u64;
    for (q, &j) in buf.iter().enumerate() {
        if let Some(&f) = buf.get(q + AHEAD) {
            prefetch_row(x, d, f as usize);
        }
        let ju = j as usize;
        let dd = sqdist(xi, &x[ju * d..(ju + 1) * d]);
        if heap_push(idx, dist, new, len, dd, j) {
            changed += 1;
        }
    }
    changed
}

/// Squared Euclidean distance with 8-wide fused multiply-adds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sqdist_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i + 16 <= n {
        let d0 = _mm256_sub_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)));
        let d1 = _mm256_sub_ps(_mm256_loadu_ps(pa.add(i + 8)), _mm256_loadu_ps(pb.add(i + 8)));
        s0 = _mm256_fmadd_ps(d0, d0, s0);
        s1 = _mm256_fmadd_ps(d1, d1, s1);
        i += 16;
    }
    if i + 8 <= n {
        let d0 = _mm256_sub_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)));
        s0 = _mm256_fmadd_ps(d0, d0, s0);
        i += 8;
    }
    let s = _mm256_add_ps(s0, s1);
    let q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    let q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    let q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
    let mut total = _mm_cvtss_f32(q);
    while i < n {
        let t = a[i] - b[i];
        total += t * t;
        i += 1;
    }
    total
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn measure_avx2(x: &[f32], d: usize, i: usize, buf: &[u32], idx: &mut [u32], dist: &mut [f32], new: &mut [bool], len: &mut u32) -> u64 {
    // SAFETY: this function runs only where AVX2 and FMA were detected.
    measure_impl(x, d, i, buf, idx, dist, new, len, |a, b| unsafe { sqdist_avx2(a, b) })
}

/// [`measure_impl`], with AVX2 and FMA when the processor has them.
fn measure(x: &[f32], d: usize, i: usize, buf: &[u32], idx: &mut [u32], dist: &mut [f32], new: &mut [bool], len: &mut u32) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the features were detected at run time.
            return unsafe { measure_avx2(x, d, i, buf, idx, dist, new, len) };
        }
    }
    measure_impl(x, d, i, buf, idx, dist, new, len, super::neighbors::sqdist)
}

/// Ask the processor to start loading row `j` (every 64-byte line of it).
#[inline(always)]
fn prefetch_row(x: &[f32], d: usize, j: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let row = &x[j * d..(j + 1) * d];
        let bytes = std::mem::size_of_val(row);
        let p = row.as_ptr() as *const i8;
        let mut o = 0;
        while o < bytes {
            // SAFETY: a prefetch is a hint; the address lies inside `row`.
            unsafe { std::arch::x86_64::_mm_prefetch(p.add(o), std::arch::x86_64::_MM_HINT_T0) };
            o += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (x, d, j);
}

/// One random-projection tree: the cells permuted so that every leaf is contiguous, and for
/// every cell the (start, end) of its leaf in that permutation.
struct Tree {
    perm: Vec<u32>,
    leaf: Vec<(u32, u32)>,
    /// leaf number of every cell
    leaf_of: Vec<u32>,
}

fn rp_tree(x: &[f32], n: usize, d: usize, leaf_size: usize, seed: u64) -> Tree {
    let mut perm: Vec<u32> = (0..n as u32).collect();
    let mut leaves: Vec<(u32, u32)> = Vec::new();
    let mut stack: Vec<(usize, usize)> = vec![(0, n)];
    let mut node = 0u64;
    let mut side: Vec<bool> = Vec::new();
    let mut normal = vec![0f32; d];
    while let Some((s, e)) = stack.pop() {
        node += 1;
        let m = e - s;
        if m <= leaf_size.max(2) {
            leaves.push((s as u32, e as u32));
            continue;
        }
        let h = hash4(seed, 0x7ee, node, m as u64);
        let a = perm[s + (h % m as u64) as usize] as usize;
        let mut b = perm[s + ((h >> 32) % m as u64) as usize] as usize;
        if a == b {
            b = perm[s + ((h >> 32) as usize + 1) % m] as usize;
        }
        let (xa, xb) = (&x[a * d..(a + 1) * d], &x[b * d..(b + 1) * d]);
        let mut off = 0f32;
        for t in 0..d {
            normal[t] = xa[t] - xb[t];
            off -= normal[t] * (xa[t] + xb[t]) * 0.5;
        }
        side.clear();
        let mut left = 0usize;
        for p in s..e {
            let c = perm[p] as usize;
            let v = super::neighbors::dot(&normal, &x[c * d..(c + 1) * d]) + off;
            let l = if v == 0.0 { hash4(seed, 0x5de, node, c as u64) & 1 == 0 } else { v < 0.0 };
            side.push(l);
            left += l as usize;
        }
        if left == 0 || left == m {
            // degenerate split (identical points): halves in hash order
            for (q, p) in (s..e).enumerate() {
                side[q] = hash4(seed, 0xdea, node, perm[p] as u64) & 1 == 0;
            }
            left = side.iter().filter(|&&v| v).count();
            if left == 0 || left == m {
                for q in 0..m {
                    side[q] = q < m / 2;
                }
                left = m / 2;
            }
        }
        // stable partition of perm[s..e] by side
        let (mut l, mut r): (Vec<u32>, Vec<u32>) = (Vec::with_capacity(left), Vec::with_capacity(m - left));
        for (q, p) in (s..e).enumerate() {
            if side[q] { l.push(perm[p]) } else { r.push(perm[p]) }
        }
        perm[s..s + left].copy_from_slice(&l);
        perm[s + left..e].copy_from_slice(&r);
        stack.push((s + left, e));
        stack.push((s, s + left));
    }
    let mut leaf_of = vec![0u32; n];
    for (li, &(s, e)) in leaves.iter().enumerate() {
        for p in s..e {
            leaf_of[perm[p as usize] as usize] = li as u32;
        }
    }
    Tree { perm, leaf: leaves, leaf_of }
}

/// Build bounded candidate lists (lowest hash priority first) from forward and reverse
/// edges, for new entries and old ones. Returns (new, old), each `n * m` with EMPTY padding.
fn candidates(lists: &Lists, n: usize, m: usize, seed: u64, round: u64) -> (Vec<u32>, Vec<u32>) {
    let k = lists.k;
    let chunks = (rayon::current_num_threads() * 2).max(1);
    let per = n.div_ceil(chunks).max(1);
    let mut newc = vec![EMPTY; n * m];
    let mut oldc = vec![EMPTY; n * m];
    newc.par_chunks_mut(per * m).zip(oldc.par_chunks_mut(per * m)).enumerate().for_each(|(c, (nc, oc))| {
        let t0 = c * per;
        let t1 = (t0 + per).min(n);
        let rows = t1 - t0;
        // priorities of the kept candidates, max-heap per row (u64 priority, u32 id)
        let mut np = vec![(u64::MAX, EMPTY); rows * m];
        let mut op = vec![(u64::MAX, EMPTY); rows * m];
        let mut nl = vec![0u32; rows];
        let mut ol = vec![0u32; rows];
        let push = |pr: &mut [(u64, u32)], len: &mut u32, p: u64, j: u32| {
            let l = *len as usize;
            if l < m {
                let mut c = l;
                while c > 0 {
                    let q = (c - 1) / 2;
                    if pr[q] >= (p, j) {
                        break;
                    }
                    pr[c] = pr[q];
                    c = q;
                }
                pr[c] = (p, j);
                *len += 1;
            } else if (p, j) < pr[0] {
                let mut q = 0;
                loop {
                    let c1 = 2 * q + 1;
                    if c1 >= m {
                        break;
                    }
                    let c = if c1 + 1 < m && pr[c1 + 1] > pr[c1] { c1 + 1 } else { c1 };
                    if pr[c] > (p, j) {
                        pr[q] = pr[c];
                        q = c;
                    } else {
                        break;
                    }
                }
                pr[q] = (p, j);
            }
        };
        for u in 0..n {
            let l = lists.len[u] as usize;
            for s in 0..l {
                let v = lists.idx[u * k + s] as usize;
                if v == u {
                    continue;
                }
                let (mine, theirs) = (u >= t0 && u < t1, v >= t0 && v < t1);
                if !mine && !theirs {
                    continue;
                }
                let isnew = lists.new[u * k + s];
                let p = hash4(seed, round, u.min(v) as u64, u.max(v) as u64);
                if mine {
                    let r = u - t0;
                    if isnew {
                        push(&mut np[r * m..(r + 1) * m], &mut nl[r], p, v as u32);
                    } else {
                        push(&mut op[r * m..(r + 1) * m], &mut ol[r], p, v as u32);
                    }
                }
                if theirs {
                    let r = v - t0;
                    if isnew {
                        push(&mut np[r * m..(r + 1) * m], &mut nl[r], p, u as u32);
                    } else {
                        push(&mut op[r * m..(r + 1) * m], &mut ol[r], p, u as u32);
                    }
                }
            }
        }
        for r in 0..rows {
            for (dst, src, len) in [(&mut *nc, &np, nl[r]), (&mut *oc, &op, ol[r])] {
                let row = &mut dst[r * m..(r + 1) * m];
                for q in 0..len as usize {
                    row[q] = src[r * m + q].1;
                }
                row[..len as usize].sort_unstable();
                // duplicates (forward and reverse edge) become EMPTY at the end
                let mut w = 0;
                for q in 0..len as usize {
                    if w == 0 || row[q] != row[w - 1] {
                        row[w] = row[q];
                        w += 1;
                    }
                }
                row[w..].iter_mut().for_each(|v| *v = EMPTY);
            }
        }
    });
    (newc, oldc)
}

/// Approximate `k`-NN of the `n x d` row-major `x` (self included, nearest first, Euclidean).
pub fn approx_knn(x: &[f32], n: usize, d: usize, k: usize, p: &AnnParams) -> (NeighborsResults, AnnReport) {
    approx_knn_with(x, n, d, k, p, &mut |_, _| {})
}

/// As [`approx_knn`], calling `on_round(round, changed)` after the forest (round 0) and after
/// every NN-descent round.
///
/// The search runs on the cells reordered along the leaves of one more random-projection tree,
/// so that the rows a cell compares itself with lie near each other in memory (at a million
/// cells the rows are otherwise fetched from all over a 200 MB matrix, one cache miss each);
/// the lists are mapped back to the input's cell numbers, and ties between equal distances
/// are broken by the smaller input number.
pub fn approx_knn_with(
    x: &[f32],
    n: usize,
    d: usize,
    k: usize,
    p: &AnnParams,
    on_round: &mut dyn FnMut(usize, u64),
) -> (NeighborsResults, AnnReport) {
    assert_eq!(x.len(), n * d);
    assert!(k >= 1 && k <= n, "need 1 <= k <= n");
    let order = rp_tree(x, n, d, p.leaf_size.max(2), hash4(p.seed, 0x10c, 0, 0)).perm;
    let mut xp = vec![0f32; n * d];
    xp.par_chunks_mut(d).zip(order.par_iter()).for_each(|(row, &i)| {
        let i = i as usize;
        row.copy_from_slice(&x[i * d..(i + 1) * d]);
    });
    let (lists, report) = nn_descent(&xp, n, d, k, p, on_round);
    drop(xp);
    // every list sorted once, in the input's cell numbers, Euclidean distances
    let mut indices = vec![0u32; n * k];
    let mut distances = vec![0f32; n * k];
    let mut at = vec![0u32; n];
    for (t, &i) in order.iter().enumerate() {
        at[i as usize] = t as u32;
    }
    indices.par_chunks_mut(k).zip(distances.par_chunks_mut(k)).enumerate().for_each(|(i, (io, dout))| {
        let t = at[i] as usize;
        let row = t * k..t * k + lists.len[t] as usize;
        let mut v: Vec<(f32, u32)> = lists.dist[row.clone()].iter().zip(&lists.idx[row]).map(|(&dd, &j)| (dd.sqrt(), order[j as usize])).collect();
        // nearest first; among equal distances the cell itself, then the smaller number
        let me = i as u32;
        v.sort_unstable_by(|a, b| a.0.total_cmp(&b.0).then((a.1 != me).cmp(&(b.1 != me))).then(a.1.cmp(&b.1)));
        for (q, (dd, j)) in v.into_iter().enumerate() {
            io[q] = j;
            dout[q] = dd;
        }
    });
    (NeighborsResults::new(indices, distances, n, k), report)
}

/// NN-descent on `x` as given (see the module's documentation): the unsorted lists, squared
/// distances, in `x`'s row numbers.
fn nn_descent(
    x: &[f32],
    n: usize,
    d: usize,
    k: usize,
    p: &AnnParams,
    on_round: &mut dyn FnMut(usize, u64),
) -> (Lists, AnnReport) {
    let m = p.max_candidates.max(1);
    let mut lists = Lists { idx: vec![EMPTY; n * k], dist: vec![f32::INFINITY; n * k], new: vec![false; n * k], len: vec![0; n], k };

    // 1. forest, leaf mates, random fill
    let trees: Vec<Tree> = (0..p.n_trees.max(1))
        .into_par_iter()
        .map(|t| rp_tree(x, n, d, p.leaf_size.max(k.min(n) / 2).max(2), hash4(p.seed, 0xf0e, t as u64, 0)))
        .collect();
    let evals0: u64 = lists
        .idx
        .par_chunks_mut(k)
        .zip(lists.dist.par_chunks_mut(k))
        .zip(lists.new.par_chunks_mut(k))
        .zip(lists.len.par_iter_mut())
        .enumerate()
        .map(|(i, (((idx, dist), new), len))| {
            with_stamps(n, |stamps, st, buf| {
                let mut it = trees.iter().flat_map(|t| {
                    let (s, e) = t.leaf[t.leaf_of[i] as usize];
                    t.perm[s as usize..e as usize].iter().copied()
                });
                // self (distance 0), then the leaf mates (`offer` skips i itself)
                heap_push(idx, dist, new, len, 0.0, i as u32);
                let (_, e2) = offer(x, d, i, &mut it, idx, dist, new, len, stamps, st, buf);
                let mut e3 = 0;
                let mut r = 0u64;
                while (*len as usize) < k && r < 64 * k as u64 {
                    let mut rnd = (0..k as u64).map(|q| (hash4(p.seed, 0xf11, i as u64, r * k as u64 + q) % n as u64) as u32);
                    e3 += offer(x, d, i, &mut rnd, idx, dist, new, len, stamps, st, buf).1;
                    r += 1;
                }
                if (*len as usize) < k {
                    // small n: every cell
                    let mut all = 0..n as u32;
                    e3 += offer(x, d, i, &mut all, idx, dist, new, len, stamps, st, buf).1;
                }
                e2 + e3
            })
        })
        .sum();
    drop(trees);
    on_round(0, n as u64);
    let mut report = AnnReport { iterations: 0, updates: Vec::new(), distance_evals: evals0 };

    // 2. NN-descent rounds
    for round in 1..=p.max_iters {
        let (newc, oldc) = candidates(&lists, n, m, p.seed, round as u64);
        // sampled new entries become old
        lists.idx.par_chunks(k).zip(lists.new.par_chunks_mut(k)).enumerate().for_each(|(u, (idx, new))| {
            let row = &newc[u * m..(u + 1) * m];
            for s in 0..k {
                if new[s] && row.binary_search(&idx[s]).is_ok() {
                    new[s] = false;
                }
            }
        });
        let (changed, evals): (u64, u64) = lists
            .idx
            .par_chunks_mut(k)
            .zip(lists.dist.par_chunks_mut(k))
            .zip(lists.new.par_chunks_mut(k))
            .zip(lists.len.par_iter_mut())
            .enumerate()
            .map(|(u, (((idx, dist), new), len))| {
                fn row(c: &[u32], m: usize, v: usize) -> &[u32] {
                    let r = &c[v * m..(v + 1) * m];
                    &r[..r.iter().position(|&j| j == EMPTY).unwrap_or(m)]
                }
                let row = |c, v| row(c, m, v);
                // candidates of u's candidates: new-any and old-new pairs, gathered without
                // branches (whether a cell was seen is not predictable)
                with_stamps(n, |stamps, st, buf| {
                    mark_list(stamps, st, u, idx, *len, buf);
                    let (nu, ou) = (row(&newc, u), row(&oldc, u));
                    buf.resize(nu.len() * (1 + 2 * m) + ou.len() * (1 + m), 0);
                    let mut l = 0usize;
                    let mut put = |j: u32| {
                        let s = &mut stamps[j as usize];
                        buf[l] = j;
                        l += (*s != st) as usize;
                        *s = st;
                    };
                    for &v in nu {
                        put(v);
                        row(&newc, v as usize).iter().chain(row(&oldc, v as usize)).for_each(|&j| put(j));
                    }
                    for &v in ou {
                        put(v);
                        row(&newc, v as usize).iter().for_each(|&j| put(j));
                    }
                    buf.truncate(l);
                    // entries pushed this round are flagged new by heap_push
                    (measure(x, d, u, buf, idx, dist, new, len), buf.len() as u64)
                })
            })
            .reduce(|| (0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        report.iterations = round;
        report.updates.push(changed);
        report.distance_evals += evals;
        on_round(round, changed);
        if (changed as f64) < p.delta * n as f64 * k as f64 {
            break;
        }
    }

    (lists, report)
}

/// Mean over cells of |approx row ∩ exact row| / k.
pub fn recall(approx: &NeighborsResults, exact: &NeighborsResults) -> f64 {
    assert_eq!((approx.n, approx.k), (exact.n, exact.k));
    let k = exact.k;
    let hits: usize = (0..exact.n)
        .into_par_iter()
        .map(|i| {
            let mut a: Vec<u32> = approx.row(i).to_vec();
            a.sort_unstable();
            exact.row(i).iter().filter(|j| a.binary_search(j).is_ok()).count()
        })
        .sum();
    hits as f64 / (exact.n * k) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::exact_knn;
    use rand::{Rng, SeedableRng};

    /// Seeded clustered data: `c` Gaussian-ish clusters in `d` dims (sum of 3 uniforms noise).
    pub fn clustered(n: usize, d: usize, c: usize, seed: u64) -> (Vec<f32>, Vec<u32>, Vec<u32>) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let centers: Vec<f32> = (0..c * d).map(|_| rng.gen::<f32>() * 6.0 - 3.0).collect();
        let shifts: Vec<f32> = (0..3 * d).map(|_| rng.gen::<f32>() - 0.5).collect();
        let mut x = vec![0f32; n * d];
        let mut labels = vec![0u32; n];
        let mut batches = vec![0u32; n];
        for i in 0..n {
            let l = rng.gen_range(0..c);
            let b = rng.gen_range(0..3);
            labels[i] = l as u32;
            batches[i] = b as u32;
            for t in 0..d {
                let noise: f32 = rng.gen::<f32>() + rng.gen::<f32>() + rng.gen::<f32>() - 1.5;
                x[i * d + t] = centers[l * d + t] + 0.5 * shifts[b * d + t] + noise;
            }
        }
        (x, labels, batches)
    }

    #[test]
    fn ann_recall_at_90_against_exact() {
        // 50 dimensions of noise around 10 centres: high intrinsic dimension, a hard case
        let (n, d, k) = (6000, 50, 90);
        let (x, _, _) = clustered(n, d, 10, 7);
        let exact = exact_knn(&x, n, d, k);
        let (approx, rep) = approx_knn(&x, n, d, k, &AnnParams { seed: 3, ..Default::default() });
        let r = recall(&approx, &exact);
        eprintln!("recall@90 n={n} d={d}: {r:.4} after {} rounds, updates {:?}, {} distance evaluations ({:.1}% of brute force)",
            rep.iterations, rep.updates, rep.distance_evals, 100.0 * rep.distance_evals as f64 / (n * n) as f64);
        assert!(r >= 0.95, "recall@90 {r} < 0.95");
        for i in 0..n {
            assert_eq!(approx.row(i)[0] as usize, i, "row {i}: self first");
            let dr = approx.row_dist(i);
            assert!(dr.windows(2).all(|w| w[0] <= w[1]), "row {i} sorted");
            // every distance is the true distance of that pair
            let j = approx.row(i)[k - 1] as usize;
            let true_d = crate::metrics::neighbors::sqdist(&x[i * d..(i + 1) * d], &x[j * d..(j + 1) * d]).sqrt();
            assert!((true_d - dr[k - 1]).abs() <= 1e-4 * true_d.max(1.0));
        }
    }

    #[test]
    fn ann_is_deterministic_for_a_seed_and_thread_count() {
        let (n, d, k) = (3000, 20, 30);
        let (x, _, _) = clustered(n, d, 6, 11);
        let p = AnnParams { seed: 42, ..Default::default() };
        let (a, ra) = approx_knn(&x, n, d, k, &p);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let (b, rb) = pool.install(|| approx_knn(&x, n, d, k, &p));
        assert_eq!(a, b, "same seed, 1 thread vs the global pool: same neighbours");
        assert_eq!(ra, rb);
        let (c, _) = approx_knn(&x, n, d, k, &AnnParams { seed: 43, ..p.clone() });
        // a different seed takes another path; the lists agree almost everywhere, not bitwise
        assert_ne!(a.indices, c.indices, "another seed should change at least one list");
        assert!(recall(&c, &a) > 0.9);
    }

    #[test]
    fn ann_handles_duplicates_and_tiny_inputs() {
        // all points identical: any k cells are nearest; self must still come first
        let (n, d, k) = (200, 4, 15);
        let x = vec![1.0f32; n * d];
        let (nn, _) = approx_knn(&x, n, d, k, &AnnParams::default());
        for i in 0..n {
            let row = nn.row(i);
            let mut s = row.to_vec();
            s.sort_unstable();
            s.dedup();
            assert_eq!(s.len(), k, "row {i} has duplicate neighbours");
            assert!(nn.row_dist(i).iter().all(|&v| v == 0.0));
        }
        // k == n: every cell
        let (x, _, _) = clustered(40, 3, 2, 1);
        let (nn, _) = approx_knn(&x, 40, 3, 40, &AnnParams::default());
        let ex = exact_knn(&x, 40, 3, 40);
        assert_eq!(recall(&nn, &ex), 1.0);
    }

    #[test]
    fn benchmark_values_with_approx_neighbours_match_exact() {
        use crate::metrics::{clisi_knn, graph_connectivity, ilisi_knn, kbet_per_label};
        let (n, d) = (6000, 30);
        let (x, labels, batches) = clustered(n, d, 8, 5);
        let ex = exact_knn(&x, n, d, 90);
        let (ap, _) = approx_knn(&x, n, d, 90, &AnnParams { seed: 1, ..Default::default() });
        let pairs = [
            ("ilisi_knn", ilisi_knn(&ex, &batches, None, true), ilisi_knn(&ap, &batches, None, true)),
            ("clisi_knn", clisi_knn(&ex, &labels, None, true), clisi_knn(&ap, &labels, None, true)),
            ("graph_connectivity", graph_connectivity(&ex.subset_k(15), &labels), graph_connectivity(&ap.subset_k(15), &labels)),
            ("kbet_per_label", kbet_per_label(&ex.subset_k(50), &batches, &labels, 0.05, 100), kbet_per_label(&ap.subset_k(50), &batches, &labels, 0.05, 100)),
        ];
        for (name, e, a) in pairs {
            eprintln!("{name:20} exact {e:.6} approx {a:.6} |diff| {:.2e}", (e - a).abs());
            assert!((e - a).abs() <= 0.01, "{name}: exact {e} vs approx {a}");
        }
    }
}
