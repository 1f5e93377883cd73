//! The `embed` task of CellPLM (see `methods/cellplm.rs`): the checkpoint (pinned weights or
//! --model-dir), the data's genes matched to the model's gene_list, cells grouped into forward
//! passes as upstream's CellEmbeddingPipeline groups them (obs batch column, then chunks of
//! --batch-size cells), provenance. Cells attend to each other within a forward pass, so the
//! grouping is part of the result and is recorded, and a sharded run is cut between passes
//! (`tasks::shard::GroupOrder`): each shard embeds whole passes and reads only their rows.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::tasks::genes::{self, match_genes, Kind};
use crate::tasks::pipeline::{self, Stage, StageClock};
use crate::tasks::runtime::{verified_weights, TaskDevice};
use crate::tasks::method::{self as method, one_step, Method, Preflight};
use crate::tasks::shard::{self, EmbeddingOut, GroupOrder, TaskRows};
use serde::Deserialize;
use crate::anndata::dataframe::Column;
use crate::anndata::AnnData;
use crate::error::{Error, Result};
use crate::methods::cellplm::{self, attention_batches, Alignment, CellPlm};
use crate::progress::reporter;
use crate::runner::{Step, TaskResult, TaskSpec};
use crate::weights::{self, Manifest};

/// The checkpoint folder and prefix: `--model-dir` (its one `<prefix>.best.ckpt`), else the
/// pinned files under the weights folder.
pub fn checkpoint(spec_params: &serde_json::Map<String, Value>, weights_dir: &Path) -> Result<(PathBuf, String)> {
    let given = spec_params.get("model_dir").and_then(Value::as_str).filter(|s| !s.is_empty()).map(PathBuf::from);
    match given {
        Some(d) => {
            let prefix = cellplm::find_prefix(&d)?;
            Ok((d, prefix))
        }
        None => {
            let m = Manifest::load()?;
            let file = m.weights.get(cellplm::REQUIRED_ENTRIES[0]).map(|e| e.file.clone()).unwrap_or_else(|| format!("cellplm/ckpt/{}.best.ckpt", cellplm::RELEASED_PREFIX));
            let path = weights_dir.join(&file);
            let dir = path.parent().map(Path::to_path_buf).unwrap_or_else(|| weights_dir.to_path_buf());
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            let prefix = name.strip_suffix(".best.ckpt").unwrap_or(cellplm::RELEASED_PREFIX).to_string();
            Ok((dir, prefix))
        }
    }
}

/// Each cell's label in obs column `key` (numbers and booleans as text); None when the column
/// is absent (upstream: all cells one sample). Missing values are refused.
pub fn batch_labels(ad: &AnnData, key: &str) -> Result<Option<Vec<String>>> {
    if key.is_empty() {
        return Ok(None);
    }
    let obs = ad.obs()?;
    let Some(col) = obs.column(key) else {
        return Ok(None);
    };
    let labels: Vec<Option<String>> = match col {
        Column::Numeric(v) => v.iter().map(|x| if x.is_nan() { None } else { Some(x.to_string()) }).collect(),
        Column::Bool(v) => v.iter().map(|b| Some(b.to_string())).collect(),
        other => other.as_labels().unwrap_or_default(),
    };
    if let Some(i) = labels.iter().position(Option::is_none) {
        return Err(Error::BadField {
            path: ad.path.clone(),
            field: format!("obs/{key}"),
            detail: format!("cell {i} ({}) has no value: CellPLM groups the cells that attend to each other by this column", ad.obs_names.get(i).cloned().unwrap_or_default()),
            hint: Some("fill the missing values (upstream's LabelEncoder refuses them too), or name another column with --batch-key (`--batch-key ''` puts all cells in one group)".into()),
        });
    }
    Ok(Some(labels.into_iter().map(Option::unwrap_or_default).collect()))
}

/// The obs labels of `--batch-key` (None: one group) and the forward passes they give
/// (`attention_batches`): what a run embeds together, whether sharded or not.
pub fn passes(ad: &AnnData, params: &serde_json::Map<String, Value>) -> Result<(Option<Vec<String>>, Vec<Vec<usize>>)> {
    let p: Params = method::params("cellplm", params)?;
    let labels = batch_labels(ad, &p.batch_key)?;
    let passes = attention_batches(labels.as_deref(), ad.n_obs, p.batch_size);
    Ok((labels, passes))
}

