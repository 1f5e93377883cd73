//! scIB metrics as pure functions on arrays, following scib-metrics
//! (YosefLab/scib-metrics, 0.6.1; BRAS and sBEE included). One metric per file, like
//! `scib_metrics/metrics/*.py`.
//!
//! Conventions: embeddings are row-major `f32` slices of `n * d`; labels and
//! batches are `u32` codes (any values; they are re-coded internally like
//! `pd.Categorical(...).codes`); neighbour lists are [`NeighborsResults`]
//! that include each cell itself (as pynndescent returns them).
//!
//! Which neighbour subset each metric gets in scib-metrics' `Benchmarker`
//! (90-NN computed once, then `subset_k`): 15 for graph connectivity and Leiden,
//! 50 for kBET, 90 for iLISI/cLISI.

#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

pub mod aggregate;
pub mod ann;
pub mod benchmark;
pub mod block_lanczos;
pub mod classification;
pub mod clustering;
pub mod dense;
pub mod graph_connectivity;
pub mod isolated_labels;
pub mod kbet;
pub mod leiden;
pub mod linalg;
pub mod lisi;
pub mod neighbors;
pub mod nmi_ari;
pub mod pcr_comparison;
pub mod prepare;
pub mod sbee;
pub mod geometry;
pub mod silhouette;
pub mod umap_graph;

pub use aggregate::{aggregate, AggregateScores, MetricKind};
pub use ann::{approx_knn, AnnParams, AnnReport};
pub use benchmark::{run_benchmark, run_benchmark_on, run_benchmark_with, BenchmarkConfig, MetricValue};
pub use dense::Dense;
pub use clustering::{kmeans, kmeans_from_centroids, kmeans_seed_spread, nmi_ari_cluster_labels_kmeans, KMeansResult, KMeansSpread};
pub use graph_connectivity::graph_connectivity;
pub use isolated_labels::{isolated_labels, isolated_labels_from_silhouette};
pub use kbet::{kbet, kbet_per_label, kbet_per_label_on};
pub use leiden::{leiden, nmi_ari_cluster_labels_leiden};
pub use lisi::{clisi_knn, ilisi_knn, lisi_knn};
pub use neighbors::{exact_knn, NeighborsResults};
pub use nmi_ari::{ari, nmi};
pub use pcr_comparison::{pcr_comparison, principal_component_regression};
pub use sbee::sbee;
pub use silhouette::{
    bras, silhouette_batch, silhouette_label, silhouette_label_from_samples, silhouette_samples,
};

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
        (
            values.iter().map(|&v| map[v as usize]).collect(),
            uniq.len(),
        )
    } else {
        let codes = values
            .iter()
            .map(|v| uniq.binary_search(v).unwrap() as u32)
            .collect();
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
            assert!(
                !v.is_null() || self.raw["metrics"].get(name).is_some(),
                "metric {name} not in fixture"
            );
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
            self.raw[name]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect()
        }
    }

    fn f32s(v: &Value) -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    }
    fn u32s(v: &Value) -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    }

    pub fn load_case(name: &str) -> Case {
        let path = format!(
            "{}/tests/fixtures/scib/{}.json",
            env!("CARGO_MANIFEST_DIR"),
            name
        );
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
        let raw: Value = serde_json::from_str(&text).unwrap();
        let n = raw["n"].as_u64().unwrap() as usize;
        let d = raw["d"].as_u64().unwrap() as usize;
        let d_pre = raw["d_pre"].as_u64().unwrap() as usize;
        let k = raw["knn_k"].as_u64().unwrap() as usize;
        let knn =
            NeighborsResults::new(u32s(&raw["knn_indices"]), f32s(&raw["knn_distances"]), n, k);
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
            assert!(
                diff <= tol,
                "{case} {name}: ours {ours} vs scib {reference} (|diff| {diff:e} > {tol:e})"
            );
        }
    }
}

#[cfg(test)]
mod timing {
    //! Timings (ignored by default): `cargo test --release -- --ignored --nocapture timing`.
    use super::*;
    use std::time::Instant;

