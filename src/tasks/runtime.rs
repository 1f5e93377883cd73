//! The shared runtime of a task process: the device, batches with the out-of-memory
//! back-off, verified weights, input helpers shared by several methods, and the commit of an
//! embedding with its provenance.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::anndata::h5util::{require_dict, set_encoding, write_f64, write_i64, write_string};
use crate::anndata::write::PendingOutput;
use crate::anndata::AnnData;
use crate::error::{Error, Hdf5Context, Result};
use crate::gpu::readback::place_rows;
use crate::runner::{TaskResult, TaskSpec};
use crate::weights::{self, Manifest, Status};

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
                out.insert(id.to_string(), json!(weights::pinned_sha256(dir, id, e)?.unwrap_or_default()));
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

/// Where a method's model folder is pinned in a weights folder (e.g. `cellama::model_dir`).
pub type PinnedFolder = fn(&Path, &Manifest) -> PathBuf;

/// The model folder a run reads and the sha256 of its files: `--model-dir` when given (it
/// must hold `needed`; the files are hashed for the provenance), else the pinned entries
/// `required` of the weights folder (verified). `true` when it is the given folder.
pub fn model_folder(method: &str, params: &serde_json::Map<String, Value>, weights_dir: &Path, required: &[&str], needed: &[weights::Needed], pinned: PinnedFolder) -> Result<(PathBuf, serde_json::Map<String, Value>, bool)> {
    match given_model_dir(params) {
        Some(d) => {
            weights::require_files(method, "--model-dir", &d, needed)?;
            let files: Vec<&str> = needed.iter().map(|n| n.file).collect();
            let shas = weights::folder_shas(&d, &files)?;
            Ok((d, shas, true))
        }
        None => {
            let shas = verified_weights(method, weights_dir, required)?;
            Ok((pinned(weights_dir, &Manifest::load()?), shas, false))
        }
    }
}

/// For a method whose weights are several manifest entries: `--model-dir` read as a stand-in
/// weights folder, each of `required`'s files found in it by the tail of its path (as `weights
/// import` finds them: `panglao_pretrained.pth`, `models/models.ckpt`, ...), or the weights
/// folder itself. Returns the folder, a manifest whose entries' files are where they are in it,
/// and the sha256 of each file read (keyed by entry id).
pub fn weights_or_folder(method: &str, params: &serde_json::Map<String, Value>, weights_dir: &Path, required: &[&str]) -> Result<(PathBuf, Manifest, serde_json::Map<String, Value>)> {
    let manifest = Manifest::load()?;
    let Some(d) = given_model_dir(params) else {
        let shas = verified_weights(method, weights_dir, required)?;
        return Ok((weights_dir.to_path_buf(), manifest, shas));
    };
    let mut local = manifest.clone();
    let mut shas = serde_json::Map::new();
    for (id, tail) in folder_files(method, &d, &manifest, required)? {
        if d.join(&tail).is_file() {
            shas.insert(id.clone(), json!(weights::sha256_file(&d.join(&tail), |_| {})?));
        }
        if let Some(e) = local.weights.get_mut(&id) {
            e.file = tail;
        }
    }
    Ok((d, local, shas))
}

/// The files of `required` in a `--model-dir` (an archive entry, which upstream ships
/// extracted, stands for its extracted files beside it); an error naming the folder, the first
/// missing file and what upstream calls it.
fn folder_files(method: &str, dir: &Path, manifest: &Manifest, required: &[&str]) -> Result<Vec<(String, String)>> {
    let (mut found, absent) = manifest.find_in_folder(required, dir);
    for id in absent {
        let Some(e) = manifest.weights.get(&id) else { continue };
        let name = Path::new(&e.file).file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        if e.archive.is_some() {
            found.push((id, name));
            continue;
        }
        return Err(Error::ModelDir {
            dir: dir.to_path_buf(),
            detail: format!("--model-dir for {method} has no {name} ({})", manifest.what_is(&id)),
            hint: format!("--model-dir must name the folder that holds {method}'s files as upstream releases them (`scfoundry weights list --method {method}` lists them; {} is {name}'s place in the weights folder); a Hugging Face snapshot or cache entry works as it is", e.file),
        });
    }
    Ok(found)
}

/// The check before a run of [`weights_or_folder`].
pub fn check_weights_or_folder(method: &str, weights_dir: &Path, model_dir: Option<&Path>, required: &[&str]) -> Result<()> {
    match model_dir {
        Some(d) => folder_files(method, d, &Manifest::load()?, required).map(drop),
        None => verified_weights(method, weights_dir, required).map(drop),
    }
}

/// `--model-dir` as the commands resolved it (a Hugging Face cache entry is already its
/// snapshot), when given.
pub fn given_model_dir(params: &serde_json::Map<String, Value>) -> Option<PathBuf> {
    params.get("model_dir").and_then(Value::as_str).filter(|s| !s.is_empty()).map(PathBuf::from)
}

