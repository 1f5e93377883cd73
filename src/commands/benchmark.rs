//! `scfoundry benchmark`: score several embeddings of one dataset with the scIB metrics
//! (scib-metrics 0.6.1 definitions, `crate::metrics`) and rank them by total score.
//!
//! As scib-metrics' `Benchmarker`: one exact 90-NN per embedding, subset to 15/50/90;
//! PCR comparison against a PCA of the unintegrated X (`metrics::prepare`); aggregates
//! 0.4 x batch + 0.6 x bio, optionally min-max scaled. Writes results.tsv, results.json,
//! results.svg/png and, with --per-cell, lisi_per_cell.tsv into the output folder. The work is
//! one task (`task`), run where `--executor` says; the input is checked here first.

use std::fmt::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use rand::seq::index::sample;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::anndata::AnnData;
use crate::cli::{BenchmarkArgs, ExecutorKind, NeighborsSearch};
use crate::commands::ExitStatus;
use crate::error::Error;
use crate::executor::{self, nextflow};
use crate::metrics::{self, aggregate, BenchmarkConfig, MetricKind, MetricValue, NeighborsResults};
use crate::plots;
use crate::progress::{reporter, warn, Progress, Reporter};
use crate::runner::{options_params, TaskResult, TaskSpec};
use crate::settings::Settings;

/// What the task needs besides data, output and seed (the spec's params).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchmarkOptions {
    pub embedding: Vec<String>,
    pub label_key: String,
    pub batch_key: String,
    pub batch_max_cells: Option<u64>,
    /// The 90-NN search (older run folders lack it: exact).
    #[serde(default)]
    pub neighbors: NeighborsSearch,
    pub metrics: Vec<String>,
    pub per_cell: bool,
    pub min_max_scale: bool,
    /// obsm key of the unintegrated embedding for PCR (older run folders lack it: a PCA of X).
    #[serde(default)]
    pub pre_integrated: Option<String>,
    /// KMeans seeds for the spread (older run folders lack it: 1, off).
    #[serde(default = "one")]
    pub kmeans_seeds: u64,
}

fn one() -> u64 {
    1
}

/// Stamped on every value: values from different implementations are not comparable.
pub const IMPLEMENTATION: &str = concat!("scfoundry-metrics ", env!("CARGO_PKG_VERSION"), " (scib-metrics 0.6.1 definitions)");
/// Largest neighbour count of the Benchmarker (15/50/90 are prefixes of it).
pub const K: usize = 90;

/// Metric selectors accepted by --metrics: (name, aliases, config field).
const METRICS: [(&str, &[&str]); 12] = [
    ("isolated_labels", &["isolated"]),
    ("nmi_ari_cluster_labels_kmeans", &["kmeans"]),
    ("nmi_ari_cluster_labels_leiden", &["leiden"]),
    ("silhouette_label", &[]),
    ("clisi_knn", &["clisi"]),
    ("bras", &[]),
    ("silhouette_batch", &[]),
    ("ilisi_knn", &["ilisi"]),
    ("kbet_per_label", &["kbet"]),
    ("graph_connectivity", &[]),
    ("pcr_comparison", &["pcr"]),
    ("sbee", &[]),
];

const BIO: [&str; 5] = ["isolated_labels", "nmi_ari_cluster_labels_kmeans", "nmi_ari_cluster_labels_leiden", "silhouette_label", "clisi_knn"];

fn is_bio(key: &str) -> bool {
    BIO.iter().any(|b| key.starts_with(b))
}

fn set(cfg: &mut BenchmarkConfig, name: &str, on: bool) {
    match name {
        "isolated_labels" => cfg.isolated_labels = on,
        "nmi_ari_cluster_labels_kmeans" => cfg.nmi_ari_cluster_labels_kmeans = on,
        "nmi_ari_cluster_labels_leiden" => cfg.nmi_ari_cluster_labels_leiden = on,
        "silhouette_label" => cfg.silhouette_label = on,
        "clisi_knn" => cfg.clisi_knn = on,
        "bras" => cfg.bras = on,
        "silhouette_batch" => cfg.silhouette_batch = on,
        "ilisi_knn" => cfg.ilisi_knn = on,
        "kbet_per_label" => cfg.kbet_per_label = on,
        "graph_connectivity" => cfg.graph_connectivity = on,
        "pcr_comparison" => cfg.pcr_comparison = on,
        "sbee" => cfg.sbee = on,
        _ => unreachable!(),
    }
}

fn enabled(cfg: &BenchmarkConfig) -> Vec<&'static str> {
    let v = serde_json::to_value(cfg).unwrap_or_default();
    METRICS.iter().map(|(n, _)| *n).filter(|n| v[*n].as_bool() == Some(true)).collect()
}

/// Parse --metrics into a configuration (empty: the Benchmarker's defaults).
pub fn parse_metrics(names: &[String], seed: u64) -> Result<BenchmarkConfig, Error> {
    let mut cfg = BenchmarkConfig { seed, ..Default::default() };
    if names.is_empty() {
        return Ok(cfg);
    }
    let defaults = enabled(&cfg);
    for (n, _) in METRICS {
        set(&mut cfg, n, false);
    }
    for raw in names {
        let name = raw.trim().to_lowercase().replace('-', "_");
        match name.as_str() {
            "default" => defaults.iter().for_each(|n| set(&mut cfg, n, true)),
            "all" => METRICS.iter().for_each(|(n, _)| set(&mut cfg, n, true)),
            "bio" => defaults.iter().filter(|n| is_bio(n)).for_each(|n| set(&mut cfg, n, true)),
            "batch" => defaults.iter().filter(|n| !is_bio(n)).for_each(|n| set(&mut cfg, n, true)),
            _ => match METRICS.iter().find(|(n, aliases)| *n == name || aliases.contains(&name.as_str())) {
                Some((n, _)) => set(&mut cfg, n, true),
                None => {
                    let mut known: Vec<&str> = METRICS.iter().map(|(n, a)| a.first().copied().unwrap_or(n)).collect();
                    known.extend(["default", "bio", "batch", "all"]);
                    return Err(Error::BadOption {
                        option: "--metrics".into(),
                        detail: format!("unknown metric `{raw}`"),
                        hint: Some(match crate::error::suggest(&name, known.iter().copied()) {
                            Some(s) => format!("did you mean `{s}`? known: {}", known.join(", ")),
                            None => format!("known metrics and groups: {}", known.join(", ")),
                        }),
                    });
                }
            },
        }
    }
    Ok(cfg)
}

