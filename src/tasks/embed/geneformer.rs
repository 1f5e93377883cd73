//! The `embed` task of Geneformer (see `methods/geneformer.rs`): rank-value tokens, the
//! encoder longest cells first, provenance.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::{json, Value};

use crate::tasks::shard::{EmbeddingOut, TaskRows};
use crate::anndata::AnnData;
use crate::error::Result;
use crate::progress::reporter;
use crate::runner::{Step, TaskResult, TaskSpec};
use crate::tasks::method::{self as method, one_step, Method, Preflight};
use crate::weights::{self, Manifest};
use crate::tasks::pipeline::{self, Plan, Stage, StageClock};
use crate::tasks::genes::{self, match_genes, Kind};
use crate::tasks::runtime::{cell_totals, obs_totals, row_total, precision, verified_weights, Batches, TaskDevice};

fn embed_geneformer(spec: &TaskSpec, task_dir: &Path) -> Result<TaskResult> {
    use crate::methods::geneformer::{self, EmbMode, GeneTable, Geneformer};
    let clock = StageClock::new();
    let rep = reporter(!spec.progress);
    let given_dir = spec.params.get("model_dir").and_then(Value::as_str).filter(|s| !s.is_empty()).map(PathBuf::from);
    let (model_dir, mut shas) = match &given_dir {
        Some(d) => (d.clone(), serde_json::Map::new()),
        None => {
            let dir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
            let shas = verified_weights(&spec.method, &dir, geneformer::REQUIRED_ENTRIES)?;
            (geneformer::model_dir(&dir, &Manifest::load()?), shas)
        }
    };
    let p: Params = method::task_params(spec)?;
    let emb_layer = p.emb_layer;
    let emb_mode = EmbMode::parse(&p.emb_mode)?;
    let batch = method::task_params::<Params>(spec)?.batch_size.max(1);
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let dict = geneformer::Dictionaries::find(&model_dir)?;
    let mut notes = Vec::new();
    // Ensembl ids, found and mapped from symbols where needed (tasks::genes)
    let (genes, gene_match) = match_genes(&ad, &x, &spec.params, Kind::Ensembl, &|g| dict.knows(g), &mut notes)?;
    let ids = genes.names.clone();
    let dev = TaskDevice::start(spec)?;
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
    if table.n_duplicated > 0 {
        notes.push(format!("{} var entries share an Ensembl id with another; their counts were summed, as upstream's collapse_gene_ids", table.n_duplicated));
    }
    let dim = model.hidden();
    let key = "X_geneformer";
    let task_rows = TaskRows::new(spec, ad.n_obs, GeneformerMethod.block_rows(&x, &spec.params))?;
    let out = EmbeddingOut::create(spec, &task_rows, key, ad.n_obs, dim)?;
    // obs['n_counts'], or each row's sum taken as the block is read
    let totals = obs_totals(&ad, &x, task_rows.start..task_rows.end, &mut notes)?;
    let p = rep.step("geneformer: embed", task_rows.len() as u64, "cells");
    let (mut empty, mut truncated, mut n_tokens) = (0usize, 0usize, 0usize);
    // blocks of rows, read and tokenised ahead on all cores while the device runs the block
    // before; within a block, groups of 20 batches, each run longest first and written in the
    // input order
    let blocks = task_rows.blocks();
    let group = batch.max(1) * 20;
    let (input_size, specials) = (model.input_size, model.dict.specials);
    let max_ranked = input_size - if specials.is_some() { 2 } else { 0 };
    let (table, totals, x) = (&table, totals.as_deref(), &x);
    let first_row = task_rows.start;
    let blocks_started = std::time::Instant::now();
    let setup = clock.elapsed();
    pipeline::run(
        blocks.len(),
        Plan::from_env(),
        |k| {
            pipeline::read_and_map(&clock, x, blocks[k], 32, |row, idx, vals| {
                let total = totals.map_or_else(|| row_total(vals), |t| t[row - first_row]);
                let ranked = table.rank(idx, vals, total);
                let cut = ranked.len() > max_ranked;
                (geneformer::finish_tokens(ranked, input_size, specials), cut)
            })
        },
        |k, tokenised| {
            let (s, _) = blocks[k];
            truncated += tokenised.iter().filter(|t| t.1).count();
            let mut tokenised = tokenised.into_iter();
            for start in (s..blocks[k].1).step_by(group) {
                let end = (start + group).min(blocks[k].1);
                let cells: Vec<Vec<u32>> = tokenised.by_ref().take(end - start).map(|t| t.0).collect();
                empty += cells.iter().filter(|c| c.is_empty()).count();
                n_tokens += cells.iter().map(Vec::len).sum::<usize>();
                // longest first, batched by tokens, halving the batch on CUDA out-of-memory; rows back in input order
                let order = geneformer::length_order(&cells);
                p.inc((cells.len() - order.len()) as u64);
                let lens: Vec<usize> = cells.iter().map(Vec::len).collect();
                let rows = clock.time(Stage::Device, || batches.run_lagged(cells.len(), dim, &order, Some(&lens), f32::NAN, |idx| model.forward_tensor(idx.iter().map(|&i| cells[i].as_slice()).collect()), |k| p.inc(k as u64)))?;
                clock.time(Stage::Write, || out.write(start, &rows))?;
            }
            Ok(())
        },
    )?;
    let blocks_wall = blocks_started.elapsed().as_secs_f64();
    p.finish();
    if empty > 0 {
        notes.push(format!("{empty} cell(s) have no gene in the token dictionary: their embedding is NaN (upstream drops such cells)"));
    }
    if truncated > 0 {
        notes.push(format!("{truncated} cell(s) have more ranked genes than the model's {} input tokens and were truncated, as upstream", model.input_size));
    }
    batches.finish(&mut notes, true);
    let mut params = spec.params.clone();
    genes::record(&gene_match, &genes, &mut params);
    batches.record(spec, &mut params);
    params.insert("emb_layer".into(), json!(emb_layer));
    params.insert("emb_mode".into(), json!(emb_mode.name()));
    params.insert("precision".into(), json!(crate::tasks::runtime::precision_name(dtype)));
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
    let mut result = out.commit(spec, &x.field, params, w, Value::Object(shas), notes)?;
    result.phases = clock.phases(setup, blocks_wall);
    result.gene_match = Some(gene_match.to_json());
    Ok(result)
}

