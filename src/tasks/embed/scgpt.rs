//! The `embed` task of scGPT (see `methods/scgpt.rs`): vocabulary match, binned tokens, the
//! transformer longest cells first, provenance.

use std::path::Path;

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
use crate::tasks::runtime::{check_model_folder, model_folder, precision, some_cells, Batches, TaskDevice};

fn embed_scgpt(spec: &TaskSpec, task_dir: &Path) -> Result<TaskResult> {
    use crate::methods::scgpt::{self, Model};
    let clock = StageClock::new();
    let rep = reporter(!spec.progress);
    let dir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let (model_dir, shas, _) = model_folder(&spec.method, &spec.params, &dir, scgpt::REQUIRED_ENTRIES, scgpt::FOLDER, scgpt::model_dir)?;
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let mut notes = Vec::new();
    let p: Params = method::task_params(spec)?;
    let (max_len, batch) = (p.max_len, p.batch_size);
    let dev = TaskDevice::start(spec)?;
    let mut model = Model::load_on(&model_dir, max_len, dev.device.clone()).map_err(|e| dev.load_error(e, "loading the model's weights", task_dir))?;
    model.set_precision(precision(spec, &dev.device, &mut notes))?;
    dev.mark_loaded();
    let mut batches = Batches::new(dev, batch, task_dir);
    // symbols, found and mapped from Ensembl ids where needed (tasks::genes); the genes
    // outside the vocabulary are left out, as upstream's embed_data does
    let vocab = &model.vocab;
    let (genes, gene_match) = match_genes(&ad, &x, &spec.params, Kind::Symbols, &|g| vocab.get(g).is_some(), &mut notes)?;
    let names: Vec<Option<String>> = genes.names.iter().cloned().map(Some).collect();
    let gene_ids = scgpt::match_genes(&names, &model.vocab);
    let matched = gene_match.matched;
    let dim = model.dim();
    let key = "X_scgpt";
    let task_rows = TaskRows::new(spec, ad.n_obs, ScgptMethod.block_rows(&x, &spec.params))?;
    let out = EmbeddingOut::create(spec, &task_rows, key, ad.n_obs, dim)?;
    let p = rep.step("scgpt: embed", task_rows.len() as u64, "cells");
    let (mut sampled, mut empty) = (0usize, Vec::new());
    // blocks of rows, read and tokenised ahead on all cores while the device runs the block before
    let blocks = task_rows.blocks();
    let (tokenizer, gene_ids, x, seed) = (&model.tokenizer, &gene_ids, &x, spec.seed);
    let blocks_started = std::time::Instant::now();
    let setup = clock.elapsed();
    pipeline::run(
        blocks.len(),
        Plan::from_env(),
        |k| pipeline::read_and_map(&clock, x, blocks[k], 32, |row, idx, vals| tokenizer.cell(idx, vals, gene_ids, seed, row)),
        |k, cells| {
            let (s, _) = blocks[k];
            sampled += cells.iter().filter(|c| c.sampled).count();
            empty.extend(cells.iter().enumerate().filter(|(_, c)| c.genes.len() == 1).map(|(i, _)| s + i));
            // longest first, batched by tokens, halving the batch on CUDA out-of-memory; rows back in input order
            let mut order: Vec<usize> = (0..cells.len()).collect();
            order.sort_by_key(|&i| std::cmp::Reverse(cells[i].genes.len()));
            let lens: Vec<usize> = cells.iter().map(|c| c.genes.len()).collect();
            let rows = clock.time(Stage::Device, || batches.run_lagged(cells.len(), dim, &order, Some(&lens), 0.0, |idx| model.embed_batch_tensor(&idx.iter().map(|&i| &cells[i]).collect::<Vec<_>>()), |k| p.inc(k as u64)))?;
            clock.time(Stage::Write, || out.write(s, &rows))
        },
    )?;
    let blocks_wall = blocks_started.elapsed().as_secs_f64();
    p.finish();
    if sampled > 0 {
        notes.push(format!("{sampled} cell(s) had more than {} genes and were sampled to --max-len {max_len} (seeded by --seed, as upstream samples at random)", max_len - 1));
    }
    if !empty.is_empty() {
        notes.push(format!("{} cell(s) express no gene of the vocabulary ({}): embedded from <cls> alone, so they share one embedding (upstream's embed_data fails on them)", empty.len(), some_cells(&ad.obs_names, &empty)));
    }
    let mut params = spec.params.clone();
    batches.finish(&mut notes, true);
    genes::record(&gene_match, &genes, &mut params);
    batches.record(spec, &mut params);
    params.insert("precision".into(), json!(crate::tasks::runtime::precision_name(model.precision())));
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
    let mut result = out.commit(spec, &x.field, params, w, Value::Object(shas), notes)?;
    result.phases = clock.phases(setup, blocks_wall);
    result.gene_match = Some(gene_match.to_json());
    Ok(result)
}