pub(super) fn embed_cellplm(spec: &TaskSpec, task_dir: &Path) -> Result<TaskResult> {
    let clock = StageClock::new();
    let rep = reporter(!spec.progress);
    let wdir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let given = spec.params.get("model_dir").and_then(Value::as_str).is_some_and(|s| !s.is_empty());
    let shas = if given { serde_json::Map::new() } else { verified_weights("cellplm", &wdir, cellplm::REQUIRED_ENTRIES)? };
    let (dir, prefix) = checkpoint(&spec.params, &wdir)?;
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let mut notes = Vec::new();

    let dev = TaskDevice::start(spec)?;
    let dtype = crate::tasks::runtime::precision(spec, &dev.device, &mut notes);
    let model = CellPlm::load(&dir, &prefix, dtype, dev.device.clone()).map_err(|e| dev.load_error(e, "loading the model's weights", task_dir))?;
    dev.mark_loaded();

    // Ensembl ids as in gene_list, found and mapped from symbols where needed (tasks::genes)
    let vocab: std::collections::HashSet<&str> = model.cfg.gene_list.iter().map(String::as_str).collect();
    let (gids, gmatch) = match_genes(&ad, &x, &spec.params, Kind::Ensembl, &|g| vocab.contains(g), &mut notes)?;
    let gene_col = gids.column.clone();
    let genes = gids.names.clone();
    let align = Alignment::new(&genes, &model.cfg.gene_list);
    if align.matched == 0 {
        let example = genes.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
        return Err(Error::BadField {
            path: spec.data.clone(),
            field: if gene_col == "index" { "var_names".into() } else { format!("var/{gene_col}") },
            detail: format!("none of its {} genes (e.g. {example}) is in the model's gene_list ({} genes, e.g. {})", ad.n_vars, model.cfg.gene_list.len(), model.cfg.gene_list.iter().take(3).cloned().collect::<Vec<_>>().join(", ")),
            hint: Some("CellPLM's gene_list holds Ensembl ids (ENSG...): name a var column of them with --gene-column, or map symbols to Ensembl ids first (upstream's ensembl_auto_conversion asks the mygene web service, which scfoundry does not)".into()),
        });
    }
    notes.push(format!(
        "{} of the data's {} genes are in the model's gene_list and were used; {} were left out; {} of the model's {} genes are absent from the data (upstream's common_preprocess)",
        align.matched,
        ad.n_vars,
        ad.n_vars - align.matched,
        model.cfg.gene_list.len() - align.model_genes_present,
        model.cfg.gene_list.len()
    ));

    let p: Params = method::task_params(spec)?;
    let (batch_key, batch) = (p.batch_key, p.batch_size);
    let (labels, passes) = passes(&ad, &spec.params)?;
    match &labels {
        Some(_) => notes.push(format!(
            "cells attend to the cells of their own obs['{batch_key}'] group in forward passes of at most {batch} cells ({} passes): an embedding depends on which cells share its pass (docs/cellplm.md)",
            passes.len()
        )),
        None if batch_key.is_empty() => notes.push(format!("all cells are one group, in forward passes of at most {batch} cells ({} passes): an embedding depends on which cells share its pass", passes.len())),
        None => notes.push(format!(
            "obs has no `{batch_key}` column: all cells are one group (as upstream), in forward passes of at most {batch} cells ({} passes); an embedding depends on which cells share its pass",
            passes.len()
        )),
    }
    if batch > 0 && passes.iter().any(|p| p.len() < batch) && passes.len() > 1 {
        let smallest = passes.iter().map(Vec::len).min().unwrap_or(0);
        if smallest < 10 {
            notes.push(format!("the smallest forward pass has {smallest} cell(s): those cells see little context"));
        }
    }
    // this task's passes: all of them, or a shard's (whole passes, positions of the pass order)
    let order = GroupOrder::new(&passes);
    let task_rows = TaskRows::of_groups(spec, &order)?;
    let first = order.bounds.partition_point(|&b| b < task_rows.start);
    let last = order.bounds.partition_point(|&b| b < task_rows.end);
    let mine = &passes[first..last];

    let dim = model.dim();
    let key = "X_cellplm";
    let out = EmbeddingOut::create(spec, &task_rows, key, ad.n_obs, dim)?;
    let p = rep.step("cellplm: embed", task_rows.len() as u64, "cells");
    let (mut fractional, mut empty, mut negative) = (None::<(usize, f32)>, 0usize, None::<(usize, f32)>);
    // the model-gene values of this task's cells only, read run by run of consecutive rows (a
    // pass may draw from anywhere in the file); `cells[k]` is row `rows[k]`
    let mut rows: Vec<usize> = task_rows.groups.as_ref().map(|g| g.rows.clone()).unwrap_or_default();
    rows.sort_unstable();
    let mut cells: Vec<Vec<(u32, f32)>> = Vec::with_capacity(rows.len());
    let setup = clock.elapsed();
    for (s, e) in x.row_runs(&rows, 1_000_000) {
        // each row's model-gene values and its first non-integer / negative value, on all cores
        let mapped = pipeline::read_and_map(&clock, &x, (s, e), 256, |row, idx, vals| {
            let frac = vals.iter().find(|v| v.fract() != 0.0).map(|v| (row, *v));
            let neg = vals.iter().find(|v| **v < 0.0 || !v.is_finite()).map(|v| (row, *v));
            (align.cell(idx, vals), frac, neg)
        })?;
        for (c, frac, neg) in mapped {
            fractional = fractional.or(frac);
            negative = negative.or(neg);
            if c.is_empty() {
                empty += 1;
            }
            cells.push(c);
        }
    }
    if let Some((row, v)) = negative {
        return Err(Error::BadField {
            path: spec.data.clone(),
            field: x.field.clone(),
            detail: format!("cell {row} ({}) has the value {v}", ad.obs_names[row]),
            hint: Some("CellPLM reads raw counts (non-negative, finite) and takes log1p itself; pass the counts layer with --layer".into()),
        });
    }
    // the embeddings in the pass order (this task's positions), written once
    let mut z_all = Vec::with_capacity(task_rows.len() * dim);
    for pass in mine {
        let input: Vec<Vec<(u32, f32)>> = pass.iter().map(|i| rows.binary_search(i).map(|k| std::mem::take(&mut cells[k])).unwrap_or_default()).collect();
        let z = clock.time(Stage::Device, || model.embed(&input)).map_err(|e| {
            if crate::gpu::is_out_of_memory(&e.to_string()) {
                dev.write_report(task_dir, None, Some(batch));
                Error::from(crate::gpu::GpuError::OutOfMemory {
                    allocator: dev.allocator().to_string(),
                    detail: e.to_string(),
                    hint: format!("a forward pass of {} cells does not fit: lower --batch-size (this changes which cells attend to each other, so the embeddings change), or free the GPU", pass.len()),
                })
            } else {
                e
            }
        })?;
        z_all.extend_from_slice(&z[..pass.len() * dim]);
        p.inc(pass.len() as u64);
    }
    clock.time(Stage::Write, || out.write(task_rows.start, &z_all))?;
    let blocks_wall = clock.elapsed() - setup;
    p.finish();
    if let Some((row, v)) = fractional {
        notes.push(format!("{} holds non-integer values (e.g. {v} at cell {row}): CellPLM takes log1p of raw counts itself; pass the counts layer with --layer if this is not one", x.field));
    }
    if empty > 0 {
        notes.push(format!("{empty} cell(s) have no count in the model's genes: their input is all zeros"));
    }
    let mut params = spec.params.clone();
    dev.write_report(task_dir, None, Some(batch));
    params.insert("batch_size".into(), json!(batch));
    params.insert("batch_key".into(), json!(batch_key));
    params.insert("batch_key_found".into(), json!(labels.is_some()));
    params.insert("forward_passes".into(), json!(passes.len()));
    params.insert("largest_pass".into(), json!(passes.iter().map(Vec::len).max().unwrap_or(0)));
    genes::record(&gmatch, &gids, &mut params);
    params.insert("device".into(), json!(spec.device.kind.to_string()));
    params.insert("model_genes".into(), json!(model.cfg.gene_list.len()));
    params.insert("genes_used".into(), json!(align.matched));
    params.insert("precision".into(), json!(crate::tasks::runtime::precision_name(dtype)));
    params.insert("enc_hid".into(), json!(model.cfg.enc_hid));
    params.insert("enc_layers".into(), json!(model.cfg.enc_layers));
    params.insert("latent_dim".into(), json!(dim));
    params.insert("normalisation".into(), json!("log1p of the counts of the model's genes, no library-size scaling (upstream's OmicsEmbedder)"));
    params.insert(
        "cell_embedding".into(),
        json!("the GMVAE latent mean (q(z|x, y) with y the argmax cluster; upstream samples y with Gumbel noise) after a Flowformer encoder over the cells of each forward pass"),
    );
    let mut w = serde_json::Map::new();
    w.insert("model_dir".into(), json!(dir.display().to_string()));
    w.insert("prefix".into(), json!(prefix));
    let mut result = out.commit(spec, &x.field, params, w, Value::Object(shas), notes)?;
    result.phases = clock.phases(setup, blocks_wall);
    result.gene_match = Some(gmatch.to_json());
    Ok(result)
}