/// Categorical obs column as u32 codes (categories sorted, as `pd.Categorical`) and names.
pub fn obs_codes(ad: &AnnData, obs: &crate::anndata::DataFrame, key: &str, flag: &str) -> Result<(Vec<u32>, Vec<String>), Error> {
    let col = obs.column(key).ok_or_else(|| Error::BadField {
        path: ad.path.clone(),
        field: format!("obs/{key}"),
        detail: "is missing".into(),
        hint: Some(format!("pass {flag} with one of the obs columns in this file: {}", ad.obs_column_names().unwrap_or_default().join(", "))),
    })?;
    let labels = col.as_labels().ok_or_else(|| Error::BadField {
        path: ad.path.clone(),
        field: format!("obs/{key}"),
        detail: format!("is a {} column; {flag} needs categories (categorical, string or integer)", col.kind()),
        hint: Some(format!("convert it first, e.g. `adata.obs['{key}'] = adata.obs['{key}'].astype('category')`")),
    })?;
    if let Some(i) = labels.iter().position(|l| l.is_none()) {
        let missing = labels.iter().filter(|l| l.is_none()).count();
        return Err(Error::BadField {
            path: ad.path.clone(),
            field: format!("obs/{key}"),
            detail: format!("{missing} cell(s) have no value, the first is cell {i} ({})", ad.obs_names.get(i).cloned().unwrap_or_default()),
            hint: Some(format!("drop or label those cells first, e.g. `adata = adata[adata.obs['{key}'].notna()].copy()`")),
        });
    }
    let labels: Vec<String> = labels.into_iter().map(Option::unwrap_or_default).collect();
    let mut cats: Vec<String> = labels.clone();
    cats.sort();
    cats.dedup();
    let codes = labels.iter().map(|l| cats.binary_search(l).unwrap_or(0) as u32).collect();
    Ok((codes, cats))
}

/// A dense obsm embedding, checked for shape and finite values.
pub fn read_embedding(ad: &AnnData, key: &str) -> Result<(Vec<f32>, usize), Error> {
    let (x, r, c) = ad.dense_entry("obsm", key)?;
    if r != ad.n_obs {
        return Err(Error::BadField {
            path: ad.path.clone(),
            field: format!("obsm/{key}"),
            detail: format!("has {r} rows but the data has {} cells", ad.n_obs),
            hint: None,
        });
    }
    if c == 0 {
        return Err(Error::BadField { path: ad.path.clone(), field: format!("obsm/{key}"), detail: "has no columns".into(), hint: None });
    }
    if let Some(p) = x.iter().position(|v| !v.is_finite()) {
        let bad = x.iter().filter(|v| !v.is_finite()).count();
        let (i, j) = (p / c, p % c);
        return Err(Error::BadField {
            path: ad.path.clone(),
            field: format!("obsm/{key}"),
            detail: format!(
                "holds {bad} non-finite value(s); the first is {} at cell {i} ({}), column {j}",
                x[p],
                ad.obs_names.get(i).cloned().unwrap_or_default()
            ),
            hint: Some("the metrics need finite coordinates: fix or drop those cells (e.g. re-run the method that made the embedding)".into()),
        });
    }
    Ok((x, c))
}

/// X as CSR in memory, for the PCA of the unintegrated data.
fn x_pre(ad: &AnnData, seed: u64, rep: &dyn Reporter) -> anyhow::Result<(Vec<f32>, usize)> {
    let x = ad.matrix(None)?;
    let (n, g) = (x.n_rows, x.n_cols);
    let p = rep.step("PCA of X (for PCR)", 2, "steps");
    let b = x.read_rows(0, n)?;
    if let Some(v) = b.data.iter().find(|v| !v.is_finite()) {
        return Err(Error::BadField {
            path: ad.path.clone(),
            field: "X".into(),
            detail: format!("holds a non-finite value ({v}); PCR comparison needs a PCA of X"),
            hint: Some("fix X, pass the unintegrated embedding with `--pre-integrated KEY`, or leave PCR out with `--metrics bio,bras,ilisi,kbet,graph_connectivity`".into()),
        }
        .into());
    }
    p.inc(1);
    let nc = metrics::prepare::scanpy_n_comps(n, g);
    if nc == 0 {
        return Err(Error::BadField {
            path: ad.path.clone(),
            field: "X".into(),
            detail: format!("is {n} x {g}: too small for a PCA"),
            hint: Some("pass the unintegrated embedding with `--pre-integrated KEY` (an obsm key)".into()),
        }
        .into());
    }
    let csr = metrics::prepare::Csr { indptr: &b.indptr, indices: &b.indices, data: &b.data, n_rows: n, n_cols: g };
    let (proj, _) = metrics::prepare::pca_projections(&csr, nc, seed);
    p.inc(1);
    p.finish();
    Ok((proj, nc))
}

/// The search `--neighbors` takes for `n` cells: `auto` is exact at any size when the dense
/// passes have a GPU.
fn resolve_search(search: NeighborsSearch, n: usize, dense: &metrics::Dense) -> NeighborsSearch {
    match search {
        NeighborsSearch::Auto if dense.is_gpu() => NeighborsSearch::Exact,
        s => s.resolve(n),
    }
}