    fn run_all(
        tag: &str,
        emb: &[f32],
        x_pre: &[f32],
        n: usize,
        d: usize,
        d_pre: usize,
        labels: &[u32],
        batches: &[u32],
        knn: Option<&NeighborsResults>,
    ) -> Vec<(&'static str, f64, f64)> {
        let only = std::env::var("TIMING_ONLY").ok();
        let want = |name: &str| {
            only.as_deref()
                .is_none_or(|o| o.split(',').any(|w| w == name))
        };
        let mut out = Vec::new();
        let mut t = Instant::now();
        let nn90 = if want("exact_knn_90") || knn.is_none() {
            let own = exact_knn(emb, n, d, 90);
            out.push(("exact_knn_90", own.n as f64, t.elapsed().as_secs_f64()));
            knn.cloned().unwrap_or(own)
        } else {
            knn.cloned().unwrap()
        };
        let (nn15, nn50) = (nn90.subset_k(15), nn90.subset_k(50));
        macro_rules! time {
            ($name:expr, $e:expr) => {{
                if want($name) {
                    t = Instant::now();
                    let v: f64 = $e;
                    out.push(($name, v, t.elapsed().as_secs_f64()));
                }
            }};
        }
        time!(
            "silhouette_label",
            silhouette_label(emb, n, d, labels, true, 256)
        );
        time!(
            "silhouette_batch",
            silhouette_batch(emb, n, d, labels, batches, true, 256)
        );
        time!("bras", bras(emb, n, d, labels, batches, 256));
        time!(
            "isolated_labels",
            isolated_labels(emb, n, d, labels, batches, true, None)
        );
        time!("ilisi_knn", ilisi_knn(&nn90, batches, None, true));
        time!("clisi_knn", clisi_knn(&nn90, labels, None, true));
        time!("graph_connectivity", graph_connectivity(&nn15, labels));
        time!(
            "pcr_comparison",
            pcr_comparison(x_pre, d_pre, emb, d, n, batches, None, true)
        );
        time!(
            "kbet_per_label",
            kbet_per_label(&nn50, batches, labels, 0.05, 100)
        );
        time!(
            "nmi_ari_cluster_labels_kmeans",
            nmi_ari_cluster_labels_kmeans(emb, n, d, labels, 0).0
        );
        time!(
            "nmi_ari_cluster_labels_leiden",
            nmi_ari_cluster_labels_leiden(&nn15, labels, &leiden::default_resolutions(), 42).0
        );
        for (name, v, s) in &out {
            eprintln!("{tag:6} {name:32} {s:9.3}s  value {v:.6}");
        }
        out
    }

    #[test]
    #[ignore]
    fn timing_fixtures() {
        for case in ["easy", "hard", "mixed", "edge"] {
            let f = fixtures::load_case(case);
            run_all(
                case,
                &f.embedding,
                &f.x_pre,
                f.n,
                f.d,
                f.d_pre,
                &f.labels,
                &f.batches,
                Some(&f.knn),
            );
        }
    }

    /// Reads the raw set written by `scripts/scib_reference.py --timing-n N`
    /// (default dir /tmp/scib-timing, or $SCIB_TIMING_DIR) and compares values and times.
    #[test]
    #[ignore]
    fn timing_vs_scib_large() {
        let dir = std::env::var("SCIB_TIMING_DIR").unwrap_or_else(|_| "/tmp/scib-timing".into());
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(format!("{dir}/meta.json")).unwrap())
                .unwrap();
        let rd = |name: &str| std::fs::read(format!("{dir}/{name}")).unwrap();
        let f32s = |b: Vec<u8>| {
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect::<Vec<f32>>()
        };
        let u32s = |b: Vec<u8>| {
            b.chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                .collect::<Vec<u32>>()
        };
        let n = meta["n"].as_u64().unwrap() as usize;
        let d = meta["d"].as_u64().unwrap() as usize;
        let d_pre = meta["d_pre"].as_u64().unwrap() as usize;
        let k = meta["k"].as_u64().unwrap() as usize;
        let (emb, x_pre) = (f32s(rd("emb.f32")), f32s(rd("x_pre.f32")));
        let (labels, batches) = (u32s(rd("labels.u32")), u32s(rd("batches.u32")));
        let knn = NeighborsResults::new(u32s(rd("knn_idx.u32")), f32s(rd("knn_dist.f32")), n, k);
        let res = run_all(
            "large",
            &emb,
            &x_pre,
            n,
            d,
            d_pre,
            &labels,
            &batches,
            Some(&knn),
        );
        eprintln!(
            "{:32} {:>10} {:>10} {:>12} {:>12}",
            "metric", "ours_s", "scib_s", "ours", "scib"
        );
        for (name, v, s) in res {
            let key = if name == "exact_knn_90" {
                "pynndescent_90"
            } else {
                name
            };
            let st = meta["timings_s"][key].as_f64().unwrap_or(f64::NAN);
            let sv = match &meta["metrics"][key] {
                serde_json::Value::Object(o) => o["nmi"].as_f64().unwrap(),
                other => other.as_f64().unwrap_or(f64::NAN),
            };
            eprintln!("{name:32} {s:10.3} {st:10.3} {v:12.6} {sv:12.6}");
        }
    }
}

