//! `scfoundry finetune`: train a classification head on a method's cell embedding (the
//! methods whose table entry gives a backbone, [`crate::tasks::method::Backbone`]), optionally
//! with the last N encoder layers of a transformer, and predict labels for new data.
//!
//! Training writes, into `--out DIR`: `model.safetensors` (`head.weight`, `head.bias` and the
//! unfrozen layers' tensors under their checkpoint names), `finetune.json` (provenance: method,
//! base weights and their sha256, classes in order, seed, options, per-epoch curves, best
//! epoch), `curves.tsv` and `curves.svg`/`.png`; pca adds its fit (`pca_fit.json`,
//! `pca_var_names.json`), since the head sits on that projection. `--predict new.h5ad` (after
//! training, or with `--model DIR`) writes a copy of new.h5ad with `obs['<label>_pred']` and
//! `obs['<label>_pred_confidence']`. The work is one task (`task`), run where `--executor`
//! says; the input is checked here first. The training code is `nn/finetune.rs`; each
//! method's backbone is in its adapter (`tasks/embed/<name>.rs`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::anndata::write::PendingOutput;
use crate::anndata::AnnData;
use crate::cli::FinetuneArgs;
use crate::commands::embed::resolve_method_params;
use crate::tasks::runtime::TaskDevice;
use crate::commands::ExitStatus;
use crate::error::{Error, Hdf5Context, Result};
use crate::executor::{self, nextflow};
use crate::nn::finetune::{self as ft, Cached, Features, Head, LoadHook, TrainOptions};
use crate::tasks::method::{Backbone, BackboneFrom, BackboneLoad, LoadedBackbone};
use crate::progress::{reporter, warn};
use crate::runner::{options_params, TaskResult, TaskSpec};
use crate::settings::Settings;
use crate::weights;

/// The methods `finetune` trains a head on (the table's entries that say so).
pub fn methods() -> Vec<&'static str> {
    crate::tasks::table::names(|m| m.finetunes())
}
pub const MODEL_FILE: &str = "model.safetensors";
pub const PROVENANCE_FILE: &str = "finetune.json";

/// What the task needs besides data, output, method and seed (the spec's params).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FinetuneOptions {
    pub label_key: String,
    pub epochs: u64,
    pub unfreeze_layers: u64,
    pub lr: f64,
    pub weight_decay: f64,
    pub patience: u64,
    pub val_fraction: f64,
    pub batch_size: u64,
    pub predict_batch_size: u64,
    /// Predict this file after training (or with `model`).
    pub predict: Option<PathBuf>,
    pub predict_out: Option<PathBuf>,
    /// Predict only, with the model in this folder (`spec.data` is the file to predict).
    pub model: Option<PathBuf>,
    /// The method's knobs after defaults (as embed records them).
    pub method_params: Map<String, Value>,
}

/// `finetune.json`, as far as prediction reads it back.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Saved {
    pub method: String,
    pub label_key: String,
    pub classes: Vec<String>,
    pub dim: usize,
    pub unfreeze_layers: u64,
    pub method_params: Map<String, Value>,
    pub seed: u64,
}

/// Default output folder: `<data stem>.<method>.finetune` beside the data (the Nextflow
/// module's name).
pub fn default_out(data: &Path, method: &str) -> PathBuf {
    let stem = data.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "data".into());
    data.with_file_name(format!("{stem}.{method}.finetune"))
}

/// Default prediction output: `<stem>.finetune.h5ad` beside the file.
/// `--predict-out` must not be an input: finetune never modifies its inputs.
fn refuse_overwriting(inputs: &[&Path], out: &Path) -> Result<()> {
    crate::paths::check_output_file(out, "--predict-out")?;
    for input in inputs {
        if crate::paths::same_file(input, out) {
            return Err(Error::BadOption {
                option: "--predict-out".into(),
                detail: format!("{} is the input file {}; finetune never modifies its inputs", out.display(), input.display()),
                hint: Some("choose another --predict-out (default: <predict>.finetune.h5ad beside it)".into()),
            });
        }
    }
    Ok(())
}

pub fn default_predict_out(data: &Path) -> PathBuf {
    let stem = data.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "data".into());
    data.with_file_name(format!("{stem}.finetune.h5ad"))
}

/// The labelled cells: their rows, class codes and the classes (sorted).
pub struct Labels {
    pub cells: Vec<usize>,
    pub codes: Vec<u32>,
    pub classes: Vec<String>,
    pub unlabelled: usize,
}

