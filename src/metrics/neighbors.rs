//! k-nearest-neighbour results and an exact, blocked brute-force kNN.
//!
//! Matches the layout scib-metrics uses (`NeighborsResults`): row `i` lists the
//! `k` nearest cells of cell `i` in increasing distance, **including the cell
//! itself** (pynndescent returns the query point first, at distance 0), with
//! Euclidean (not squared) distances.

use rayon::prelude::*;
use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// k-nearest-neighbour lists, row-major `n x k`.
#[derive(Debug, Clone, PartialEq)]
pub struct NeighborsResults {
    /// Neighbour indices, `n * k`, row-major, nearest first.
    pub indices: Vec<u32>,
    /// Euclidean distances matching `indices`.
    pub distances: Vec<f32>,
    pub n: usize,
    pub k: usize,
}

impl NeighborsResults {
    /// Build from row-major arrays; panics if the lengths disagree.
    pub fn new(indices: Vec<u32>, distances: Vec<f32>, n: usize, k: usize) -> Self {
        assert_eq!(indices.len(), n * k, "indices must be n*k");
        assert_eq!(distances.len(), n * k, "distances must be n*k");
        NeighborsResults {
            indices,
            distances,
            n,
            k,
        }
    }

    /// Keep the first `k` neighbours of every row (scib-metrics' `subset_neighbors`).
    pub fn subset_k(&self, k: usize) -> NeighborsResults {
        assert!(k <= self.k, "k must be <= the number of stored neighbours");
        let mut indices = Vec::with_capacity(self.n * k);
        let mut distances = Vec::with_capacity(self.n * k);
        for i in 0..self.n {
            indices.extend_from_slice(&self.indices[i * self.k..i * self.k + k]);
            distances.extend_from_slice(&self.distances[i * self.k..i * self.k + k]);
        }
        NeighborsResults {
            indices,
            distances,
            n: self.n,
            k,
        }
    }

    /// Neighbour indices of row `i`.
    pub fn row(&self, i: usize) -> &[u32] {
        &self.indices[i * self.k..(i + 1) * self.k]
    }

    /// Neighbour distances of row `i`.
    pub fn row_dist(&self, i: usize) -> &[f32] {
        &self.distances[i * self.k..(i + 1) * self.k]
    }
}

#[derive(PartialEq)]
struct Cand(f32, u32);
impl Eq for Cand {}
impl PartialOrd for Cand {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Cand {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0).then(self.1.cmp(&other.1))
    }
}

const COL_BLOCK: usize = 512;

/// A block of columns (cells) transposed to `d x ncp` (ncp = nc rounded up to
/// a multiple of 8, zero padded) so that distance kernels vectorise over cells.
pub(crate) struct ColBlock {
    pub data: Vec<f32>,
    pub nc: usize,
    pub ncp: usize,
}

impl ColBlock {
    pub fn new(x: &[f32], d: usize, c0: usize, c1: usize) -> ColBlock {
        let nc = c1 - c0;
        let ncp = nc.div_ceil(8) * 8;
        let mut data = vec![0f32; d * ncp];
        for c in 0..nc {
            let row = &x[(c0 + c) * d..(c0 + c + 1) * d];
            for t in 0..d {
                data[t * ncp + c] = row[t];
            }
        }
        ColBlock { data, nc, ncp }
    }
}

/// Kind of pairwise quantity a tile kernel computes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum TileOp {
    /// sum_t (a_t - b_t)^2, by direct differences (no cancellation)
    SqDist,
    /// sum_t a_t * b_t
    Dot,
}

