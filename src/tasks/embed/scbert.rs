//! The `embed` task of scBERT (see `methods/scbert.rs`): the reference gene order, preprocess.py's
//! normalisation and predict.py's bins, the Performer in batches with the GPU back-off,
//! provenance.

use std::path::Path;

use serde_json::{json, Value};

use crate::tasks::genes::{self, match_genes, Kind};
use crate::tasks::runtime::{check_weights_or_folder, some_cells, weights_or_folder, Batches, TaskDevice};
use crate::tasks::method::{self as method, one_step, Method, Preflight};
use serde::Deserialize;
use crate::tasks::shard::{EmbeddingOut, TaskRows};
use crate::anndata::AnnData;
use crate::error::{Error, Result};
use crate::methods::scbert::{self, GeneAlign, ScBert};
use crate::progress::reporter;
use crate::runner::{TaskResult, TaskSpec};
use crate::weights;

pub(super) fn embed_scbert(spec: &TaskSpec, task_dir: &Path) -> Result<TaskResult> {
    let rep = reporter(!spec.progress);
    let dir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let (dir, manifest, shas) = weights_or_folder("scbert", &spec.params, &dir, scbert::REQUIRED_ENTRIES)?;
    let (model_path, ref_path) = scbert::files(&dir, &manifest);
    let reference = AnnData::open(&ref_path)?.var_names;
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let mut notes = Vec::new();

    // the data's genes as the model reads them, found and mapped where needed (tasks::genes)
    let mut gene_notes = Vec::new();
    let vocab: std::collections::HashSet<&str> = reference.iter().map(String::as_str).collect();
    let (gids, gmatch) = match_genes(&ad, &x, &spec.params, Kind::Symbols, &|g| vocab.contains(g), &mut gene_notes)?;
    let align = GeneAlign::new(&reference, &gids.names);
    if align.matched == 0 {
        let example = ad.var_names.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
        return Err(Error::BadField {
            path: spec.data.clone(),
            field: "var_names".into(),
            detail: format!("none of the {} genes is among the {} reference genes of {} (e.g. {example})", ad.n_vars, align.n_genes, ref_path.display()),
            hint: Some("scBERT matches gene symbols exactly (e.g. CD3E), in the PanglaoDB naming of panglao_10000.h5ad; data with Ensembl ids in var_names needs the symbols there".into()),
        });
    }
    notes.push(format!(
        "{} of the {} reference genes are in the data (matched by exact name, as preprocess.py); the other {} are zero in every cell{}",
        align.matched,
        align.n_genes,
        align.n_genes - align.matched,
        if align.repeated > 0 { format!("; {} repeated var_names were left out (the first column of a name is used, as upstream)", align.repeated) } else { String::new() }
    ));

    let dev = TaskDevice::start(spec)?;
    // float32: no bf16 fidelity has been measured for scBERT (docs/scbert.md)
    let model = ScBert::load_on(&model_path, candle_core::DType::F32, dev.device.clone()).map_err(|e| dev.load_error(e, "loading the model's weights", task_dir))?;
    dev.mark_loaded();
    if model.dims.seq_len != align.n_genes + 1 {
        return Err(Error::BadWeights {
            path: ref_path.clone(),
            detail: format!(
                "lists {} genes, but the checkpoint {} has {} gene2vec positions (genes + the appended one): the gene list and the checkpoint must be upstream's pair",
                align.n_genes,
                model_path.display(),
                model.dims.seq_len
            ),
        });
    }
    let batch = method::task_params::<Params>(spec)?.batch_size;
    let mut batches = Batches::new(dev, batch, task_dir);
    let dim = model.dim();
    let key = "X_scbert";
    let task_rows = TaskRows::new(spec, ad.n_obs, ScBertMethod.block_rows(&x, &spec.params))?;
    let out = EmbeddingOut::create(spec, &task_rows, key, ad.n_obs, dim)?;
    let p = rep.step("scbert: embed", task_rows.len() as u64, "cells");
    let (mut few, mut empty) = (0usize, Vec::new());
    // blocks of about 2M stored values (some 2,000 cells of ~1,000 expressed genes); at
    // 16,907 tokens a cell their token rows stay near 135 MB
    for (s, e) in task_rows.blocks() {
        let b = x.read_rows(s, e)?;
        let mut cells: Vec<Vec<u32>> = Vec::with_capacity(b.n_rows());
        for i in 0..b.n_rows() {
            let (idx, vals) = b.row(i);
            let (t, expressed) = scbert::tokens(idx, vals, &align).map_err(|v| Error::BadField {
                path: spec.data.clone(),
                field: x.field.clone(),
                detail: format!("cell {} ({}) has the value {v}", s + i, ad.obs_names[s + i]),
                hint: Some("scBERT reads raw counts (it normalises to 1e4 and takes log2 itself, as preprocess.py); pass the counts layer with --layer".into()),
            })?;
            if expressed < scbert::MIN_GENES {
                few += 1;
            }
            if expressed == 0 {
                empty.push(s + i);
            }
            cells.push(t);
        }
        let order: Vec<usize> = (0..cells.len()).collect();
        let rows = batches.run(cells.len(), dim, &order, 0.0, |idx| model.embed(&idx.iter().map(|&i| cells[i].as_slice()).collect::<Vec<_>>()), |k| p.inc(k as u64))?;
        out.write(s, &rows)?;
    }
    p.finish();
    if few > 0 {
        notes.push(format!(
            "{few} cell(s) express fewer than {} of the reference genes: upstream's preprocess.py drops them (filter_cells min_genes=200); they are embedded here",
            scbert::MIN_GENES
        ));
    }
    if !empty.is_empty() {
        notes.push(format!("{} cell(s) have no count in any reference gene ({}): all their tokens are 0, so they share one embedding", empty.len(), some_cells(&ad.obs_names, &empty)));
    }
    let mut params = spec.params.clone();
    batches.finish(&mut notes, true);
    batches.record(spec, &mut params);
    params.insert("depth".into(), json!(model.dims.depth));
    params.insert("heads".into(), json!(model.dims.heads));
    params.insert("nb_features".into(), json!(model.dims.nb_features));
    params.insert("genes_reference".into(), json!(align.n_genes));
    params.insert("genes_matched".into(), json!(align.matched));
    params.insert("cells_below_min_genes".into(), json!(few));
    params.insert("preprocessing".into(), json!("reference genes by exact name, normalize_total(1e4) over them, log2(1 + x), bins min(trunc(x), 5), a 0 appended (preprocess.py, predict.py)"));
    params.insert("cell_embedding".into(), json!("mean of the final LayerNorm's output over the gene positions (the appended one left out), as BioLLM's 'mean'; FAVOR+ key stabiliser per cell (each cell as predict.py runs it, alone)"));
    let mut w = serde_json::Map::new();
    w.insert("model".into(), json!(model_path.display().to_string()));
    w.insert("reference_genes".into(), json!(ref_path.display().to_string()));
    genes::commit_matched(out, spec, &x.field, params, w, Value::Object(shas), notes, &gmatch, &gids)
}

/// scBERT's options, from `methods/scbert.toml`.
#[derive(Debug, Deserialize)]
pub struct Params {
    pub batch_size: usize,
}

/// scBERT: the table's entry.
pub struct ScBertMethod;

impl Method for ScBertMethod {
    fn block_rows(&self, x: &crate::anndata::Matrix, params: &serde_json::Map<String, serde_json::Value>) -> usize {
        let _ = params;
        crate::tasks::shard::block_rows(x, 2_000_000, 1)
    }

    fn check(&self, pf: &Preflight) -> Result<()> {
        check_weights_or_folder(pf.method, pf.weights_dir, pf.model_dir, scbert::REQUIRED_ENTRIES)
    }

    fn embed(&self, spec: &TaskSpec, task_dir: &Path, step: &crate::runner::Step) -> Option<Result<TaskResult>> {
        one_step(step, || embed_scbert(spec, task_dir))
    }
}