/// Read and check the label column: present, categorical/string/integer, two classes or
/// more, and (categorical) at least as many labelled cells as categories.
pub fn read_labels(ad: &AnnData, key: &str) -> Result<Labels> {
    use crate::anndata::dataframe::Column;
    let obs = ad.obs()?;
    let field = format!("obs/{key}");
    let Some(col) = obs.column(key) else {
        let have = obs.names();
        return Err(Error::BadField {
            path: ad.path.clone(),
            field,
            detail: format!("is missing: there is no label column `{key}`"),
            hint: Some(if have.is_empty() { "the file has no obs columns: add the labels first (`adata.obs['cell_type'] = ...`)".into() } else { format!("pass --label-key with one of the obs columns of this file: {}", have.join(", ")) }),
        });
    };
    let values = col.as_labels().ok_or_else(|| Error::BadField {
        path: ad.path.clone(),
        field: field.clone(),
        detail: format!("is a {} column; labels must be categorical, string or integer", col.kind()),
        hint: Some(format!("convert it first, e.g. `adata.obs['{key}'] = adata.obs['{key}'].astype(str).astype('category')`")),
    })?;
    let mut classes: Vec<String> = values.iter().flatten().cloned().collect();
    classes.sort();
    classes.dedup();
    let cells: Vec<usize> = (0..values.len()).filter(|&i| values[i].is_some()).collect();
    if let Column::Categorical { categories, .. } = col {
        if cells.len() < categories.len() {
            return Err(Error::BadField {
                path: ad.path.clone(),
                field,
                detail: format!("has {} labelled cell(s) but {} categories: fewer cells than classes", cells.len(), categories.len()),
                hint: Some(format!("label more cells, or drop unused categories (`adata.obs['{key}'] = adata.obs['{key}'].cat.remove_unused_categories()`)")),
            });
        }
    }
    if classes.len() < 2 {
        return Err(Error::BadField {
            path: ad.path.clone(),
            field,
            detail: match classes.first() {
                Some(c) => format!("holds one label only ({c:?} on {} cells): a classifier needs two classes or more", cells.len()),
                None => "has no labelled cell".into(),
            },
            hint: Some("fine-tune on data with several labels in --label-key".into()),
        });
    }
    let codes = cells.iter().map(|&i| classes.binary_search(values[i].as_ref().unwrap()).unwrap() as u32).collect();
    Ok(Labels { unlabelled: values.len() - cells.len(), cells, codes, classes })
}

fn check_method(s: &Settings, name: &str) -> anyhow::Result<crate::registry::Method> {
    let m = s.registry.get(name)?.clone();
    if !methods().contains(&m.name.as_str()) || !m.implemented {
        return Err(Error::BadOption {
            option: "--method".into(),
            detail: format!("{} cannot be fine-tuned in this version", m.name),
            hint: Some(format!("fine-tune one of: {}", methods().join(", "))),
        }
        .into());
    }
    Ok(m)
}

/// Check the weights a method needs before any run folder exists.
fn preflight_weights(s: &Settings, method: &str, params: &Map<String, Value>, data: &Path) -> anyhow::Result<()> {
    let Some(entry) = crate::tasks::table::get(method) else { return Ok(()) };
    let model_dir = params.get("model_dir").and_then(Value::as_str).filter(|s| !s.is_empty()).map(Path::new);
    entry.check(&crate::tasks::method::Preflight { method, weights_dir: &s.weights_dir, params, model_dir, data })?;
    Ok(())
}

/// More `--unfreeze-layers` than the model runs is a user error before any run folder exists
/// (the loading hook checks again in the task). A config it cannot read is left to the task.
fn preflight_layers(s: &Settings, method: &str, params: &Map<String, Value>, unfreeze: u64) -> anyhow::Result<()> {
    if unfreeze == 0 {
        return Ok(());
    }
    let Some(entry) = crate::tasks::table::get(method) else { return Ok(()) };
    let Some(crate::tasks::method::LayerCount { path, key, left_out }) = entry.layer_count(&s.weights_dir, params)? else {
        return Ok(());
    };
    let Some(n) = std::fs::read_to_string(&path).ok().and_then(|t| serde_json::from_str::<Value>(&t).ok()).and_then(|v| v.get(key).and_then(Value::as_u64)) else {
        return Ok(());
    };
    let runs = n.saturating_sub(left_out);
    if unfreeze > runs {
        let why = if left_out > 0 { format!(" (the {n} of {} less the last, which --emb-layer -1 does not read)", path.display()) } else { format!(" ({key} in {})", path.display()) };
        return Err(Error::BadOption {
            option: "--unfreeze-layers".into(),
            detail: format!("{unfreeze} layers asked, but {method} runs {runs} encoder layers{why}"),
            hint: Some(format!("pass --unfreeze-layers {runs} or fewer{}", if left_out > 0 { " (or --emb-layer 0 to run and train the last layer too)" } else { "" })),
        }
        .into());
    }
    Ok(())
}

