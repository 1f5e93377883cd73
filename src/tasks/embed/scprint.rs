//! The `embed` task of scPRINT (see `methods/scprint.rs`): the checkpoint, the data's genes
//! against its gene list, each cell's max_len genes drawn as upstream's Collator draws them
//! (numpy's RandomState seeded with --seed, cell after cell), the transformer in batches (with
//! the GPU back-off), provenance.

use std::path::Path;

use serde_json::{json, Value};

use crate::tasks::genes::{self, match_genes, GeneMatch, Kind, Resolved};
use crate::tasks::runtime::{check_weights_or_folder, weights_or_folder, Batches, TaskDevice};
use crate::tasks::method::{self as method, one_step, Method, Preflight};
use serde::Deserialize;
use crate::formats::numpy_rng::RngState;
use crate::tasks::shard::{load_block_state, save_block_states, BlockStates, EmbeddingOut, TaskRows};
use crate::anndata::AnnData;
use crate::error::{Error, Result};
use crate::methods::scprint::{self, CellProblem, CellTokens, GeneAlignment, Normalization, RandomState, ScPrint};
use crate::progress::reporter;
use crate::runner::{Step, TaskResult, TaskSpec};
use crate::weights;

/// The data's genes against the checkpoint's, the genes per cell (--max-len, at most the
/// model's) and the notes on both.
fn alignment(spec: &TaskSpec, ad: &AnnData, x: &crate::anndata::Matrix, cfg: &scprint::Config) -> Result<(GeneAlignment, usize, Vec<String>, Resolved, GeneMatch)> {
    // Ensembl ids without versions, found and mapped from symbols where needed (tasks::genes)
    let vocab: std::collections::HashSet<&str> = cfg.genes.iter().map(String::as_str).collect();
    let mut gene_notes = Vec::new();
    let (gids, gmatch) = match_genes(ad, x, &spec.params, Kind::Ensembl, &|g| vocab.contains(g), &mut gene_notes)?;
    let align = GeneAlignment::new(&cfg.genes, cfg.organisms.len(), &gids.names);
    if align.present == 0 {
        let example = ad.var_names.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
        let model_example = cfg.genes.iter().take(2).cloned().collect::<Vec<_>>().join(", ");
        return Err(Error::BadField {
            path: spec.data.clone(),
            field: "var_names".into(),
            detail: format!("none of its {} genes (e.g. {example}) is among the checkpoint's {} genes (e.g. {model_example})", ad.n_vars, cfg.genes.len()),
            hint: Some("scPRINT matches Ensembl gene ids (e.g. ENSG00000167286) in var_names, as upstream's scdataloader; put the ids there (without version suffixes)".into()),
        });
    }
    let p: Params = method::task_params(spec)?;
    let asked = p.max_len;
    let max_len = asked.min(align.block.len());
    let mut notes = vec![format!(
        "{} of the model's {} genes are in the data; the others count as zero-expressed{}{}",
        align.present,
        align.block.len(),
        if ad.n_vars > align.present + align.duplicates { format!("; {} data genes are not model genes (not tokens, but counted in the depth)", ad.n_vars - align.present - align.duplicates) } else { String::new() },
        if align.duplicates > 0 { format!("; {} repeated gene names: their first column is used", align.duplicates) } else { String::new() }
    )];
    if max_len < asked {
        notes.push(format!("--max-len {asked} is more than the model's {} genes: every cell gets all of them (upstream's Collator would fail)", align.block.len()));
    }
    notes.splice(0..0, gene_notes);
    Ok((align, max_len, notes, gids, gmatch))
}

