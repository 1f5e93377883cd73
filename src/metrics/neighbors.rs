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
        NeighborsResults { indices, distances, n, k }
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
        NeighborsResults { indices, distances, n: self.n, k }
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

const ROW_BLOCK: usize = 64;
const COL_BLOCK: usize = 1024;

/// Exact Euclidean kNN by blocked brute force (row blocks in parallel, column
/// blocks with a dot-product kernel, per-row bounded max-heap).
///
/// Self is included (normally first, distance 0), like pynndescent and
/// scib-metrics' `NeighborsResults`. Ties are broken by the smaller index.
/// Memory: O(n*k + ROW_BLOCK*COL_BLOCK) per thread.
pub fn exact_knn(x: &[f32], n: usize, d: usize, k: usize) -> NeighborsResults {
    assert_eq!(x.len(), n * d);
    assert!(k >= 1 && k <= n, "need 1 <= k <= n");
    let norms: Vec<f32> = (0..n)
        .map(|i| x[i * d..(i + 1) * d].iter().map(|v| v * v).sum())
        .collect();
    let mut indices = vec![0u32; n * k];
    let mut distances = vec![0f32; n * k];
    indices
        .par_chunks_mut(ROW_BLOCK * k)
        .zip(distances.par_chunks_mut(ROW_BLOCK * k))
        .enumerate()
        .for_each(|(bi, (idx_out, dist_out))| {
            let r0 = bi * ROW_BLOCK;
            let r1 = (r0 + ROW_BLOCK).min(n);
            let nr = r1 - r0;
            let mut heaps: Vec<BinaryHeap<Cand>> = (0..nr).map(|_| BinaryHeap::with_capacity(k + 1)).collect();
            let mut dots = vec![0f32; nr * COL_BLOCK];
            let mut c0 = 0;
            while c0 < n {
                let c1 = (c0 + COL_BLOCK).min(n);
                let nc = c1 - c0;
                // dot-product kernel: rows r0..r1 against columns c0..c1
                for (ri, r) in (r0..r1).enumerate() {
                    let xr = &x[r * d..(r + 1) * d];
                    let out = &mut dots[ri * COL_BLOCK..ri * COL_BLOCK + nc];
                    for (cj, c) in (c0..c1).enumerate() {
                        let xc = &x[c * d..(c + 1) * d];
                        out[cj] = dot(xr, xc);
                    }
                }
                for (ri, r) in (r0..r1).enumerate() {
                    let heap = &mut heaps[ri];
                    let nr_ = norms[r];
                    for cj in 0..nc {
                        let c = c0 + cj;
                        let d2 = if c == r { 0.0 } else { (nr_ + norms[c] - 2.0 * dots[ri * COL_BLOCK + cj]).max(0.0) };
                        if heap.len() < k {
                            heap.push(Cand(d2, c as u32));
                        } else if let Some(top) = heap.peek() {
                            if Cand(d2, c as u32) < *top {
                                heap.pop();
                                heap.push(Cand(d2, c as u32));
                            }
                        }
                    }
                }
                c0 = c1;
            }
            for (ri, heap) in heaps.into_iter().enumerate() {
                let r = r0 + ri;
                let mut v = heap.into_sorted_vec();
                // refine: recompute the kept distances directly (no cancellation error)
                for c in v.iter_mut() {
                    let j = c.1 as usize;
                    c.0 = if j == r { 0.0 } else { sqdist(&x[r * d..(r + 1) * d], &x[j * d..(j + 1) * d]) };
                }
                v.sort();
                for (t, c) in v.into_iter().enumerate() {
                    idx_out[ri * k + t] = c.1;
                    dist_out[ri * k + t] = c.0.sqrt();
                }
            }
        });
    NeighborsResults { indices, distances, n, k }
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

#[inline]
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
        for case in ["easy", "hard", "mixed"] {
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
                    assert!((kth_ours - kth_ref).abs() <= 1e-4 * kth_ref.max(1.0), "case {case} row {i}: sets differ");
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
    fn subset_keeps_prefix() {
        let x: Vec<f32> = (0..40).map(|v| (v as f32 * 0.37).sin()).collect();
        let nn = exact_knn(&x, 20, 2, 6);
        let s = nn.subset_k(3);
        for i in 0..20 {
            assert_eq!(s.row(i), &nn.row(i)[..3]);
        }
    }
}
