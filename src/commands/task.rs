//! `scfoundry __task SPEC`: the task process the runner starts. It does the work, then
//! records its own cost (stats.json) and result (result.json) beside the spec.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::{json, Value};

use crate::anndata::h5util::{require_dict, write_array_f64, write_f64, write_i64, write_string, set_encoding};
use crate::anndata::write::{write_rows, PendingOutput};
use crate::anndata::AnnData;
use crate::gpu::readback::place_rows;
use crate::commands::ExitStatus;
use crate::error::{Error, Hdf5Context, Result};
use crate::methods::cellama::{self, Encoder};
use crate::methods::pca::{self, Names, PcaFit, PcaOptions};
use crate::weights::{self, Manifest, Status};
use crate::progress::reporter;
use crate::runner::stats::TaskStats;
use crate::runner::{Step, TaskResult, TaskSpec};

mod c2s;
mod scvi;
mod uce;
mod scbert;
mod scimilarity;
mod genept;
mod scfoundation;
mod cellplm;
mod novae;
mod scprint;
mod cellfm;

pub use novae::coords as novae_coords;

pub use scvi::{model_dir as scvi_model_dir, prepare as scvi_prepare};
pub use cellplm::checkpoint as cellplm_checkpoint;
pub mod cls_encoder;

pub fn run(spec_path: &Path) -> anyhow::Result<ExitStatus> {
    let started = Instant::now();
    let text = std::fs::read_to_string(spec_path).map_err(|e| Error::Io { path: spec_path.into(), source: e })?;
    let spec: TaskSpec = serde_json::from_str(&text)?;
    let dir = spec_path.parent().unwrap_or(Path::new("."));
    let outcome: anyhow::Result<TaskResult> = match (spec.command.as_str(), spec.method.as_str(), &spec.step) {
        ("embed", "pca", Step::Embed) => embed_pca(&spec).map_err(Into::into),
        ("embed", "pca", Step::Fit) => fit_pca(&spec).map_err(Into::into),
        ("embed", "pca", Step::Project { shard, start, end }) => project_pca(&spec, *shard, *start, *end).map_err(Into::into),
        ("embed", "pca", Step::Merge { shards }) => merge_pca(&spec, shards).map_err(Into::into),
        ("embed", "cellama", Step::Embed) => embed_cellama(&spec, dir).map_err(Into::into),
        ("embed", "geneformer", Step::Embed) => embed_geneformer(&spec, dir).map_err(Into::into),
        ("embed", "scgpt", Step::Embed) => embed_scgpt(&spec, dir).map_err(Into::into),
        ("embed", "uce", Step::Embed) => uce::embed_uce(&spec, dir).map_err(Into::into),
        ("embed", "scbert", Step::Embed) => scbert::embed_scbert(&spec, dir).map_err(Into::into),
        ("embed", "c2s", Step::Embed) => c2s::embed_c2s(&spec, dir).map_err(Into::into),
        ("embed", "scvi", Step::Embed) => scvi::embed_scvi(&spec, dir).map_err(Into::into),
        ("embed", "scimilarity", Step::Embed) => scimilarity::embed_scimilarity(&spec, dir).map_err(Into::into),
        ("embed", "genept", Step::Embed) => genept::embed_genept(&spec, dir).map_err(Into::into),
        ("embed", "cellplm", Step::Embed) => cellplm::embed_cellplm(&spec, dir).map_err(Into::into),
        ("embed", "novae", Step::Embed) => novae::embed_novae(&spec, dir).map_err(Into::into),
        ("embed", "sccello", Step::Embed) => cls_encoder::embed(&spec, dir, crate::methods::cls_encoder::Arch::Sccello).map_err(Into::into),
        ("embed", "langcell", Step::Embed) => cls_encoder::embed(&spec, dir, crate::methods::cls_encoder::Arch::Langcell).map_err(Into::into),
        ("embed", "scfoundation", Step::Embed) => scfoundation::embed_scfoundation(&spec, dir).map_err(Into::into),
        ("embed", "scprint", Step::Embed) => scprint::embed_scprint(&spec, dir).map_err(Into::into),
        ("embed", "cellfm", Step::Embed) => cellfm::embed_cellfm(&spec, dir).map_err(Into::into),
        ("transfer", "pca", Step::Fit) => transfer_fit_pca(&spec).map_err(Into::into),
        ("transfer", "pca", Step::Embed) => transfer_embed_pca(&spec).map_err(Into::into),
        ("transfer", "cellama", Step::Embed) => transfer_embed_cellama(&spec, dir).map_err(Into::into),
        ("transfer", "novae", Step::Embed) => novae::embed_novae(&spec, dir).map_err(Into::into),
        ("integrate", _, Step::Embed) => crate::commands::integrate::task(&spec),
        ("benchmark", _, Step::Embed) => crate::commands::benchmark::task(&spec),
        ("geometry", _, Step::Embed) => crate::commands::geometry::task(&spec),
        ("finetune", _, Step::Embed) => crate::commands::finetune::task(&spec, dir),
        (c, m, _) => Err(Error::NotImplemented { name: format!("{c} {m}"), version: env!("CARGO_PKG_VERSION") }.into()),
    };
    let stats = TaskStats::measure_self(started.elapsed().as_millis() as u64);
    let _ = std::fs::write(dir.join("stats.json"), serde_json::to_string_pretty(&stats)?);
    let result = outcome?;
    std::fs::write(dir.join("result.json"), serde_json::to_string_pretty(&result)?)?;
    Ok(ExitStatus::Success)
}

fn param_u64(spec: &TaskSpec, key: &str, default: u64) -> u64 {
    spec.params.get(key).and_then(Value::as_u64).unwrap_or(default)
}

