//! The `embed` and `transfer` tasks of PCA (see `methods/pca.rs`): in one process, or sharded
//! (fit, one projection per shard, merge); the reference's fit for label transfer.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::{json, Value};

use crate::anndata::write::{write_rows, PendingOutput};
use crate::anndata::AnnData;
use crate::error::{Error, Result};
use crate::progress::reporter;
use crate::runner::{Step, TaskResult, TaskSpec};
use crate::tasks::method::{self as method, Method};
use crate::anndata::h5util::{require_dict, set_encoding, write_array_f64};
use crate::error::Hdf5Context;
use crate::methods::pca::{self, Names, PcaFit, PcaOptions};
use crate::tasks::runtime::{provenance, write_f32_file, write_json_dict};

/// The data opened and checked, the matrix, the options in effect and notes for the user.
struct Loaded {
    ad: AnnData,
    x: crate::anndata::Matrix,
    opts: PcaOptions,
    notes: Vec<String>,
}

fn load(spec: &TaskSpec) -> Result<Loaded> {
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let mut notes = Vec::new();
    if x.format == "csc" {
        notes.push(format!("{} is stored as CSC, which was converted to CSR in memory; store CSR to stream with flat memory", x.field));
    }
    let p: Params = method::task_params(spec)?;
    let opts = PcaOptions {
        n_comps: p.n_comps,
        n_top_genes: p.n_top_genes,
        seed: spec.seed,
        ..PcaOptions::default()
    };
    if opts.n_top_genes > ad.n_vars {
        notes.push(format!("--n-top-genes {} exceeds the {} genes in the data; all genes with finite dispersion are used", opts.n_top_genes, ad.n_vars));
    }
    Ok(Loaded { ad, x, opts, notes })
}

/// The folder a sharded run's steps share.
fn work_dir(spec: &TaskSpec) -> Result<PathBuf> {
    let w = spec.work.clone().ok_or_else(|| Error::BadOption {
        option: "task spec".into(),
        detail: "a sharded step needs a `work` folder".into(),
        hint: None,
    })?;
    std::fs::create_dir_all(&w).map_err(|e| Error::Io { path: w.clone(), source: e })?;
    Ok(w)
}

pub fn fit_path(work: &Path) -> PathBuf {
    work.join("pca_fit.json")
}

/// Shard `i`'s block of the embedding: raw little-endian f32, rows x n_comps.
pub fn shard_path(work: &Path, shard: usize) -> PathBuf {
    work.join(format!("X_pca.shard{shard}.f32"))
}

/// The whole embedding in one process: fit, project straight into the output, write.
fn embed_pca(spec: &TaskSpec) -> Result<TaskResult> {
    let rep = reporter(!spec.progress);
    let l = load(spec)?;
    let names = Names { obs: &l.ad.obs_names, var: &l.ad.var_names };
    let fit = pca::fit(&l.x, &names, &l.opts, rep.as_ref())?;
    let nc = fit.variance.len();
    let clock = std::time::Instant::now();
    let out = PendingOutput::create(&spec.data, &spec.out)?;
    let copy_s = clock.elapsed().as_secs_f64();
    let ds = out.create_obsm(OBSM_KEY, l.ad.n_obs, nc)?;
    pca::transform(&l.x, &fit, &l.opts, rep.as_ref(), |start, rows| write_rows(&ds, start, rows, nc))?;
    drop(ds);
    let project_s = clock.elapsed().as_secs_f64() - copy_s;
    let mut result = finish_output(spec, out, &l, &fit)?;
    let mut phases: Vec<(String, f64)> = fit.timings.clone();
    phases.push(("copy input".into(), copy_s));
    phases.push(("projection".into(), project_s));
    phases.push(("write rest".into(), clock.elapsed().as_secs_f64() - copy_s - project_s));
    report_phases(&phases);
    result.phases = phases;
    Ok(result)
}

/// With $SCFOUNDRY_PROFILE set, print each phase's seconds.
fn report_phases(phases: &[(String, f64)]) {
    if std::env::var_os(crate::env::EnvVars::PROFILE).is_some() {
        for (k, v) in phases {
            eprintln!("profile: {k:<16} {v:.3}s");
        }
    }
}

