//! The `embed` task of scCello and LangCell (see `methods/cls_encoder.rs`): the V1
//! dictionaries, geneformer 0.0.1's per-column gene table with each upstream's scaling, `<cls>`
//! tokens, the encoder in batches with the GPU back-off, provenance.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::tasks::pipeline::{self, Plan, Stage, StageClock};
use crate::tasks::genes::{self, match_genes, Kind};
use crate::tasks::runtime::{verified_weights, Batches, TaskDevice};
use crate::tasks::method::{self as method, one_step, Method, Preflight};
use serde::Deserialize;
use crate::tasks::shard::{EmbeddingOut, TaskRows};
use crate::anndata::AnnData;
use crate::error::Result;
use crate::nn::cls_encoder::{Arch, ClsEncoder};
use crate::methods::geneformer::{self, length_order, Dictionaries};
use crate::methods::{langcell, sccello};
use crate::progress::reporter;
use crate::runner::{TaskResult, TaskSpec};
use crate::weights::{self, Manifest};

/// The model folder given with --model-dir or found in the weights folder; its sha256s.
fn model_folder(spec: &TaskSpec, arch: Arch) -> Result<(PathBuf, serde_json::Map<String, Value>, bool)> {
    if let Some(d) = spec.params.get("model_dir").and_then(Value::as_str).filter(|s| !s.is_empty()) {
        return Ok((PathBuf::from(d), serde_json::Map::new(), true));
    }
    let dir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let manifest = Manifest::load()?;
    Ok(match arch {
        Arch::Sccello => (sccello::model_dir(&dir, &manifest), verified_weights(&spec.method, &dir, sccello::REQUIRED_ENTRIES)?, false),
        Arch::Langcell => (langcell::ckpt_dir(&dir, &manifest), verified_weights(&spec.method, &dir, langcell::REQUIRED_ENTRIES)?, false),
    })
}

/// Load the encoder of `arch` from its folder (dictionaries found beside it or one level up).
pub fn load(arch: Arch, dir: &Path, device: candle_core::Device) -> Result<ClsEncoder> {
    let dict = Dictionaries::find(dir)?;
    match arch {
        Arch::Sccello => sccello::load(dir, dict, device),
        Arch::Langcell => langcell::load(dir, dict, device),
    }
}