/// Write a JSON object as an AnnData dict (strings, numbers, bools, nested objects).
pub(crate) fn write_json_dict(parent: &hdf5::Group, name: &str, v: &serde_json::Map<String, Value>) -> hdf5::Result<()> {
    if parent.link_exists(name) {
        parent.unlink(name)?;
    }
    let g = require_dict(parent, name)?;
    for (k, val) in v {
        match val {
            Value::String(s) => write_string(&g, k, s)?,
            Value::Number(n) if n.is_i64() || n.is_u64() => write_i64(&g, k, n.as_i64().unwrap_or(i64::MAX))?,
            Value::Number(n) => write_f64(&g, k, n.as_f64().unwrap_or(f64::NAN))?,
            Value::Bool(b) => {
                let ds = g.new_dataset::<bool>().shape(()).create(k.as_str())?;
                ds.write_scalar(b)?;
                set_encoding(&ds, "numeric-scalar", "0.2.0")?;
            }
            Value::Object(o) => write_json_dict(&g, k, o)?,
            Value::Null => {}
            Value::Array(_) => write_string(&g, k, &val.to_string())?,
        }
    }
    Ok(())
}

/// The sha256 of each weights entry a method needs, verified (hashing once, then stamped);
/// `WeightsMissing` naming the folder when any is absent.
pub fn verified_weights(method: &str, dir: &Path, ids: &[&str]) -> Result<serde_json::Map<String, Value>> {
    let manifest = Manifest::load()?;
    let mut missing = Vec::new();
    let mut out = serde_json::Map::new();
    for id in ids {
        let Some(e) = manifest.weights.get(*id) else {
            missing.push(id.to_string());
            continue;
        };
        let path = dir.join(&e.file);
        match weights::check(dir, id, e, true, |_| {})? {
            Status::Missing => missing.push(id.to_string()),
            Status::Verified => {
                out.insert(id.to_string(), json!(e.sha256.clone().unwrap_or_default()));
            }
            Status::Unpinned | Status::Present => {
                let sha = match weights::stamped_sha256(dir, id, &path) {
                    Some(s) => s,
                    None => weights::sha256_file(&path, |_| {})?,
                };
                out.insert(id.to_string(), json!(sha));
            }
            bad @ (Status::WrongHash { .. } | Status::WrongSize { .. }) => {
                return Err(Error::BadWeights { path, detail: format!("{bad} for {id}; it does not match weights.toml") });
            }
        }
    }
    if !missing.is_empty() {
        return Err(Error::WeightsMissing { method: method.into(), dir: dir.to_path_buf(), missing });
    }
    Ok(out)
}

/// Each requested obs column as upstream's `str(adata.obs[feature].iloc[i])`; absent columns
/// are skipped with a note (upstream skips them silently).
pub fn obs_strings(ad: &AnnData, names: &[String], notes: &mut Vec<String>) -> Result<Vec<(String, Vec<String>)>> {
    use crate::anndata::dataframe::Column;
    if names.is_empty() {
        return Ok(vec![]);
    }
    let obs = ad.obs()?;
    let mut out = Vec::new();
    for n in names {
        let Some(col) = obs.column(n) else {
            notes.push(format!("obs has no column `{n}`: left out of the sentences (as upstream does); obs columns: {}", obs.names().join(", ")));
            continue;
        };
        let b = |v: bool| if v { "True" } else { "False" }.to_string();
        let vals: Vec<String> = match col {
            Column::Numeric(v) => v.iter().map(|&x| cellama::py_float(x)).collect(),
            Column::Bool(v) => v.iter().map(|&x| b(x)).collect(),
            Column::NullableBool { values, mask } => values.iter().zip(mask).map(|(&x, &m)| if m { "<NA>".into() } else { b(x) }).collect(),
            Column::NullableInt { values, mask } => values.iter().zip(mask).map(|(x, &m)| if m { "<NA>".into() } else { x.to_string() }).collect(),
            Column::NullableString { values, mask } => values.iter().zip(mask).map(|(x, &m)| if m { "<NA>".into() } else { x.clone() }).collect(),
            other => other.as_labels().unwrap_or_default().into_iter().map(|v| v.unwrap_or_else(|| "nan".into())).collect(),
        };
        out.push((n.clone(), vals));
    }
    Ok(out)
}

/// Cell sentences for rows `start..` of a block (see `methods/cellama.rs`).
pub fn cellama_sentences(block: &crate::anndata::CsrBlock, var_names: &[String], obs: &[(String, Vec<String>)], top: usize) -> Vec<String> {
    (0..block.n_rows())
        .map(|i| {
            let (idx, vals) = block.row(i);
            let genes: Vec<&str> = cellama::top_genes(idx, vals, var_names.len(), top).into_iter().map(|j| var_names[j].as_str()).collect();
            let fields: Vec<(&str, &str)> = obs.iter().map(|(n, v)| (n.as_str(), v[block.start_row + i].as_str())).collect();
            cellama::sentence(&genes, &fields)
        })
        .collect()
}

/// The task's device: the CPU, or the GPU runtime with the chosen allocator installed.
pub struct TaskDevice {
    pub device: candle_core::Device,
    #[cfg(feature = "cuda")]
    runtime: Option<crate::gpu::cuda::Runtime>,
}

impl TaskDevice {
    pub fn start(spec: &TaskSpec) -> Result<TaskDevice> {
        match spec.device.kind {
            crate::gpu::DeviceKind::Cpu => Ok(TaskDevice {
                device: candle_core::Device::Cpu,
                #[cfg(feature = "cuda")]
                runtime: None,
            }),
            #[cfg(feature = "cuda")]
            crate::gpu::DeviceKind::Cuda => {
                let rt = crate::gpu::cuda::start(&spec.device)?;
                Ok(TaskDevice { device: rt.device.clone(), runtime: Some(rt) })
            }
            #[cfg(not(feature = "cuda"))]
            crate::gpu::DeviceKind::Cuda => Err(crate::gpu::GpuError::NotCompiled.into()),
        }
    }

    /// Write `gpu.json` (peak device memory, allocator, pointer checks, back-off) into the
    /// task folder; nothing on the CPU.
    pub fn write_report(&self, dir: &Path, backoff: Option<crate::gpu::backoff::BackoffReport>, batch_size: Option<usize>) {
        #[cfg(feature = "cuda")]
        if let Some(rt) = &self.runtime {
            let _ = self.device.synchronize();
            let mut r = rt.resource.report(&rt.name);
            r.backoff = backoff;
            r.batch_size = batch_size.map(|b| b as u64);
            let _ = std::fs::write(dir.join(crate::gpu::GpuReport::FILE), serde_json::to_string_pretty(&r).unwrap_or_default());
        }
        #[cfg(not(feature = "cuda"))]
        let _ = (dir, backoff, batch_size);
    }

