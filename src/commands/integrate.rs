//! `scfoundry integrate --method harmony|seurat`: correct batch effects.
//!
//! harmony reads `obsm[--embedding]`; seurat reads the expression matrix (X or `--layer`, raw
//! counts log-normalised here, or log-normalised values with `--log-normalized`). Both read the
//! batch column(s), run the method, and write a copy of the input with `obsm['X_<method>']` and
//! `uns['scfoundry_integrate']` (provenance). The work is one task (`task`), run where
//! `--executor` says; the input is checked here first.

use std::path::Path;
use std::time::Instant;

use serde_json::{json, Value};

use crate::anndata::write::{write_rows, PendingOutput};
use crate::anndata::AnnData;
use crate::cli::IntegrateArgs;
use crate::commands::embed::default_output;
use crate::commands::ExitStatus;
use crate::error::{Error, Hdf5Context};
use crate::executor::{self, nextflow};
use crate::methods::harmony::{harmonize, HarmonyError, HarmonyOptions};
use crate::progress::warn;
use crate::registry::Kind;
use crate::runner::{options_params, TaskResult, TaskSpec};
use crate::settings::Settings;
use crate::tasks::integrate::{batch_codes, batch_levels, IntegrateOptions};

/// The embedding and the batch codes, checked.
struct Loaded {
    ad: AnnData,
    z: Vec<f32>,
    n: usize,
    d: usize,
    codes: Vec<Vec<u32>>,
    n_batches: Vec<usize>,
}

fn load(data: &Path, o: &IntegrateOptions) -> anyhow::Result<Loaded> {
    let ad = AnnData::open(data)?;
    if ad.n_obs == 0 {
        return Err(Error::ZeroCells { path: ad.path.clone(), n_vars: ad.n_vars }.into());
    }
    let (codes, n_batches) = batch_codes(&ad, &o.batch_key)?;
    let (z, n, d) = ad.dense_entry("obsm", &o.embedding)?;
    if n != ad.n_obs {
        return Err(Error::BadField { path: ad.path.clone(), field: format!("obsm/{}", o.embedding), detail: format!("has {n} rows but the data has {} cells", ad.n_obs), hint: None }.into());
    }
    if let Some(i) = z.iter().position(|v| !v.is_finite()) {
        return Err(Error::BadField {
            path: ad.path.clone(),
            field: format!("obsm/{}", o.embedding),
            detail: format!("holds a non-finite value at cell {} ({})", i / d, ad.obs_names[i / d]),
            hint: Some("recompute the embedding; Harmony needs finite coordinates".into()),
        }
        .into());
    }
    Ok(Loaded { ad, z, n, d, codes, n_batches })
}


