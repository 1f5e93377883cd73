//! The `embed` task of scFoundation (see `methods/scfoundation.rs`): the gene list, the
//! checkpoint's `cell` model, each cell's non-zero genes plus T and S, the encoder in batches
//! (longest cells first, with the GPU back-off), provenance.

use std::path::Path;

use serde_json::{json, Value};

use crate::tasks::genes::{self, match_genes, Kind};
use crate::tasks::runtime::{check_weights_or_folder, precision, weights_or_folder, Batches, LengthStats, TaskDevice};
use crate::tasks::method::{one_step, Method, Preflight};
use crate::tasks::shard::{EmbeddingOut, TaskRows};
use crate::anndata::AnnData;
use crate::error::{Error, Result};
use crate::methods::scfoundation::{self, CellInput, CellProblem, GeneAlignment, ScFoundation};
use crate::progress::reporter;
use crate::runner::{TaskResult, TaskSpec};
use crate::weights;

pub(super) fn embed_scfoundation(spec: &TaskSpec, task_dir: &Path) -> Result<TaskResult> {
    let rep = reporter(!spec.progress);
    let dir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let (dir, manifest, shas) = weights_or_folder("scfoundation", &spec.params, &dir, scfoundation::REQUIRED_ENTRIES)?;
    let (ckpt, index) = scfoundation::files(&dir, &manifest);
    let genes = scfoundation::read_gene_index(&index)?;
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    // the data's genes as the model reads them, found and mapped where needed (tasks::genes)
    let mut gene_notes = Vec::new();
    let vocab: std::collections::HashSet<&str> = genes.iter().map(String::as_str).collect();
    let (gids, gmatch) = match_genes(&ad, &x, &spec.params, Kind::Symbols, &|g| vocab.contains(g), &mut gene_notes)?;
    let align = GeneAlignment::new(&genes, &gids.names);
    if align.present() == 0 {
        let example = ad.var_names.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
        return Err(Error::BadField {
            path: spec.data.clone(),
            field: "var_names".into(),
            detail: format!("none of its {} genes (e.g. {example}) is in the model's {} genes of {}", ad.n_vars, genes.len(), index.display()),
            hint: Some("scFoundation matches gene symbols (e.g. CD3E) in var_names, as upstream's main_gene_selection; data with Ensembl ids in var_names needs the symbols there".into()),
        });
    }
    let mut notes = vec![format!(
        "{} of the model's {} genes are in the data; {} are zero-filled (upstream's main_gene_selection){}{}",
        align.present(),
        genes.len(),
        align.missing.len(),
        if ad.n_vars > align.present() + align.duplicates { format!("; {} data genes are not model genes and are left out (also of the total count)", ad.n_vars - align.present() - align.duplicates) } else { String::new() },
        if align.duplicates > 0 { format!("; {} repeated gene names: their first column is used", align.duplicates) } else { String::new() }
    )];

    let dev = TaskDevice::start(spec)?;
    let dtype = precision(spec, &dev.device, &mut notes);
    let model = ScFoundation::load_on(&ckpt, scfoundation::CELL_KEY, dtype, dev.device.clone()).map_err(|e| dev.load_error(e, "loading the model's weights", task_dir))?;
    dev.mark_loaded();
    if model.n_genes() != genes.len() {
        return Err(Error::BadWeights {
            path: ckpt.clone(),
            detail: format!("its seq_len {} fits {} genes plus T and S, but {} lists {} genes: the checkpoint and the gene list do not belong together", model.config.seq_len, model.n_genes(), index.display(), genes.len()),
        });
    }
    let dim = model.dim();
    let mut batches = Batches::new(dev, scfoundation::BATCH_SIZE, task_dir);
    let key = "X_scfoundation";
    let task_rows = TaskRows::new(spec, ad.n_obs, ScFoundationMethod.block_rows(&x, &spec.params))?;
    let out = EmbeddingOut::create(spec, &task_rows, key, ad.n_obs, dim)?;
    let p = rep.step("scfoundation: embed", task_rows.len() as u64, "cells");
    let mut tokens = LengthStats::default();
    for (s, e) in task_rows.blocks() {
        let b = x.read_rows(s, e)?;
        let mut cells: Vec<CellInput> = Vec::with_capacity(b.n_rows());
        for i in 0..b.n_rows() {
            let (idx, vals) = b.row(i);
            let cell = &ad.obs_names[s + i];
            let c = scfoundation::cell_input(idx, vals, &align, scfoundation::TGTHIGHRES).map_err(|problem| {
                let (detail, hint) = match problem {
                    CellProblem::Negative(v) => (format!("cell {} ({cell}) has the negative value {v}", s + i), "scFoundation reads raw counts (it normalises them itself); pass the counts layer with --layer"),
                    CellProblem::NonFinite(v) => (format!("cell {} ({cell}) has the value {v}", s + i), "scFoundation reads raw counts; pass the counts layer with --layer"),
                    CellProblem::TooFew(n) => (
                        format!("cell {} ({cell}) has {} expressed model gene(s) and a total count of at most 1: upstream's pooling over the genes (T and S aside) has nothing to pool", s + i, n.saturating_sub(1)),
                        "filter out cells without counts in the model's genes first (e.g. sc.pp.filter_cells(adata, min_counts=2))",
                    ),
                };
                Error::BadField { path: spec.data.clone(), field: x.field.clone(), detail, hint: Some(hint.into()) }
            })?;
            tokens.add(c.values.len());
            cells.push(c);
        }
        // longest first, by tokens (cells packed: no padding), each batch read back while the
        // next one runs
        let lens: Vec<usize> = cells.iter().map(|c| c.values.len()).collect();
        let mut order: Vec<usize> = (0..cells.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(lens[i]));
        let rows = batches.run_lagged(cells.len(), dim, &order, Some(&lens), 0.0, |idx| model.forward(&idx.iter().map(|&i| &cells[i]).collect::<Vec<_>>()), |k| p.inc(k as u64))?;
        out.write(s, &rows)?;
    }
    p.finish();
    notes.extend(tokens.note("tokens per cell (expressed model genes + T + S)"));
    let mut params = spec.params.clone();
    batches.finish(&mut notes, true);
    batches.record(spec, &mut params);
    params.insert("precision".into(), json!(crate::tasks::runtime::precision_name(model.dtype())));
    params.insert("version".into(), json!(scfoundation::CELL_KEY));
    params.insert("input_type".into(), json!("singlecell"));
    params.insert("pre_normalized".into(), json!("F"));
    params.insert("tgthighres".into(), json!("t4"));
    params.insert("pool_type".into(), json!("all"));
    params.insert("cell_embedding".into(), json!("concat(S token, T token, max over genes, mean over genes) of the encoder output; cells packed without padding (each cell as alone, as upstream runs it)"));
    params.insert("layers".into(), json!(model.config.depth));
    params.insert("hidden_dim".into(), json!(model.config.hidden_dim));
    params.insert("genes_in_model".into(), json!(genes.len()));
    params.insert("genes_present".into(), json!(align.present()));
    params.insert("genes_zero_filled".into(), json!(align.missing.len()));
    let mut w = serde_json::Map::new();
    w.insert("model".into(), json!(ckpt.display().to_string()));
    w.insert("gene_index".into(), json!(index.display().to_string()));
    genes::commit_matched(out, spec, &x.field, params, w, Value::Object(shas), notes, &gmatch, &gids)
}

/// scFoundation: the table's entry.
pub struct ScFoundationMethod;

impl Method for ScFoundationMethod {
    fn check(&self, pf: &Preflight) -> Result<()> {
        check_weights_or_folder(pf.method, pf.weights_dir, pf.model_dir, scfoundation::REQUIRED_ENTRIES)
    }

    fn embed(&self, spec: &TaskSpec, task_dir: &Path, step: &crate::runner::Step) -> Option<Result<TaskResult>> {
        one_step(step, || embed_scfoundation(spec, task_dir))
    }
}