    /// Call once the model's weights are on the device: the report separates them from batches.
    pub fn mark_loaded(&self) {
        #[cfg(feature = "cuda")]
        if let Some(rt) = &self.runtime {
            let _ = self.device.synchronize();
            rt.resource.mark_loaded();
        }
    }

    /// An out-of-memory error while loading a model becomes a clear GPU error (with the cost
    /// report written); other errors pass through.
    pub fn load_error(&self, e: Error, what: &str, dir: &Path) -> Error {
        if !crate::gpu::is_out_of_memory(&e.to_string()) {
            return e;
        }
        self.write_report(dir, None, None);
        let allocator = self.allocator();
        let hint = match allocator {
            crate::gpu::AllocatorKind::Pool | crate::gpu::AllocatorKind::ManagedPool => {
                "raise --maximum-pool-size (and --gpu-memory-limit if set), or use --allocator managed for a model larger than the card".to_string()
            }
            _ => "free memory on the GPU (`scfoundry doctor` shows what is free), raise --gpu-memory-limit if set, or use --allocator managed".to_string(),
        };
        crate::gpu::GpuError::ModelTooLarge { what: what.into(), allocator: allocator.to_string(), hint }.into()
    }

    pub fn allocator(&self) -> crate::gpu::AllocatorKind {
        #[cfg(feature = "cuda")]
        if let Some(rt) = &self.runtime {
            return rt.resource.kind;
        }
        crate::gpu::AllocatorKind::default()
    }
}

/// Smallest, largest and mean token count of a task's cells, for its notes.
#[derive(Debug, Default)]
pub struct LengthStats {
    min: usize,
    max: usize,
    total: usize,
    cells: usize,
}

impl LengthStats {
    pub fn add(&mut self, n: usize) {
        self.min = if self.cells == 0 { n } else { self.min.min(n) };
        self.max = self.max.max(n);
        self.total += n;
        self.cells += 1;
    }

    /// "`what`: min to max, mean m", or nothing without cells.
    pub fn note(&self, what: &str) -> Option<String> {
        (self.cells > 0).then(|| format!("{what}: {} to {}, mean {:.0}", self.min, self.max, self.total as f64 / self.cells as f64))
    }
}

/// Batched model runs on a task's device: the batch size in effect and the out-of-memory
/// back-off so far, carried from one block of rows to the next (see `gpu/backoff.rs`).
pub struct Batches {
    pub dev: TaskDevice,
    size: usize,
    backoff: Option<crate::gpu::backoff::BackoffReport>,
    task_dir: PathBuf,
    // whether a run batched by tokens (for the parameters)
    by_tokens: bool,
}

impl Batches {
    pub fn new(dev: TaskDevice, size: usize, task_dir: &Path) -> Batches {
        Batches { dev, size: size.max(1), backoff: None, task_dir: task_dir.to_path_buf(), by_tokens: false }
    }

    /// The batch size in effect (smaller than asked after a back-off).
    pub fn size(&self) -> usize {
        self.size
    }

    /// All of `cells` through `forward` (which gets a batch's cells), longest first (by `len`, a
    /// cell's tokens), so that the cells of a batch have similar lengths and pad little, batched
    /// by tokens (`gpu::backoff::TokenBudget`: the batch size's worth of the longest cells, and
    /// as many shorter cells as fit the same padded tokens, up to `BATCH_GROWTH` times as many).
    pub fn run_longest_first<C>(&mut self, cells: &[C], dim: usize, len: impl Fn(&C) -> usize, mut forward: impl FnMut(&[&C]) -> Result<Vec<f32>>, progress: impl FnMut(usize)) -> Result<Vec<f32>> {
        let tokens: Vec<usize> = cells.iter().map(&len).collect();
        let mut order: Vec<usize> = (0..cells.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(tokens[i]));
        self.run_rows(cells.len(), dim, &order, Some(&tokens), 0.0, |idx| forward(&idx.iter().map(|&i| &cells[i]).collect::<Vec<_>>()), progress)
    }

    /// Rows (`n x dim`, in cell order) of the cells in `order`, run through `forward` in that
    /// order in batches, halving the batch on CUDA out-of-memory; cells not in `order` keep
    /// `fill`. `progress` hears of each finished batch. On an error the cost report is written.
    pub fn run(&mut self, n: usize, dim: usize, order: &[usize], fill: f32, forward: impl FnMut(&[usize]) -> Result<Vec<f32>>, progress: impl FnMut(usize)) -> Result<Vec<f32>> {
        self.run_rows(n, dim, order, None, fill, forward, progress)
    }

    /// [`Self::run`], by cells or, with `tokens` (each cell's token count, by cell), by tokens.
    #[allow(clippy::too_many_arguments)]
    fn run_rows(&mut self, n: usize, dim: usize, order: &[usize], tokens: Option<&[usize]>, fill: f32, forward: impl FnMut(&[usize]) -> Result<Vec<f32>>, mut progress: impl FnMut(usize)) -> Result<Vec<f32>> {
        let mut rows = vec![fill; n * dim];
        self.run_with(order, tokens, forward, |r, v: Vec<f32>| {
            place_rows(&mut rows, dim, &order[r.clone()], &v);
            progress(r.len());
            Ok(())
        })?;
        Ok(rows)
    }