pub fn run(s: &Settings, args: &IntegrateArgs) -> anyhow::Result<ExitStatus> {
    let m = s.registry.get(&args.method)?.clone();
    if m.kind != Kind::Integration {
        return Err(Error::BadOption {
            option: "--method".into(),
            detail: format!("{} is an embedding method, not an integration method", m.name),
            hint: Some(format!("run `scfoundry embed --method {}` first, then integrate its embedding with `--method harmony`", m.name)),
        }
        .into());
    }
    if args.batch.batch_size.is_some() && !m.honoured("integrate").iter().any(|o| o == "--batch-size") {
        warn(&format!("{} does not honour --batch-size when integrating; ignored", m.name));
    }
    if !m.implemented || !matches!(m.name.as_str(), "harmony" | "seurat" | "scvi_denovo") {
        return Err(Error::NotImplemented { name: m.name.clone(), version: env!("CARGO_PKG_VERSION") }.into());
    }
    let seurat = m.name == "seurat";
    if seurat {
        if args.theta.is_some() {
            warn("--theta is a harmony option; seurat ignores it");
        }
        if args.embedding != "X_pca" {
            warn("--embedding is a harmony option; seurat reads the expression matrix (X or --layer)");
        }
        if args.batch_key.len() > 1 {
            return Err(Error::BadOption { option: "--batch-key".into(), detail: format!("seurat integrates over one batch column, {} given", args.batch_key.len()), hint: Some("combine the columns into one obs column first".into()) }.into());
        }
        for (flag, v) in [("--dims", args.dims), ("--k-weight", args.k_weight)] {
            if v == Some(0) {
                return Err(Error::BadOption { option: flag.into(), detail: "must be at least 1".into(), hint: None }.into());
            }
        }
    } else if m.name == "scvi_denovo" {
        if args.log_normalized || args.dims.is_some() || args.k_weight.is_some() || args.theta.is_some() {
            warn("--log-normalized, --dims, --k-weight and --theta are seurat and harmony options; scvi_denovo ignores them (it trains on raw counts)");
        }
    } else if args.layer.is_some() || args.log_normalized || args.dims.is_some() || args.k_weight.is_some() {
        warn("--layer, --log-normalized, --dims and --k-weight are seurat options; harmony ignores them");
    }
    let pipeline = executor::preflight(&args.exec)?;
    let opts = IntegrateOptions {
        embedding: args.embedding.clone(),
        batch_key: args.batch_key.clone(),
        theta: args.theta,
        layer: args.layer.clone(),
        log_normalized: args.log_normalized,
        dims: args.dims,
        k_weight: args.k_weight,
        scvi: args.scvi.clone(),
        batch_size: args.batch.batch_size,
    };
    // the input is checked before any run folder exists; the task reads it again
    if m.name == "scvi_denovo" {
        super::integrate_scvi::check(&args.data, &opts)?;
    } else if seurat {
        let ad = AnnData::open(&args.data)?;
        if ad.n_obs == 0 {
            return Err(Error::ZeroCells { path: ad.path.clone(), n_vars: ad.n_vars }.into());
        }
        batch_codes(&ad, &opts.batch_key)?;
        ad.matrix(opts.layer.as_deref())?;
    } else {
        drop(load(&args.data, &opts)?);
    }
    let out_path = match (&args.out, args.in_place) {
        (_, true) => args.data.clone(),
        (Some(o), false) => o.clone(),
        (None, false) => default_output(&args.data, &m.name),
    };
    if !args.in_place && std::fs::canonicalize(&out_path).ok() == std::fs::canonicalize(&args.data).ok() && out_path.exists() {
        return Err(Error::BadOption { option: "--out".into(), detail: format!("{} is the input file", out_path.display()), hint: Some("pass --in-place to replace the input on purpose".into()) }.into());
    }
    let run = executor::create_run(s, &args.exec, &out_path, &m.name)?;
    let tag = args.data.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    let name = format!("INTEGRATE_{} ({tag})", m.name.to_uppercase());
    let spec = TaskSpec::new(&run, name, "integrate", &m.name, &args.data, &out_path, args.seed, options_params(&opts), s.quiet, s.progress)?;
    let published = nextflow::outdir(&run).join("integrate").join(default_output(&spec.data, &m.name).file_name().unwrap_or_default());
    let params = nextflow_params(&spec, &opts, &run);
    executor::run_single(s, &args.exec, pipeline, &run, spec, params, &published)
}

/// The Nextflow parameters of an integration (names as in nextflow_schema.json).
pub fn nextflow_params(spec: &TaskSpec, o: &IntegrateOptions, run: &crate::runner::Run) -> Vec<(String, String)> {
    let mut p = nextflow::task_params("integrate", Some(&spec.method), &spec.data, run, spec.seed);
    p.push(("embedding".into(), o.embedding.clone()));
    p.push(("batch_key".into(), o.batch_key.join(",")));
    if let Some(t) = o.theta {
        p.push(("theta".into(), t.to_string()));
    }
    if let Some(l) = &o.layer {
        p.push(("layer".into(), l.clone()));
    }
    if o.log_normalized {
        p.push(("log_normalized".into(), "true".into()));
    }
    if let Some(d) = o.dims {
        p.push(("dims".into(), d.to_string()));
    }
    if let Some(k) = o.k_weight {
        p.push(("k_weight".into(), k.to_string()));
    }
    p
}