pub(super) fn embed(spec: &TaskSpec, task_dir: &Path, arch: Arch) -> Result<TaskResult> {
    let clock = StageClock::new();
    let rep = reporter(!spec.progress);
    let name = arch.name();
    let (model_dir, mut shas, given) = model_folder(spec, arch)?;
    let batch = method::task_params::<Params>(spec)?.batch_size.max(1);
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let mut notes = Vec::new();
    let dev = TaskDevice::start(spec)?;
    let mut model = load(arch, &model_dir, dev.device.clone()).map_err(|e| dev.load_error(e, "loading the model's weights", task_dir))?;
    model.set_precision(crate::tasks::runtime::precision(spec, &dev.device, &mut notes))?;
    dev.mark_loaded();
    let mut batches = Batches::new(dev, batch, task_dir);
    if given {
        let mut files = vec![model.weights_path.clone(), model.dict.token_path.clone(), model.dict.median_path.clone()];
        files.extend(model.proj_path.clone());
        for p in files {
            let n = p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
            shas.insert(n, json!(weights::sha256_file(&p, |_| {})?));
        }
    }
    // Ensembl ids matched exactly to the gene median dictionary, found and mapped from
    // symbols where needed (tasks::genes)
    let dict = &model.dict;
    let (genes, gene_match) = match_genes(&ad, &x, &spec.params, Kind::Ensembl, &|g| !g.starts_with('<') && dict.medians.contains_key(g), &mut notes)?;
    let table = model.gene_table(&genes.names)?;
    if table.n_repeated > 0 {
        notes.push(format!("{} var entries share an Ensembl id with another; each was ranked on its own, as upstream (nothing summed)", table.n_repeated));
    }
    let dim = model.dim();
    let key = format!("X_{name}");
    let task_rows = TaskRows::new(spec, ad.n_obs, ClsEncoderMethod(arch).block_rows(&x, &spec.params))?;
    let out = EmbeddingOut::create(spec, &task_rows, &key, ad.n_obs, dim)?;
    let p = rep.step(&format!("{name}: embed"), task_rows.len() as u64, "cells");
    let (mut only_cls, mut truncated, mut n_tokens) = (0usize, 0usize, 0usize);
    // blocks of rows, read and tokenised ahead on all cores while the device runs the block
    // before; within a block, groups of 20 batches, each run longest first and written in the
    // input order
    let blocks = task_rows.blocks();
    let group = batch * 20;
    let (table, x, model_ref) = (&table, &x, &model);
    let blocks_started = std::time::Instant::now();
    let setup = clock.elapsed();
    pipeline::run(
        blocks.len(),
        Plan::from_env(),
        |k| pipeline::read_and_map(&clock, x, blocks[k], 32, |_, idx, vals| model_ref.cell_tokens(table, idx, vals)),
        |k, tokenised| {
            let (s, e) = blocks[k];
            truncated += tokenised.iter().filter(|t| t.1).count();
            let mut tokenised = tokenised.into_iter();
            for start in (s..e).step_by(group) {
                let end = (start + group).min(e);
                let cells: Vec<Vec<u32>> = tokenised.by_ref().take(end - start).map(|t| t.0).collect();
                only_cls += cells.iter().filter(|c| c.len() == 1).count();
                n_tokens += cells.iter().map(Vec::len).sum::<usize>();
                let order = length_order(&cells);
                let lens: Vec<usize> = cells.iter().map(Vec::len).collect();
                let rows = clock.time(Stage::Device, || batches.run_lagged(cells.len(), dim, &order, Some(&lens), f32::NAN, |idx| model_ref.forward_tensor(&idx.iter().map(|&i| cells[i].as_slice()).collect::<Vec<_>>()), |k| p.inc(k as u64)))?;
                clock.time(Stage::Write, || out.write(start, &rows))?;
            }
            Ok(())
        },
    )?;
    let blocks_wall = blocks_started.elapsed().as_secs_f64();
    p.finish();
    if only_cls > 0 {
        notes.push(format!("{only_cls} cell(s) have no gene in the dictionaries: their tokens are <cls> alone, embedded as upstream does"));
    }
    if truncated > 0 {
        notes.push(format!("{truncated} cell(s) have more ranked genes than the model's {} input tokens (with <cls>) and were truncated, as upstream", model.input_size));
    }
    batches.finish(&mut notes, true);
    let mut params = spec.params.clone();
    genes::record(&gene_match, &genes, &mut params);
    batches.record(spec, &mut params);
    params.insert("precision".into(), json!(crate::tasks::runtime::precision_name(model.precision())));
    params.insert("model_input_size".into(), json!(model.input_size));
    params.insert("cls_token".into(), json!(model.cls));
    params.insert("pooling".into(), json!(match arch {
        Arch::Sccello => "last layer at <cls>",
        Arch::Langcell => "cell_proj(last layer at <cls>), L2-normalised",
    }));
    params.insert("target_sum".into(), json!(geneformer::TARGET_SUM));
    params.insert("genes_in_dictionary".into(), json!(table.n_genes()));
    params.insert("mean_tokens_per_cell".into(), json!(n_tokens as f64 / ad.n_obs.max(1) as f64));
    params.insert("tie_order".into(), json!("gene order (stable sort)"));
    let mut w = serde_json::Map::new();
    w.insert("dir".into(), json!(model_dir.display().to_string()));
    w.insert("weights_file".into(), json!(model.weights_path.display().to_string()));
    if let Some(pp) = &model.proj_path {
        w.insert("cell_proj".into(), json!(pp.display().to_string()));
    }
    w.insert("token_dictionary".into(), json!(model.dict.token_path.display().to_string()));
    w.insert("gene_median_dictionary".into(), json!(model.dict.median_path.display().to_string()));
    let mut result = out.commit(spec, &x.field, params, w, Value::Object(shas), notes)?;
    result.phases = clock.phases(setup, blocks_wall);
    result.gene_match = Some(gene_match.to_json());
    Ok(result)
}

/// scCello's and LangCell's options, from their tomls.
#[derive(Debug, Deserialize)]
pub struct Params {
    pub batch_size: usize,
}

/// scCello and LangCell: one entry each in the table.
pub struct ClsEncoderMethod(pub Arch);

impl Method for ClsEncoderMethod {
    fn block_rows(&self, x: &crate::anndata::Matrix, params: &serde_json::Map<String, serde_json::Value>) -> usize {
        // cells are sorted by length in groups of 20 batches: blocks are whole groups
        let batch = params.get("batch_size").and_then(serde_json::Value::as_u64).unwrap_or(1).max(1) as usize;
        crate::tasks::shard::block_rows(x, 2_000_000, batch * 20)
    }

    fn check(&self, pf: &Preflight) -> Result<()> {
        match pf.model_dir {
            Some(d) => Dictionaries::find(d).map(drop),
            None => {
                let ids = match self.0 {
                    Arch::Sccello => sccello::REQUIRED_ENTRIES,
                    Arch::Langcell => langcell::REQUIRED_ENTRIES,
                };
                verified_weights(pf.method, pf.weights_dir, ids).map(drop)
            }
        }
    }

    fn embed(&self, spec: &TaskSpec, task_dir: &Path, step: &crate::runner::Step) -> Option<Result<TaskResult>> {
        one_step(step, || embed(spec, task_dir, self.0))
    }
}