/// Step 1 of a sharded run: passes 1-2 and the eigenvectors on the whole data; save the fit.
fn fit_pca(spec: &TaskSpec) -> Result<TaskResult> {
    let rep = reporter(!spec.progress);
    let l = load(spec)?;
    let names = Names { obs: &l.ad.obs_names, var: &l.ad.var_names };
    let fit = pca::fit(&l.x, &names, &l.opts, rep.as_ref())?;
    let work = work_dir(spec)?;
    fit.save(&fit_path(&work))?;
    report_phases(&fit.timings);
    Ok(TaskResult { output: Some(fit_path(&work)), obsm_key: None, n_obs: l.ad.n_obs, dim: fit.variance.len(), notes: l.notes, phases: fit.timings, ..Default::default() })
}

/// Step 2, one per shard: pass 3 over rows `start..end`, written as raw f32.
fn project_pca(spec: &TaskSpec, shard: usize, start: usize, end: usize) -> Result<TaskResult> {
    if std::env::var(crate::env::EnvVars::FAIL_SHARD).ok().and_then(|v| v.parse::<usize>().ok()) == Some(shard) {
        return Err(Error::BadOption {
            option: crate::env::EnvVars::FAIL_SHARD.into(),
            detail: format!("shard {shard} fails on purpose"),
            hint: Some(format!("unset {} (it exists to test failure handling)", crate::env::EnvVars::FAIL_SHARD)),
        });
    }
    let rep = reporter(!spec.progress);
    let l = load(spec)?;
    let work = work_dir(spec)?;
    let fit = PcaFit::load(&fit_path(&work))?;
    check_fit(spec, &l, &fit)?;
    let nc = fit.variance.len();
    let path = shard_path(&work, shard);
    let tmp = path.with_extension("f32.tmp");
    let mut buf: Vec<u8> = Vec::with_capacity(end.saturating_sub(start) * nc * 4);
    pca::transform_rows(&l.x, &fit, &l.opts, rep.as_ref(), start, end, |_, rows| {
        buf.extend(rows.iter().flat_map(|v| v.to_le_bytes()));
        Ok(())
    })?;
    std::fs::write(&tmp, &buf).map_err(|e| Error::Io { path: tmp.clone(), source: e })?;
    std::fs::rename(&tmp, &path).map_err(|e| Error::Io { path: path.clone(), source: e })?;
    Ok(TaskResult { output: Some(path), obsm_key: None, n_obs: end - start, dim: nc, notes: vec![], phases: vec![], ..Default::default() })
}

/// Step 3: the output from the fit and the shard files, exactly as `embed_pca` writes it.
fn merge_pca(spec: &TaskSpec, shards: &[(usize, usize)]) -> Result<TaskResult> {
    let l = load(spec)?;
    let work = work_dir(spec)?;
    let fit = PcaFit::load(&fit_path(&work))?;
    check_fit(spec, &l, &fit)?;
    let nc = fit.variance.len();
    let covered: usize = shards.iter().map(|(s, e)| e - s).sum();
    if covered != l.ad.n_obs || shards.windows(2).any(|w| w[0].1 != w[1].0) || shards.first().map(|s| s.0) != Some(0) {
        return Err(Error::BadOption { option: "shards".into(), detail: format!("the shards {shards:?} do not cover the {} cells in order", l.ad.n_obs), hint: None });
    }
    let out = PendingOutput::create(&spec.data, &spec.out)?;
    let ds = out.create_obsm(OBSM_KEY, l.ad.n_obs, nc)?;
    for (i, &(start, end)) in shards.iter().enumerate() {
        let path = shard_path(&work, i);
        let bytes = std::fs::read(&path).map_err(|e| Error::Io { path: path.clone(), source: e })?;
        if bytes.len() != (end - start) * nc * 4 {
            return Err(Error::BadField {
                path: path.clone(),
                field: format!("shard {i}"),
                detail: format!("holds {} bytes, expected {} ({} rows x {nc} x 4)", bytes.len(), (end - start) * nc * 4, end - start),
                hint: Some("the shard's task did not finish; run it again".into()),
            });
        }
        let rows: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        write_rows(&ds, start, &rows, nc)?;
    }
    drop(ds);
    let result = finish_output(spec, out, &l, &fit)?;
    // the blocks are in the output now; the fit stays as a record of the run
    for i in 0..shards.len() {
        let _ = std::fs::remove_file(shard_path(&work, i));
    }
    Ok(result)
}