/// Geneformer's options, from `methods/geneformer.toml`.
#[derive(Debug, Deserialize)]
pub struct Params {
    pub batch_size: usize,
    pub emb_layer: i32,
    pub emb_mode: String,
}

/// Geneformer: the table's entry.
pub struct GeneformerMethod;

impl Method for GeneformerMethod {
    fn block_rows(&self, x: &crate::anndata::Matrix, params: &serde_json::Map<String, serde_json::Value>) -> usize {
        // cells are sorted by length in groups of 20 batches: blocks are whole groups
        let batch = params.get("batch_size").and_then(serde_json::Value::as_u64).unwrap_or(1).max(1) as usize;
        crate::tasks::shard::block_rows(x, 2_000_000, batch * 20)
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
        let dir = match params.get("model_dir").and_then(Value::as_str).filter(|s| !s.is_empty()) {
            Some(d) => PathBuf::from(d),
            None => crate::methods::geneformer::model_dir(weights_dir, &Manifest::load()?),
        };
        // emb_layer -1 reads the second-to-last layer: the last one is not run
        let emb_layer = params.get("emb_layer").and_then(Value::as_i64).unwrap_or(-1);
        Ok(Some(crate::tasks::method::LayerCount { path: dir.join("config.json"), key: "num_hidden_layers", left_out: emb_layer.unsigned_abs() }))
    }

    fn check(&self, pf: &Preflight) -> Result<()> {
        match pf.model_dir {
            Some(d) => crate::methods::geneformer::Dictionaries::find(d).map(drop),
            None => verified_weights(pf.method, pf.weights_dir, crate::methods::geneformer::REQUIRED_ENTRIES).map(drop),
        }
    }

