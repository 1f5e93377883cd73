//! `scfoundry geometry`: describe an embedding's geometry on a seeded subsample: the
//! distribution of pairwise distances, the Levina-Bickel intrinsic dimension, and how
//! much of each cell's neighbourhood in a PCA of X (the same cells) the embedding keeps
//! at k = 5, 15, 50. Writes geometry.tsv, geometry.json, geometry.svg and geometry.png.
//! The work is one task (`task`), run where `--executor` says; the input is checked here first.

use std::path::Path;
use std::time::Instant;

use rand::seq::index::sample;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::anndata::AnnData;
use crate::cli::GeometryArgs;
use crate::commands::benchmark::{default_out, read_embedding, write_file};
use crate::commands::ExitStatus;
use crate::error::Error;
use crate::executor::{self, nextflow};
use crate::metrics::{self, geometry as geo};
use crate::plots;
use crate::progress::{reporter, warn};
use crate::runner::{options_params, TaskResult, TaskSpec};
use crate::settings::Settings;

/// What the task needs besides data, output and seed (the spec's params).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GeometryOptions {
    pub embedding: String,
    pub max_cells: u64,
}

const KS: [usize; 3] = [5, 15, 50];
const LID_K: usize = 20;
const N_PAIRS: usize = 200_000;

/// The reference space: a PCA of X on the chosen cells. Raw counts (non-negative integers)
/// are first normalised to 1e4 per cell and log1p-transformed (scanpy's standard recipe);
/// other values are used as stored. Returns (coordinates, n_comps, description).
fn reference_pca(ad: &AnnData, cells: &[usize], seed: u64) -> anyhow::Result<Option<(Vec<f32>, usize, String)>> {
    let x = ad.matrix(None)?;
    let g = x.n_cols;
    let m = cells.len();
    let mut indptr = vec![0usize];
    let (mut indices, mut data) = (Vec::new(), Vec::new());
    for &c in cells {
        let b = x.read_rows(c, c + 1)?;
        let (idx, val) = b.row(0);
        indices.extend_from_slice(idx);
        data.extend_from_slice(val);
        indptr.push(data.len());
    }
    if data.is_empty() || data.iter().any(|v| !v.is_finite()) {
        return Ok(None);
    }
    let counts = data.iter().all(|&v| v >= 0.0 && v.fract() == 0.0);
    if counts {
        for i in 0..m {
            let r = indptr[i]..indptr[i + 1];
            let tot: f32 = data[r.clone()].iter().sum();
            if tot > 0.0 {
                data[r].iter_mut().for_each(|v| *v = (*v / (tot / 1e4)).ln_1p());
            }
        }
    }
    let nc = 50.min(m - 1).min(g - 1);
    if nc == 0 {
        return Ok(None);
    }
    let csr = metrics::prepare::Csr { indptr: &indptr, indices: &indices, data: &data, n_rows: m, n_cols: g };
    let (p, _) = metrics::prepare::pca_projections(&csr, nc, seed);
    let how = if counts {
        format!("PCA of X (raw counts: normalised to 1e4 per cell, log1p; all {g} genes; {nc} components)")
    } else {
        format!("PCA of X as stored (all {g} genes; {nc} components)")
    };
    Ok(Some((p, nc, how)))
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let pos = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// The data, the embedding and its dimension, checked: enough cells for the neighbourhoods.
fn load(data: &Path, o: &GeometryOptions) -> anyhow::Result<(AnnData, Vec<f32>, usize)> {
    let ad = AnnData::open(data)?;
    let n = ad.n_obs;
    let (x, d) = read_embedding(&ad, &o.embedding)?;
    let kmax = *KS.last().unwrap();
    let m = (o.max_cells as usize).min(n);
    if m <= kmax {
        return Err(Error::BadField {
            path: ad.path.clone(),
            field: format!("obsm/{}", o.embedding),
            detail: format!("{m} cells{}; the neighbourhood measures use up to {kmax} neighbours, so at least {} cells are needed", if m < n { " after --max-cells" } else { "" }, kmax + 1),
            hint: Some(if m < n { "raise --max-cells".into() } else { "describe a larger dataset".into() }),
        }
        .into());
    }
    Ok((ad, x, d))
}

pub fn run(s: &Settings, a: &GeometryArgs) -> anyhow::Result<ExitStatus> {
    let pipeline = executor::preflight(&a.exec)?;
    let opts = GeometryOptions { embedding: a.embedding.clone(), max_cells: a.max_cells };
    // the input is checked before any run folder exists; the task reads it again
    drop(load(&a.data, &opts)?);
    let out_dir = a.out.clone().unwrap_or_else(|| default_out(&a.data, "geometry"));
    crate::paths::check_output_dir(&out_dir, "--out")?;
    let run = executor::create_run(s, &a.exec, &out_dir, "geometry")?;
    let tag = a.data.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    let spec = TaskSpec::new(&run, format!("GEOMETRY ({tag})"), "geometry", "geometry", &a.data, &out_dir, a.seed, options_params(&opts), s.quiet, s.progress)?;
    let published = nextflow::outdir(&run).join("geometry").join(default_out(&spec.data, "geometry").file_name().unwrap_or_default());
    let mut params = nextflow::task_params("geometry", None, &spec.data, &run, spec.seed);
    params.push(("embedding".into(), opts.embedding.clone()));
    params.push(("max_cells".into(), opts.max_cells.to_string()));
    executor::run_single(s, &a.exec, pipeline, &run, spec, params, &published)
}

/// The task: describe the embedding and write the tables and the figure.
pub fn task(spec: &TaskSpec) -> anyhow::Result<TaskResult> {
    let t0 = Instant::now();
    let rep = reporter(spec.quiet || !spec.progress);
    let a: GeometryOptions = spec.options()?;
    let seed = spec.seed;
    let (ad, x, d) = load(&spec.data, &a)?;
    let n = ad.n_obs;
    let kmax = *KS.last().unwrap();
    let m = (a.max_cells as usize).min(n);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x9e0);
    let mut cells = if m < n { sample(&mut rng, n, m).into_vec() } else { (0..n).collect() };
    cells.sort_unstable();
    let mut xs = Vec::with_capacity(m * d);
    for &c in &cells {
        xs.extend_from_slice(&x[c * d..(c + 1) * d]);
    }
    drop(x);

    let p = rep.step("pairwise distances", 1, "sample");
    let dists: Vec<f64> = geo::sample_pair_distances(&xs, m, d, N_PAIRS, seed).into_iter().map(f64::from).collect();
    p.finish();
    let p = rep.step(&format!("{}-NN (exact)", kmax), 1, "search");
    let nn = metrics::exact_knn(&xs, m, d, kmax + 1);
    p.finish();
    let (lid, lid_global) = geo::levina_bickel(&nn, LID_K);
    let n_dup = lid.iter().filter(|v| v.is_nan()).count();
    if n_dup > 0 {
        warn(&format!("{n_dup} cell(s) have a neighbour at distance 0 (duplicated coordinates): their local dimension is undefined and left out"));
    }

    // reference space: PCA of X on the same cells, else of the embedding itself
    let p = rep.step("reference PCA", 1, "fit");
    let (refx, ref_d, ref_how) = match reference_pca(&ad, &cells, seed)? {
        Some(r) => r,
        None => {
            warn("X holds no usable values: the neighbourhood reference is a PCA of the embedding itself");
            let csr_data: Vec<f32> = xs.clone();
            let indptr: Vec<usize> = (0..=m).map(|i| i * d).collect();
            let indices: Vec<u32> = (0..m).flat_map(|_| 0..d as u32).collect();
            let nc = 50.min(m - 1).min(d.max(2) - 1).max(1);
            let csr = metrics::prepare::Csr { indptr: &indptr, indices: &indices, data: &csr_data, n_rows: m, n_cols: d };
            let (pp, _) = metrics::prepare::pca_projections(&csr, nc.min(d), seed);
            (pp, nc.min(d), format!("PCA of the embedding itself ({} components; X holds no usable values)", nc.min(d)))
        }
    };
    p.finish();
    let nn_ref = metrics::exact_knn(&refx, m, ref_d, kmax + 1);

    let mut sorted = dists.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let mean = sorted.iter().sum::<f64>() / sorted.len() as f64;
    let mut lid_sorted: Vec<f64> = lid.iter().copied().filter(|v| v.is_finite()).collect();
    lid_sorted.sort_by(|a, b| a.total_cmp(b));

    let mut rows: Vec<(String, String, f64, String)> = vec![
        ("cells_total".into(), String::new(), n as f64, String::new()),
        ("cells_used".into(), String::new(), m as f64, format!("seeded uniform subsample (seed {})", seed)),
        ("dimensions".into(), String::new(), d as f64, String::new()),
        ("pairwise_distance_mean".into(), String::new(), mean, format!("{} sampled pairs", sorted.len())),
        ("pairwise_distance_median".into(), String::new(), quantile(&sorted, 0.5), String::new()),
        ("pairwise_distance_p05".into(), String::new(), quantile(&sorted, 0.05), String::new()),
        ("pairwise_distance_p95".into(), String::new(), quantile(&sorted, 0.95), String::new()),
        ("pairwise_distance_cv".into(), String::new(), (sorted.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / sorted.len() as f64).sqrt() / mean, "sd / mean: near 0 means distances concentrate".into()),
        ("intrinsic_dim_mle".into(), LID_K.to_string(), lid_global, "Levina & Bickel (2004) MLE, global = inverse of the mean inverse (MacKay & Ghahramani)".into()),
        ("intrinsic_dim_median_local".into(), LID_K.to_string(), quantile(&lid_sorted, 0.5), "median of the per-cell estimates".into()),
    ];
    let mut pres = Vec::new();
    for k in KS {
        let ov = geo::knn_overlap(&nn_ref, &nn, k);
        let f = ov.iter().map(|o| o.0).sum::<f64>() / m as f64;
        let j = ov.iter().map(|o| o.1).sum::<f64>() / m as f64;
        rows.push(("neighbourhood_preservation".into(), k.to_string(), f, format!("mean fraction of each cell's {k} nearest neighbours in the reference kept in the embedding")));
        rows.push(("knn_overlap_jaccard".into(), k.to_string(), j, "mean Jaccard index of the two k-NN sets".into()));
        pres.push((k, f, j));
    }

    let out_dir = spec.out.clone();
    std::fs::create_dir_all(&out_dir).map_err(|e| Error::Io { path: out_dir.clone(), source: e })?;
    let mut tsv = String::from("metric\tk\tvalue\tnote\n");
    for (name, k, v, note) in &rows {
        tsv.push_str(&format!("{name}\t{k}\t{v:.6}\t{note}\n"));
    }
    tsv.push_str(&format!("reference\t\t\t{ref_how}\n"));
    write_file(&out_dir.join("geometry.tsv"), tsv.as_bytes())?;
    let (de, dc) = geo::histogram(&dists, 60);
    let (le, lc) = geo::histogram(&lid, 50);
    let doc = json!({
        "scfoundry_version": env!("CARGO_PKG_VERSION"),
        "data": spec.data,
        "embedding": a.embedding,
        "seed": seed,
        "max_cells": a.max_cells,
        "reference": ref_how,
        "values": rows.iter().map(|(n, k, v, note)| json!({"metric": n, "k": k, "value": if v.is_finite() { json!(v) } else { serde_json::Value::Null }, "note": note})).collect::<Vec<_>>(),
        "pairwise_distance_histogram": {"edges": de, "counts": dc},
        "local_intrinsic_dim_histogram": {"edges": le, "counts": lc, "k": LID_K},
    });
    write_file(&out_dir.join("geometry.json"), serde_json::to_string_pretty(&doc)?.as_bytes())?;
    let data_name = spec.data.file_name().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    let fig = plots::GeometryFigure {
        title: format!("{data_name} obsm['{}']: {m} of {n} cells, {d} dims; intrinsic dim (Levina-Bickel, k={LID_K}) {lid_global:.1}", a.embedding),
        dist_edges: de,
        dist_counts: dc,
        lid_edges: le,
        lid_counts: lc,
        lid_label: format!("Levina-Bickel MLE per cell (k={LID_K})"),
        preservation: pres,
        preservation_label: "fraction of reference neighbours kept".into(),
        reference: ref_how.clone(),
    };
    plots::geometry_figure(&fig, &out_dir.join("geometry.svg"), &out_dir.join("geometry.png"))?;
    let mut stdout = String::from("metric\tk\tvalue\n");
    for (name, k, v, _) in &rows {
        stdout.push_str(&format!("{name}\t{k}\t{v:.4}\n"));
    }
    let summary = vec![
        format!("reference for neighbourhoods: {ref_how}"),
        format!("wrote {} (geometry.tsv, geometry.json, geometry.svg, geometry.png) in {:.1}s", out_dir.display(), t0.elapsed().as_secs_f64()),
    ];
    Ok(TaskResult { output: Some(out_dir), n_obs: m, dim: d, stdout: Some(stdout), summary, ..Default::default() })
}
