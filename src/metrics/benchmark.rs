//! The metric set of scib-metrics' `Benchmarker` (benchmark/_core.py) on one
//! embedding: which metrics run by default, on which inputs and neighbour
//! subsets (15/50/90 of one 90-NN), under which names and groups.
//!
//! Defaults (scib-metrics 0.6.1): bio = isolated labels, KMeans NMI/ARI,
//! silhouette label, cLISI (Leiden off); batch = BRAS, iLISI, kBET,
//! graph connectivity, PCR comparison (the classic batch silhouette and sBEE are off).

use super::aggregate::MetricKind;
use super::dense::Dense;
use super::neighbors::NeighborsResults;
use super::silhouette::{
    silhouette_label_from_samples, silhouette_samples_on, BetweenCluster, Distance,
};
use super::*;

/// Which metrics to run (field names follow scib-metrics' dataclasses).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct BenchmarkConfig {
    pub isolated_labels: bool,
    pub nmi_ari_cluster_labels_leiden: bool,
    pub nmi_ari_cluster_labels_kmeans: bool,
    pub silhouette_label: bool,
    pub clisi_knn: bool,
    pub silhouette_batch: bool,
    pub bras: bool,
    pub ilisi_knn: bool,
    pub kbet_per_label: bool,
    pub graph_connectivity: bool,
    pub pcr_comparison: bool,
    /// sBEE (scib-metrics 0.6; off by default there too)
    #[serde(default)]
    pub sbee: bool,
    /// seed for KMeans and Leiden
    pub seed: u64,
    /// rows per block in the silhouettes
    pub chunk_size: usize,
}

impl Default for BenchmarkConfig {
    fn default() -> Self {
        BenchmarkConfig {
            isolated_labels: true,
            nmi_ari_cluster_labels_leiden: false,
            nmi_ari_cluster_labels_kmeans: true,
            silhouette_label: true,
            clisi_knn: true,
            silhouette_batch: false,
            bras: true,
            ilisi_knn: true,
            kbet_per_label: true,
            graph_connectivity: true,
            pcr_comparison: true,
            sbee: false,
            seed: 0,
            chunk_size: 256,
        }
    }
}

/// One metric result.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MetricValue {
    /// scib-metrics' raw row name (e.g. `nmi_ari_cluster_labels_kmeans_nmi`)
    pub key: String,
    /// scib-metrics' clean column name (e.g. `KMeans NMI`)
    pub name: String,
    pub kind: MetricKind,
    pub value: f64,
}

fn mv(key: &str, name: &str, kind: MetricKind, value: f64) -> MetricValue {
    MetricValue {
        key: key.into(),
        name: name.into(),
        kind,
        value,
    }
}

/// Run the configured metrics on one embedding. `nn` must hold at least 90
/// neighbours (self included) of `emb`; `x_pre` is the unintegrated embedding
/// for PCR (n x d_pre).
#[allow(clippy::too_many_arguments)]
pub fn run_benchmark(
    emb: &[f32],
    n: usize,
    d: usize,
    x_pre: &[f32],
    d_pre: usize,
    labels: &[u32],
    batches: &[u32],
    nn: &NeighborsResults,
    cfg: &BenchmarkConfig,
) -> Vec<MetricValue> {
    run_benchmark_with(emb, n, d, x_pre, d_pre, labels, batches, nn, cfg, &mut |_| {})
}

/// [`run_benchmark`], calling `on_metric(key)` as each metric starts (for progress
/// reporting; `key` is the scib-metrics function name).
#[allow(clippy::too_many_arguments)]
pub fn run_benchmark_with(
    emb: &[f32],
    n: usize,
    d: usize,
    x_pre: &[f32],
    d_pre: usize,
    labels: &[u32],
    batches: &[u32],
    nn: &NeighborsResults,
    cfg: &BenchmarkConfig,
    on_metric: &mut dyn FnMut(&str),
) -> Vec<MetricValue> {
    run_benchmark_on(&Dense::cpu(), emb, n, d, x_pre, d_pre, labels, batches, nn, cfg, on_metric)
}