/// The task: run the method and write the output.
pub fn task(spec: &TaskSpec) -> anyhow::Result<TaskResult> {
    let o: IntegrateOptions = spec.options()?;
    if spec.method == "scvi_denovo" {
        return super::integrate_scvi::task(spec, &o);
    }
    if spec.method == "seurat" {
        return task_seurat(spec, &o);
    }
    let Loaded { ad, z, n, d, codes, n_batches } = load(&spec.data, &o)?;
    let mut opts = HarmonyOptions { seed: spec.seed, ..HarmonyOptions::default() };
    if let Some(t) = o.theta {
        opts.theta = vec![t];
    }
    let started = Instant::now();
    let res = harmonize(&z, n, d, &codes, &opts, None).map_err(|e| match e {
        HarmonyError::Input(msg) => anyhow::Error::from(Error::BadOption { option: "--batch-key / --theta".into(), detail: msg, hint: None }),
        other => anyhow::Error::from(other),
    })?;
    let secs = started.elapsed().as_secs_f64();
    drop(ad);
    let out = PendingOutput::create(&spec.data, &spec.out)?;
    let key = format!("X_{}", spec.method);
    let ds = out.create_obsm(&key, n, d)?;
    write_rows(&ds, 0, &res.z_corr, d)?;
    drop(ds);
    let uns = crate::anndata::h5util::require_dict(out.file(), "uns").h5ctx(|| "creating uns".into())?;
    let mut prov = serde_json::Map::new();
    prov.insert("tool".into(), json!("scfoundry"));
    prov.insert("version".into(), json!(env!("CARGO_PKG_VERSION")));
    prov.insert("method".into(), json!(spec.method));
    prov.insert("embedding".into(), json!(o.embedding));
    prov.insert("obsm_key".into(), json!(key));
    prov.insert("batch_key".into(), json!(o.batch_key.join(",")));
    prov.insert("seed".into(), json!(spec.seed));
    prov.insert("theta".into(), json!(opts.theta.first().copied().unwrap_or(2.0) as f64));
    prov.insert("iterations".into(), json!(res.iterations));
    prov.insert("converged".into(), json!(res.converged));
    prov.insert("clusters".into(), json!(res.n_clusters));
    prov.insert("date".into(), json!(chrono::Local::now().to_rfc3339()));
    prov.insert("run_id".into(), json!(spec.run_id));
    prov.insert("command_line".into(), Value::String(spec.command_line.clone()));
    crate::tasks::runtime::write_json_dict(&uns, "scfoundry_integrate", &prov).h5ctx(|| "writing uns/scfoundry_integrate".into())?;
    drop(uns);
    out.commit()?;
    let summary = format!(
        "wrote {} with obsm['{key}'] ({n} cells x {d}): harmony on obsm['{}'] over {} ({} batches), {} iterations{} in {secs:.1}s",
        spec.out.display(),
        o.embedding,
        o.batch_key.join(", "),
        n_batches.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(" x "),
        res.iterations,
        if res.converged { "" } else { " (not converged: the iteration limit was reached)" },
    );
    Ok(TaskResult { output: Some(spec.out.clone()), obsm_key: Some(key), n_obs: n, dim: d, summary: vec![summary], ..Default::default() })
}

