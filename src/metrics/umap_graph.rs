//! UMAP fuzzy-simplicial-set connectivities from kNN lists, as scib-metrics'
//! `NeighborsResults.knn_graph_connectivities` (umap-learn
//! `fuzzy_simplicial_set` with set_op_mix_ratio = 1, local_connectivity = 1).
//! Used by kBET (and Leiden in scib-metrics).

use rayon::prelude::*;

use super::neighbors::NeighborsResults;

/// Symmetric sparse matrix in CSR form (sorted column indices, no zeros).
#[derive(Debug, Clone)]
pub struct CsrGraph {
    pub n: usize,
    pub indptr: Vec<usize>,
    pub indices: Vec<u32>,
    pub data: Vec<f32>,
}

impl CsrGraph {
    pub fn row(&self, i: usize) -> (&[u32], &[f32]) {
        let (a, b) = (self.indptr[i], self.indptr[i + 1]);
        (&self.indices[a..b], &self.data[a..b])
    }

    /// Induced subgraph on `nodes` (in the given order).
    pub fn subgraph(&self, nodes: &[usize]) -> CsrGraph {
        let mut local = std::collections::HashMap::with_capacity(nodes.len());
        for (li, &i) in nodes.iter().enumerate() {
            local.insert(i as u32, li as u32);
        }
        let mut indptr = vec![0usize];
        let mut indices = Vec::new();
        let mut data = Vec::new();
        for &i in nodes {
            let (idx, val) = self.row(i);
            let mut row: Vec<(u32, f32)> = idx
                .iter()
                .zip(val)
                .filter_map(|(j, &v)| local.get(j).map(|&lj| (lj, v)))
                .collect();
            row.sort_unstable_by_key(|e| e.0);
            for (j, v) in row {
                indices.push(j);
                data.push(v);
            }
            indptr.push(indices.len());
        }
        CsrGraph {
            n: nodes.len(),
            indptr,
            indices,
            data,
        }
    }

    /// Connected components (the graph is symmetric, so weak = strong).
    pub fn connected_components(&self) -> (usize, Vec<u32>) {
        let mut comp = vec![u32::MAX; self.n];
        let mut nc = 0u32;
        let mut stack = Vec::new();
        for s in 0..self.n {
            if comp[s] != u32::MAX {
                continue;
            }
            comp[s] = nc;
            stack.push(s);
            while let Some(v) = stack.pop() {
                for &w in self.row(v).0 {
                    if comp[w as usize] == u32::MAX {
                        comp[w as usize] = nc;
                        stack.push(w as usize);
                    }
                }
            }
            nc += 1;
        }
        (nc as usize, comp)
    }
}

const SMOOTH_K_TOLERANCE: f64 = 1e-5;
const MIN_K_DIST_SCALE: f64 = 1e-3;

/// umap `smooth_knn_dist` (local_connectivity = 1, bandwidth = 1): (sigma, rho) per row.
fn smooth_knn_dist(nn: &NeighborsResults) -> (Vec<f32>, Vec<f32>) {
    let k = nn.k;
    let target = (k as f64).log2();
    let mean_all: f64 =
        nn.distances.iter().map(|&v| v as f64).sum::<f64>() / nn.distances.len() as f64;
    (0..nn.n)
        .into_par_iter()
        .map(|i| {
            let d = nn.row_dist(i);
            let rho: f32 = d.iter().copied().find(|&v| v > 0.0).unwrap_or(0.0);
            let (mut lo, mut hi, mut mid) = (0f64, f64::MAX, 1f64);
            for _ in 0..64 {
                let mut psum = 0f64;
                for &dj in &d[1..] {
                    let t = dj - rho;
                    psum += if t > 0.0 {
                        (-(t as f64 / mid)).exp()
                    } else {
                        1.0
                    };
                }
                if (psum - target).abs() < SMOOTH_K_TOLERANCE {
                    break;
                }
                if psum > target {
                    hi = mid;
                    mid = (lo + hi) / 2.0;
                } else {
                    lo = mid;
                    if hi >= f64::MAX {
                        mid *= 2.0;
                    } else {
                        mid = (lo + hi) / 2.0;
                    }
                }
            }
            let mut sigma = mid as f32;
            if rho > 0.0 {
                let m = d.iter().map(|&v| v as f64).sum::<f64>() / k as f64;
                if (sigma as f64) < MIN_K_DIST_SCALE * m {
                    sigma = (MIN_K_DIST_SCALE * m) as f32;
                }
            } else if (sigma as f64) < MIN_K_DIST_SCALE * mean_all {
                sigma = (MIN_K_DIST_SCALE * mean_all) as f32;
            }
            (sigma, rho)
        })
        .unzip()
}

/// Fuzzy union of the UMAP membership strengths: W + W^T - W∘W^T.
pub fn fuzzy_connectivities(nn: &NeighborsResults) -> CsrGraph {
    let (sigmas, rhos) = smooth_knn_dist(nn);
    let n = nn.n;
    // (row, col, value, from_transpose)
    let mut trip: Vec<(u32, u32, f32, bool)> = Vec::with_capacity(2 * n * nn.k);
    for i in 0..n {
        for (t, &j) in nn.row(i).iter().enumerate() {
            let dij = nn.row_dist(i)[t];
            let val = if j as usize == i {
                0.0
            } else if dij - rhos[i] <= 0.0 || sigmas[i] == 0.0 {
                1.0
            } else {
                (-(((dij - rhos[i]) / sigmas[i]) as f64)).exp() as f32
            };
            if val != 0.0 {
                trip.push((i as u32, j, val, false));
                trip.push((j, i as u32, val, true));
            }
        }
    }
    trip.par_sort_unstable_by_key(|e| (e.0, e.1));
    let mut indptr = vec![0usize; n + 1];
    let mut indices = Vec::with_capacity(trip.len() / 2);
    let mut data = Vec::with_capacity(trip.len() / 2);
    let mut t = 0;
    while t < trip.len() {
        let (r, c) = (trip[t].0, trip[t].1);
        let (mut a, mut b) = (0f32, 0f32);
        while t < trip.len() && trip[t].0 == r && trip[t].1 == c {
            if trip[t].3 {
                b += trip[t].2;
            } else {
                a += trip[t].2;
            }
            t += 1;
        }
        let v = a + b - a * b;
        if v != 0.0 {
            indices.push(c);
            data.push(v);
            indptr[r as usize + 1] += 1;
        }
    }
    for i in 0..n {
        indptr[i + 1] += indptr[i];
    }
    CsrGraph {
        n,
        indptr,
        indices,
        data,
    }
}