    /// As [`Self::run`], with `forward` returning the batch's rows on the model's device
    /// (`batch x dim`, any float type) without reading them: each batch is read back while the
    /// next one runs (`gpu::readback`), so the GPU does not sit idle while the host prepares
    /// the next batch. With `tokens` (each cell's token count, by cell; `order` longest first)
    /// the batches go by tokens (`gpu::backoff::TokenBudget`): the batch size's worth of the
    /// longest cells, and up to `BATCH_GROWTH` times as many shorter ones, so that short cells
    /// do not run in batches too small to keep the GPU busy.
    pub fn run_lagged(&mut self, n: usize, dim: usize, order: &[usize], tokens: Option<&[usize]>, fill: f32, forward: impl FnMut(&[usize]) -> Result<candle_core::Tensor>, mut progress: impl FnMut(usize)) -> Result<Vec<f32>> {
        let mut rows = vec![fill; n * dim];
        let mut lagged = crate::gpu::readback::Lagged::new();
        let read_err = |e: candle_core::Error| Error::Model { context: "reading a batch's embeddings back from the device".into(), detail: e.to_string() };
        let mut place = |r: std::ops::Range<usize>, v: Vec<f32>| {
            place_rows(&mut rows, dim, &order[r.clone()], &v);
            progress(r.len());
        };
        self.run_with(order, tokens, forward, |r, t: candle_core::Tensor| {
            if let Some((done, v)) = lagged.push(r, &t).map_err(read_err)? {
                place(done, v);
            }
            Ok(())
        })?;
        if let Some((done, v)) = lagged.finish().map_err(read_err)? {
            place(done, v);
        }
        Ok(rows)
    }

    /// The batches of `order` through `forward` (by cells, or by `tokens` when given), each
    /// result to `done` in order (an error from `done` stops the run), halving the batch on
    /// out-of-memory; the back-off and, on an error, the cost report recorded.
    fn run_with<T>(&mut self, order: &[usize], tokens: Option<&[usize]>, mut forward: impl FnMut(&[usize]) -> Result<T>, done: impl FnMut(std::ops::Range<usize>, T) -> Result<()>) -> Result<()> {
        use crate::gpu::backoff::{extra_hint, run_batched, BackoffError, BackoffReport, TokenBudget, BATCH_GROWTH};
        let is_oom = |e: &Error| crate::gpu::is_out_of_memory(&e.to_string());
        let cost = |k: usize| tokens.map_or(1, |t| t[order[k]]);
        let budget = match (tokens, order.first()) {
            (Some(t), Some(&first)) => {
                self.by_tokens = true;
                TokenBudget::new(self.size, BATCH_GROWTH, t[first])
            }
            _ => TokenBudget::per_cell(self.size),
        };
        let outcome = run_batched(order.len(), budget, cost, is_oom, |r| forward(&order[r]), done);
        let allocator = self.dev.allocator();
        let err = match outcome {
            Ok(None) => return Ok(()),
            Ok(Some(r)) => {
                self.size = r.final_batch;
                self.backoff = Some(match self.backoff.take() {
                    Some(t) => BackoffReport { requested: t.requested, final_batch: r.final_batch, retries: t.retries + r.retries },
                    None => r,
                });
                return Ok(());
            }
            Err(BackoffError::OutOfMemoryAtOne(e)) => crate::gpu::GpuError::OutOfMemory {
                allocator: allocator.to_string(),
                detail: e.to_string(),
                hint: format!("the model itself does not fit: free the GPU, raise --gpu-memory-limit, or use --allocator managed{}", extra_hint(allocator)),
            }
            .into(),
            Err(BackoffError::Other(e)) => e,
        };
        self.dev.write_report(&self.task_dir, self.backoff.clone(), Some(self.size));
        Err(err)
    }

    /// The batch size in effect (after any back-off) and the device, into an embedding task's
    /// parameters (`uns['scfoundry']['parameters']`).
    pub fn record(&self, spec: &TaskSpec, params: &mut serde_json::Map<String, Value>) {
        params.insert("batch_size".into(), json!(self.size));
        if self.by_tokens {
            let growth = crate::gpu::backoff::BATCH_GROWTH;
            params.insert("batching".into(), json!(format!("by tokens: batch_size cells of the longest length, up to {growth} x batch_size shorter ones")));
        }
        params.insert("device".into(), json!(spec.device.kind.to_string()));
    }

    /// After the last batch: the back-off note (`batch_flag`: the method honours --batch-size)
    /// and the cost report.
    pub fn finish(&self, notes: &mut Vec<String>, batch_flag: bool) {
        if let Some(b) = &self.backoff {
            notes.push(b.message(self.dev.allocator(), batch_flag));
        }
        self.dev.write_report(&self.task_dir, self.backoff.clone(), Some(self.size));
    }
}

/// What a cellama task needs: the data, its sentences' parts and the loaded encoder.
struct CellamaJob {
    ad: AnnData,
    x: crate::anndata::Matrix,
    top: usize,
    obs: Vec<(String, Vec<String>)>,
    enc: Encoder,
    model_dir: PathBuf,
    shas: serde_json::Map<String, Value>,
    notes: Vec<String>,
    batches: Batches,
}

fn cellama_prepare(spec: &TaskSpec, task_dir: &Path) -> Result<CellamaJob> {
    let dir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let shas = verified_weights("cellama", &dir, cellama::REQUIRED_ENTRIES)?;
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let mut notes = Vec::new();
    let top = param_u64(spec, "top_genes", cellama::DEFAULT_TOP_GENES as u64) as usize;
    let features: Vec<String> = spec
        .params
        .get("obs_features")
        .and_then(Value::as_str)
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    let obs = obs_strings(&ad, &features, &mut notes)?;
    let model_dir = cellama::model_dir(&dir, &Manifest::load()?);
    let dev = TaskDevice::start(spec)?;
    let enc = Encoder::load_on(&model_dir, dev.device.clone()).map_err(|e| dev.load_error(e, "loading the model's weights", task_dir))?;
    dev.mark_loaded();
    let batches = Batches::new(dev, param_u64(spec, "batch_size", cellama::BATCH_SIZE as u64) as usize, task_dir);
    Ok(CellamaJob { ad, x, top, obs, enc, model_dir, shas, notes, batches })
}

