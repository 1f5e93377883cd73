//! The integration task of seurat (see `methods/seurat.rs`): anchors between the batches of the
//! expression matrix, the corrected expression, then PCA, written as `obsm['X_seurat']`.

use std::path::Path;
use std::time::Instant;

use serde_json::{json, Value};

use crate::anndata::write::{write_rows, PendingOutput};
use crate::anndata::AnnData;
use crate::cli::IntegrateArgs;
use crate::error::{Error, Hdf5Context};
use crate::progress::warn;
use crate::runner::{TaskResult, TaskSpec};
use crate::tasks::integrate::{batch_codes, batch_levels, IntegrateOptions};
use crate::tasks::method::Method;

/// The seurat task: log-normalised expression of the integration features, anchors, correction,
/// PCA (methods/seurat.rs), written as `obsm['X_seurat']`.
fn task(spec: &TaskSpec, o: &IntegrateOptions) -> anyhow::Result<TaskResult> {
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
                    (format!("holds {v} at cell {c} ({}), gene {gene}: log-normalised values are finite and non-negative", ad.obs_names[c]), "seurat needs log1p of counts per 10,000 (or raw counts without --skip-counts-check, also spelled --log-normalized)".to_string())
                } else {
                    (format!("holds {v} at cell {c} ({}), gene {gene}, which is not a raw count", ad.obs_names[c]), "pass --skip-counts-check (also spelled --log-normalized) if the matrix is already log-normalised, or --layer NAME to read a layer of raw counts".to_string())
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

/// seurat: the table's entry.
pub struct Seurat;

impl Method for Seurat {
    fn integrates(&self) -> bool {
        true
    }

    fn check_integrate_options(&self, args: &IntegrateArgs) -> anyhow::Result<()> {
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
        Ok(())
    }

    fn check_integrate_data(&self, data: &Path, opts: &IntegrateOptions) -> anyhow::Result<()> {
        let ad = AnnData::open(data)?;
        if ad.n_obs == 0 {
            return Err(Error::ZeroCells { path: ad.path.clone(), n_vars: ad.n_vars }.into());
        }
        batch_codes(&ad, &opts.batch_key)?;
        ad.matrix(opts.layer.as_deref())?;
        Ok(())
    }

    fn integrate(&self, spec: &TaskSpec) -> Option<anyhow::Result<TaskResult>> {
        Some(spec.options().map_err(Into::into).and_then(|o: IntegrateOptions| task(spec, &o)))
    }
}