/// out[i * cb.ncp + c] = op(row r0 + i, column c of `cb`) for i in 0..nr.
/// Register-blocked: 4 rows x 8 columns of accumulators, loop over d inside.
/// Uses an AVX2+FMA build of the same code when the CPU has it.
pub(crate) fn tile_kernel(
    x: &[f32],
    d: usize,
    r0: usize,
    nr: usize,
    cb: &ColBlock,
    op: TileOp,
    out: &mut [f32],
) {
    debug_assert!(out.len() >= nr * cb.ncp);
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the features were detected at run time.
            unsafe {
                match op {
                    TileOp::SqDist => tile_avx512::<true>(x, d, r0, nr, cb, out),
                    TileOp::Dot => tile_avx512::<false>(x, d, r0, nr, cb, out),
                }
            }
            return;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the features were detected at run time.
            unsafe {
                match op {
                    TileOp::SqDist => tile_avx2::<true>(x, d, r0, nr, cb, out),
                    TileOp::Dot => tile_avx2::<false>(x, d, r0, nr, cb, out),
                }
            }
            return;
        }
    }
    match op {
        TileOp::SqDist => tile_generic::<true, false>(x, d, r0, nr, cb, out),
        TileOp::Dot => tile_generic::<false, false>(x, d, r0, nr, cb, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const SQ: bool>(
    x: &[f32],
    d: usize,
    r0: usize,
    nr: usize,
    cb: &ColBlock,
    out: &mut [f32],
) {
    tile_generic::<SQ, true>(x, d, r0, nr, cb, out)
}

/// [`tile_generic`] with 8 rows x 32 columns of accumulators (sixteen 16-lane registers of the
/// 32 that AVX-512 has); each pair's sum is the same sequence of fused multiply-adds as in the
/// AVX2 build, so the values are identical.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn tile_avx512<const SQ: bool>(
    x: &[f32],
    d: usize,
    r0: usize,
    nr: usize,
    cb: &ColBlock,
    out: &mut [f32],
) {
    let ncp = cb.ncp;
    let mut i = 0;
    while i + 8 <= nr {
        let mut c = 0;
        while c + 16 <= ncp {
            tile_block::<SQ, true, 8, 16>(x, d, r0 + i, c, cb, out, i);
            c += 16;
        }
        if c < ncp {
            tile_block::<SQ, true, 8, 8>(x, d, r0 + i, c, cb, out, i);
        }
        i += 8;
    }
    if i < nr {
        tile_generic::<SQ, true>(x, d, r0 + i, nr - i, cb, &mut out[i * ncp..]);
    }
}

/// One register block: rows `r0 + i .. r0 + i + R` against the `W` columns
/// `c .. c + W` of `cb`; each pair's sum runs over `t` in order, so the value
/// does not depend on the blocking. `FMA`: fused multiply-adds (one rounding per term; only
/// where the processor has them, else `mul_add` is a slow library call).
#[inline(always)]
fn tile_block<const SQ: bool, const FMA: bool, const R: usize, const W: usize>(
    x: &[f32],
    d: usize,
    rows: usize,
    c: usize,
    cb: &ColBlock,
    out: &mut [f32],
    out_row0: usize,
) {
    let ncp = cb.ncp;
    let a: [&[f32]; R] = std::array::from_fn(|q| &x[(rows + q) * d..(rows + q + 1) * d]);
    let mut acc = [[0f32; W]; R];
    for (t, colrow) in cb.data.chunks_exact(ncp).take(d).enumerate() {
        let col: &[f32; W] = colrow[c..c + W].try_into().unwrap();
        for q in 0..R {
            let aq = a[q][t];
            for l in 0..W {
                match (SQ, FMA) {
                    (true, true) => {
                        let e = aq - col[l];
                        acc[q][l] = e.mul_add(e, acc[q][l]);
                    }
                    (true, false) => {
                        let e = aq - col[l];
                        acc[q][l] += e * e;
                    }
                    (false, true) => acc[q][l] = aq.mul_add(col[l], acc[q][l]),
                    (false, false) => acc[q][l] += aq * col[l],
                }
            }
        }
    }
    for (q, accq) in acc.iter().enumerate() {
        let o = (out_row0 + q) * ncp + c;
        out[o..o + W].copy_from_slice(accq);
    }
}

#[inline(always)]
fn tile_generic<const SQ: bool, const FMA: bool>(
    x: &[f32],
    d: usize,
    r0: usize,
    nr: usize,
    cb: &ColBlock,
    out: &mut [f32],
) {
    let ncp = cb.ncp;
    let mut i = 0;
    // 4 rows x 16 columns: eight 8-lane accumulators, enough independent
    // chains to hide the add latency
    while i + 4 <= nr {
        let mut c = 0;
        while c + 16 <= ncp {
            tile_block::<SQ, FMA, 4, 16>(x, d, r0 + i, c, cb, out, i);
            c += 16;
        }
        if c < ncp {
            tile_block::<SQ, FMA, 4, 8>(x, d, r0 + i, c, cb, out, i);
        }
        i += 4;
    }
    while i < nr {
        let mut c = 0;
        while c + 16 <= ncp {
            tile_block::<SQ, FMA, 1, 16>(x, d, r0 + i, c, cb, out, i);
            c += 16;
        }
        if c < ncp {
            tile_block::<SQ, FMA, 1, 8>(x, d, r0 + i, c, cb, out, i);
        }
        i += 1;
    }
}

/// Rounds of disjoint pairs of blocks `(r, c)`, `r <= c`, that together cover
/// every unordered pair of `nb` blocks exactly once (the diagonal pairs form
/// the first round; the rest is the circle method of a round-robin
/// tournament). No block appears twice in one round, so the pairs of a round
/// can run in parallel, each writing to its two blocks' accumulators.
pub(crate) fn block_pair_rounds(nb: usize) -> Vec<Vec<(usize, usize)>> {
    let mut rounds = vec![(0..nb).map(|b| (b, b)).collect::<Vec<_>>()];
    if nb < 2 {
        return rounds;
    }
    let m = nb + nb % 2; // an odd count gets a dummy block (a bye)
    for r in 0..m - 1 {
        let pos = |i: usize| if i == 0 { 0 } else { (i - 1 + r) % (m - 1) + 1 };
        let round: Vec<(usize, usize)> = (0..m / 2)
            .map(|i| (pos(i), pos(m - 1 - i)))
            .filter(|&(a, b)| a < nb && b < nb)
            .map(|(a, b)| (a.min(b), a.max(b)))
            .collect();
        rounds.push(round);
    }
    rounds
}

/// Offer the candidates `(dist[j], c0 + j)` to a bounded max-heap of the k best.
#[inline]
fn offer(heap: &mut BinaryHeap<Cand>, k: usize, dist: &[f32], c0: usize, self_idx: Option<usize>) {
    let mut worst = if heap.len() < k { f32::INFINITY } else { heap.peek().unwrap().0 };
    let self_local = self_idx.and_then(|s| s.checked_sub(c0)).filter(|&s| s < dist.len());
    for (chunk_i, chunk) in dist.chunks(16).enumerate() {
        let base = chunk_i * 16;
        // most candidates lose to the k-th best once the heap is full: count
        // the chunk's contenders first (a branch-free, vectorised test)
        let contenders: u32 = chunk.iter().map(|&dd| (dd <= worst) as u32).sum();
        if contenders == 0 && !self_local.is_some_and(|s| s >= base && s < base + chunk.len()) {
            continue;
        }
        for (cj, &dd) in chunk.iter().enumerate() {
            offer_one(heap, k, &mut worst, dd, c0 + base + cj, self_idx);
        }
    }
}

#[inline(always)]
fn offer_one(
    heap: &mut BinaryHeap<Cand>,
    k: usize,
    worst: &mut f32,
    dd: f32,
    c: usize,
    self_idx: Option<usize>,
) {
    let d2 = if Some(c) == self_idx { 0.0 } else { dd };
    if d2 > *worst {
        return;
    }
    let cand = Cand(d2, c as u32);
    if heap.len() < k {
        heap.push(cand);
        if heap.len() == k {
            *worst = heap.peek().unwrap().0;
        }
    } else if cand < *heap.peek().unwrap() {
        heap.pop();
        heap.push(cand);
        *worst = heap.peek().unwrap().0;
    }
}

/// Exact Euclidean kNN by blocked brute force.
///
/// Each pair of 512-cell blocks is computed once (register-blocked distance
/// kernel) and offered both ways, to the rows' heaps and, transposed, to the
/// columns' heaps: half the distance work of a row-by-row scan. The pairs run
/// in rounds of disjoint blocks ([`block_pair_rounds`]), in parallel.
/// Squared differences are symmetric bit for bit and the heaps keep the k
/// smallest `(distance, index)`, so the result does not depend on the order.
///
/// Self is included (normally first, distance 0), like pynndescent and
/// scib-metrics' `NeighborsResults`. Ties are broken by the smaller index.
/// Memory: O(n*k) heaps (the size of the result) + two tiles per thread.
pub fn exact_knn(x: &[f32], n: usize, d: usize, k: usize) -> NeighborsResults {
    assert_eq!(x.len(), n * d);
    assert!(k >= 1 && k <= n, "need 1 <= k <= n");
    const S: usize = COL_BLOCK;
    let nb = n.div_ceil(S);
    // all column blocks transposed once (n*d floats), shared by the threads
    let blocks: Vec<ColBlock> = (0..nb)
        .into_par_iter()
        .map(|b| ColBlock::new(x, d, b * S, ((b + 1) * S).min(n)))
        .collect();
    let heaps: Vec<std::sync::Mutex<Vec<BinaryHeap<Cand>>>> = (0..nb)
        .map(|b| {
            let nr = ((b + 1) * S).min(n) - b * S;
            std::sync::Mutex::new((0..nr).map(|_| BinaryHeap::with_capacity(k + 1)).collect())
        })
        .collect();
    for round in block_pair_rounds(nb) {
        round.par_iter().for_each_init(
            || (vec![0f32; S * (S + 8)], vec![0f32; S * S]),
            |(tile, tr), &(rb, cb)| {
                let (r0, c0) = (rb * S, cb * S);
                let cblk = &blocks[cb];
                let nr = ((rb + 1) * S).min(n) - r0;
                let (nc, ncp) = (cblk.nc, cblk.ncp);
                tile_kernel(x, d, r0, nr, cblk, TileOp::SqDist, tile);
                {
                    let mut hr = heaps[rb].lock().unwrap();
                    for ri in 0..nr {
                        let self_idx = (rb == cb).then_some(r0 + ri);
                        offer(&mut hr[ri], k, &tile[ri * ncp..ri * ncp + nc], c0, self_idx);
                    }
                }
                if rb != cb {
                    // transpose in 8 x 8 blocks, then offer the rows to the columns
                    for ci in (0..nc).step_by(8) {
                        for ri in (0..nr).step_by(8) {
                            for c in ci..(ci + 8).min(nc) {
                                for r in ri..(ri + 8).min(nr) {
                                    tr[c * nr + r] = tile[r * ncp + c];
                                }
                            }
                        }
                    }
                    let mut hc = heaps[cb].lock().unwrap();
                    for cj in 0..nc {
                        offer(&mut hc[cj], k, &tr[cj * nr..(cj + 1) * nr], r0, None);
                    }
                }
            },
        );
    }
    let mut indices = vec![0u32; n * k];
    let mut distances = vec![0f32; n * k];
    indices
        .par_chunks_mut(S * k)
        .zip(distances.par_chunks_mut(S * k))
        .zip(heaps.into_par_iter())
        .for_each(|((idx_out, dist_out), hs)| {
            for (ri, heap) in hs.into_inner().unwrap().into_iter().enumerate() {
                for (t, c) in heap.into_sorted_vec().into_iter().enumerate() {
                    idx_out[ri * k + t] = c.1;
                    dist_out[ri * k + t] = c.0.sqrt();
                }
            }
        });
    NeighborsResults {
        indices,
        distances,
        n,
        k,
    }
}

#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    // 8 independent accumulators so the compiler can vectorise
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

#[inline(always)]
pub(crate) fn sqdist(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            let t = a[c * 8 + l] - b[c * 8 + l];
            acc[l] += t * t;
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        let t = a[i] - b[i];
        s += t * t;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::fixtures::load_case;

    #[test]
    fn exact_knn_matches_fixture_neighbours() {
        for case in ["easy", "hard", "mixed", "edge"] {
            let f = load_case(case);
            let nn = exact_knn(&f.embedding, f.n, f.d, f.knn.k);
            let mut set_mismatch = 0usize;
            let mut max_dd = 0f32;
            for i in 0..f.n {
                // self first
                assert_eq!(nn.row(i)[0] as usize, i);
                let a: std::collections::HashSet<u32> = nn.row(i).iter().copied().collect();
                let b: std::collections::HashSet<u32> = f.knn.row(i).iter().copied().collect();
                if a != b {
                    // allowed only for ties at the k-th distance
                    let kth_ours = nn.row_dist(i)[f.knn.k - 1];
                    let kth_ref = f.knn.row_dist(i)[f.knn.k - 1];
                    assert!(
                        (kth_ours - kth_ref).abs() <= 1e-4 * kth_ref.max(1.0),
                        "case {case} row {i}: sets differ"
                    );
                    set_mismatch += 1;
                }
                for t in 0..f.knn.k {
                    max_dd = max_dd.max((nn.row_dist(i)[t] - f.knn.row_dist(i)[t]).abs());
                }
            }
            eprintln!("{case}: exact_knn vs pynndescent: {set_mismatch} rows differ (ties), max |dist diff| {max_dd:e}");
            assert!(max_dd < 1e-3);
        }
    }

    #[test]
    fn block_pair_rounds_cover_each_pair_once() {
        for nb in 0..12 {
            let rounds = block_pair_rounds(nb);
            let mut seen = std::collections::HashSet::new();
            for round in &rounds {
                let mut used = std::collections::HashSet::new();
                for &(a, b) in round {
                    assert!(a <= b && b < nb);
                    assert!(used.insert(a) && (a == b || used.insert(b)), "nb {nb}: block twice in a round");
                    assert!(seen.insert((a, b)), "nb {nb}: pair twice");
                }
            }
            assert_eq!(seen.len(), nb * (nb + 1) / 2, "nb {nb}");
        }
    }

    #[test]
    fn exact_knn_equals_a_full_sort() {
        // 1,300 cells: three blocks of 512 (the last one partial), so every
        // kind of pair (diagonal, full x full, full x partial) is exercised;
        // integer-valued coordinates make many exact ties.
        let (n, d, k) = (1300usize, 5usize, 20usize);
        let x: Vec<f32> = (0..n * d).map(|i| ((i * 7919 + 13) % 11) as f32).collect();
        let nn = exact_knn(&x, n, d, k);
        for i in (0..n).step_by(7) {
            let mut all: Vec<(f32, u32)> = (0..n)
                .map(|j| (if i == j { 0.0 } else { sqdist(&x[i * d..(i + 1) * d], &x[j * d..(j + 1) * d]) }, j as u32))
                .collect();
            all.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            let want: Vec<u32> = all[..k].iter().map(|c| c.1).collect();
            assert_eq!(nn.row(i), &want[..], "row {i}");
            for t in 0..k {
                assert_eq!(nn.row_dist(i)[t], all[t].0.sqrt());
            }
        }
    }

    #[test]
    fn subset_keeps_prefix() {
        let x: Vec<f32> = (0..40).map(|v| (v as f32 * 0.37).sin()).collect();
        let nn = exact_knn(&x, 20, 2, 6);
        let s = nn.subset_k(3);
        for i in 0..20 {
            assert_eq!(s.row(i), &nn.row(i)[..3]);
        }
    }
}

#[cfg(test)]
mod bench {
    use super::*;

    /// Kernel throughput (ignored): `cargo test --release -- --ignored --nocapture kernel_throughput`.
    #[test]
    #[ignore]
    fn kernel_throughput() {
        let (n, d) = (4096usize, 50usize);
        let x: Vec<f32> = (0..n * d)
            .map(|i| ((i * 7919) % 1000) as f32 / 100.0)
            .collect();
        let cb = ColBlock::new(&x, d, 0, 512);
        let mut tile = vec![0f32; 64 * cb.ncp];
        let t = std::time::Instant::now();
        let reps = 2000;
        for r in 0..reps {
            tile_kernel(
                &x,
                d,
                (r * 64) % (n - 64),
                64,
                &cb,
                TileOp::SqDist,
                &mut tile,
            );
        }
        let s = t.elapsed().as_secs_f64();
        let flops = reps as f64 * 64.0 * 512.0 * d as f64 * 3.0;
        eprintln!(
            "tile kernel: {:.2} GFlop/s single thread ({s:.3}s)",
            flops / s / 1e9
        );
        let t = std::time::Instant::now();
        let nn = exact_knn(&x[..n * d], n, d, 90);
        let s = t.elapsed().as_secs_f64();
        eprintln!(
            "exact_knn n={n}: {s:.3}s, {:.2} GFlop/s equiv",
            (n * n * d * 3) as f64 / s / 1e9
        );
        assert_eq!(nn.k, 90);
    }
}