/// The seurat task: log-normalised expression of the integration features, anchors, correction,
/// PCA (methods/seurat.rs), written as `obsm['X_seurat']`.
fn task_seurat(spec: &TaskSpec, o: &IntegrateOptions) -> anyhow::Result<TaskResult> {
    use crate::methods::seurat::{batch_variable_features, integrate, select_integration_features, SeuratError, SeuratOptions};
    let rep = crate::progress::for_settings(spec.quiet, spec.progress);
    let ad = AnnData::open(&spec.data)?;
    if ad.n_obs == 0 {
        return Err(Error::ZeroCells { path: ad.path.clone(), n_vars: ad.n_vars }.into());
    }
    let (codes, _, levels) = batch_levels(&ad, &o.batch_key)?;
    let (codes, levels) = (codes.into_iter().next().unwrap(), levels.into_iter().next().unwrap());
    let nb = levels.len();
    let key = o.batch_key.join(",");
    let mut sizes = vec![0usize; nb];
    codes.iter().for_each(|&c| sizes[c as usize] += 1);
    if let Some(b) = sizes.iter().position(|&s| s < 2) {
        return Err(Error::BadField {
            path: ad.path.clone(),
            field: format!("obs/{key}"),
            detail: format!("batch '{}' has {} cell; seurat scales each batch and needs at least 2 cells in every batch", levels[b], sizes[b]),
            hint: Some("drop that batch's cells or merge it into another batch".into()),
        }
        .into());
    }
    let x = ad.matrix(o.layer.as_deref())?;
    let (n, g) = (x.n_rows, x.n_cols);
    let started = Instant::now();
    // the log-normalised matrix (CSR, in memory) and per-batch moments of the normalised values
    let mut indptr = vec![0usize];
    let mut indices: Vec<u32> = Vec::new();
    let mut data: Vec<f32> = Vec::new();
    let mut sum = vec![0f64; nb * g];
    let mut sq = vec![0f64; nb * g];
    let p = rep.step("seurat: reading the expression", n as u64, "cells");
    for (s, e) in x.blocks(4_000_000) {
        let b = x.read_rows(s, e)?;
        for i in 0..b.n_rows() {
            let c = s + i;
            let (idx, vals) = b.row(i);
            if let Some(t) = vals.iter().position(|v| !v.is_finite() || *v < 0.0 || (!o.log_normalized && v.fract() != 0.0)) {
                let v = vals[t];
                let gene = ad.var_names.get(idx[t] as usize).cloned().unwrap_or_default();
                let (detail, hint) = if o.log_normalized {
                    (format!("holds {v} at cell {c} ({}), gene {gene}: log-normalised values are finite and non-negative", ad.obs_names[c]), "seurat needs log1p of counts per 10,000 (or raw counts without --log-normalized)".to_string())
                } else {
                    (format!("holds {v} at cell {c} ({}), gene {gene}, which is not a raw count", ad.obs_names[c]), "pass --log-normalized if the matrix is already log-normalised, or --layer NAME to read a layer of raw counts".to_string())
                };
                return Err(Error::BadField { path: ad.path.clone(), field: x.field.clone(), detail, hint: Some(hint) }.into());
            }
            let total: f64 = vals.iter().map(|&v| v as f64).sum();
            let bi = codes[c] as usize * g;
            for (&j, &v) in idx.iter().zip(vals) {
                let (lv, ev) = if o.log_normalized {
                    (v as f64, (v as f64).exp_m1())
                } else {
                    let ev = if total > 0.0 { v as f64 / total * 1e4 } else { 0.0 };
                    (ev.ln_1p(), ev)
                };
                if lv != 0.0 {
                    indices.push(j);
                    data.push(lv as f32);
                }
                sum[bi + j as usize] += ev;
                sq[bi + j as usize] += ev * ev;
            }
            indptr.push(indices.len());
        }
        p.inc((e - s) as u64);
    }
    p.finish();
    let defaults = SeuratOptions::default();
    let dims = o.dims.unwrap_or(defaults.dims);
    let opts = SeuratOptions { dims, npcs: dims, k_weight: o.k_weight.unwrap_or(defaults.k_weight), seed: spec.seed, ..defaults };
    // SelectIntegrationFeatures over the per-batch variable genes
    let ranked: Vec<Vec<usize>> = (0..nb)
        .map(|b| {
            let m = sizes[b] as f64;
            let mean: Vec<f64> = (0..g).map(|j| sum[b * g + j] / m).collect();
            let var: Vec<f64> = (0..g).map(|j| ((sq[b * g + j] - m * mean[j] * mean[j]) / (m - 1.0)).max(0.0)).collect();
            batch_variable_features(&mean, &var, opts.n_features)
        })
        .collect();
    drop((sum, sq));
    let features = select_integration_features(&ranked, opts.n_features);
    if features.len() < 2 {
        return Err(Error::BadField { path: ad.path.clone(), field: x.field.clone(), detail: format!("has {} variable gene(s) across the batches; seurat needs at least 2", features.len()), hint: None }.into());
    }
    let f = features.len();
    let mut col = vec![u32::MAX; g];
    for (t, &j) in features.iter().enumerate() {
        col[j] = t as u32;
    }
    let mut dense = vec![0f32; n * f];
    for c in 0..n {
        for t in indptr[c]..indptr[c + 1] {
            let k = col[indices[t] as usize];
            if k != u32::MAX {
                dense[c * f + k as usize] = data[t];
            }
        }
    }
    drop((indptr, indices, data));
    let note = |m: &str| rep.note(&format!("seurat: {m}"));
    let res = integrate(&dense, n, f, &codes, &levels, &opts, &note).map_err(|e| match e {
        SeuratError::Input(msg) => anyhow::Error::from(Error::BadField { path: ad.path.clone(), field: format!("obs/{key}"), detail: msg, hint: None }),
    })?;
    for m in &res.notes {
        warn(&format!("seurat: {m}"));
    }
    let secs = started.elapsed().as_secs_f64();
    let field = x.field.clone();
    drop(x);
    drop(ad);
    let d = res.npcs;
    let out = PendingOutput::create(&spec.data, &spec.out)?;
    let okey = format!("X_{}", spec.method);
    let ds = out.create_obsm(&okey, n, d)?;
    write_rows(&ds, 0, &res.embedding, d)?;
    drop(ds);
    let names = |ds: &[usize]| ds.iter().map(|&b| levels[b].clone()).collect::<Vec<_>>();
    let merges: Vec<Value> = res.merges.iter().map(|m| json!({"reference": names(&m.reference), "query": names(&m.query)})).collect();
    let uns = crate::anndata::h5util::require_dict(out.file(), "uns").h5ctx(|| "creating uns".into())?;
    let mut prov = serde_json::Map::new();
    prov.insert("tool".into(), json!("scfoundry"));
    prov.insert("version".into(), json!(env!("CARGO_PKG_VERSION")));
    prov.insert("method".into(), json!(spec.method));
    prov.insert("matrix".into(), json!(field));
    prov.insert("input_values".into(), json!(if o.log_normalized { "log_normalized" } else { "raw_counts (LogNormalize, scale factor 1e4)" }));
    prov.insert("obsm_key".into(), json!(okey));
    prov.insert("batch_key".into(), json!(key));
    prov.insert("seed".into(), json!(spec.seed));
    prov.insert("n_features".into(), json!(f));
    prov.insert("dims".into(), json!(opts.dims));
    prov.insert("k_anchor".into(), json!(opts.k_anchor));
    prov.insert("k_filter".into(), json!(opts.k_filter));
    prov.insert("k_score".into(), json!(opts.k_score));
    prov.insert("k_weight".into(), json!(opts.k_weight));
    prov.insert("sd_weight".into(), json!(opts.sd_weight));
    prov.insert("npcs".into(), json!(d));
    prov.insert("anchors".into(), json!(res.n_anchors));
    prov.insert("merges".into(), Value::Array(merges));
    prov.insert("notes".into(), json!(res.notes));
    prov.insert("date".into(), json!(chrono::Local::now().to_rfc3339()));
    prov.insert("run_id".into(), json!(spec.run_id));
    prov.insert("command_line".into(), Value::String(spec.command_line.clone()));
    crate::tasks::runtime::write_json_dict(&uns, "scfoundry_integrate", &prov).h5ctx(|| "writing uns/scfoundry_integrate".into())?;
    drop(uns);
    out.commit()?;
    let summary = format!(
        "wrote {} with obsm['{okey}'] ({n} cells x {d}): seurat on {field} ({f} features) over {key} ({nb} batches), {} anchors, {} merges in {secs:.1}s",
        spec.out.display(),
        res.n_anchors,
        res.merges.len(),
    );
    Ok(TaskResult { output: Some(spec.out.clone()), obsm_key: Some(okey), n_obs: n, dim: d, summary: vec![summary], ..Default::default() })
}