/// [`run_benchmark_with`], the dense passes (the label silhouette's distances, kBET's kNN) on
/// `dense`'s device.
#[allow(clippy::too_many_arguments)]
pub fn run_benchmark_on(
    dense: &Dense,
    emb: &[f32],
    n: usize,
    d: usize,
    x_pre: &[f32],
    d_pre: usize,
    labels: &[u32],
    batches: &[u32],
    nn: &NeighborsResults,
    cfg: &BenchmarkConfig,
    on_metric: &mut dyn FnMut(&str),
) -> Vec<MetricValue> {
    use MetricKind::{BatchCorrection as Batch, BioConservation as Bio};
    assert!(nn.k >= 90, "the Benchmarker uses a 90-NN");
    let nn90 = nn.subset_k(90);
    let nn50 = nn.subset_k(50);
    let nn15 = nn.subset_k(15);
    let mut out = Vec::new();
    // the label silhouette is shared by isolated labels and silhouette label; with a GPU its
    // distances run there while the CPU's cores score BRAS (its value is pushed in its place)
    let need_sil = cfg.isolated_labels || cfg.silhouette_label;
    let sil_key = if cfg.isolated_labels { "isolated_labels" } else { "silhouette_label" };
    let sil_samples = || silhouette_samples_on(dense, emb, n, d, labels, cfg.chunk_size, Distance::Euclidean, BetweenCluster::Nearest);
    let (sil, mut early_bras) = if need_sil && dense.is_gpu() {
        std::thread::scope(|s| {
            let job = s.spawn(sil_samples);
            let b = cfg.bras.then(|| {
                on_metric("bras");
                bras(emb, n, d, labels, batches, cfg.chunk_size)
            });
            on_metric(sil_key);
            (Some(job.join().expect("the label silhouette's thread panicked")), b)
        })
    } else if need_sil {
        on_metric(sil_key);
        (Some(sil_samples()), None)
    } else {
        (None, None)
    };
    if cfg.isolated_labels {
        on_metric("isolated_labels");
        let v = isolated_labels::isolated_labels_from_silhouette(
            sil.as_ref().unwrap(),
            labels,
            batches,
            true,
            None,
        );
        out.push(mv("isolated_labels", "Isolated labels", Bio, v));
    }
    if cfg.nmi_ari_cluster_labels_leiden {
        on_metric("nmi_ari_cluster_labels_leiden");
        let (a, b) =
            nmi_ari_cluster_labels_leiden(&nn15, labels, &leiden::default_resolutions(), cfg.seed);
        out.push(mv(
            "nmi_ari_cluster_labels_leiden_nmi",
            "Leiden NMI",
            Bio,
            a,
        ));
        out.push(mv(
            "nmi_ari_cluster_labels_leiden_ari",
            "Leiden ARI",
            Bio,
            b,
        ));
    }
    if cfg.nmi_ari_cluster_labels_kmeans {
        on_metric("nmi_ari_cluster_labels_kmeans");
        let (a, b) = nmi_ari_cluster_labels_kmeans(emb, n, d, labels, cfg.seed);
        out.push(mv(
            "nmi_ari_cluster_labels_kmeans_nmi",
            "KMeans NMI",
            Bio,
            a,
        ));
        out.push(mv(
            "nmi_ari_cluster_labels_kmeans_ari",
            "KMeans ARI",
            Bio,
            b,
        ));
    }
    if cfg.silhouette_label {
        on_metric("silhouette_label");
        out.push(mv(
            "silhouette_label",
            "Silhouette label",
            Bio,
            silhouette_label_from_samples(sil.as_ref().unwrap(), true),
        ));
    }
    if cfg.clisi_knn {
        on_metric("clisi_knn");
        out.push(mv(
            "clisi_knn",
            "cLISI",
            Bio,
            clisi_knn(&nn90, labels, None, true),
        ));
    }
    if cfg.silhouette_batch {
        on_metric("silhouette_batch");
        out.push(mv(
            "silhouette_batch",
            "Silhouette batch",
            Batch,
            silhouette_batch(emb, n, d, labels, batches, true, cfg.chunk_size),
        ));
    }
    if cfg.bras {
        let v = early_bras.take().unwrap_or_else(|| {
            on_metric("bras");
            bras(emb, n, d, labels, batches, cfg.chunk_size)
        });
        out.push(mv("bras", "BRAS", Batch, v));
    }
    if cfg.ilisi_knn {
        on_metric("ilisi_knn");
        out.push(mv(
            "ilisi_knn",
            "iLISI",
            Batch,
            ilisi_knn(&nn90, batches, None, true),
        ));
    }
    if cfg.kbet_per_label {
        on_metric("kbet_per_label");
        out.push(mv(
            "kbet_per_label",
            "KBET",
            Batch,
            kbet_per_label_on(dense, &nn50, batches, labels, 0.05, 100),
        ));
    }
    if cfg.graph_connectivity {
        on_metric("graph_connectivity");
        out.push(mv(
            "graph_connectivity",
            "Graph connectivity",
            Batch,
            graph_connectivity(&nn15, labels),
        ));
    }
    if cfg.pcr_comparison {
        on_metric("pcr_comparison");
        out.push(mv(
            "pcr_comparison",
            "PCR comparison",
            Batch,
            pcr_comparison(x_pre, d_pre, emb, d, n, batches, None, true),
        ));
    }
    if cfg.sbee {
        on_metric("sbee");
        out.push(mv("sbee", "sBEE", Batch, sbee::sbee(&nn90, emb, d, batches, labels)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{assert_close, load_case};
    use super::*;

    /// Same rows as scib-metrics' Benchmarker on the fixture embedding
    /// ("emb", with the fixture's X_pre as pre-integrated embedding). KMeans is
    /// random (see clustering.rs) and is checked there; here only that it is present.
    #[test]
    fn benchmark_matches_benchmarker_rows() {
        for case in ["easy", "hard", "mixed", "edge"] {
            let f = load_case(case);
            let res = run_benchmark(
                &f.embedding,
                f.n,
                f.d,
                &f.x_pre,
                f.d_pre,
                &f.labels,
                &f.batches,
                &f.knn,
                &BenchmarkConfig::default(),
            );
            let rows = &f.raw["benchmarker"]["raw"]["rows"]["emb"];
            let types = &f.raw["benchmarker"]["raw"]["metric_types"];
            let n_metric_rows = types
                .as_object()
                .unwrap()
                .values()
                .filter(|t| t.as_str() != Some("Aggregate score"))
                .count();
            assert_eq!(res.len(), n_metric_rows);
            for m in &res {
                let kind = match m.kind {
                    MetricKind::BatchCorrection => "Batch correction",
                    MetricKind::BioConservation => "Bio conservation",
                };
                assert_eq!(types[&m.key].as_str(), Some(kind), "{case} {}", m.key);
                if m.key.contains("kmeans") {
                    continue;
                }
                assert_close(
                    case,
                    &format!("benchmarker {}", m.key),
                    m.value,
                    rows[&m.key].as_f64().unwrap(),
                    1e-3,
                );
            }
        }
    }
}