fn resolve_device(s: &Settings, method: &str, a: &FinetuneArgs) -> anyhow::Result<crate::gpu::DeviceSpec> {
    let spec = s.device_spec(&a.device)?;
    if !s.registry.get(method)?.cuda {
        if spec.kind == crate::gpu::DeviceKind::Cuda {
            warn(&format!("{method} runs on the CPU only; --device cuda is ignored"));
        }
        return Ok(crate::gpu::DeviceSpec::default());
    }
    if spec.kind == crate::gpu::DeviceKind::Cuda && a.exec.executor == crate::cli::ExecutorKind::Local {
        crate::gpu::preflight(&spec).map_err(Error::Gpu)?;
    }
    Ok(spec)
}

pub fn run(s: &Settings, a: &FinetuneArgs) -> anyhow::Result<ExitStatus> {
    let pipeline = executor::preflight(&a.exec)?;
    if let Some(model) = &a.model {
        return run_predict_only(s, a, model, pipeline);
    }
    let (method, data, label_key) = (a.method.clone().unwrap_or_default(), a.data.clone().unwrap_or_default(), a.label_key.clone().unwrap_or_default());
    let m = check_method(s, &method)?;
    let mut params = resolve_method_params(&s.registry, &m, "finetune", &a.batch, &a.knobs, crate::commands::embed::on_gpu(&m, &a.device))?;
    let honours = m.honoured("finetune");
    let batch_size = params.remove("batch_size").and_then(|v| v.as_u64()).unwrap_or(64);
    let predict_batch_size = match a.predict_batch_size {
        Some(p) if honours.iter().any(|o| o == "--predict-batch-size") => p,
        Some(_) => {
            warn(&format!("{} does not honour --predict-batch-size when fine-tuning; ignored", m.name));
            batch_size * 4
        }
        None => batch_size * 4,
    };
    let unfreezes = crate::tasks::table::get(&m.name).is_some_and(|e| e.unfreezes());
    if a.unfreeze_layers > 0 && !unfreezes {
        warn(&format!("{} has no encoder layers to unfreeze: --unfreeze-layers is not honoured, only the head is trained", m.name));
    }
    if a.predict.is_some() && a.exec.executor == crate::cli::ExecutorKind::Nextflow {
        return Err(Error::BadOption {
            option: "--predict".into(),
            detail: "the pipeline's FINETUNE process trains only".into(),
            hint: Some("train with --executor nextflow, then predict with `scfoundry finetune --model DIR --predict FILE`".into()),
        }
        .into());
    }
    preflight_weights(s, &m.name, &params, &data)?;
    preflight_layers(s, &m.name, &params, a.unfreeze_layers)?;
    // the input is checked before any run folder exists; the task reads it again
    let ad = AnnData::open(&data)?;
    ad.check_usable()?;
    let labels = read_labels(&ad, &label_key)?;
    if let Some(w) = crate::tasks::counts::check(&m, &ad, None, a.skip_counts_check)? {
        warn(&w);
    }
    drop((ad, labels));
    if let Some(p) = &a.predict {
        let pad = AnnData::open(p)?;
        pad.check_usable()?;
        if let Some(w) = crate::tasks::counts::check(&m, &pad, None, a.skip_counts_check)? {
            warn(&w);
        }
    }
    let out = a.out.clone().unwrap_or_else(|| default_out(&data, &m.name));
    if out.is_file() {
        return Err(Error::BadOption { option: "--out".into(), detail: format!("{} is a file; finetune writes a folder", out.display()), hint: Some("choose a folder name for --out".into()) }.into());
    }
    if let Some(p) = &a.predict {
        let inputs: Vec<&Path> = std::iter::once(p.as_path()).chain(a.data.as_deref()).collect();
        refuse_overwriting(&inputs, &a.predict_out.clone().unwrap_or_else(|| default_predict_out(p)))?;
    }
    let opts = FinetuneOptions {
        label_key: label_key.clone(),
        epochs: a.epochs,
        unfreeze_layers: if unfreezes { a.unfreeze_layers } else { 0 },
        lr: a.lr,
        weight_decay: a.weight_decay,
        patience: a.patience,
        val_fraction: a.val_fraction,
        batch_size,
        predict_batch_size,
        predict: a.predict.as_ref().map(std::path::absolute).transpose()?,
        predict_out: a.predict.as_ref().map(|p| std::path::absolute(a.predict_out.clone().unwrap_or_else(|| default_predict_out(p)))).transpose()?,
        model: None,
        method_params: params,
    };
    let device = resolve_device(s, &m.name, a)?;
    let run = executor::create_run(s, &a.exec, &out, &m.name)?;
    let tag = data.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    let spec = TaskSpec {
        weights_dir: Some(std::path::absolute(&s.weights_dir)?),
        gpus: crate::commands::task_gpus(a.exec.executor, &a.gpu),
        device,
        ..TaskSpec::new(&run, format!("FINETUNE_{} ({tag})", m.name.to_uppercase()), "finetune", &m.name, &data, &out, a.seed, options_params(&opts), s.quiet, s.progress)?
    };
    let published = nextflow::outdir(&run).join("finetune").join(default_out(&spec.data, &m.name).file_name().unwrap_or_default());
    let params = nextflow_params(&spec, &opts, &run);
    executor::run_single(s, &a.exec, pipeline, &run, spec, params, &published)
}