/// Encode every cell; `sink(start_row, rows)` receives blocks of `enc.hidden`-wide rows.
/// Adds a note when sentences were truncated.
fn cellama_encode(job: &mut CellamaJob, rep: &dyn crate::progress::Reporter, mut sink: impl FnMut(usize, &[f32]) -> Result<()>) -> Result<()> {
    let (enc, x, dim) = (&job.enc, &job.x, job.enc.hidden);
    let p = rep.step("cellama: encode", job.ad.n_obs as u64, "cells");
    let mut truncated = 0usize;
    for (s, e) in x.blocks(1_000_000) {
        let b = x.read_rows(s, e)?;
        let sentences = cellama_sentences(&b, &job.ad.var_names, &job.obs, job.top);
        for snt in &sentences {
            if enc.token_ids(snt)?.len() >= enc.max_seq_length {
                truncated += 1;
            }
        }
        // in input order: each batch is a run of consecutive sentences
        let order: Vec<usize> = (0..sentences.len()).collect();
        let rows = job.batches.run(sentences.len(), dim, &order, 0.0, |idx| enc.encode(&sentences[idx[0]..idx[0] + idx.len()]), |k| p.inc(k as u64))?;
        sink(s, &rows)?;
    }
    p.finish();
    if truncated > 0 {
        job.notes.push(format!("{truncated} cell sentence(s) reached the model's {} tokens and were truncated, as sentence-transformers does", enc.max_seq_length));
    }
    job.batches.finish(&mut job.notes, false);
    Ok(())
}

fn embed_cellama(spec: &TaskSpec, task_dir: &Path) -> Result<TaskResult> {
    let rep = reporter(!spec.progress);
    let mut job = cellama_prepare(spec, task_dir)?;
    let dim = job.enc.hidden;
    let out = PendingOutput::create(&spec.data, &spec.out)?;
    let key = "X_cellama";
    let ds = out.create_obsm(key, job.ad.n_obs, dim)?;
    cellama_encode(&mut job, rep.as_ref(), |s, rows| write_rows(&ds, s, rows, dim))?;
    drop(ds);
    let batch = job.batches.size();
    let CellamaJob { ad, x, enc, model_dir, shas, notes, .. } = job;
    let mut params = spec.params.clone();
    params.insert("batch_size".into(), json!(batch));
    params.insert("device".into(), json!(spec.device.kind.to_string()));
    params.insert("max_seq_length".into(), json!(enc.max_seq_length));
    params.insert("pooling".into(), json!("mean, L2-normalised"));
    params.insert("tie_order".into(), json!("gene order (stable argsort)"));
    let mut w = serde_json::Map::new();
    w.insert("dir".into(), json!(model_dir.display().to_string()));
    commit_embedding(spec, out, key, &x.field, params, w, Value::Object(shas), ad.n_obs, dim, notes)
}

/// The Ensembl ids of the var entries: a var column, or the index for `index`.
pub fn gene_ids(ad: &AnnData, column: &str) -> Result<Vec<String>> {
    if column == "index" {
        return Ok(ad.var_names.clone());
    }
    let var = ad.var()?;
    let Some(col) = var.column(column) else {
        let mut names = var.names().join(", ");
        if names.is_empty() {
            names = "none".into();
        }
        return Err(Error::BadField {
            path: ad.path.clone(),
            field: format!("var/{column}"),
            detail: format!("no var column `{column}` with Ensembl ids (var columns: {names}; var_names start {})", ad.var_names.iter().take(3).cloned().collect::<Vec<_>>().join(", ")),
            hint: Some("name the column with --gene-column, or `--gene-column index` when var_names are Ensembl ids; map symbols to Ensembl ids first otherwise (upstream: Ensembl BioMart or gene_name_id_dict.pkl)".into()),
        });
    };
    match col.as_labels() {
        Some(v) => Ok(v.into_iter().map(Option::unwrap_or_default).collect()),
        None => Err(Error::BadField { path: ad.path.clone(), field: format!("var/{column}"), detail: format!("is {}, not strings", col.kind()), hint: Some("--gene-column must name a column of Ensembl ids".into()) }),
    }
}

/// Each cell's total counts: obs['n_counts'] when present (upstream requires it), else row sums.
pub(crate) fn cell_totals(ad: &AnnData, x: &crate::anndata::Matrix, notes: &mut Vec<String>) -> Result<Vec<f64>> {
    use crate::anndata::dataframe::Column;
    let obs = ad.obs()?;
    if let Some(Column::Numeric(v)) = obs.column("n_counts") {
        return Ok(v.clone());
    }
    notes.push(format!("obs has no numeric `n_counts` (upstream requires it: each cell's total counts); the row sums of {} were used", x.field));
    let mut out = Vec::with_capacity(ad.n_obs);
    for (s, e) in x.blocks(1_000_000) {
        let b = x.read_rows(s, e)?;
        for i in 0..b.n_rows() {
            out.push(b.row(i).1.iter().map(|&v| v as f64).sum());
        }
    }
    Ok(out)
}

