//! The `embed` and `transfer` tasks of cellama (see `methods/cellama.rs`): cell sentences, the
//! sentence encoder in batches, provenance.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::{json, Value};

use crate::anndata::AnnData;
use crate::error::Result;
use crate::progress::reporter;
use crate::runner::{Step, TaskResult, TaskSpec};
use crate::tasks::method::{self as method, one_step, Method, Preflight};
use crate::weights::{self, Manifest};
use crate::methods::cellama::{self, Encoder};
use crate::tasks::genes::{is_symbol, match_genes, GeneMatch, Kind, Resolved};
use crate::tasks::runtime::{check_model_folder, model_folder, obs_strings, precision, precision_name, write_f32_file, Batches, TaskDevice};
use crate::tasks::pipeline::{self, Plan, Stage, StageClock};
use crate::tasks::shard::{EmbeddingOut, TaskRows};

/// Cell sentences for rows `start..` of a block (see `methods/cellama.rs`).
pub fn cellama_sentences(block: &crate::anndata::CsrBlock, var_names: &[String], obs: &[(String, Vec<String>)], top: usize) -> Vec<String> {
    (0..block.n_rows())
        .map(|i| {
            let (idx, vals) = block.row(i);
            row_sentence(block.start_row + i, idx, vals, var_names, obs, top)
        })
        .collect()
}

/// The sentence of row `row` of the file, given its (genes, values).
fn row_sentence(row: usize, idx: &[u32], vals: &[f32], var_names: &[String], obs: &[(String, Vec<String>)], top: usize) -> String {
    let genes: Vec<&str> = cellama::top_genes(idx, vals, var_names.len(), top).into_iter().map(|j| var_names[j].as_str()).collect();
    let fields: Vec<(&str, &str)> = obs.iter().map(|(n, v)| (n.as_str(), v[row].as_str())).collect();
    cellama::sentence(&genes, &fields)
}

/// What a cellama task needs: the data, its sentences' parts and the loaded encoder.
struct CellamaJob {
    ad: AnnData,
    x: crate::anndata::Matrix,
    top: usize,
    obs: Vec<(String, Vec<String>)>,
    enc: Encoder,
    /// The precision the encoder runs in (`--precision`).
    dtype: candle_core::DType,
    model_dir: PathBuf,
    shas: serde_json::Map<String, Value>,
    notes: Vec<String>,
    batches: Batches,
    /// The gene names written into the sentences (Ensembl ids mapped to symbols) and the match.
    genes: Resolved,
    gene_match: GeneMatch,
}

fn cellama_prepare(spec: &TaskSpec, task_dir: &Path) -> Result<CellamaJob> {
    let dir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let (model_dir, shas, _) = model_folder(&spec.method, &spec.params, &dir, cellama::REQUIRED_ENTRIES, cellama::FOLDER, cellama::model_dir)?;
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let mut notes = Vec::new();
    let p: Params = method::task_params(spec)?;
    let top = p.top_genes;
    let features: Vec<String> = p
        .obs_features
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    let obs = obs_strings(&ad, &features, &mut notes)?;
    // gene names as text: Ensembl ids mapped to symbols (tasks::genes)
    let (genes, gene_match) = match_genes(&ad, &x, &spec.params, Kind::Symbols, &is_symbol, &mut notes)?;
    let dev = TaskDevice::start(spec)?;
    let dtype = precision(spec, &dev.device, &mut notes);
    let enc = Encoder::load_dtype(&model_dir, dev.device.clone(), dtype).map_err(|e| dev.load_error(e, "loading the model's weights", task_dir))?;
    dev.mark_loaded();
    let batches = Batches::new(dev, p.batch_size.max(1), task_dir);
    Ok(CellamaJob { ad, x, top, obs, enc, dtype, model_dir, shas, notes, batches, genes, gene_match })
}