/// The 90-NN of one embedding (or subsample), exact (on `dense`'s device) or NN-descent; the
/// latter's rounds are reported on the progress bar and recorded for results.json.
#[allow(clippy::too_many_arguments)]
fn knn(name: &str, x: &[f32], n: usize, d: usize, search: NeighborsSearch, seed: u64, dense: &metrics::Dense, rep: &dyn Reporter, reports: &mut Vec<Value>) -> NeighborsResults {
    match resolve_search(search, n, dense) {
        NeighborsSearch::Exact => {
            let p = rep.step(&format!("{name} {K}-NN (exact, {})", dense.name()), 1, "search");
            let nn = dense.knn("90-NN", x, n, d, K);
            p.inc(1);
            p.finish();
            nn
        }
        NeighborsSearch::Approx | NeighborsSearch::Auto => {
            let params = metrics::AnnParams { seed, ..Default::default() };
            let p = rep.step(&format!("{name} {K}-NN (NN-descent)"), params.max_iters as u64 + 1, "rounds");
            let t = Instant::now();
            let (nn, r) = metrics::ann::approx_knn_with(x, n, d, K, &params, &mut |_, _| p.inc(1));
            p.finish();
            reports.push(json!({ "embedding": name, "n_cells": n, "seconds": t.elapsed().as_secs_f64(), "report": r }));
            nn
        }
    }
}

fn take_rows(x: &[f32], d: usize, rows: &[usize]) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * d);
    for &r in rows {
        out.extend_from_slice(&x[r * d..(r + 1) * d]);
    }
    out
}

/// Why scib-metrics (and we) give NaN for a metric, for the warning.
fn nan_reason(key: &str) -> &'static str {
    match key {
        "kbet_per_label" => "every label has fewer than 10 cells or a single batch, so kBET is undefined for each (scib-metrics gives NaN too)",
        "bras" | "silhouette_batch" => "no label has cells in two or more batches with more than one cell each (scib-metrics raises here)",
        "pcr_comparison" => "the batches explain no variance of the unintegrated PCA (PCR of X is 0), so the ratio is 0/0",
        "ilisi_knn" | "clisi_knn" => "the LISI kernel vanished for every cell (all neighbours at the same distance)",
        _ => "the metric is undefined on this data (scib-metrics gives NaN too)",
    }
}

struct Scored {
    embedding: String,
    dim: usize,
    values: Vec<MetricValue>,
    knn_s: f64,
    metrics_s: f64,
    /// Wall seconds per metric step, in the order run ("(subsample)" marks the batch half).
    steps: Vec<(String, f64)>,
    lisi: Option<(Vec<f64>, Vec<f64>)>,
    kmeans_spread: Option<metrics::KMeansSpread>,
}

fn run_metrics(
    dense: &metrics::Dense,
    tag: &str,
    emb: &[f32],
    n: usize,
    d: usize,
    pre: &[f32],
    d_pre: usize,
    labels: &[u32],
    batches: &[u32],
    nn: &NeighborsResults,
    cfg: &BenchmarkConfig,
    rep: &dyn Reporter,
    steps: &mut Vec<(String, f64)>,
) -> Vec<MetricValue> {
    let mut bar: Option<(String, Box<dyn Progress>)> = None;
    let mut started = Instant::now();
    let mut on = |key: &str| {
        if bar.as_ref().is_some_and(|(k, _)| k == key) {
            return;
        }
        if let Some((k, b)) = bar.take() {
            b.inc(1);
            b.finish();
            steps.push((k, started.elapsed().as_secs_f64()));
        }
        started = Instant::now();
        bar = Some((key.to_string(), rep.step(&format!("{tag} {key}"), 1, "metric")));
    };
    let out = metrics::run_benchmark_on(dense, emb, n, d, pre, d_pre, labels, batches, nn, cfg, &mut on);
    if let Some((k, b)) = bar.take() {
        b.inc(1);
        b.finish();
        steps.push((k, started.elapsed().as_secs_f64()));
    }
    out
}

fn is_synthetic(ad: &AnnData) -> bool {
    let uns = ad.uns();
    let name = ad.path.file_name().map(|s| s.to_string_lossy().to_lowercase()).unwrap_or_default();
    uns.get("synthetic").is_some_and(|v| v.as_bool() == Some(true) || v.is_string())
        || uns.get("source").and_then(Value::as_str).is_some_and(|s| s.to_lowercase().contains("synthetic"))
        || name.contains("synthetic")
}

pub fn default_out(data: &Path, what: &str) -> PathBuf {
    let stem = data.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "data".into());
    data.with_file_name(format!("{stem}.{what}"))
}

fn fmt(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else {
        format!("{v:.6}")
    }
}

/// The metrics selected, the labels and batches, the subsample and the embeddings, checked.
struct Prepared {
    cfg: BenchmarkConfig,
    selected: Vec<&'static str>,
    ad: AnnData,
    n: usize,
    labels: Vec<u32>,
    label_cats: Vec<String>,
    batches: Vec<u32>,
    batch_cats: Vec<String>,
    any_bio: bool,
    any_batch: bool,
    sub: Option<Vec<usize>>,
    embs: Vec<(String, Vec<f32>, usize)>,
    /// The --pre-integrated embedding, read when PCR is selected.
    pre: Option<(Vec<f32>, usize)>,
}