fn embed_geneformer(spec: &TaskSpec, task_dir: &Path) -> Result<TaskResult> {
    use crate::methods::geneformer::{self, EmbMode, GeneTable, Geneformer};
    let rep = reporter(!spec.progress);
    let given_dir = spec.params.get("model_dir").and_then(Value::as_str).filter(|s| !s.is_empty()).map(PathBuf::from);
    let (model_dir, mut shas) = match &given_dir {
        Some(d) => (d.clone(), serde_json::Map::new()),
        None => {
            let dir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
            let shas = verified_weights("geneformer", &dir, geneformer::REQUIRED_ENTRIES)?;
            (geneformer::model_dir(&dir, &Manifest::load()?), shas)
        }
    };
    let emb_layer = spec.params.get("emb_layer").and_then(Value::as_i64).unwrap_or(-1) as i32;
    let emb_mode = EmbMode::parse(spec.params.get("emb_mode").and_then(Value::as_str).unwrap_or("cell"))?;
    let column = spec.params.get("gene_column").and_then(Value::as_str).filter(|s| !s.is_empty()).unwrap_or(geneformer::DEFAULT_GENE_COLUMN).to_string();
    let batch = param_u64(spec, "batch_size", geneformer::DEFAULT_BATCH_SIZE as u64).max(1) as usize;
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let ids = gene_ids(&ad, &column)?;
    let dev = TaskDevice::start(spec)?;
    let dict = geneformer::Dictionaries::find(&model_dir)?;
    let mut notes = Vec::new();
    let dtype = precision(spec, &dev.device, &mut notes);
    let model = Geneformer::load_dtype(&model_dir, dict, emb_layer, emb_mode, dev.device.clone(), dtype).map_err(|e| dev.load_error(e, "loading the model's weights", task_dir))?;
    dev.mark_loaded();
    let mut batches = Batches::new(dev, batch, task_dir);
    if given_dir.is_some() {
        for p in [&model.weights_path, &model.dict.token_path, &model.dict.median_path] {
            let name = p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
            shas.insert(name, json!(weights::sha256_file(p, |_| {})?));
        }
    }
    let table = GeneTable::new(&ids, &model.dict)?;
    if table.n_genes() == 0 {
        return Err(Error::BadField {
            path: spec.data.clone(),
            field: format!("var/{column}"),
            detail: format!("none of the {} ids is in the token dictionary {} (ids start {})", ids.len(), model.dict.token_path.display(), ids.iter().take(3).cloned().collect::<Vec<_>>().join(", ")),
            hint: Some("Geneformer needs Ensembl gene ids (ENSG...): choose the column with --gene-column".into()),
        });
    }
    if table.n_duplicated > 0 {
        notes.push(format!("{} var entries share an Ensembl id with another; their counts were summed, as upstream's collapse_gene_ids", table.n_duplicated));
    }
    let totals = cell_totals(&ad, &x, &mut notes)?;
    let dim = model.hidden();
    let out = PendingOutput::create(&spec.data, &spec.out)?;
    let key = "X_geneformer";
    let ds = out.create_obsm(key, ad.n_obs, dim)?;
    let p = rep.step("geneformer: embed", ad.n_obs as u64, "cells");
    let (mut empty, mut truncated, mut n_tokens) = (0usize, 0usize, 0usize);
    // blocks of cells: tokenised together, run longest first, written in the input order
    for (s, e) in x.blocks(2_000_000) {
        for start in (s..e).step_by(batch.max(1) * 20) {
            let end = (start + batch.max(1) * 20).min(e);
            let b = x.read_rows(start, end)?;
            let cells: Vec<Vec<u32>> = (0..b.n_rows())
                .map(|i| {
                    let (idx, vals) = b.row(i);
                    let ranked = table.rank(idx, vals, totals[start + i]);
                    if ranked.len() > model.input_size - if model.dict.specials.is_some() { 2 } else { 0 } {
                        truncated += 1;
                    }
                    model.tokens(ranked)
                })
                .collect();
            empty += cells.iter().filter(|c| c.is_empty()).count();
            n_tokens += cells.iter().map(Vec::len).sum::<usize>();
            // longest first, batched by tokens, halving the batch on CUDA out-of-memory; rows back in input order
            let order = geneformer::length_order(&cells);
            p.inc((cells.len() - order.len()) as u64);
            let lens: Vec<usize> = cells.iter().map(Vec::len).collect();
            let rows = batches.run_lagged(cells.len(), dim, &order, Some(&lens), f32::NAN, |idx| model.forward_tensor(idx.iter().map(|&i| cells[i].as_slice()).collect()), |k| p.inc(k as u64))?;
            write_rows(&ds, start, &rows, dim)?;
        }
    }
    p.finish();
    drop(ds);
    if empty > 0 {
        notes.push(format!("{empty} cell(s) have no gene in the token dictionary: their embedding is NaN (upstream drops such cells)"));
    }
    if truncated > 0 {
        notes.push(format!("{truncated} cell(s) have more ranked genes than the model's {} input tokens and were truncated, as upstream", model.input_size));
    }
    batches.finish(&mut notes, true);
    let mut params = spec.params.clone();
    params.insert("gene_column".into(), json!(column));
    batches.record(spec, &mut params);
    params.insert("emb_layer".into(), json!(emb_layer));
    params.insert("emb_mode".into(), json!(emb_mode.name()));
    params.insert("precision".into(), json!(if dtype == candle_core::DType::BF16 { "bf16" } else { "f32" }));
    params.insert("model_input_size".into(), json!(model.input_size));
    params.insert("special_tokens".into(), json!(model.dict.specials.is_some()));
    params.insert("target_sum".into(), json!(geneformer::TARGET_SUM));
    params.insert("genes_in_dictionary".into(), json!(table.n_genes()));
    params.insert("mean_tokens_per_cell".into(), json!(n_tokens as f64 / ad.n_obs.max(1) as f64));
    params.insert("tie_order".into(), json!("gene order (stable sort)"));
    let mut w = serde_json::Map::new();
    w.insert("dir".into(), json!(model_dir.display().to_string()));
    w.insert("weights_file".into(), json!(model.weights_path.display().to_string()));
    w.insert("token_dictionary".into(), json!(model.dict.token_path.display().to_string()));
    w.insert("gene_median_dictionary".into(), json!(model.dict.median_path.display().to_string()));
    commit_embedding(spec, out, key, &x.field, params, w, Value::Object(shas), ad.n_obs, dim, notes)
}

/// Each gene's symbol for scGPT's vocabulary: var_names, or the var column `gene_col`
/// (embed_data's `gene_col`; "index" means var_names, as upstream).
pub fn scgpt_gene_names(ad: &AnnData, gene_col: &str) -> Result<Vec<Option<String>>> {
    if gene_col.is_empty() || gene_col == "index" {
        return Ok(ad.var_names.iter().cloned().map(Some).collect());
    }
    let var = ad.var()?;
    let col = var.column(gene_col).ok_or_else(|| Error::BadOption {
        option: "--gene-col".into(),
        detail: format!("var has no column `{gene_col}`; var columns: {}", if var.names().is_empty() { "(none)".to_string() } else { var.names().join(", ") }),
        hint: Some("leave --gene-col out to match var_names".into()),
    })?;
    col.as_labels().ok_or_else(|| Error::BadOption {
        option: "--gene-col".into(),
        detail: format!("var column `{gene_col}` is {}, not gene symbols", col.kind()),
        hint: None,
    })
}