/// Encode the cells of `rows`, batched within the blocks of its grid (so a shard's batches are
/// the whole run's); `sink(start_row, rows)` receives blocks of `enc.hidden`-wide rows. While the
/// device runs a block, the next is read and its sentences built and tokenized on all cores
/// (`tasks::pipeline`). Adds a note when sentences were truncated; returns the task's phases.
fn cellama_encode(job: &mut CellamaJob, rep: &dyn crate::progress::Reporter, rows: &TaskRows, clock: &StageClock, mut sink: impl FnMut(usize, &[f32]) -> Result<()>) -> Result<Vec<(String, f64)>> {
    let CellamaJob { enc, x, genes, obs, top, batches, notes, .. } = job;
    let (enc, x, dim, top) = (&*enc, &*x, enc.hidden, *top);
    let (names, obs) = (&genes.names, &*obs);
    let p = rep.step("cellama: encode", rows.len() as u64, "cells");
    let mut truncated = 0usize;
    let blocks = rows.blocks();
    let setup = clock.elapsed();
    let started = std::time::Instant::now();
    pipeline::run(
        blocks.len(),
        Plan::from_env(),
        |k| {
            let sentences = pipeline::read_and_map(clock, x, blocks[k], 64, |row, idx, vals| row_sentence(row, idx, vals, names, obs, top))?;
            // tokenized once, on all cores
            clock.time(Stage::Tokenise, || enc.tokenize(&sentences))
        },
        |k, ids| {
            truncated += ids.iter().filter(|t| t.len() >= enc.max_seq_length).count();
            // batched longest first, so each batch's sentences are of similar lengths
            let order = cellama::longest_first(&ids);
            let out = clock.time(Stage::Device, || batches.run(ids.len(), dim, &order, 0.0, |idx| enc.encode_ids(&idx.iter().map(|&i| ids[i].as_slice()).collect::<Vec<_>>()), |n| p.inc(n as u64)))?;
            clock.time(Stage::Write, || sink(blocks[k].0, &out))
        },
    )?;
    let blocks_wall = started.elapsed().as_secs_f64();
    p.finish();
    if truncated > 0 {
        notes.push(format!("{truncated} cell sentence(s) reached the model's {} tokens and were truncated, as sentence-transformers does", enc.max_seq_length));
    }
    batches.finish(notes, true);
    Ok(clock.phases(setup, blocks_wall))
}

fn embed_cellama(spec: &TaskSpec, task_dir: &Path) -> Result<TaskResult> {
    let rep = reporter(!spec.progress);
    let clock = StageClock::new();
    let mut job = cellama_prepare(spec, task_dir)?;
    let dim = job.enc.hidden;
    let key = "X_cellama";
    let rows = TaskRows::new(spec, job.ad.n_obs, Cellama.block_rows(&job.x, &spec.params))?;
    let out = EmbeddingOut::create(spec, &rows, key, job.ad.n_obs, dim)?;
    let phases = cellama_encode(&mut job, rep.as_ref(), &rows, &clock, |s, r| out.write(s, r))?;
    let CellamaJob { x, enc, dtype, model_dir, shas, notes, genes, gene_match, batches, .. } = job;
    let mut params = spec.params.clone();
    crate::tasks::genes::record(&gene_match, &genes, &mut params);
    batches.record(spec, &mut params);
    params.insert("precision".into(), json!(precision_name(dtype)));
    params.insert("max_seq_length".into(), json!(enc.max_seq_length));
    params.insert("pooling".into(), json!("mean, L2-normalised"));
    params.insert("tie_order".into(), json!("gene order (stable argsort)"));
    let mut w = serde_json::Map::new();
    w.insert("dir".into(), json!(model_dir.display().to_string()));
    let mut result = out.commit(spec, &x.field, params, w, Value::Object(shas), notes)?;
    result.gene_match = Some(gene_match.to_json());
    result.phases = phases;
    Ok(result)
}

/// Embed `spec.data` with cellama (per cell, nothing fitted); write it to `spec.out`.
fn transfer_embed_cellama(spec: &TaskSpec, task_dir: &Path) -> Result<TaskResult> {
    let rep = reporter(!spec.progress);
    let clock = StageClock::new();
    let mut job = cellama_prepare(spec, task_dir)?;
    let dim = job.enc.hidden;
    let mut emb = vec![0f32; job.ad.n_obs * dim];
    let rows = TaskRows::new(spec, job.ad.n_obs, Cellama.block_rows(&job.x, &spec.params))?;
    let phases = cellama_encode(&mut job, rep.as_ref(), &rows, &clock, |start, rows| {
        emb[start * dim..start * dim + rows.len()].copy_from_slice(rows);
        Ok(())
    })?;
    write_f32_file(&spec.out, &emb)?;
    Ok(TaskResult { output: Some(spec.out.clone()), obsm_key: Some("X_cellama".into()), n_obs: job.ad.n_obs, dim, notes: job.notes, phases, ..Default::default() })
}

/// cellama's options, from `methods/cellama.toml`.
#[derive(Debug, Deserialize)]
pub struct Params {
    pub top_genes: usize,
    pub obs_features: String,
    /// Sentences a forward pass (`[batch]`: sentence-transformers' 32 on the CPU).
    pub batch_size: usize,
}

/// cellama: the table's entry.
pub struct Cellama;

impl Method for Cellama {
    /// Blocks of about 4 million stored values (about 4,000 cells of 1,000 genes); a sentence's
    /// embedding does not depend on its batch, so blocks need not hold whole batches.
    fn block_rows(&self, x: &crate::anndata::Matrix, _params: &serde_json::Map<String, Value>) -> usize {
        crate::tasks::shard::block_rows(x, 4_000_000, 1)
    }