fn prepare(data: &Path, a: &BenchmarkOptions, seed: u64) -> anyhow::Result<Prepared> {
    let cfg = parse_metrics(&a.metrics, seed)?;
    let selected = enabled(&cfg);
    if selected.is_empty() {
        return Err(Error::BadOption { option: "--metrics".into(), detail: "selects no metric".into(), hint: Some("e.g. `--metrics default`".into()) }.into());
    }
    let mut embeddings: Vec<String> = Vec::new();
    for e in &a.embedding {
        let e = e.trim().to_string();
        if !e.is_empty() && !embeddings.contains(&e) {
            embeddings.push(e);
        }
    }
    if embeddings.is_empty() {
        return Err(Error::BadOption { option: "--embedding".into(), detail: "names no obsm key".into(), hint: Some("e.g. `--embedding X_pca,X_scvi`".into()) }.into());
    }

    let ad = AnnData::open(data)?;
    let n = ad.n_obs;
    // only the two obs columns the metrics use are read (obs may hold many more)
    let obs = ad.obs_columns(&[a.label_key.as_str(), a.batch_key.as_str()])?;
    let (labels, label_cats) = obs_codes(&ad, &obs, &a.label_key, "--label-key")?;
    let (batches, batch_cats) = obs_codes(&ad, &obs, &a.batch_key, "--batch-key")?;
    let any_bio = selected.iter().any(|m| is_bio(m));
    let any_batch = selected.iter().any(|m| !is_bio(m));
    if label_cats.len() < 2 && any_bio {
        return Err(Error::BadField {
            path: ad.path.clone(),
            field: format!("obs/{}", a.label_key),
            detail: format!("has a single category ({:?}); the bio-conservation metrics compare cell types and need at least 2", label_cats[0]),
            hint: Some("pass the column with the cell types as --label-key, or score only batch correction with `--metrics batch`".into()),
        }
        .into());
    }
    if batch_cats.len() < 2 && any_batch {
        return Err(Error::BadField {
            path: ad.path.clone(),
            field: format!("obs/{}", a.batch_key),
            detail: format!("has a single batch ({:?}); the batch-correction metrics need at least 2 batches", batch_cats[0]),
            hint: Some("pass the column with the batches as --batch-key, or score only bio conservation with `--metrics bio`".into()),
        }
        .into());
    }
    if n <= K {
        return Err(Error::BadField {
            path: ad.path.clone(),
            field: "obs".into(),
            detail: format!("has {n} cells; the neighbour metrics use {K} neighbours of each cell (as scib-metrics' Benchmarker), so at least {} cells are needed", K + 1),
            hint: Some("score a larger dataset (scib-metrics cannot score this one either)".into()),
        }
        .into());
    }
    // subsample for the batch metrics
    let sub: Option<Vec<usize>> = match a.batch_max_cells {
        Some(m) if (m as usize) < n && any_batch => {
            let m = m as usize;
            if m <= K {
                return Err(Error::BadOption {
                    option: "--batch-max-cells".into(),
                    detail: format!("{m} is too few: the batch metrics use {K} neighbours, so at least {} cells are needed", K + 1),
                    hint: Some("use a few thousand cells or more".into()),
                }
                .into());
            }
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x5ca1ab1e);
            let mut idx = sample(&mut rng, n, m).into_vec();
            idx.sort_unstable();
            Some(idx)
        }
        _ => None,
    };
    if let Some(idx) = &sub {
        let bs: std::collections::BTreeSet<u32> = idx.iter().map(|&i| batches[i]).collect();
        if bs.len() < 2 {
            return Err(Error::BadOption { option: "--batch-max-cells".into(), detail: "the subsample holds a single batch".into(), hint: Some("subsample more cells".into()) }.into());
        }
    }
    // read every embedding before the long work, so a bad key fails at once
    let mut embs: Vec<(String, Vec<f32>, usize)> = Vec::new();
    for e in &embeddings {
        let (x, d) = read_embedding(&ad, e)?;
        embs.push((e.clone(), x, d));
    }
    let pre = match &a.pre_integrated {
        Some(key) if cfg.pcr_comparison => Some(read_embedding(&ad, key.trim())?),
        _ => None,
    };
    Ok(Prepared { cfg, selected, ad, n, labels, label_cats, batches, batch_cats, any_bio, any_batch, sub, embs, pre })
}

/// `--device`: the CPU, or a GPU for the O(n²) passes (checked here when it runs locally).
fn resolve_device(s: &Settings, args: &BenchmarkArgs) -> anyhow::Result<crate::gpu::DeviceSpec> {
    use crate::gpu::DeviceKind;
    let spec = s.device_spec(&args.device)?;
    match (spec.kind, args.exec.executor) {
        (DeviceKind::Cpu, _) => {
            if args.device.memory_options_given() {
                warn("the GPU memory options (--allocator, pool sizes, --gpu-memory-limit, ...) apply with --device cuda; ignored on the CPU");
            }
            // (a list from SCFOUNDRY_GPUS, set for a whole shell or by the pipeline, is not news)
            if args.gpu.is_some() && std::env::var_os(crate::env::EnvVars::GPUS).is_none() {
                warn("--gpu applies with --device cuda; ignored on the CPU");
            }
        }
        (DeviceKind::Cuda, ExecutorKind::Nextflow) => {
            return Err(Error::BadOption {
                option: "--device".into(),
                detail: "cuda: the pipeline's BENCHMARK process runs on CPU nodes (process_cpu)".into(),
                hint: Some("run the GPU benchmark with --executor local or slurm (with --gpus 1), or leave --device out".into()),
            }
            .into());
        }
        (DeviceKind::Cuda, ExecutorKind::Local) => {
            // the task sees only the card it takes: check one of the list here
            let first = match &args.gpu {
                Some(crate::gpu::cards::GpuList::Cards(c)) => c.iter().copied().min().unwrap_or(0),
                _ => 0,
            };
            crate::gpu::preflight(&crate::gpu::DeviceSpec { ordinal: first as usize, ..spec.clone() }).map_err(Error::Gpu)?;
        }
        (DeviceKind::Cuda, ExecutorKind::Slurm) => {}
    }
    Ok(spec)
}