fn run_predict_only(s: &Settings, a: &FinetuneArgs, model: &Path, pipeline: Option<nextflow::Pipeline>) -> anyhow::Result<ExitStatus> {
    if pipeline.is_some() {
        return Err(Error::BadOption { option: "--executor".into(), detail: "the Nextflow pipeline trains (FINETUNE); predicting with --model runs locally or with slurm".into(), hint: Some("use --executor local or slurm with --model".into()) }.into());
    }
    let saved = load_saved(model)?;
    let predict = a.predict.clone().expect("clap requires --predict with --model");
    AnnData::open(&predict)?.check_usable()?;
    let out = a.predict_out.clone().unwrap_or_else(|| default_predict_out(&predict));
    refuse_overwriting(&[&predict], &out)?;
    let label_key = a.label_key.clone().unwrap_or_else(|| saved.label_key.clone());
    let opts = FinetuneOptions {
        label_key,
        epochs: 0,
        unfreeze_layers: saved.unfreeze_layers,
        lr: 0.0,
        weight_decay: 0.0,
        patience: 0,
        val_fraction: 0.0,
        batch_size: a.batch.batch_size.unwrap_or(64),
        predict_batch_size: a.predict_batch_size.or(a.batch.batch_size).unwrap_or(256),
        predict: Some(std::path::absolute(&predict)?),
        predict_out: Some(std::path::absolute(&out)?),
        model: Some(std::path::absolute(model)?),
        method_params: saved.method_params.clone(),
    };
    let device = resolve_device(s, &saved.method, a)?;
    let run = executor::create_run(s, &a.exec, &out, &saved.method)?;
    let tag = predict.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    let spec = TaskSpec {
        weights_dir: Some(std::path::absolute(&s.weights_dir)?),
        gpus: crate::commands::task_gpus(a.exec.executor, &a.gpu),
        device,
        ..TaskSpec::new(&run, format!("PREDICT_{} ({tag})", saved.method.to_uppercase()), "finetune", &saved.method, &predict, &out, saved.seed, options_params(&opts), s.quiet, s.progress)?
    };
    executor::run_single(s, &a.exec, None, &run, spec, Vec::new(), Path::new(""))
}

/// The Nextflow parameters of a fine-tuning run (names as in nextflow_schema.json).
pub fn nextflow_params(spec: &TaskSpec, o: &FinetuneOptions, run: &crate::runner::Run) -> Vec<(String, String)> {
    let mut p = nextflow::task_params("finetune", Some(&spec.method), &spec.data, run, spec.seed);
    p.push(("label_key".into(), o.label_key.clone()));
    p.push(("batch_size".into(), o.batch_size.to_string()));
    p.push(("epochs".into(), o.epochs.to_string()));
    p.push(("unfreeze_layers".into(), o.unfreeze_layers.to_string()));
    p.push(("lr".into(), o.lr.to_string()));
    p.push(("weight_decay".into(), o.weight_decay.to_string()));
    p.push(("patience".into(), o.patience.to_string()));
    p.push(("val_fraction".into(), o.val_fraction.to_string()));
    p.push(("predict_batch_size".into(), o.predict_batch_size.to_string()));
    p
}