#[cfg(test)]
mod scale {
    //! Scale smoke test (ignored): `SCALE_N=100000 cargo test --release -- --ignored --nocapture scale_smoke`.
    use super::*;
    use rand::{Rng, SeedableRng};
    use std::time::Instant;

    #[test]
    #[ignore]
    fn scale_smoke() {
        let n: usize = std::env::var("SCALE_N")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(100_000);
        let d = 50;
        let (n_lab, n_bat) = (12usize, 4usize);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let centers: Vec<f32> = (0..n_lab * d)
            .map(|_| rng.gen::<f32>() * 8.0 - 4.0)
            .collect();
        let shifts: Vec<f32> = (0..n_bat * d)
            .map(|_| rng.gen::<f32>() * 2.0 - 1.0)
            .collect();
        let labels: Vec<u32> = (0..n).map(|_| rng.gen_range(0..n_lab as u32)).collect();
        let batches: Vec<u32> = (0..n).map(|_| rng.gen_range(0..n_bat as u32)).collect();
        let mut emb = vec![0f32; n * d];
        let mut pre = vec![0f32; n * d];
        for i in 0..n {
            for j in 0..d {
                let c = centers[labels[i] as usize * d + j];
                let s = shifts[batches[i] as usize * d + j];
                let noise: f32 = rng.gen::<f32>() + rng.gen::<f32>() + rng.gen::<f32>() - 1.5;
                emb[i * d + j] = c + 0.2 * s + noise;
                pre[i * d + j] = c + s + noise;
            }
        }
        let t = Instant::now();
        let nn = exact_knn(&emb, n, d, 90);
        eprintln!(
            "n={n} d={d}: exact_knn_90 {:.1}s",
            t.elapsed().as_secs_f64()
        );
        let cfg = BenchmarkConfig {
            nmi_ari_cluster_labels_leiden: true,
            silhouette_batch: true,
            ..Default::default()
        };
        // time each metric separately
        let names = [
            "isolated_labels",
            "nmi_ari_cluster_labels_leiden",
            "nmi_ari_cluster_labels_kmeans",
            "silhouette_label",
            "clisi_knn",
            "silhouette_batch",
            "bras",
            "ilisi_knn",
            "kbet_per_label",
            "graph_connectivity",
            "pcr_comparison",
        ];
        for name in names {
            let mut c = BenchmarkConfig {
                isolated_labels: false,
                nmi_ari_cluster_labels_leiden: false,
                nmi_ari_cluster_labels_kmeans: false,
                silhouette_label: false,
                clisi_knn: false,
                silhouette_batch: false,
                bras: false,
                ilisi_knn: false,
                kbet_per_label: false,
                graph_connectivity: false,
                pcr_comparison: false,
                ..cfg.clone()
            };
            let v = serde_json::to_value(&c).unwrap();
            let mut v = v.as_object().unwrap().clone();
            v.insert(name.into(), serde_json::Value::Bool(true));
            c = serde_json::from_value(serde_json::Value::Object(v)).unwrap();
            let t = Instant::now();
            let r = run_benchmark(&emb, n, d, &pre, d, &labels, &batches, &nn, &c);
            eprintln!(
                "n={n}: {name:32} {:8.1}s  {:?}",
                t.elapsed().as_secs_f64(),
                r.iter().map(|m| m.value).collect::<Vec<_>>()
            );
        }
    }
}