/// A fit made for other data is refused.
fn check_fit(spec: &TaskSpec, l: &Loaded, fit: &PcaFit) -> Result<()> {
    if fit.n_obs != l.ad.n_obs || fit.hvg_genes.last().is_some_and(|&g| g >= l.ad.n_vars) {
        return Err(Error::BadField {
            path: spec.data.clone(),
            field: "X".into(),
            detail: format!("the saved fit is for {} cells, the data has {}", fit.n_obs, l.ad.n_obs),
            hint: Some("run the fit step again on this data".into()),
        });
    }
    Ok(())
}

const OBSM_KEY: &str = "X_pca";

/// varm['PCs'], uns['pca'] as scanpy writes them, uns['scfoundry'] provenance; then rename into place.
fn finish_output(spec: &TaskSpec, out: PendingOutput, l: &Loaded, fit: &PcaFit) -> Result<TaskResult> {
    let ad = &l.ad;
    let nc = fit.variance.len();
    let key = OBSM_KEY;
    let f = out.file();
    // varm['PCs']: loadings for every gene, zero outside the HVGs (as scanpy with mask_var)
    let varm = require_dict(f, "varm").h5ctx(|| "creating varm".into())?;
    if varm.link_exists("PCs") {
        varm.unlink("PCs").h5ctx(|| "replacing varm/PCs".into())?;
    }
    let m = fit.hvg_genes.len();
    let mut pcs = vec![0f32; ad.n_vars * nc];
    for (h, &gene) in fit.hvg_genes.iter().enumerate() {
        for c in 0..nc {
            pcs[gene * nc + c] = fit.components[c * m + h] as f32;
        }
    }
    let pcs_ds = varm.new_dataset::<f32>().shape([ad.n_vars, nc]).create("PCs").h5ctx(|| "creating varm/PCs".into())?;
    pcs_ds.write_raw(&pcs).h5ctx(|| "writing varm/PCs".into())?;
    set_encoding(&pcs_ds, "array", "0.2.0").h5ctx(|| "tagging varm/PCs".into())?;

    let uns = require_dict(f, "uns").h5ctx(|| "creating uns".into())?;
    // uns['pca'] as scanpy writes it
    let mut pca_params = serde_json::Map::new();
    pca_params.insert("zero_center".into(), json!(true));
    pca_params.insert("use_highly_variable".into(), json!(true));
    pca_params.insert("mask_var".into(), json!("highly_variable"));
    if uns.link_exists("pca") {
        uns.unlink("pca").h5ctx(|| "replacing uns/pca".into())?;
    }
    let pca_g = require_dict(&uns, "pca").h5ctx(|| "creating uns/pca".into())?;
    write_array_f64(&pca_g, "variance", &fit.variance).h5ctx(|| "writing uns/pca/variance".into())?;
    write_array_f64(&pca_g, "variance_ratio", &fit.variance_ratio).h5ctx(|| "writing uns/pca/variance_ratio".into())?;
    write_json_dict(&pca_g, "params", &pca_params).h5ctx(|| "writing uns/pca/params".into())?;

    // uns['scfoundry']: provenance
    let mut prov = provenance(spec, key, &l.x.field);
    let mut params = spec.params.clone();
    params.insert("target_sum".into(), json!(l.opts.target_sum as f64));
    params.insert("hvg_flavor".into(), json!("seurat")); // not a method name
    params.insert("n_hvg_selected".into(), json!(m));
    prov.insert("parameters".into(), Value::Object(params));
    prov.insert("weights".into(), json!({}));
    write_json_dict(&uns, "scfoundry", &prov).h5ctx(|| "writing uns/scfoundry".into())?;
    drop(uns);
    drop(varm);
    out.commit()?;
    Ok(TaskResult { output: Some(spec.out.clone()), obsm_key: Some(key.into()), n_obs: ad.n_obs, dim: nc, notes: l.notes.clone(), phases: vec![], ..Default::default() })
}

/// The fit of a transfer: PCA fitted on the reference (`spec.data`), saved to `spec.out`.
fn transfer_fit_pca(spec: &TaskSpec) -> Result<TaskResult> {
    let rep = reporter(!spec.progress);
    let l = load(spec)?;
    let names = Names { obs: &l.ad.obs_names, var: &l.ad.var_names };
    let fit = pca::fit(&l.x, &names, &l.opts, rep.as_ref())?;
    if let Some(d) = spec.out.parent() {
        std::fs::create_dir_all(d).map_err(|e| Error::Io { path: d.into(), source: e })?;
    }
    fit.save(&spec.out)?;
    Ok(TaskResult { output: Some(spec.out.clone()), obsm_key: None, n_obs: l.ad.n_obs, dim: fit.variance.len(), notes: l.notes, phases: fit.timings, ..Default::default() })
}