pub fn load_saved(dir: &Path) -> Result<Saved> {
    let path = dir.join(PROVENANCE_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::Io { path: path.clone(), source: e })?;
    serde_json::from_str(&text).map_err(|e| Error::BadField {
        path: path.clone(),
        field: "finetune.json".into(),
        detail: format!("is not a scfoundry fine-tuning record: {e}"),
        hint: Some("pass --model the --out folder of a `scfoundry finetune` run".into()),
    })
}

// ---- the backbone: what produces the features the head reads ----------------------------

/// The method's fine-tuning backbone, from the table.
fn load_backbone(spec: &TaskSpec, params: &Map<String, Value>, hook: &LoadHook, device: &Device, from: BackboneFrom) -> Result<LoadedBackbone> {
    let load = BackboneLoad { spec, params, hook, device, from };
    crate::tasks::table::get(&spec.method)
        .and_then(|m| m.backbone(&load))
        .unwrap_or_else(|| Err(Error::NotImplemented { name: format!("finetune {}", spec.method), version: env!("CARGO_PKG_VERSION") }))
}

/// With no trainable layer, run the model once over the usable cells and keep the embedding.
fn freeze<'a>(mut f: Box<dyn Features + 'a>, dim: usize, usable: &[bool], batch: usize, device: &Device, label: &str) -> Result<Box<dyn Features + 'a>> {
    if f.precomputed() {
        return Ok(f);
    }
    let rep = reporter(false);
    let cells: Vec<usize> = (0..usable.len()).filter(|&i| usable[i]).collect();
    let p = rep.step(label, cells.len() as u64, "cells");
    let mut rows = vec![0f32; usable.len() * dim];
    let ctx = |e: candle_core::Error| Error::Model { context: "embedding cells".into(), detail: e.to_string() };
    for chunk in cells.chunks(batch.max(1)) {
        let t = f.forward(chunk)?.detach().to_device(&Device::Cpu).map_err(ctx)?;
        let v = t.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(ctx)?;
        for (k, &i) in chunk.iter().enumerate() {
            rows[i * dim..(i + 1) * dim].copy_from_slice(&v[k * dim..(k + 1) * dim]);
        }
        p.inc(chunk.len() as u64);
    }
    p.finish();
    Ok(Box::new(Cached(Tensor::from_vec(rows, (usable.len(), dim), device).map_err(ctx)?)))
}

// ---- the task -----------------------------------------------------------------------------

/// The task: train (and predict), or predict with a saved model.
pub fn task(spec: &TaskSpec, task_dir: &Path) -> anyhow::Result<TaskResult> {
    let o: FinetuneOptions = spec.options()?;
    match &o.model {
        Some(dir) => predict_task(spec, &o, dir, task_dir),
        None => train_task(spec, &o, task_dir),
    }
}

fn save_tensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let ctx = |e: candle_core::Error| Error::Model { context: format!("writing {}", path.display()), detail: e.to_string() };
    let mut map = HashMap::new();
    for (k, t) in tensors {
        map.insert(k.clone(), t.to_device(&Device::Cpu).map_err(ctx)?);
    }
    let tmp = path.with_extension("safetensors.tmp");
    candle_core::safetensors::save(&map, &tmp).map_err(ctx)?;
    std::fs::rename(&tmp, path).map_err(|e| Error::Io { path: path.into(), source: e })
}

fn fmt_opt(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.6}")).unwrap_or_else(|| "NA".into())
}

