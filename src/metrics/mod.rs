//! scIB metrics as pure functions on arrays, following scib-metrics
//! (YosefLab/scib-metrics, 0.5.10 — the newest on PyPI; it already contains
//! BRAS). One metric per file, like `scib_metrics/metrics/*.py`.
//!
//! Conventions: embeddings are row-major `f32` slices of `n * d`; labels and
//! batches are `u32` codes (any values; they are re-coded internally like
//! `pd.Categorical(...).codes`); neighbour lists are [`NeighborsResults`]
//! that include each cell itself (as pynndescent returns them).
//!
//! Which neighbour subset each metric gets in scib-metrics' `Benchmarker`
//! (90-NN computed once, then `subset_k`): 15 for graph connectivity and Leiden,
//! 50 for kBET, 90 for iLISI/cLISI.

pub mod aggregate;
pub mod clustering;
pub mod graph_connectivity;
pub mod isolated_labels;
pub mod kbet;
pub mod leiden;
pub mod linalg;
pub mod lisi;
pub mod neighbors;
pub mod nmi_ari;
pub mod pcr_comparison;
pub mod silhouette;
pub mod umap_graph;

pub use aggregate::{aggregate, AggregateScores, MetricKind};
pub use clustering::{kmeans, nmi_ari_cluster_labels_kmeans, KMeansResult};
pub use graph_connectivity::graph_connectivity;
pub use isolated_labels::isolated_labels;
pub use kbet::{kbet, kbet_per_label};
pub use leiden::{leiden, nmi_ari_cluster_labels_leiden};
pub use lisi::{clisi_knn, ilisi_knn, lisi_knn};
pub use neighbors::{exact_knn, NeighborsResults};
pub use nmi_ari::{ari, nmi};
pub use pcr_comparison::{pcr_comparison, principal_component_regression};
pub use silhouette::{bras, silhouette_batch, silhouette_label, silhouette_samples};

/// Neighbour counts scib-metrics' Benchmarker derives from one 90-NN search.
pub const BENCHMARK_K: [usize; 3] = [15, 50, 90];

/// Re-code arbitrary u32 codes to 0..m in sorted order of the original values
/// (what `pd.Categorical(x).codes` does); returns (codes, m).
pub fn compact_codes(values: &[u32]) -> (Vec<u32>, usize) {
    let mut uniq: Vec<u32> = values.to_vec();
    uniq.sort_unstable();
    uniq.dedup();
    let max = uniq.last().copied().unwrap_or(0) as usize;
    if max < 4 * values.len() + 1024 {
        let mut map = vec![u32::MAX; max + 1];
        for (i, &u) in uniq.iter().enumerate() {
            map[u as usize] = i as u32;
        }
        (values.iter().map(|&v| map[v as usize]).collect(), uniq.len())
    } else {
        let codes = values.iter().map(|v| uniq.binary_search(v).unwrap() as u32).collect();
        (codes, uniq.len())
    }
}

#[cfg(test)]
pub(crate) mod fixtures {
    //! Loader for the scib-metrics reference fixtures (scripts/scib_reference.py).
    use super::NeighborsResults;
    use serde_json::Value;

    pub struct Case {
        pub raw: Value,
        pub n: usize,
        pub d: usize,
        pub d_pre: usize,
        pub embedding: Vec<f32>,
        pub x_pre: Vec<f32>,
        pub labels: Vec<u32>,
        pub batches: Vec<u32>,
        pub knn: NeighborsResults,
    }

    impl Case {
        /// A scalar metric stored by the reference script (NaN for null).
        pub fn metric(&self, name: &str) -> f64 {
            let v = &self.raw["metrics"][name];
            assert!(!v.is_null() || self.raw["metrics"].get(name).is_some(), "metric {name} not in fixture");
            v.as_f64().unwrap_or(f64::NAN)
        }
        pub fn metric_list(&self, name: &str) -> Vec<f64> {
            self.raw["metrics"][name]
                .as_array()
                .unwrap_or_else(|| panic!("list {name} not in fixture"))
                .iter()
                .map(|v| v.as_f64().unwrap_or(f64::NAN))
                .collect()
        }
        pub fn u32_list(&self, name: &str) -> Vec<u32> {
            self.raw[name].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
        }
    }

    fn f32s(v: &Value) -> Vec<f32> {
        v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
    }
    fn u32s(v: &Value) -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
    }

    pub fn load_case(name: &str) -> Case {
        let path = format!("{}/tests/fixtures/scib/{}.json", env!("CARGO_MANIFEST_DIR"), name);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
        let raw: Value = serde_json::from_str(&text).unwrap();
        let n = raw["n"].as_u64().unwrap() as usize;
        let d = raw["d"].as_u64().unwrap() as usize;
        let d_pre = raw["d_pre"].as_u64().unwrap() as usize;
        let k = raw["knn_k"].as_u64().unwrap() as usize;
        let knn = NeighborsResults::new(u32s(&raw["knn_indices"]), f32s(&raw["knn_distances"]), n, k);
        Case {
            embedding: f32s(&raw["embedding"]),
            x_pre: f32s(&raw["x_pre"]),
            labels: u32s(&raw["labels"]),
            batches: u32s(&raw["batches"]),
            n,
            d,
            d_pre,
            knn,
            raw,
        }
    }

    /// Assert |ours - reference| <= tol (NaN == NaN) and print the difference.
    pub fn assert_close(case: &str, name: &str, ours: f64, reference: f64, tol: f64) {
        let diff = (ours - reference).abs();
        eprintln!("{case:5} {name:40} ours={ours:.9} scib={reference:.9} |diff|={diff:.3e}");
        if reference.is_nan() {
            assert!(ours.is_nan(), "{case} {name}: scib gives NaN, ours {ours}");
        } else {
            assert!(diff <= tol, "{case} {name}: ours {ours} vs scib {reference} (|diff| {diff:e} > {tol:e})");
        }
    }
}