/// `--precision`: bf16 on a GPU, float32 otherwise (a CPU run asked for bf16 says so in a note).
pub(crate) fn precision(spec: &TaskSpec, device: &candle_core::Device, notes: &mut Vec<String>) -> candle_core::DType {
    match spec.params.get("precision").and_then(Value::as_str) {
        Some("bf16") if device.is_cuda() => candle_core::DType::BF16,
        Some("bf16") => {
            notes.push("--precision bf16 applies on a GPU; this CPU run used float32".to_string());
            candle_core::DType::F32
        }
        _ => candle_core::DType::F32,
    }
}

fn embed_scgpt(spec: &TaskSpec, task_dir: &Path) -> Result<TaskResult> {
    use crate::methods::scgpt::{self, Model};
    let rep = reporter(!spec.progress);
    let dir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let shas = verified_weights("scgpt", &dir, scgpt::REQUIRED_ENTRIES)?;
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let mut notes = Vec::new();
    let max_len = param_u64(spec, "max_len", scgpt::DEFAULT_MAX_LEN as u64) as usize;
    let batch = param_u64(spec, "batch_size", scgpt::DEFAULT_BATCH_SIZE as u64) as usize;
    let gene_col = spec.params.get("gene_col").and_then(Value::as_str).unwrap_or("index").to_string();
    let model_dir = scgpt::model_dir(&dir, &Manifest::load()?);
    let dev = TaskDevice::start(spec)?;
    let mut model = Model::load_on(&model_dir, max_len, dev.device.clone()).map_err(|e| dev.load_error(e, "loading the model's weights", task_dir))?;
    model.set_precision(precision(spec, &dev.device, &mut notes))?;
    dev.mark_loaded();
    let mut batches = Batches::new(dev, batch, task_dir);
    let names = scgpt_gene_names(&ad, &gene_col)?;
    let gene_ids = scgpt::match_genes(&names, &model.vocab);
    let matched = gene_ids.iter().filter(|g| g.is_some()).count();
    let source = if gene_col == "index" { "var_names".to_string() } else { format!("var['{gene_col}']") };
    if matched == 0 {
        let example = names.iter().flatten().take(3).cloned().collect::<Vec<_>>().join(", ");
        return Err(Error::BadField {
            path: spec.data.clone(),
            field: source.clone(),
            detail: format!("none of the {} genes is in scGPT's vocabulary ({} entries), e.g. {example}", names.len(), model.vocab.n_entries()),
            hint: Some("scGPT matches gene symbols (e.g. CD3E); pass --gene-col with the var column that holds them".into()),
        });
    }
    if matched < names.len() {
        notes.push(format!("{matched} of {} genes ({source}) are in scGPT's vocabulary; the others are left out, as upstream's embed_data does", names.len()));
    }
    let dim = model.dim();
    let out = PendingOutput::create(&spec.data, &spec.out)?;
    let key = "X_scgpt";
    let ds = out.create_obsm(key, ad.n_obs, dim)?;
    let p = rep.step("scgpt: embed", ad.n_obs as u64, "cells");
    let (mut sampled, mut empty) = (0usize, Vec::new());
    for (s, e) in x.blocks(1_000_000) {
        let b = x.read_rows(s, e)?;
        let cells: Vec<scgpt::Cell> = (0..b.n_rows())
            .map(|i| {
                let (idx, vals) = b.row(i);
                model.tokenizer.cell(idx, vals, &gene_ids, spec.seed, s + i)
            })
            .collect();
        sampled += cells.iter().filter(|c| c.sampled).count();
        empty.extend(cells.iter().enumerate().filter(|(_, c)| c.genes.len() == 1).map(|(i, _)| s + i));
        // longest first, batched by tokens, halving the batch on CUDA out-of-memory; rows back in input order
        let mut order: Vec<usize> = (0..cells.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(cells[i].genes.len()));
        let lens: Vec<usize> = cells.iter().map(|c| c.genes.len()).collect();
        let rows = batches.run_lagged(cells.len(), dim, &order, Some(&lens), 0.0, |idx| model.embed_batch_tensor(&idx.iter().map(|&i| &cells[i]).collect::<Vec<_>>()), |k| p.inc(k as u64))?;
        write_rows(&ds, s, &rows, dim)?;
    }
    p.finish();
    drop(ds);
    if sampled > 0 {
        notes.push(format!("{sampled} cell(s) had more than {} genes and were sampled to --max-len {max_len} (seeded by --seed, as upstream samples at random)", max_len - 1));
    }
    if !empty.is_empty() {
        notes.push(format!("{} cell(s) express no gene of the vocabulary ({}): embedded from <cls> alone, so they share one embedding (upstream's embed_data fails on them)", empty.len(), some_cells(&ad.obs_names, &empty)));
    }
    let mut params = spec.params.clone();
    batches.finish(&mut notes, true);
    params.insert("gene_col".into(), json!(gene_col));
    batches.record(spec, &mut params);
    params.insert("precision".into(), json!(if model.precision() == candle_core::DType::BF16 { "bf16" } else { "f32" }));
    params.insert("genes_matched".into(), json!(matched));
    params.insert("n_bins".into(), json!(model.args.n_bins));
    params.insert("input_emb_style".into(), json!(model.args.input_emb_style));
    params.insert("pad_value".into(), json!(model.args.pad_value as f64));
    params.insert("cell_embedding".into(), json!("<cls> output, L2-normalised"));
    params.insert("rng".into(), json!("numpy MT19937 per cell, seeded with (seed + cell row) mod 2^32: bin ties, then sampling"));
    params.insert("cells_sampled".into(), json!(sampled));
    params.insert("cells_without_vocab_genes".into(), json!(empty.len()));
    let mut w = serde_json::Map::new();
    w.insert("dir".into(), json!(model_dir.display().to_string()));
    commit_embedding(spec, out, key, &x.field, params, w, Value::Object(shas), ad.n_obs, dim, notes)
}