fn train_task(spec: &TaskSpec, o: &FinetuneOptions, task_dir: &Path) -> anyhow::Result<TaskResult> {
    let started = Instant::now();
    let out = &spec.out;
    std::fs::create_dir_all(out).map_err(|e| Error::Io { path: out.clone(), source: e })?;
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let labels = read_labels(&ad, &o.label_key)?;
    let mut notes = Vec::new();
    if labels.unlabelled > 0 {
        notes.push(format!("{} of {} cells have no label in obs['{}'] and are left out of training", labels.unlabelled, ad.n_obs, o.label_key));
    }
    let dev = TaskDevice::start(spec)?;
    let device = dev.device.clone();
    let hook = LoadHook::new(o.unfreeze_layers as usize, HashMap::new());
    let loaded = load_backbone(spec, &o.method_params, &hook, &device, BackboneFrom::Training { data: &ad, out }).map_err(|e| dev.load_error(e, "loading the model's weights", task_dir))?;
    dev.mark_loaded();
    let LoadedBackbone { backbone: bb, base_dir, shas, files: extra_files, notes: loaded_notes } = loaded;
    notes.extend(loaded_notes);
    let dim = bb.dim();
    let (inp, usable) = bb.features(&ad, spec.seed, &device, true, &mut notes)?;
    let inp = if o.unfreeze_layers == 0 { freeze(inp, dim, &usable, o.predict_batch_size as usize, &device, &format!("{}: embed", spec.method))? } else { inp };
    // the labelled, usable cells: training indexes these
    let keep: Vec<usize> = (0..labels.cells.len()).filter(|&k| usable[labels.cells[k]]).collect();
    let rows: Vec<usize> = keep.iter().map(|&k| labels.cells[k]).collect();
    let codes: Vec<u32> = keep.iter().map(|&k| labels.codes[k]).collect();
    let split = ft::split(&codes, labels.classes.len(), o.val_fraction, spec.seed);
    if split.val.is_empty() && o.val_fraction > 0.0 {
        notes.push("no cell was held out for validation (too few cells per label): early stopping watches the training loss".into());
    }
    // the training code indexes 0..rows.len(); map to the file's rows
    struct Rows<'a, 'b> {
        inner: Box<dyn Features + 'a>,
        rows: &'b [usize],
    }
    impl Features for Rows<'_, '_> {
        fn forward(&mut self, cells: &[usize]) -> Result<Tensor> {
            let r: Vec<usize> = cells.iter().map(|&i| self.rows[i]).collect();
            self.inner.forward(&r)
        }
    }
    let mut feats = Rows { inner: inp, rows: &rows };
    let topts = TrainOptions {
        epochs: o.epochs as usize,
        batch_size: o.batch_size as usize,
        predict_batch_size: o.predict_batch_size as usize,
        lr: o.lr,
        weight_decay: o.weight_decay,
        patience: o.patience as usize,
        seed: spec.seed,
    };
    let layers = hook.vars();
    let quiet = spec.quiet || !spec.progress;
    let trained = ft::train(&mut feats, dim, &codes, labels.classes.len(), &split, &layers, &topts, &device, |s| {
        if !quiet {
            eprintln!(
                "epoch {:>3}: train loss {:.4} acc {:.3}{}",
                s.epoch,
                s.train_loss,
                s.train_accuracy,
                match (s.val_loss, s.val_accuracy) {
                    (Some(l), Some(a)) => format!(", val loss {l:.4} acc {a:.3}"),
                    _ => String::new(),
                }
            );
        }
    })?;
    drop(feats);
    // model.safetensors: the head and the unfrozen layers of the best epoch
    let mut tensors = vec![("head.weight".to_string(), trained.head_w.clone()), ("head.bias".to_string(), trained.head_b.clone())];
    tensors.extend(trained.layers.iter().cloned());
    let model_path = out.join(MODEL_FILE);
    save_tensors(&model_path, &tensors)?;
    // curves.tsv and the figure
    let mut tsv = String::from("epoch\ttrain_loss\ttrain_accuracy\tval_loss\tval_accuracy\tseconds\n");
    for h in &trained.history {
        tsv.push_str(&format!("{}\t{:.6}\t{:.6}\t{}\t{}\t{:.3}\n", h.epoch, h.train_loss, h.train_accuracy, fmt_opt(h.val_loss), fmt_opt(h.val_accuracy), h.seconds));
    }
    crate::tasks::shard::write_atomic(&out.join("curves.tsv"), tsv.as_bytes())?;
    let fig = crate::plots::curves::CurvesFigure {
        title: format!("scfoundry finetune: {} on obs['{}'] ({} classes, seed {})", spec.method, o.label_key, labels.classes.len(), spec.seed),
        epochs: trained.history.iter().map(|h| h.epoch).collect(),
        train_loss: trained.history.iter().map(|h| h.train_loss).collect(),
        val_loss: trained.history.iter().map(|h| h.val_loss).collect(),
        train_acc: trained.history.iter().map(|h| h.train_accuracy).collect(),
        val_acc: trained.history.iter().map(|h| h.val_accuracy).collect(),
        best_epoch: trained.best_epoch,
    };
    crate::plots::curves::curves_figure(&fig, &out.join("curves.svg"), &out.join("curves.png"))?;
    // finetune.json
    let best = trained.history.iter().find(|h| h.epoch == trained.best_epoch);
    let mut layer_names: Vec<String> = trained.layers.iter().map(|(n, _)| n.clone()).collect();
    layer_names.sort();
    let mut base = Map::new();
    if let Some(d) = &base_dir {
        base.insert("dir".into(), json!(d.display().to_string()));
    }
    base.insert("sha256".into(), Value::Object(shas));
    let mut files = Map::new();
    files.insert("model".into(), json!(MODEL_FILE));
    files.insert("model_sha256".into(), json!(weights::sha256_file(&model_path, |_| {})?));
    for (k, p) in &extra_files {
        files.insert(k.clone(), json!(p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default()));
    }
    let doc = json!({
        "tool": "scfoundry",
        "version": env!("CARGO_PKG_VERSION"),
        "command": "finetune",
        "command_line": spec.command_line,
        "date": chrono::Local::now().to_rfc3339(),
        "run_id": spec.run_id,
        "method": spec.method,
        "label_key": o.label_key,
        "classes": labels.classes,
        "dim": dim,
        "seed": spec.seed,
        "rng": "ChaCha8 seeded with --seed: stream 1 the split, stream 2 the head's initial weights, stream 3 the shuffling",
        "input": spec.data.display().to_string(),
        "n_cells": ad.n_obs,
        "n_labelled": labels.cells.len(),
        "n_train": split.train.len(),
        "n_val": split.val.len(),
        "unfreeze_layers": o.unfreeze_layers,
        "unfrozen_tensors": layer_names,
        "method_params": o.method_params,
        "options": {
            "epochs": o.epochs, "batch_size": o.batch_size, "predict_batch_size": o.predict_batch_size,
            "lr": o.lr, "weight_decay": o.weight_decay, "patience": o.patience, "val_fraction": o.val_fraction,
            "optimizer": "AdamW (candle-nn; beta1 0.9, beta2 0.999, eps 1e-8)", "loss": "mean softmax cross-entropy",
            "device": spec.device.kind.to_string(),
        },
        "base_weights": base,
        "files": files,
        "monitor": trained.monitor,
        "best_epoch": trained.best_epoch,
        "stopped_early": trained.stopped_early,
        "best": best,
        "history": trained.history,
        "notes": notes,
    });
    crate::tasks::shard::write_atomic(&out.join(PROVENANCE_FILE), serde_json::to_string_pretty(&doc)?.as_bytes())?;
    let mut summary = vec![format!(
        "trained {} head on obs['{}'] ({} classes, {} training / {} validation cells) in {:.1}s: best epoch {} of {}{}, {}; wrote {}",
        spec.method,
        o.label_key,
        labels.classes.len(),
        split.train.len(),
        split.val.len(),
        started.elapsed().as_secs_f64(),
        trained.best_epoch,
        trained.history.len(),
        if trained.stopped_early { " (stopped early)" } else { "" },
        match best {
            Some(b) => match (b.val_loss, b.val_accuracy) {
                (Some(l), Some(a)) => format!("validation loss {l:.4}, accuracy {a:.3}"),
                _ => format!("training loss {:.4}, accuracy {:.3}", b.train_loss, b.train_accuracy),
            },
            None => "no epoch".into(),
        },
        out.display()
    )];
    if let (Some(p), Some(po)) = (&o.predict, &o.predict_out) {
        // predict with the best weights: reload the layers as plain tensors
        let head = Head::from_tensors(&trained.head_w, &trained.head_b)?;
        let bb = if o.unfreeze_layers > 0 {
            drop(bb);
            let overrides: HashMap<String, Tensor> = trained.layers.iter().cloned().collect();
            let hook = LoadHook::new(0, overrides);
            load_backbone(spec, &o.method_params, &hook, &device, BackboneFrom::Weights)?.backbone
        } else {
            bb
        };
        summary.push(predict_file(spec, bb.as_ref(), &head, &labels.classes, &o.label_key, p, po, o, &device, &mut notes, Some(out))?);
    }
    dev.write_report(task_dir, None, Some(o.batch_size as usize));
    Ok(TaskResult { output: Some(out.clone()), n_obs: ad.n_obs, dim, notes, summary, ..Default::default() })
}