/// The check before a run of [`model_folder`]: the given folder holds `needed`, or the
/// weights folder holds the pinned entries (verified).
pub fn check_model_folder(method: &str, weights_dir: &Path, model_dir: Option<&Path>, required: &[&str], needed: &[weights::Needed]) -> Result<()> {
    match model_dir {
        Some(d) => weights::require_files(method, "--model-dir", d, needed),
        None => verified_weights(method, weights_dir, required).map(drop),
    }
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
            Column::Numeric(v) => v.iter().map(|&x| crate::methods::cellama::py_float(x)).collect(),
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

/// The total counts of cells `rows` (a task's rows; index `i - rows.start`): obs['n_counts']
/// when present (upstream requires it), else row sums of those rows only.
pub(crate) fn cell_totals(ad: &AnnData, x: &crate::anndata::Matrix, rows: std::ops::Range<usize>, notes: &mut Vec<String>) -> Result<Vec<f64>> {
    if let Some(t) = obs_totals(ad, x, rows.clone(), notes)? {
        return Ok(t);
    }
    let mut out = Vec::with_capacity(rows.len());
    let mut s = rows.start;
    while s < rows.end {
        let e = (s + 4096).min(rows.end);
        let b = x.read_rows(s, e)?;
        for i in 0..b.n_rows() {
            out.push(row_total(b.row(i).1));
        }
        s = e;
    }
    Ok(out)
}

/// obs['n_counts'] of cells `rows` (index `i - rows.start`), or None, with a note, when obs has
/// no numeric `n_counts`: the caller then takes each cell's [`row_total`] as it reads the row
/// (what [`cell_totals`] computes, without reading X once more).
pub(crate) fn obs_totals(ad: &AnnData, x: &crate::anndata::Matrix, rows: std::ops::Range<usize>, notes: &mut Vec<String>) -> Result<Option<Vec<f64>>> {
    use crate::anndata::dataframe::Column;
    let obs = ad.obs()?;
    if let Some(Column::Numeric(v)) = obs.column("n_counts") {
        return Ok(Some(v[rows].to_vec()));
    }
    notes.push(format!("obs has no numeric `n_counts` (upstream requires it: each cell's total counts); the row sums of {} were used", x.field));
    Ok(None)
}

/// A row's sum, in f64 (a cell's total counts when obs has no `n_counts`).
pub(crate) fn row_total(values: &[f32]) -> f64 {
    values.iter().map(|&v| v as f64).sum()
}

/// `--precision` for this task (`tasks::precision::decide`): `auto` (the default) is the
/// method's `[precision] gpu_default` on a GPU with bf16 and float32 on the CPU; the note saying
/// which precision ran and why joins `notes`.
pub(crate) fn precision(spec: &TaskSpec, device: &candle_core::Device, notes: &mut Vec<String>) -> candle_core::DType {
    use crate::tasks::precision::{decide, Requested};
    let registry = crate::registry::Registry::builtin();
    let gpu_default = registry.methods.get(&spec.method).and_then(|m| m.precision.as_ref()).map(|p| p.gpu_default);
    let requested = spec.params.get("precision").and_then(Value::as_str).and_then(Requested::parse).unwrap_or(Requested::Auto);
    let d = decide(gpu_default, requested, device.is_cuda(), compute_capability(device));
    notes.extend(d.note);
    match d.dtype {
        crate::registry::Dtype::Bf16 => candle_core::DType::BF16,
        crate::registry::Dtype::F32 => candle_core::DType::F32,
    }
}

/// The name a task records for the precision its model ran in (`parameters.precision`).
pub(crate) fn precision_name(dtype: candle_core::DType) -> &'static str {
    if dtype == candle_core::DType::BF16 {
        "bf16"
    } else {
        "f32"
    }
}

/// The GPU's compute capability; `None` on the CPU or when the driver does not say.
pub(crate) fn compute_capability(device: &candle_core::Device) -> Option<(u32, u32)> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return d.cuda_stream().context().compute_capability().ok().map(|(major, minor)| (major as u32, minor as u32));
    }
    let _ = device;
    None
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
    let mut params = params;
    // `precision` is what ran (the adapter's); `precision_requested` what was asked (`auto` by default)
    if let Some(asked) = spec.params.get("precision") {
        params.entry("precision_requested").or_insert_with(|| asked.clone());
    }
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

/// Write rows x dim little-endian f32 to `path` through a temporary file.
pub(crate) fn write_f32_file(path: &Path, values: &[f32]) -> Result<()> {
    let tmp = path.with_extension("f32.tmp");
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).map_err(|e| Error::Io { path: d.into(), source: e })?;
    }
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&tmp, bytes).map_err(|e| Error::Io { path: tmp.clone(), source: e })?;
    std::fs::rename(&tmp, path).map_err(|e| Error::Io { path: path.into(), source: e })
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