    fn embed(&self, spec: &TaskSpec, task_dir: &Path, step: &Step) -> Option<Result<TaskResult>> {
        one_step(step, || embed_geneformer(spec, task_dir))
    }
}

// ---- fine-tuning ---------------------------------------------------------------------------

/// Geneformer as a fine-tuning backbone, with the var column of its gene ids.
struct Backbone {
    model: crate::methods::geneformer::Geneformer,
    column: Option<String>,
    min_gene_match: f64,
}

fn load_backbone(load: &method::BackboneLoad) -> Result<method::LoadedBackbone> {
    use crate::methods::geneformer::{self, Dictionaries, EmbMode, Geneformer};
    let mut shas = serde_json::Map::new();
    let dir = match method::param_str(load.params, "model_dir") {
        Some(d) => PathBuf::from(d),
        None => {
            let wdir = load.spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
            shas = verified_weights(&load.spec.method, &wdir, geneformer::REQUIRED_ENTRIES)?;
            geneformer::model_dir(&wdir, &Manifest::load()?)
        }
    };
    let emb_layer = load.params.get("emb_layer").and_then(Value::as_i64).unwrap_or(-1) as i32;
    let mode = EmbMode::parse(load.params.get("emb_mode").and_then(Value::as_str).unwrap_or("cell"))?;
    let model = Geneformer::load_hooked(&dir, Dictionaries::find(&dir)?, emb_layer, mode, load.device.clone(), Some(load.hook))?;
    if shas.is_empty() {
        for p in [&model.weights_path, &model.dict.token_path, &model.dict.median_path] {
            let name = p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
            shas.insert(name, json!(weights::sha256_file(p, |_| {})?));
        }
    }
    let (column, min_gene_match) = genes::options(load.params);
    Ok(method::LoadedBackbone { backbone: Box::new(Backbone { model, column, min_gene_match }), base_dir: Some(dir), shas, files: Vec::new(), notes: Vec::new() })
}

/// The cells' tokens, run through the model on demand.
struct Tokens<'a> {
    model: &'a crate::methods::geneformer::Geneformer,
    cells: Vec<Vec<u32>>,
}

impl crate::nn::finetune::Features for Tokens<'_> {
    fn forward(&mut self, cells: &[usize]) -> Result<candle_core::Tensor> {
        self.model.forward_tensor(cells.iter().map(|&i| self.cells[i].as_slice()).collect())
    }
}

impl method::Backbone for Backbone {
    fn dim(&self) -> usize {
        self.model.hidden()
    }

    /// Cells with no gene in the token dictionary have no features.
    fn features<'a>(&'a self, ad: &AnnData, _seed: u64, _device: &candle_core::Device, _train: bool, notes: &mut Vec<String>) -> Result<(Box<dyn crate::nn::finetune::Features + 'a>, Vec<bool>)> {
        use crate::methods::geneformer::GeneTable;
        let x = ad.matrix(None)?;
        let dict = &self.model.dict;
        let (genes, _) = genes::match_genes_with(ad, &x, self.column.as_deref(), self.min_gene_match, Kind::Ensembl, &|g| dict.knows(g), notes)?;
        let table = GeneTable::new(&genes.names, dict)?;
        let totals = cell_totals(ad, &x, 0..ad.n_obs, notes)?;
        let mut cells = Vec::with_capacity(ad.n_obs);
        for (s, e) in x.blocks(1_000_000) {
            let b = x.read_rows(s, e)?;
            for i in 0..b.n_rows() {
                let (idx, vals) = b.row(i);
                cells.push(self.model.tokens(table.rank(idx, vals, totals[s + i])));
            }
        }
        let usable: Vec<bool> = cells.iter().map(|c| !c.is_empty()).collect();
        let empty = usable.iter().filter(|u| !**u).count();
        if empty > 0 {
            notes.push(format!("{empty} cell(s) of {} have no gene in the token dictionary: they are left out (no prediction)", ad.path.display()));
        }
        Ok((Box::new(Tokens { model: &self.model, cells }), usable))
    }
}