#[allow(clippy::too_many_arguments)]
fn predict_file(spec: &TaskSpec, bb: &dyn Backbone, head: &Head, classes: &[String], label_key: &str, data: &Path, out: &Path, o: &FinetuneOptions, device: &Device, notes: &mut Vec<String>, model_dir: Option<&Path>) -> Result<String> {
    let ad = AnnData::open(data)?;
    ad.check_usable()?;
    let (mut f, usable) = bb.features(&ad, spec.seed, device, false, notes)?;
    let cells: Vec<usize> = (0..ad.n_obs).filter(|&i| usable[i]).collect();
    let rep = reporter(spec.quiet || !spec.progress);
    let p = rep.step("finetune: predict", cells.len() as u64, "cells");
    let (c, conf) = ft::predict(f.as_mut(), head, &cells, o.predict_batch_size as usize, |k| p.inc(k as u64))?;
    p.finish();
    let mut codes = vec![-1i32; ad.n_obs];
    let mut confidence = vec![f32::NAN; ad.n_obs];
    for (k, &i) in cells.iter().enumerate() {
        codes[i] = c[k] as i32;
        confidence[i] = conf[k];
    }
    let pred_key = format!("{label_key}_pred");
    let conf_key = format!("{pred_key}_confidence");
    // accuracy when the file has the labels too
    let truth = read_labels(&ad, label_key).ok();
    let accuracy = truth.as_ref().map(|t| {
        let hits = t.cells.iter().zip(&t.codes).filter(|(&i, &code)| codes[i] >= 0 && classes[codes[i] as usize] == t.classes[code as usize]).count();
        hits as f64 / t.cells.len().max(1) as f64
    });
    let pending = PendingOutput::create(data, out)?;
    pending.add_obs_categorical(&pred_key, &codes, classes)?;
    pending.add_obs_f32(&conf_key, &confidence)?;
    let uns = crate::anndata::h5util::require_dict(pending.file(), "uns").h5ctx(|| "creating uns".into())?;
    let mut prov = Map::new();
    prov.insert("tool".into(), json!("scfoundry"));
    prov.insert("version".into(), json!(env!("CARGO_PKG_VERSION")));
    prov.insert("command".into(), json!("finetune --predict"));
    prov.insert("method".into(), json!(spec.method));
    prov.insert("model".into(), json!(model_dir.map(|d| d.display().to_string()).unwrap_or_default()));
    prov.insert("pred_key".into(), json!(pred_key));
    prov.insert("seed".into(), json!(spec.seed));
    prov.insert("date".into(), json!(chrono::Local::now().to_rfc3339()));
    prov.insert("run_id".into(), json!(spec.run_id));
    prov.insert("command_line".into(), json!(spec.command_line));
    if let Some(a) = accuracy {
        prov.insert("accuracy".into(), json!(a));
    }
    crate::tasks::runtime::write_json_dict(&uns, "scfoundry_finetune", &prov).h5ctx(|| "writing uns/scfoundry_finetune".into())?;
    drop(uns);
    pending.commit()?;
    Ok(format!(
        "wrote {} with obs['{pred_key}'] and obs['{conf_key}'] ({} cells){}",
        out.display(),
        cells.len(),
        accuracy.map(|a| format!("; accuracy against its obs['{label_key}']: {a:.3}")).unwrap_or_default()
    ))
}

