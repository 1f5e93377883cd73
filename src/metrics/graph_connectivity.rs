//! Graph connectivity (scib-metrics `metrics/_graph_connectivity.py`).
//!
//! For every label: the directed kNN graph (scib's `knn_graph_distances`, an
//! edge i -> j for every listed neighbour, self and zero distances included)
//! restricted to the label's cells; strongly connected components; score =
//! size of the largest component / number of cells. Mean over labels.
//! The Benchmarker passes the 15-NN subset.

use super::compact_codes;
use super::neighbors::NeighborsResults;

/// Largest strongly-connected-component fraction per label, averaged.
pub fn graph_connectivity(nn: &NeighborsResults, labels: &[u32]) -> f64 {
    assert_eq!(labels.len(), nn.n);
    let (codes, n_labels) = compact_codes(labels);
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); n_labels];
    for (i, &c) in codes.iter().enumerate() {
        members[c as usize].push(i);
    }
    let mut local = vec![u32::MAX; nn.n];
    let mut total = 0.0;
    for m in &members {
        for (li, &i) in m.iter().enumerate() {
            local[i] = li as u32;
        }
        let c = codes[m[0]];
        let adj: Vec<Vec<u32>> = m
            .iter()
            .map(|&i| {
                nn.row(i)
                    .iter()
                    .filter(|&&j| codes[j as usize] == c)
                    .map(|&j| local[j as usize])
                    .collect()
            })
            .collect();
        let comp = strongly_connected_components(&adj);
        let mut sizes = vec![0usize; comp.iter().copied().max().map_or(0, |v| v as usize + 1)];
        for &cc in &comp {
            sizes[cc as usize] += 1;
        }
        total += *sizes.iter().max().unwrap() as f64 / m.len() as f64;
    }
    total / n_labels as f64
}

/// Iterative Tarjan; returns a component id per node.
pub(crate) fn strongly_connected_components(adj: &[Vec<u32>]) -> Vec<u32> {
    let n = adj.len();
    const UNSET: u32 = u32::MAX;
    let mut index = vec![UNSET; n];
    let mut low = vec![0u32; n];
    let mut on_stack = vec![false; n];
    let mut stack: Vec<u32> = Vec::new();
    let mut comp = vec![UNSET; n];
    let mut next_index = 0u32;
    let mut n_comp = 0u32;
    let mut call: Vec<(u32, usize)> = Vec::new();
    for s in 0..n {
        if index[s] != UNSET {
            continue;
        }
        call.push((s as u32, 0));
        index[s] = next_index;
        low[s] = next_index;
        next_index += 1;
        stack.push(s as u32);
        on_stack[s] = true;
        while let Some(&mut (v, ref mut ei)) = call.last_mut() {
            let v = v as usize;
            if *ei < adj[v].len() {
                let w = adj[v][*ei] as usize;
                *ei += 1;
                if index[w] == UNSET {
                    index[w] = next_index;
                    low[w] = next_index;
                    next_index += 1;
                    stack.push(w as u32);
                    on_stack[w] = true;
                    call.push((w as u32, 0));
                } else if on_stack[w] {
                    low[v] = low[v].min(index[w]);
                }
            } else {
                call.pop();
                if let Some(&(u, _)) = call.last() {
                    let u = u as usize;
                    low[u] = low[u].min(low[v]);
                }
                if low[v] == index[v] {
                    loop {
                        let w = stack.pop().unwrap() as usize;
                        on_stack[w] = false;
                        comp[w] = n_comp;
                        if w == v {
                            break;
                        }
                    }
                    n_comp += 1;
                }
            }
        }
    }
    comp
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{assert_close, load_case};
    use super::*;

    #[test]
    fn scc_small() {
        // 0->1->2->0, 3->0, 4 alone
        let adj = vec![vec![1], vec![2], vec![0], vec![0], vec![]];
        let c = strongly_connected_components(&adj);
        assert_eq!(c[0], c[1]);
        assert_eq!(c[1], c[2]);
        assert_ne!(c[3], c[0]);
        assert_ne!(c[4], c[0]);
        assert_ne!(c[4], c[3]);
    }

    #[test]
    fn graph_connectivity_matches_scib() {
        for case in ["easy", "hard", "mixed", "edge"] {
            let f = load_case(case);
            let g15 = graph_connectivity(&f.knn.subset_k(15), &f.labels);
            assert_close(
                case,
                "graph_connectivity",
                g15,
                f.metric("graph_connectivity"),
                1e-3,
            );
            let g50 = graph_connectivity(&f.knn.subset_k(50), &f.labels);
            assert_close(
                case,
                "graph_connectivity_k50",
                g50,
                f.metric("graph_connectivity_k50"),
                1e-3,
            );
        }
    }
}