/// CellPLM's options, from `methods/cellplm.toml`.
#[derive(Debug, Deserialize)]
pub struct Params {
    pub batch_size: usize,
    pub batch_key: String,
}

/// CellPLM: the table's entry.
pub struct CellPlmMethod;

impl Method for CellPlmMethod {
    fn check(&self, pf: &Preflight) -> Result<()> {
        // the checkpoint (pinned files, or --model-dir's one prefix) and its config
        if pf.model_dir.is_none() {
            verified_weights(pf.method, pf.weights_dir, cellplm::REQUIRED_ENTRIES)?;
        }
        let (dir, prefix) = checkpoint(pf.params, pf.weights_dir)?;
        cellplm::Config::read(&cellplm::checkpoint_files(&dir, &prefix).0).map(drop)
    }

    fn shard_groups(&self, ad: &AnnData, params: &serde_json::Map<String, Value>) -> Result<Option<GroupOrder>> {
        Ok(Some(GroupOrder::new(&passes(ad, params)?.1)))
    }

    fn embed(&self, spec: &TaskSpec, task_dir: &Path, step: &Step) -> Option<Result<TaskResult>> {
        match step {
            // the shards' rows are positions in the pass order: the merge puts them back
            Step::Merge { shards } => Some((|| {
                let ad = AnnData::open(&spec.data)?;
                let order = GroupOrder::new(&passes(&ad, &spec.params)?.1);
                shard::merge_ordered(spec, shards, Some(&order))
            })()),
            _ => one_step(step, || embed_cellplm(spec, task_dir)),
        }
    }
}
