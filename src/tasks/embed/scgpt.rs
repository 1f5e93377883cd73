//! The `embed` task of scGPT (see `methods/scgpt.rs`): vocabulary match, binned tokens, the
//! transformer longest cells first, provenance.

use std::path::Path;

use serde::Deserialize;
use serde_json::{json, Value};

use crate::tasks::shard::{EmbeddingOut, TaskRows};
use crate::anndata::AnnData;
use crate::error::{Error, Result};
use crate::progress::reporter;
use crate::runner::{Step, TaskResult, TaskSpec};
use crate::tasks::method::{self as method, one_step, Method, Preflight};
use crate::weights::{self, Manifest};
use crate::tasks::pipeline::{self, Plan, Stage, StageClock};
use crate::tasks::runtime::{check_model_folder, model_folder, precision, some_cells, Batches, TaskDevice};

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

fn embed_scgpt(spec: &TaskSpec, task_dir: &Path) -> Result<TaskResult> {
    use crate::methods::scgpt::{self, Model};
    use rayon::prelude::*;
    let clock = StageClock::new();
    let rep = reporter(!spec.progress);
    let dir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let (model_dir, shas, _) = model_folder(&spec.method, &spec.params, &dir, scgpt::REQUIRED_ENTRIES, scgpt::FOLDER, scgpt::model_dir)?;
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let mut notes = Vec::new();
    let p: Params = method::task_params(spec)?;
    let (max_len, batch, gene_col) = (p.max_len, p.batch_size, p.gene_col);
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
        |k| {
            let (s, e) = blocks[k];
            let b = clock.time(Stage::Read, || x.read_rows(s, e))?;
            Ok(clock.time(Stage::Tokenise, || {
                (0..b.n_rows())
                    .into_par_iter()
                    .with_min_len(32)
                    .map(|i| {
                        let (idx, vals) = b.row(i);
                        tokenizer.cell(idx, vals, gene_ids, seed, s + i)
                    })
                    .collect::<Vec<scgpt::Cell>>()
            }))
        },
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
    let mut result = out.commit(spec, &x.field, params, w, Value::Object(shas), notes)?;
    result.phases = clock.phases(setup, blocks_wall);
    Ok(result)
}

/// scGPT's options, from `methods/scgpt.toml`.
#[derive(Debug, Deserialize)]
pub struct Params {
    pub batch_size: usize,
    pub max_len: usize,
    pub gene_col: String,
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
    gene_col: String,
}

fn load_backbone(load: &method::BackboneLoad) -> Result<method::LoadedBackbone> {
    use crate::methods::scgpt;
    let wdir = load.spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let (dir, shas, _) = model_folder(&load.spec.method, load.params, &wdir, scgpt::REQUIRED_ENTRIES, scgpt::FOLDER, scgpt::model_dir)?;
    let model = scgpt::Model::load_hooked(&dir, method::param_u64(load.params, "max_len", scgpt::DEFAULT_MAX_LEN as u64) as usize, load.device.clone(), Some(load.hook))?;
    let gene_col = method::param_str(load.params, "gene_col").unwrap_or_else(|| "index".into());
    Ok(method::LoadedBackbone { backbone: Box::new(Backbone { model, gene_col }), base_dir: Some(dir), shas, files: Vec::new(), notes: Vec::new() })
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

    fn features<'a>(&'a self, ad: &AnnData, seed: u64, _device: &candle_core::Device, _train: bool, _notes: &mut Vec<String>) -> Result<(Box<dyn crate::nn::finetune::Features + 'a>, Vec<bool>)> {
        let x = ad.matrix(None)?;
        let names = scgpt_gene_names(ad, &self.gene_col)?;
        let gene_ids = crate::methods::scgpt::match_genes(&names, &self.model.vocab);
        if gene_ids.iter().all(Option::is_none) {
            return Err(Error::BadField { path: ad.path.clone(), field: "var_names".into(), detail: "none of the genes is in scGPT's vocabulary".into(), hint: Some("pass --gene-col with the var column of gene symbols".into()) });
        }
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