/// scGPT's options, from `methods/scgpt.toml`.
#[derive(Debug, Deserialize)]
pub struct Params {
    pub batch_size: usize,
    pub max_len: usize,
}

/// scGPT: the table's entry.
pub struct ScgptMethod;

impl Method for ScgptMethod {
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
            None => crate::methods::scgpt::model_dir(weights_dir, &Manifest::load()?),
        };
        let path = dir.join("args.json");
        Ok(Some(crate::tasks::method::LayerCount { path, key: "nlayers", left_out: 0 }))
    }

    fn check(&self, pf: &Preflight) -> Result<()> {
        check_model_folder(pf.method, pf.weights_dir, pf.model_dir, crate::methods::scgpt::REQUIRED_ENTRIES, crate::methods::scgpt::FOLDER)
    }

    fn embed(&self, spec: &TaskSpec, task_dir: &Path, step: &Step) -> Option<Result<TaskResult>> {
        one_step(step, || embed_scgpt(spec, task_dir))
    }
}

// ---- fine-tuning ---------------------------------------------------------------------------

/// scGPT as a fine-tuning backbone, with the var column of its gene symbols.
struct Backbone {
    model: crate::methods::scgpt::Model,
    column: Option<String>,
    min_gene_match: f64,
}

fn load_backbone(load: &method::BackboneLoad) -> Result<method::LoadedBackbone> {
    use crate::methods::scgpt;
    let wdir = load.spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let (dir, shas, _) = model_folder(&load.spec.method, load.params, &wdir, scgpt::REQUIRED_ENTRIES, scgpt::FOLDER, scgpt::model_dir)?;
    let model = scgpt::Model::load_hooked(&dir, method::param_u64(load.params, "max_len", scgpt::DEFAULT_MAX_LEN as u64) as usize, load.device.clone(), Some(load.hook))?;
    let (column, min_gene_match) = genes::options(load.params);
    Ok(method::LoadedBackbone { backbone: Box::new(Backbone { model, column, min_gene_match }), base_dir: Some(dir), shas, files: Vec::new(), notes: Vec::new() })
}

/// The cells' tokens, run through the model on demand.
struct Cells<'a> {
    model: &'a crate::methods::scgpt::Model,
    cells: Vec<crate::methods::scgpt::Cell>,
}

impl crate::nn::finetune::Features for Cells<'_> {
    fn forward(&mut self, cells: &[usize]) -> Result<candle_core::Tensor> {
        self.model.embed_tensor(&cells.iter().map(|&i| &self.cells[i]).collect::<Vec<_>>())
    }
}

impl method::Backbone for Backbone {
    fn dim(&self) -> usize {
        self.model.dim()
    }

    fn features<'a>(&'a self, ad: &AnnData, seed: u64, _device: &candle_core::Device, _train: bool, notes: &mut Vec<String>) -> Result<(Box<dyn crate::nn::finetune::Features + 'a>, Vec<bool>)> {
        let x = ad.matrix(None)?;
        let vocab = &self.model.vocab;
        let (genes, _) = genes::match_genes_with(ad, &x, self.column.as_deref(), self.min_gene_match, Kind::Symbols, &|g| vocab.get(g).is_some(), notes)?;
        let names: Vec<Option<String>> = genes.names.into_iter().map(Some).collect();
        let gene_ids = crate::methods::scgpt::match_genes(&names, vocab);
        let mut cells = Vec::with_capacity(ad.n_obs);
        for (s, e) in x.blocks(1_000_000) {
            let b = x.read_rows(s, e)?;
            for i in 0..b.n_rows() {
                let (idx, vals) = b.row(i);
                cells.push(self.model.tokenizer.cell(idx, vals, &gene_ids, seed, s + i));
            }
        }
        Ok((Box::new(Cells { model: &self.model, cells }), vec![true; ad.n_obs]))
    }
}