/// The first five of `cells`' names, ", ..." after them when there are more: for notes that name
/// the cells they are about.
pub(crate) fn some_cells(obs_names: &[String], cells: &[usize]) -> String {
    let shown: Vec<&str> = cells.iter().take(5).map(|&i| obs_names[i].as_str()).collect();
    format!("{}{}", shown.join(", "), if cells.len() > shown.len() { ", ..." } else { "" })
}

/// The last step of an embedding task: `uns['scfoundry']` (the [`provenance`], the parameters
/// the run used and the weights files it read, `weights`, with their sha256, `sha256`: a file's,
/// or an object of them by name) written into the pending output, which is then renamed into
/// place; the destination is untouched until this succeeds.
#[allow(clippy::too_many_arguments)]
pub(crate) fn commit_embedding(spec: &TaskSpec, out: PendingOutput, key: &str, matrix: &str, params: serde_json::Map<String, Value>, mut weights: serde_json::Map<String, Value>, sha256: Value, n_obs: usize, dim: usize, notes: Vec<String>) -> Result<TaskResult> {
    let uns = require_dict(out.file(), "uns").h5ctx(|| "creating uns".into())?;
    let mut prov = provenance(spec, key, matrix);
    prov.insert("parameters".into(), Value::Object(params));
    weights.insert("sha256".into(), sha256);
    prov.insert("weights".into(), Value::Object(weights));
    write_json_dict(&uns, "scfoundry", &prov).h5ctx(|| "writing uns/scfoundry".into())?;
    drop(uns);
    out.commit()?;
    Ok(TaskResult { output: Some(spec.out.clone()), obsm_key: Some(key.into()), n_obs, dim, notes, phases: Vec::new(), ..Default::default() })
}

/// The provenance every embedding task writes to `uns['scfoundry']`: tool, version, method,
/// command, seed, date, run, input and the matrix read. Callers add parameters and weights.
pub(crate) fn provenance(spec: &TaskSpec, key: &str, matrix: &str) -> serde_json::Map<String, Value> {
    let meta = std::fs::metadata(&spec.data).ok();
    let mut prov = serde_json::Map::new();
    prov.insert("tool".into(), json!("scfoundry"));
    prov.insert("version".into(), json!(env!("CARGO_PKG_VERSION")));
    prov.insert("method".into(), json!(spec.method));
    prov.insert("command".into(), json!(spec.command));
    prov.insert("command_line".into(), json!(spec.command_line));
    prov.insert("obsm_key".into(), json!(key));
    prov.insert("seed".into(), json!(spec.seed));
    prov.insert("date".into(), json!(chrono::Local::now().to_rfc3339()));
    prov.insert("run_id".into(), json!(spec.run_id));
    prov.insert("input".into(), json!(spec.data.display().to_string()));
    prov.insert("input_size".into(), json!(meta.as_ref().map(|m| m.len()).unwrap_or(0)));
    prov.insert("matrix".into(), json!(matrix));
    prov
}

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
    let opts = PcaOptions {
        n_comps: param_u64(spec, "n_comps", 50) as usize,
        n_top_genes: param_u64(spec, "n_top_genes", 2000) as usize,
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
    if std::env::var_os("SCFOUNDRY_PROFILE").is_some() {
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
    if std::env::var(crate::settings::EnvVars::FAIL_SHARD).ok().and_then(|v| v.parse::<usize>().ok()) == Some(shard) {
        return Err(Error::BadOption {
            option: crate::settings::EnvVars::FAIL_SHARD.into(),
            detail: format!("shard {shard} fails on purpose"),
            hint: Some(format!("unset {} (it exists to test failure handling)", crate::settings::EnvVars::FAIL_SHARD)),
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
    params.insert("hvg_flavor".into(), json!("seurat"));
    params.insert("n_hvg_selected".into(), json!(m));
    prov.insert("parameters".into(), Value::Object(params));
    prov.insert("weights".into(), json!({}));
    write_json_dict(&uns, "scfoundry", &prov).h5ctx(|| "writing uns/scfoundry".into())?;
    drop(uns);
    drop(varm);
    out.commit()?;
    Ok(TaskResult { output: Some(spec.out.clone()), obsm_key: Some(key.into()), n_obs: ad.n_obs, dim: nc, notes: l.notes.clone(), phases: vec![], ..Default::default() })
}

// ---- label transfer: embeddings of the reference and the query as raw f32 files ----------

/// Write rows x dim little-endian f32 to `path` through a temporary file.
fn write_f32_file(path: &Path, values: &[f32]) -> Result<()> {
    let tmp = path.with_extension("f32.tmp");
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).map_err(|e| Error::Io { path: d.into(), source: e })?;
    }
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&tmp, bytes).map_err(|e| Error::Io { path: tmp.clone(), source: e })?;
    std::fs::rename(&tmp, path).map_err(|e| Error::Io { path: path.into(), source: e })
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

/// Embed `spec.data` with cellama (per cell, nothing fitted); write it to `spec.out`.
fn transfer_embed_cellama(spec: &TaskSpec, task_dir: &Path) -> Result<TaskResult> {
    let rep = reporter(!spec.progress);
    let mut job = cellama_prepare(spec, task_dir)?;
    let dim = job.enc.hidden;
    let mut emb = vec![0f32; job.ad.n_obs * dim];
    cellama_encode(&mut job, rep.as_ref(), |start, rows| {
        emb[start * dim..start * dim + rows.len()].copy_from_slice(rows);
        Ok(())
    })?;
    write_f32_file(&spec.out, &emb)?;
    Ok(TaskResult { output: Some(spec.out.clone()), obsm_key: Some("X_cellama".into()), n_obs: job.ad.n_obs, dim, notes: job.notes, phases: vec![], ..Default::default() })
}

#[cfg(test)]
mod tests {
    #[test]
    fn length_stats_note_min_max_and_mean() {
        let mut l = super::LengthStats::default();
        assert_eq!(l.note("tokens"), None);
        for n in [5, 2, 9] {
            l.add(n);
        }
        assert_eq!(l.note("tokens").as_deref(), Some("tokens: 2 to 9, mean 5"));
    }
}
