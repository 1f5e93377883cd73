//! `scfoundry integrate --method harmony`: correct batch effects in an embedding.
//!
//! Reads `obsm[--embedding]` and the batch column(s), runs the method, and writes a copy of the
//! input with `obsm['X_<method>']` and `uns['scfoundry_integrate']` (provenance).

use std::collections::BTreeSet;
use std::time::Instant;

use serde_json::{json, Value};

use crate::anndata::write::{write_rows, PendingOutput};
use crate::anndata::AnnData;
use crate::cli::IntegrateArgs;
use crate::commands::embed::default_output;
use crate::commands::ExitStatus;
use crate::error::{Error, Hdf5Context};
use crate::methods::harmony::{harmonize, HarmonyError, HarmonyOptions};
use crate::progress::warn;
use crate::registry::Kind;
use crate::settings::Settings;

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
    if !m.implemented || m.name != "harmony" {
        return Err(Error::NotImplemented { name: m.name.clone(), version: env!("CARGO_PKG_VERSION") }.into());
    }
    let ad = AnnData::open(&args.data)?;
    if ad.n_obs == 0 {
        return Err(Error::ZeroCells { path: ad.path.clone(), n_vars: ad.n_vars }.into());
    }
    let (z, n, d) = ad.dense_entry("obsm", &args.embedding)?;
    if n != ad.n_obs {
        return Err(Error::BadField { path: ad.path.clone(), field: format!("obsm/{}", args.embedding), detail: format!("has {n} rows but the data has {} cells", ad.n_obs), hint: None }.into());
    }
    if let Some(i) = z.iter().position(|v| !v.is_finite()) {
        return Err(Error::BadField {
            path: ad.path.clone(),
            field: format!("obsm/{}", args.embedding),
            detail: format!("holds a non-finite value at cell {} ({})", i / d, ad.obs_names[i / d]),
            hint: Some("recompute the embedding; Harmony needs finite coordinates".into()),
        }
        .into());
    }
    let obs = ad.obs()?;
    let mut codes: Vec<Vec<u32>> = Vec::new();
    let mut n_batches = Vec::new();
    for key in &args.batch_key {
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
            field: format!("obs/{}", args.batch_key.join(",")),
            detail: "holds a single batch: there is nothing to integrate".into(),
            hint: Some("pass the column that separates the batches with --batch-key".into()),
        }
        .into());
    }
    let mut opts = HarmonyOptions { seed: args.seed, ..HarmonyOptions::default() };
    if let Some(t) = args.theta {
        opts.theta = vec![t];
    }
    let started = Instant::now();
    let res = harmonize(&z, n, d, &codes, &opts, None).map_err(|e| match e {
        HarmonyError::Input(msg) => anyhow::Error::from(Error::BadOption { option: "--batch-key / --theta".into(), detail: msg, hint: None }),
        other => anyhow::Error::from(other),
    })?;
    let secs = started.elapsed().as_secs_f64();

    let out_path = match (&args.out, args.in_place) {
        (_, true) => args.data.clone(),
        (Some(o), false) => o.clone(),
        (None, false) => default_output(&args.data, &m.name),
    };
    if !args.in_place && std::fs::canonicalize(&out_path).ok() == std::fs::canonicalize(&args.data).ok() && out_path.exists() {
        return Err(Error::BadOption { option: "--out".into(), detail: format!("{} is the input file", out_path.display()), hint: Some("pass --in-place to replace the input on purpose".into()) }.into());
    }
    drop(obs);
    let out = PendingOutput::create(&args.data, &out_path)?;
    let key = format!("X_{}", m.name);
    let ds = out.create_obsm(&key, n, d)?;
    write_rows(&ds, 0, &res.z_corr, d)?;
    drop(ds);
    let uns = crate::anndata::h5util::require_dict(out.file(), "uns").h5ctx(|| "creating uns".into())?;
    let mut prov = serde_json::Map::new();
    prov.insert("tool".into(), json!("scfoundry"));
    prov.insert("version".into(), json!(env!("CARGO_PKG_VERSION")));
    prov.insert("method".into(), json!(m.name));
    prov.insert("embedding".into(), json!(args.embedding));
    prov.insert("obsm_key".into(), json!(key));
    prov.insert("batch_key".into(), json!(args.batch_key.join(",")));
    prov.insert("seed".into(), json!(args.seed));
    prov.insert("theta".into(), json!(opts.theta.first().copied().unwrap_or(2.0) as f64));
    prov.insert("iterations".into(), json!(res.iterations));
    prov.insert("converged".into(), json!(res.converged));
    prov.insert("clusters".into(), json!(res.n_clusters));
    prov.insert("date".into(), json!(chrono::Local::now().to_rfc3339()));
    prov.insert("command_line".into(), Value::String(std::env::args().collect::<Vec<_>>().join(" ")));
    crate::commands::task::write_json_dict(&uns, "scfoundry_integrate", &prov).h5ctx(|| "writing uns/scfoundry_integrate".into())?;
    drop(uns);
    out.commit()?;
    if !s.quiet {
        eprintln!(
            "wrote {} with obsm['{key}'] ({n} cells x {d}): harmony on obsm['{}'] over {} ({} batches), {} iterations{} in {secs:.1}s",
            out_path.display(),
            args.embedding,
            args.batch_key.join(", "),
            n_batches.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(" x "),
            res.iterations,
            if res.converged { "" } else { " (not converged: the iteration limit was reached)" },
        );
    }
    Ok(ExitStatus::Success)
}