    fn check(&self, pf: &Preflight) -> Result<()> {
        check_model_folder(pf.method, pf.weights_dir, pf.model_dir, cellama::REQUIRED_ENTRIES, cellama::FOLDER)
    }

    fn transfers(&self) -> bool {
        true
    }

    fn check_transfer(&self, pf: &Preflight) -> Result<()> {
        check_model_folder(pf.method, pf.weights_dir, pf.model_dir, cellama::REQUIRED_ENTRIES, cellama::FOLDER)
    }

    fn finetunes(&self) -> bool {
        true
    }

    fn unfreezes(&self) -> bool {
        true
    }

    fn backbone(&self, load: &method::BackboneLoad) -> Option<Result<method::LoadedBackbone>> {
        Some(load_backbone(load))
    }

    fn layer_count(&self, weights_dir: &Path, params: &serde_json::Map<String, Value>) -> Result<Option<crate::tasks::method::LayerCount>> {
        let dir = match method::model_dir(params) {
            Some(d) => d,
            None => cellama::model_dir(weights_dir, &Manifest::load()?),
        };
        let path = dir.join("config.json");
        Ok(Some(crate::tasks::method::LayerCount { path, key: "num_hidden_layers", left_out: 0 }))
    }

    fn embed(&self, spec: &TaskSpec, task_dir: &Path, step: &Step) -> Option<Result<TaskResult>> {
        one_step(step, || embed_cellama(spec, task_dir))
    }

    fn transfer(&self, spec: &TaskSpec, task_dir: &Path, step: &Step) -> Option<Result<TaskResult>> {
        one_step(step, || transfer_embed_cellama(spec, task_dir))
    }
}

// ---- fine-tuning ---------------------------------------------------------------------------

/// cellama's encoder as a fine-tuning backbone, with the sentence options in effect.
struct Backbone {
    enc: Encoder,
    top: usize,
    obs_features: Vec<String>,
    gene_column: Option<String>,
    min_gene_match: f64,
}

fn load_backbone(load: &method::BackboneLoad) -> Result<method::LoadedBackbone> {
    let wdir = load.spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let (dir, shas, _) = model_folder(&load.spec.method, load.params, &wdir, cellama::REQUIRED_ENTRIES, cellama::FOLDER, cellama::model_dir)?;
    let enc = Encoder::load_hooked(&dir, load.device.clone(), Some(load.hook))?;
    let obs_features = method::param_str(load.params, "obs_features").map(|f| f.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect()).unwrap_or_default();
    let top = method::param_u64(load.params, "top_genes", cellama::DEFAULT_TOP_GENES as u64) as usize;
    let (gene_column, min_gene_match) = crate::tasks::genes::options(load.params);
    Ok(method::LoadedBackbone { backbone: Box::new(Backbone { enc, top, obs_features, gene_column, min_gene_match }), base_dir: Some(dir), shas, files: Vec::new(), notes: Vec::new() })
}

/// The cells' sentences, encoded on demand.
struct Sentences<'a> {
    enc: &'a Encoder,
    sentences: Vec<String>,
}

impl crate::nn::finetune::Features for Sentences<'_> {
    fn forward(&mut self, cells: &[usize]) -> Result<candle_core::Tensor> {
        self.enc.encode_tensor(&cells.iter().map(|&i| self.sentences[i].clone()).collect::<Vec<_>>())
    }
}

impl method::Backbone for Backbone {
    fn dim(&self) -> usize {
        self.enc.hidden
    }

    fn features<'a>(&'a self, ad: &AnnData, _seed: u64, _device: &candle_core::Device, _train: bool, notes: &mut Vec<String>) -> Result<(Box<dyn crate::nn::finetune::Features + 'a>, Vec<bool>)> {
        let x = ad.matrix(None)?;
        let obs = obs_strings(ad, &self.obs_features, notes)?;
        let (genes, _) = crate::tasks::genes::match_genes_with(ad, &x, self.gene_column.as_deref(), self.min_gene_match, Kind::Symbols, &is_symbol, notes)?;
        // each block read, then its sentences built on all cores (as `embed` builds them)
        let clock = StageClock::new();
        let mut sentences = Vec::with_capacity(ad.n_obs);
        for block in x.blocks(1_000_000) {
            sentences.extend(pipeline::read_and_map(&clock, &x, block, 64, |row, idx, vals| row_sentence(row, idx, vals, &genes.names, &obs, self.top))?);
        }
        Ok((Box::new(Sentences { enc: &self.enc, sentences }), vec![true; ad.n_obs]))
    }
}