/// One cell's tokens (the draws it makes from `rng`), or why the cell cannot be embedded.
#[allow(clippy::too_many_arguments)]
fn tokenize_cell(spec: &TaskSpec, field: &str, cfg: &scprint::Config, row: usize, cell: &str, idx: &[u32], vals: &[f32], align: &GeneAlignment, max_len: usize, rng: &mut RandomState) -> Result<CellTokens> {
    let bad = |detail: String, hint: &str| Error::BadField { path: spec.data.clone(), field: field.to_string(), detail, hint: Some(hint.into()) };
    let c = scprint::tokenize(idx, vals, align, max_len, rng).map_err(|problem| match problem {
        CellProblem::Negative(v) => bad(format!("cell {row} ({cell}) has the negative value {v}"), "scPRINT reads raw counts (it normalises them itself); pass the counts layer with --layer"),
        CellProblem::NonFinite(v) => bad(format!("cell {row} ({cell}) has the value {v}"), "scPRINT reads raw counts; pass the counts layer with --layer"),
    })?;
    if c.expressed == 0 && cfg.normalization == Normalization::Sum {
        return Err(bad(
            format!("cell {row} ({cell}) has no count in the model's genes: the checkpoint's `sum` normalisation divides by zero there"),
            "filter out cells without counts first (e.g. sc.pp.filter_cells(adata, min_counts=1))",
        ));
    }
    Ok(c)
}

/// The fit's file in the run's work folder: the RandomState at the start of every block.
const RNG_FILE: &str = "scprint_rng.json";

/// The fit step of a sharded run: the tokenisation's draws replayed over all cells (no model,
/// only the checkpoint's gene list), the RandomState saved at the start of every block, so a
/// shard draws its cells' genes as the whole run does.
fn fit_scprint(spec: &TaskSpec) -> Result<TaskResult> {
    let rep = reporter(!spec.progress);
    let dir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let (dir, manifest, _) = weights_or_folder("scprint", &spec.params, &dir, scprint::REQUIRED_ENTRIES)?;
    let ckpt = scprint::checkpoint_file(&dir, &manifest);
    let cfg = scprint::read_config(&ckpt)?;
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let (align, max_len, notes, _, _) = alignment(spec, &ad, &x, &cfg)?;
    let rows = TaskRows::new(spec, ad.n_obs, ScPrintMethod.block_rows(&x, &spec.params))?;
    let mut rng = RandomState::new(spec.seed as u32);
    let mut states = Vec::new();
    let p = rep.step("scprint: draw the cells' genes", rows.len() as u64, "cells");
    for (s, e) in rows.blocks() {
        states.push(rng.state());
        let b = x.read_rows(s, e)?;
        for i in 0..b.n_rows() {
            let (idx, vals) = b.row(i);
            tokenize_cell(spec, &x.field, &cfg, s + i, &ad.obs_names[s + i], idx, vals, &align, max_len, &mut rng)?;
        }
        p.inc((e - s) as u64);
    }
    p.finish();
    let path = save_block_states(spec, RNG_FILE, &BlockStates { n_obs: ad.n_obs, block: rows.block, states })?;
    Ok(TaskResult { output: Some(path), n_obs: ad.n_obs, notes, ..Default::default() })
}

