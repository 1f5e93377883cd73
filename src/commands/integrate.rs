//! `scfoundry integrate --method harmony`: correct batch effects in an embedding.
//!
//! Reads `obsm[--embedding]` and the batch column(s), runs the method, and writes a copy of the
//! input with `obsm['X_<method>']` and `uns['scfoundry_integrate']` (provenance). The work is one
//! task (`task`), run where `--executor` says; the input is checked here first.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};
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

/// What the task needs besides data, output, method and seed (the spec's params).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IntegrateOptions {
    pub embedding: String,
    pub batch_key: Vec<String>,
    pub theta: Option<f32>,
    /// scvi_denovo's options (absent in specs written before it existed).
    #[serde(default)]
    pub scvi: crate::cli::ScviArgs,
    #[serde(default)]
    pub batch_size: Option<u64>,
}

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
    let (codes, n_batches) = batch_codes(&ad, &o.batch_key)?;
    Ok(Loaded { ad, z, n, d, codes, n_batches })
}

/// The codes (levels sorted) and level counts of each batch column, checked: present,
/// categorical, with a value for every cell, and more than one batch in all.
pub(crate) fn batch_codes(ad: &AnnData, batch_key: &[String]) -> anyhow::Result<(Vec<Vec<u32>>, Vec<usize>)> {
    let obs = ad.obs()?;
    let mut codes: Vec<Vec<u32>> = Vec::new();
    let mut n_batches = Vec::new();
    for key in batch_key {
        let col = obs.column(key).ok_or_else(|| Error::BadField {
            path: ad.path.clone(),
            field: format!("obs/{key}"),
            detail: "is missing".into(),
            hint: Some(format!("obs columns in this file: {}", obs.names().join(", "))),
        })?;
        let labels = col.as_labels().ok_or_else(|| Error::BadField {
            path: ad.path.clone(),
            field: format!("obs/{key}"),
            detail: format!("is a {} column; a batch key must be categorical, string or integer", col.kind()),
            hint: None,
        })?;
        if let Some(i) = labels.iter().position(Option::is_none) {
            return Err(Error::BadField {
                path: ad.path.clone(),
                field: format!("obs/{key}"),
                detail: format!("has no value for cell {i} ({})", ad.obs_names[i]),
                hint: Some("give every cell a batch, or drop the cells without one".into()),
            }
            .into());
        }
        let levels: BTreeSet<&str> = labels.iter().map(|l| l.as_deref().unwrap()).collect();
        let levels: Vec<&str> = levels.into_iter().collect();
        n_batches.push(levels.len());
        codes.push(labels.iter().map(|l| levels.binary_search(&l.as_deref().unwrap()).unwrap() as u32).collect());
    }
    if n_batches.iter().all(|&b| b < 2) {
        return Err(Error::BadField {
            path: ad.path.clone(),
            field: format!("obs/{}", batch_key.join(",")),
            detail: "holds a single batch: there is nothing to integrate".into(),
            hint: Some("pass the column that separates the batches with --batch-key".into()),
        }
        .into());
    }
    drop(obs);
    Ok((codes, n_batches))
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
    if !m.implemented || !matches!(m.name.as_str(), "harmony" | "scvi_denovo") {
        return Err(Error::NotImplemented { name: m.name.clone(), version: env!("CARGO_PKG_VERSION") }.into());
    }
    let pipeline = executor::preflight(&args.exec)?;
    let opts = IntegrateOptions { embedding: args.embedding.clone(), batch_key: args.batch_key.clone(), theta: args.theta, scvi: args.scvi.clone(), batch_size: args.batch.batch_size };
    // the input is checked before any run folder exists; the task reads it again
    if m.name == "scvi_denovo" {
        super::integrate_scvi::check(&args.data, &opts)?;
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
    p
}

/// The task: run the method and write the output.
pub fn task(spec: &TaskSpec) -> anyhow::Result<TaskResult> {
    let o: IntegrateOptions = spec.options()?;
    if spec.method == "scvi_denovo" {
        return super::integrate_scvi::task(spec, &o);
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
    crate::commands::task::write_json_dict(&uns, "scfoundry_integrate", &prov).h5ctx(|| "writing uns/scfoundry_integrate".into())?;
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