fn predict_task(spec: &TaskSpec, o: &FinetuneOptions, dir: &Path, task_dir: &Path) -> anyhow::Result<TaskResult> {
    let saved = load_saved(dir)?;
    let dev = TaskDevice::start(spec)?;
    let device = dev.device.clone();
    let model_path = dir.join(MODEL_FILE);
    let ctx = |e: candle_core::Error| Error::BadWeights { path: model_path.clone(), detail: e.to_string() };
    let mut tensors = candle_core::safetensors::load(&model_path, &device).map_err(ctx)?;
    let (w, b) = match (tensors.remove("head.weight"), tensors.remove("head.bias")) {
        (Some(w), Some(b)) => (w, b),
        _ => return Err(Error::BadWeights { path: model_path.clone(), detail: "has no head.weight / head.bias".into() }.into()),
    };
    if w.dims() != [saved.classes.len(), saved.dim] {
        return Err(Error::BadWeights { path: model_path.clone(), detail: format!("head.weight is {:?}, finetune.json says {} classes x {}", w.dims(), saved.classes.len(), saved.dim) }.into());
    }
    let head = Head::from_tensors(&w, &b)?;
    let mut notes = Vec::new();
    let hook = LoadHook::new(0, tensors);
    let bb = load_backbone(spec, &saved.method_params, &hook, &device, BackboneFrom::Saved(dir)).map_err(|e| dev.load_error(e, "loading the model's weights", task_dir))?.backbone;
    let data = o.predict.clone().unwrap_or_else(|| spec.data.clone());
    let out = o.predict_out.clone().unwrap_or_else(|| spec.out.clone());
    let line = predict_file(spec, bb.as_ref(), &head, &saved.classes, &o.label_key, &data, &out, o, &device, &mut notes, Some(dir))?;
    dev.write_report(task_dir, None, Some(o.predict_batch_size as usize));
    Ok(TaskResult { output: Some(out), n_obs: 0, dim: saved.dim, notes, summary: vec![line], ..Default::default() })
}