pub(super) fn embed_scprint(spec: &TaskSpec, task_dir: &Path) -> Result<TaskResult> {
    let rep = reporter(!spec.progress);
    let dir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let (dir, manifest, shas) = weights_or_folder("scprint", &spec.params, &dir, scprint::REQUIRED_ENTRIES)?;
    let ckpt = scprint::checkpoint_file(&dir, &manifest);
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;

    let dev = TaskDevice::start(spec)?;
    let mut precision_notes = Vec::new();
    let dtype = crate::tasks::runtime::precision(spec, &dev.device, &mut precision_notes);
    let model = ScPrint::load_on(&ckpt, dtype, dev.device.clone()).map_err(|e| dev.load_error(e, "loading the model's weights", task_dir))?;
    dev.mark_loaded();
    let (align, max_len, mut notes, gids, gmatch) = alignment(spec, &ad, &x, &model.config)?;
    notes.extend(precision_notes);
    let p: Params = method::task_params(spec)?;
    let dim = model.dim();
    let batch = p.batch_size;
    let mut batches = Batches::new(dev, batch, task_dir);
    let key = "X_scprint";
    let task_rows = TaskRows::new(spec, ad.n_obs, ScPrintMethod.block_rows(&x, &spec.params))?;
    let out = EmbeddingOut::create(spec, &task_rows, key, ad.n_obs, dim)?;
    let p = rep.step("scprint: embed", task_rows.len() as u64, "cells");
    // one RandomState for the whole run, drawn from cell after cell, as upstream's global numpy;
    // a shard starts from the state the fit saved at its first row
    let mut rng = match spec.step {
        Step::Project { .. } => {
            let state: RngState = load_block_state(spec, RNG_FILE, &task_rows, ad.n_obs)?;
            RandomState::from_state(&state).ok_or_else(|| Error::BadOption { option: "task spec".into(), detail: format!("{RNG_FILE} in the run's work folder holds no RandomState"), hint: Some("start the run again".into()) })?
        }
        _ => RandomState::new(spec.seed as u32),
    };
    let cfg = &model.config;
    let (mut sampled, mut filled, mut expressed) = (0usize, 0usize, 0usize);
    for (s, e) in task_rows.blocks() {
        let b = x.read_rows(s, e)?;
        let mut cells: Vec<CellTokens> = Vec::with_capacity(b.n_rows());
        for i in 0..b.n_rows() {
            let (idx, vals) = b.row(i);
            let c = tokenize_cell(spec, &x.field, cfg, s + i, &ad.obs_names[s + i], idx, vals, &align, max_len, &mut rng)?;
            sampled += (c.expressed > max_len) as usize;
            filled += (c.expressed < max_len) as usize;
            expressed += c.expressed;
            cells.push(c);
        }
        let order: Vec<usize> = (0..cells.len()).collect();
        // each batch read back while the next one runs
        let rows = batches.run_lagged(cells.len(), dim, &order, None, 0.0, |idx| model.forward(&idx.iter().map(|&i| &cells[i]).collect::<Vec<_>>()), |k| p.inc(k as u64))?;
        out.write(s, &rows)?;
    }
    p.finish();
    if !task_rows.is_empty() {
        notes.push(format!(
            "{max_len} genes per cell (--max-len); mean {:.0} expressed model genes per cell; {sampled} cell(s) had more and were sampled, {filled} had fewer and got random zero-count genes (both drawn as upstream's numpy RandomState with --seed {})",
            expressed as f64 / task_rows.len() as f64,
            spec.seed
        ));
    }
    let mut params = spec.params.clone();
    batches.finish(&mut notes, true);
    let cfg = &model.config;
    batches.record(spec, &mut params);
    params.insert("precision".into(), json!(crate::tasks::runtime::precision_name(model.dtype())));
    params.insert("max_len".into(), json!(max_len));
    params.insert("how".into(), json!("random expr"));
    params.insert("add_zero_genes".into(), json!(0));
    params.insert("pred_embedding".into(), json!(scprint::PRED_EMBEDDING));
    params.insert("cell_embedding".into(), json!("mean of the transformer outputs at the pred_embedding class tokens (Embedder, obsm['scprint_emb'])"));
    params.insert("normalization".into(), json!(if cfg.normalization == Normalization::Log { "log" } else { "sum" }));
    params.insert("d_model".into(), json!(cfg.d_model));
    params.insert("layers".into(), json!(cfg.nlayers));
    params.insert("genes_in_model".into(), json!(cfg.genes.len()));
    params.insert("genes_present".into(), json!(align.present));
    let mut w = serde_json::Map::new();
    w.insert("checkpoint".into(), json!(ckpt.display().to_string()));
    genes::record(&gmatch, &gids, &mut params);
    let mut result = out.commit(spec, &x.field, params, w, Value::Object(shas), notes)?;
    result.gene_match = Some(gmatch.to_json());
    Ok(result)
}

/// scPRINT's options, from `methods/scprint.toml`.
#[derive(Debug, Deserialize)]
pub struct Params {
    pub batch_size: usize,
    pub max_len: usize,
}

/// scPRINT: the table's entry.
pub struct ScPrintMethod;

impl Method for ScPrintMethod {
    fn check(&self, pf: &Preflight) -> Result<()> {
        check_weights_or_folder(pf.method, pf.weights_dir, pf.model_dir, scprint::REQUIRED_ENTRIES)
    }

    fn fits_before_shards(&self) -> bool {
        true
    }

    fn embed(&self, spec: &TaskSpec, task_dir: &Path, step: &Step) -> Option<Result<TaskResult>> {
        match step {
            Step::Fit => Some(fit_scprint(spec)),
            _ => one_step(step, || embed_scprint(spec, task_dir)),
        }
    }
}