pub fn run(s: &Settings, args: &BenchmarkArgs) -> anyhow::Result<ExitStatus> {
    let device = resolve_device(s, args)?;
    let pipeline = executor::preflight(&args.exec)?;
    let opts = BenchmarkOptions {
        embedding: args.embedding.clone(),
        label_key: args.label_key.clone(),
        batch_key: args.batch_key.clone(),
        batch_max_cells: args.batch_max_cells,
        neighbors: args.neighbors,
        metrics: args.metrics.clone(),
        per_cell: args.per_cell,
        min_max_scale: args.min_max_scale,
        pre_integrated: args.pre_integrated.clone(),
        kmeans_seeds: args.kmeans_seeds,
    };
    // the input is checked before any run folder exists; the task reads it again
    drop(prepare(&args.data, &opts, args.seed)?);
    let out_dir = args.out.clone().unwrap_or_else(|| default_out(&args.data, "benchmark"));
    crate::paths::check_output_dir(&out_dir, "--out")?;
    let run = executor::create_run(s, &args.exec, &out_dir, "benchmark")?;
    let tag = args.data.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    let mut spec = TaskSpec::new(&run, format!("BENCHMARK ({tag})"), "benchmark", "benchmark", &args.data, &out_dir, args.seed, options_params(&opts), s.quiet, s.progress)?;
    if device.kind == crate::gpu::DeviceKind::Cuda {
        spec.gpus = crate::commands::task_gpus(args.exec.executor, &args.gpu);
    }
    spec.device = device;
    let published = nextflow::outdir(&run).join("benchmark").join(default_out(&spec.data, "benchmark").file_name().unwrap_or_default());
    let params = nextflow_params(&spec, &opts, &run);
    executor::run_single(s, &args.exec, pipeline, &run, spec, params, &published)
}

/// The Nextflow parameters of a benchmark (names as in nextflow_schema.json).
pub fn nextflow_params(spec: &TaskSpec, o: &BenchmarkOptions, run: &crate::runner::Run) -> Vec<(String, String)> {
    let mut p = nextflow::task_params("benchmark", None, &spec.data, run, spec.seed);
    p.push(("embedding".into(), o.embedding.join(",")));
    p.push(("label_key".into(), o.label_key.clone()));
    p.push(("batch_key".into(), o.batch_key.clone()));
    if !o.metrics.is_empty() {
        p.push(("metrics".into(), o.metrics.join(",")));
    }
    if let Some(m) = o.batch_max_cells {
        p.push(("batch_max_cells".into(), m.to_string()));
    }
    match o.neighbors {
        NeighborsSearch::Approx => p.push(("neighbors".into(), "approx".into())),
        NeighborsSearch::Exact => p.push(("neighbors".into(), "exact".into())),
        NeighborsSearch::Auto => {}
    }
    if let Some(k) = &o.pre_integrated {
        p.push(("pre_integrated".into(), k.clone()));
    }
    if o.kmeans_seeds != 5 {
        p.push(("kmeans_seeds".into(), o.kmeans_seeds.to_string()));
    }
    for (flag, on) in [("per_cell", o.per_cell), ("min_max_scale", o.min_max_scale)] {
        if on {
            p.push((flag.into(), "true".into()));
        }
    }
    p
}