/// Project `spec.data` (the reference or the query) with the reference's fit, genes aligned
/// by var name; write the embedding to `spec.out`.
fn transfer_embed_pca(spec: &TaskSpec) -> Result<TaskResult> {
    let rep = reporter(!spec.progress);
    let l = load(spec)?;
    let param_path = |k: &str| spec.params.get(k).and_then(Value::as_str).map(PathBuf::from);
    let missing = |k: &str| Error::BadOption { option: "task spec".into(), detail: format!("a transfer task needs `{k}`"), hint: None };
    let reference = param_path("reference").ok_or_else(|| missing("reference"))?;
    let fit_file = param_path("fit").ok_or_else(|| missing("fit"))?;
    let fit = PcaFit::load(&fit_file)?;
    let ref_var = if reference == spec.data { l.ad.var_names.clone() } else { AnnData::open(&reference)?.var_names };
    let map = pca::align_genes(&fit, &ref_var, &l.ad.var_names);
    let m = fit.hvg_genes.len();
    let min = spec.params.get("min_gene_overlap").and_then(Value::as_f64).unwrap_or(DEFAULT_MIN_GENE_OVERLAP);
    let present = m - map.missing.len();
    if map.present_fraction(m) < min {
        return Err(Error::GeneOverlap { reference, query: spec.data.clone(), present, total: m, min_fraction: min, example: map.missing.first().cloned().unwrap_or_default() });
    }
    let mut notes = l.notes.clone();
    if !map.missing.is_empty() {
        let shown: Vec<&str> = map.missing.iter().take(5).map(String::as_str).collect();
        let msg = format!(
            "{} of the reference's {m} highly variable genes are missing from {} and count as zero there (e.g. {}{})",
            map.missing.len(),
            spec.data.display(),
            shown.join(", "),
            if map.missing.len() > shown.len() { ", ..." } else { "" }
        );
        crate::progress::warn(&msg);
        notes.push(msg);
    }
    let names = Names { obs: &l.ad.obs_names, var: &l.ad.var_names };
    let sf = pca::size_factors(&l.x, &names, &l.opts)?;
    let nc = fit.variance.len();
    let mut emb = vec![0f32; l.ad.n_obs * nc];
    pca::transform_mapped(&l.x, &fit, &map, &sf, &l.opts, rep.as_ref(), |start, rows| {
        emb[start * nc..start * nc + rows.len()].copy_from_slice(rows);
        Ok(())
    })?;
    write_f32_file(&spec.out, &emb)?;
    Ok(TaskResult { output: Some(spec.out.clone()), obsm_key: Some("X_pca".into()), n_obs: l.ad.n_obs, dim: nc, notes, phases: vec![], ..Default::default() })
}

/// Share of the reference's highly variable genes the query must have (by var name).
pub const DEFAULT_MIN_GENE_OVERLAP: f64 = 0.5;

/// PCA's options, from `methods/pca.toml`.
#[derive(Debug, Deserialize)]
pub struct Params {
    pub n_comps: usize,
    pub n_top_genes: usize,
}

/// PCA: the table's entry.
pub struct Pca;

impl Method for Pca {
    fn transfers(&self) -> bool {
        true
    }

    fn fits_before_shards(&self) -> bool {
        true
    }

    fn fits_reference(&self) -> bool {
        true
    }

    fn finetunes(&self) -> bool {
        true
    }

    fn embed(&self, spec: &TaskSpec, _task_dir: &Path, step: &Step) -> Option<Result<TaskResult>> {
        Some(match step {
            Step::Embed => embed_pca(spec),
            Step::Fit => fit_pca(spec),
            Step::Project { shard, start, end } => project_pca(spec, *shard, *start, *end),
            Step::Merge { shards } => merge_pca(spec, shards),
        })
    }

    fn transfer(&self, spec: &TaskSpec, _task_dir: &Path, step: &Step) -> Option<Result<TaskResult>> {
        match step {
            Step::Fit => Some(transfer_fit_pca(spec)),
            Step::Embed => Some(transfer_embed_pca(spec)),
            _ => None,
        }
    }
}