/// The task: score every embedding, rank them, write the tables and the figure.
pub fn task(spec: &TaskSpec, task_dir: &Path) -> anyhow::Result<TaskResult> {
    let t0 = Instant::now();
    let rep = reporter(spec.quiet || !spec.progress);
    let a: BenchmarkOptions = spec.options()?;
    let seed = spec.seed;
    let Prepared { mut cfg, mut selected, ad, n, labels, label_cats, batches, batch_cats, any_bio, mut any_batch, sub, embs, pre } = prepare(&spec.data, &a, seed)?;
    // the O(n²) passes on the task's device (--device cuda: a GPU)
    let dev = crate::tasks::runtime::TaskDevice::start(spec)?;
    let dense = metrics::Dense::on(&dev.device);
    let out_dir = spec.out.clone();
    std::fs::create_dir_all(&out_dir).map_err(|e| Error::Io { path: out_dir.clone(), source: e })?;

    // PCR's unintegrated embedding: --pre-integrated, else a PCA of X (X is read only here)
    if a.pre_integrated.is_some() && !cfg.pcr_comparison {
        warn("--pre-integrated is used by PCR comparison only, which --metrics leaves out: ignored");
    }
    let mut x_pre_source = Value::Null;
    let (pre, d_pre) = match pre {
        Some((x, d)) => {
            let key = a.pre_integrated.clone().unwrap_or_default();
            x_pre_source = json!({ "source": format!("obsm/{key}"), "n_comps": d, "method": "the embedding as stored (scib-metrics' pre_integrated_embedding_obsm_key)" });
            (x, d)
        }
        None if cfg.pcr_comparison => match x_pre(&ad, seed, rep.as_ref()) {
            Ok((x, d)) => {
                x_pre_source = json!({ "source": "X", "n_comps": d, "method": "zero-centred PCA of X as stored, all genes (scib-metrics Benchmarker.prepare: sc.tl.pca(svd_solver='arpack', use_highly_variable=False)); Lanczos" });
                (x, d)
            }
            Err(e) if selected.len() > 1 => {
                let why = match e.downcast_ref::<Error>() {
                    Some(err) => format!("{err}"),
                    None => format!("{e:#}"),
                };
                warn(&format!("PCR comparison left out, the other metrics are scored ({why}); to score it, pass the unintegrated embedding with `--pre-integrated KEY` (an obsm key)"));
                set(&mut cfg, "pcr_comparison", false);
                selected.retain(|m| *m != "pcr_comparison");
                any_batch = selected.iter().any(|m| !is_bio(m));
                x_pre_source = json!({ "left_out": why });
                (Vec::new(), 0)
            }
            Err(e) => return Err(e),
        },
        None => (Vec::new(), 0),
    };
    let synthetic = is_synthetic(&ad);

    // bio on all cells; batch on the subsample when there is one
    let (mut bio_cfg, mut batch_cfg) = (cfg.clone(), cfg.clone());
    for m in &selected {
        set(if is_bio(m) { &mut batch_cfg } else { &mut bio_cfg }, m, false);
    }
    cfg.seed = seed;
    let mut scored: Vec<Scored> = Vec::new();
    let mut ann_reports: Vec<Value> = Vec::new();
    let want_spread = cfg.nmi_ari_cluster_labels_kmeans && a.kmeans_seeds > 1;
    let spread_seeds: Vec<u64> = (0..a.kmeans_seeds).map(|i| seed.wrapping_add(i)).collect();
    let spread_label = |name: &str| format!("{name} KMeans over {} seeds", spread_seeds.len());
    for (name, x, d) in &embs {
        let (n, d) = (n, *d);
        // with a GPU, the KMeans seed spread (CPU cores) runs while the GPU finds the neighbours
        let (nn, knn_s, early_spread) = std::thread::scope(|sc| {
            let job = (dense.is_gpu() && want_spread).then(|| {
                let p = rep.step(&spread_label(name), 1, "metric");
                let h = sc.spawn(|| {
                    let t = Instant::now();
                    (metrics::kmeans_seed_spread(x, n, d, &labels, &spread_seeds), t.elapsed().as_secs_f64())
                });
                (p, h)
            });
            let t = Instant::now();
            let nn = knn(name, x, n, d, a.neighbors, seed, &dense, rep.as_ref(), &mut ann_reports);
            let knn_s = t.elapsed().as_secs_f64();
            let early = job.map(|(p, h)| {
                let r = h.join().expect("the KMeans seed spread's thread panicked");
                p.inc(1);
                p.finish();
                r
            });
            (nn, knn_s, early)
        });
        let t = Instant::now();
        let mut values = Vec::new();
        let mut steps = vec![("knn".to_string(), knn_s)];
        match &sub {
            None => values = run_metrics(&dense, name, x, n, d, &pre, d_pre, &labels, &batches, &nn, &cfg, rep.as_ref(), &mut steps),
            Some(idx) => {
                values.extend(run_metrics(&dense, name, x, n, d, &pre, d_pre, &labels, &batches, &nn, &bio_cfg, rep.as_ref(), &mut steps));
                let xs = take_rows(x, d, idx);
                let ps = if d_pre > 0 { take_rows(&pre, d_pre, idx) } else { Vec::new() };
                let ls: Vec<u32> = idx.iter().map(|&i| labels[i]).collect();
                let bs: Vec<u32> = idx.iter().map(|&i| batches[i]).collect();
                let t_sub = Instant::now();
                let nns = knn(&format!("{name} (subsample)"), &xs, idx.len(), d, a.neighbors, seed, &dense, rep.as_ref(), &mut ann_reports);
                steps.push(("knn (subsample)".to_string(), t_sub.elapsed().as_secs_f64()));
                let mut sub_steps = Vec::new();
                values.extend(run_metrics(&dense, name, &xs, idx.len(), d, &ps, d_pre, &ls, &bs, &nns, &batch_cfg, rep.as_ref(), &mut sub_steps));
                steps.extend(sub_steps.into_iter().map(|(k, s)| (format!("{k} (subsample)"), s)));
            }
        }
        // KMeans over more seeds, beside the one-run headline
        let spread_step = "nmi_ari_cluster_labels_kmeans (seed spread)".to_string();
        let kmeans_spread = match early_spread {
            Some((s, secs)) => {
                steps.push((format!("{spread_step}, beside the knn"), secs));
                Some(s)
            }
            None => want_spread.then(|| {
                let p = rep.step(&spread_label(name), 1, "metric");
                let t = Instant::now();
                let s = metrics::kmeans_seed_spread(x, n, d, &labels, &spread_seeds);
                p.inc(1);
                p.finish();
                steps.push((spread_step, t.elapsed().as_secs_f64()));
                s
            }),
        };
        // rows in scib-metrics' order: bio first, then batch, each in dataclass order
        let lisi = a.per_cell.then(|| (metrics::lisi_knn(&nn, &batches, None), metrics::lisi_knn(&nn, &labels, None)));
        for v in &values {
            if v.value.is_nan() {
                warn(&format!("{} is NaN for {name}: {}", v.name, nan_reason(&v.key)));
            }
        }
        scored.push(Scored { embedding: name.clone(), dim: d, values, knn_s, metrics_s: t.elapsed().as_secs_f64(), steps, lisi, kmeans_spread });
    }

    // aggregate and rank
    let kinds: Vec<MetricKind> = scored[0].values.iter().map(|v| v.kind).collect();
    let table: Vec<Vec<f64>> = scored.iter().map(|s| s.values.iter().map(|v| v.value).collect()).collect();
    let agg = aggregate(&kinds, &table, a.min_max_scale);
    let shown: Vec<Vec<f64>> = if a.min_max_scale { metrics::aggregate::min_max_scale(&table) } else { table.clone() };
    let sort_key = |i: usize| {
        let g = agg[i];
        let v = if any_bio && any_batch { g.total } else if any_batch { g.batch_correction } else { g.bio_conservation };
        if v.is_nan() { f64::NEG_INFINITY } else { v }
    };
    let mut order: Vec<usize> = (0..scored.len()).collect();
    order.sort_by(|&i, &j| sort_key(j).total_cmp(&sort_key(i)));
    // the ranking score of each embedding with its KMeans NMI/ARI at the low and the high end of
    // their seed spread (the others as run), and the pairs whose ranges overlap
    let ranges: Vec<Option<(f64, f64)>> = (0..scored.len())
        .map(|i| {
            let sp = scored[i].kmeans_spread.as_ref()?;
            let at = |nmi: f64, ari: f64| {
                let mut t = table.clone();
                for (m, v) in scored[i].values.iter().zip(t[i].iter_mut()) {
                    if m.key == "nmi_ari_cluster_labels_kmeans_nmi" {
                        *v = nmi;
                    } else if m.key == "nmi_ari_cluster_labels_kmeans_ari" {
                        *v = ari;
                    }
                }
                let g = aggregate(&kinds, &t, a.min_max_scale)[i];
                if any_bio && any_batch { g.total } else { g.bio_conservation }
            };
            let (ns, as_) = (sp.nmi_summary(), sp.ari_summary());
            let (lo, hi) = (at(ns.min, as_.min), at(ns.max, as_.max));
            // the headline run belongs to the range too
            let own = sort_key(i);
            Some((lo.min(hi).min(own), lo.max(hi).max(own)))
        })
        .collect();
    let range_of = |i: usize| ranges[i].unwrap_or((sort_key(i), sort_key(i)));
    let may_flip: Vec<Vec<usize>> = (0..scored.len())
        .map(|i| {
            (0..scored.len())
                .filter(|&j| j != i && (ranges[i].is_some() || ranges[j].is_some()))
                .filter(|&j| {
                    let ((li, hi), (lj, hj)) = (range_of(i), range_of(j));
                    li <= hj && lj <= hi
                })
                .collect()
        })
        .collect();

    let batch_cells = sub.as_ref().map_or(n, |s| s.len());
    let subsample = json!({
        "batch_max_cells": a.batch_max_cells,
        "batch_metric_cells": if any_batch { Some(batch_cells) } else { None },
        "bio_metric_cells": if any_bio { Some(n) } else { None },
        "method": if sub.is_some() { "uniform without replacement (ChaCha8, seeded), batch metrics only; their 90-NN is recomputed on the subsample" } else { "none: every cell" },
        "seed": seed,
    });
    let data_name = spec.data.file_name().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();

    // results.tsv
    let metric_names: Vec<&str> = scored[0].values.iter().map(|v| v.name.as_str()).collect();
    let tsv_path = out_dir.join("results.tsv");
    let mut tsv = String::new();
    tsv.push_str("rank\tembedding");
    for m in &metric_names {
        tsv.push_str(&format!("\t{m}"));
    }
    tsv.push_str("\tBatch correction\tBio conservation\tTotal\tn_cells\tbatch_metric_cells\tk\tseed\tmin_max_scaled\timplementation\n");
    for (rank, &i) in order.iter().enumerate() {
        tsv.push_str(&format!("{}\t{}", rank + 1, scored[i].embedding));
        for v in &shown[i] {
            tsv.push_str(&format!("\t{}", fmt(*v)));
        }
        let g = agg[i];
        tsv.push_str(&format!(
            "\t{}\t{}\t{}\t{n}\t{batch_cells}\t{K}\t{}\t{}\t{IMPLEMENTATION}\n",
            fmt(g.batch_correction),
            fmt(g.bio_conservation),
            fmt(g.total),
            seed,
            a.min_max_scale
        ));
    }
    write_file(&tsv_path, tsv.as_bytes())?;

    // results.json
    let stamp = |v: f64| json!({ "value": if v.is_nan() { Value::Null } else { json!(v) }, "implementation": IMPLEMENTATION });
    let results: Vec<Value> = order
        .iter()
        .enumerate()
        .map(|(rank, &i)| {
            let sc = &scored[i];
            let mut vals = serde_json::Map::new();
            for (m, v) in sc.values.iter().zip(&shown[i]) {
                let mut o = stamp(*v);
                o["name"] = json!(m.name);
                o["group"] = json!(match m.kind { MetricKind::BioConservation => "Bio conservation", MetricKind::BatchCorrection => "Batch correction" });
                if a.min_max_scale {
                    o["raw_value"] = if m.value.is_nan() { Value::Null } else { json!(m.value) };
                }
                vals.insert(m.key.clone(), o);
            }
            let g = agg[i];
            json!({
                "rank": rank + 1,
                "embedding": sc.embedding,
                "dim": sc.dim,
                "metrics": vals,
                "aggregates": {
                    "Batch correction": stamp(g.batch_correction),
                    "Bio conservation": stamp(g.bio_conservation),
                    "Total": stamp(g.total),
                },
                "seconds": { "knn": sc.knn_s, "metrics": sc.metrics_s },
                "kmeans_seed_spread": match &sc.kmeans_spread {
                    None => Value::Null,
                    Some(sp) => json!({
                        "seeds": sp.seeds,
                        "nmi": sp.nmi,
                        "ari": sp.ari,
                        "nmi_summary": sp.nmi_summary(),
                        "ari_summary": sp.ari_summary(),
                        "ranking_score_range": ranges[i].map(|(lo, hi)| json!([lo, hi])),
                        "rank_may_flip_with": may_flip[i].iter().map(|&j| scored[j].embedding.clone()).collect::<Vec<_>>(),
                        "note": "headline KMeans NMI/ARI is the one run with --seed, as scib-metrics reports it (seed 0 there); the spread is beside it and enters no aggregate",
                    }),
                },
                "step_seconds": sc.steps.iter().map(|(k, s)| json!({ "step": k, "seconds": s })).collect::<Vec<_>>(),
            })
        })
        .collect();
    let doc = json!({
        "implementation": IMPLEMENTATION,
        "scfoundry_version": env!("CARGO_PKG_VERSION"),
        "command_line": spec.command_line,
        "data": spec.data,
        "synthetic": synthetic,
        "n_cells": n,
        "label_key": a.label_key,
        "batch_key": a.batch_key,
        "n_labels": label_cats.len(),
        "n_batches": batch_cats.len(),
        "seed": seed,
        "neighbors": match resolve_search(a.neighbors, n, &dense) {
            NeighborsSearch::Exact => json!({ "k": K, "subsets": metrics::BENCHMARK_K, "search": "exact", "requested": a.neighbors, "auto_exact_max_cells": NeighborsSearch::AUTO_EXACT_MAX_CELLS, "device": dense.name(), "method": "exact brute force, Euclidean, self included (scib-metrics uses pynndescent)" }),
            NeighborsSearch::Approx | NeighborsSearch::Auto => json!({
                "k": K,
                "subsets": metrics::BENCHMARK_K,
                "search": "approx",
                "requested": a.neighbors,
                "auto_exact_max_cells": NeighborsSearch::AUTO_EXACT_MAX_CELLS,
                "method": "NN-descent from a random-projection forest (as pynndescent), Euclidean, self included",
                "seed": seed,
                "params": metrics::AnnParams { seed, ..Default::default() },
                "runs": ann_reports,
            }),
        },
        "x_pre": x_pre_source,
        "subsample": subsample,
        "min_max_scale": a.min_max_scale,
        "aggregation": "Batch correction = mean of batch metrics, Bio conservation = mean of bio metrics (NaN skipped), Total = 0.4 x batch + 0.6 x bio",
        "metrics": selected,
        "kmeans_seeds": if cfg.nmi_ari_cluster_labels_kmeans && a.kmeans_seeds > 1 { json!((0..a.kmeans_seeds).map(|i| seed.wrapping_add(i)).collect::<Vec<_>>()) } else { Value::Null },
        "results": results,
        "dense_passes": {
            "device": dense.name(),
            "passes": dense.passes(),
            "fallbacks": dense.fallbacks(),
        },
        "seconds": t0.elapsed().as_secs_f64(),
    });
    write_file(&out_dir.join("results.json"), serde_json::to_string_pretty(&doc)?.as_bytes())?;

    // lisi_per_cell.tsv
    if a.per_cell {
        let mut s = String::from("cell");
        for sc in &scored {
            s.push_str(&format!("\t{0}_ilisi\t{0}_clisi", sc.embedding));
        }
        s.push('\n');
        for c in 0..n {
            s.push_str(&ad.obs_names[c]);
            for sc in &scored {
                let (b, l) = sc.lisi.as_ref().unwrap();
                s.push_str(&format!("\t{}\t{}", fmt(b[c]), fmt(l[c])));
            }
            s.push('\n');
        }
        write_file(&out_dir.join("lisi_per_cell.tsv"), s.as_bytes())?;
    }

    // figure
    let fig = plots::ResultsTable {
        title: format!(
            "{}{data_name}: {n} cells, {} labels, {} batches{}",
            if synthetic { "SYNTHETIC data, " } else { "" },
            label_cats.len(),
            batch_cats.len(),
            if a.min_max_scale { " (min-max scaled)" } else { "" }
        ),
        subtitle: format!(
            "{IMPLEMENTATION}; {} {K}-NN; seed {}{}{}",
            match a.neighbors.resolve(n) { NeighborsSearch::Exact => "exact", _ => "approximate (NN-descent)" },
            seed,
            if sub.is_some() { format!("; batch metrics on {batch_cells} sampled cells") } else { String::new() },
            if may_flip.iter().any(|f| !f.is_empty()) { format!("; * rank could flip with the KMeans seed ({} seeds)", a.kmeans_seeds) } else { String::new() }
        ),
        metrics: scored[0].values.iter().map(|v| (v.name.clone(), v.kind)).collect(),
        rows: order.iter().map(|&i| (format!("{}{}", scored[i].embedding, if may_flip[i].is_empty() { "" } else { " *" }), shown[i].clone(), agg[i])).collect(),
    };
    plots::results_table(&fig, &out_dir.join("results.svg"), &out_dir.join("results.png"))?;

    // the ranked table, for stdout
    let mut so = String::new();
    let w = scored.iter().map(|s| s.embedding.len()).max().unwrap_or(9).max(9);
    writeln!(so, "{:<4} {:<w$} {:>10} {:>10} {:>10}", "rank", "embedding", "batch", "bio", "total")?;
    for (rank, &i) in order.iter().enumerate() {
        let g = agg[i];
        writeln!(so, "{:<4} {:<w$} {:>10.4} {:>10.4} {:>10.4}", rank + 1, scored[i].embedding, g.batch_correction, g.bio_conservation, g.total)?;
    }
    for &i in &order {
        if let Some(sp) = &scored[i].kmeans_spread {
            let (ns, as_) = (sp.nmi_summary(), sp.ari_summary());
            let flips = if may_flip[i].is_empty() { String::new() } else { format!("; rank could flip with {}", may_flip[i].iter().map(|&j| scored[j].embedding.as_str()).collect::<Vec<_>>().join(", ")) };
            writeln!(
                so,
                "{}: KMeans over seeds {}..{}: NMI {:.4} [{:.4}, {:.4}], ARI {:.4} [{:.4}, {:.4}] (mean [min, max]){flips}",
                scored[i].embedding,
                sp.seeds[0],
                sp.seeds[sp.seeds.len() - 1],
                ns.mean,
                ns.min,
                ns.max,
                as_.mean,
                as_.min,
                as_.max
            )?;
        }
    }
    let summary = format!(
        "scored {} embedding(s) of {n} cells with {} metric(s) in {:.1}s; wrote {} (results.tsv, results.json, results.svg, results.png{})",
        scored.len(),
        metric_names.len(),
        t0.elapsed().as_secs_f64(),
        out_dir.display(),
        if a.per_cell { ", lisi_per_cell.tsv" } else { "" }
    );
    for f in dense.fallbacks() {
        warn(&f);
    }
    dev.write_report(task_dir, None, None);
    Ok(TaskResult { output: Some(out_dir), n_obs: n, stdout: Some(so), summary: vec![summary], ..Default::default() })
}

/// Write through a temporary file beside `path`, renamed into place (no half-written results).
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    let tmp = path.with_file_name(format!(".{}.tmp", path.file_name().map(|s| s.to_string_lossy()).unwrap_or_default()));
    std::fs::write(&tmp, bytes).map_err(|e| Error::Io { path: tmp.clone(), source: e })?;
    std::fs::rename(&tmp, path).map_err(|e| Error::Io { path: path.into(), source: e })
}
