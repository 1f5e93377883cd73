//! The `embed` task of SCimilarity (see `methods/scimilarity.rs`): the model folder, the genes
//! aligned to its order, log-normalised cells through the encoder in batches, provenance.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::tasks::genes::{self, match_genes, Kind};
use crate::tasks::runtime::{verified_weights, Batches, TaskDevice};
use crate::tasks::method::{self as method, one_step, Method, Preflight};
use serde::Deserialize;
use crate::tasks::shard::{EmbeddingOut, TaskRows};
use crate::anndata::AnnData;
use crate::error::{Error, Result};
use crate::methods::scimilarity::{self, Alignment, Encoder};
use crate::nn::sparse_rows::SparseRows;
use crate::progress::reporter;
use crate::runner::{TaskResult, TaskSpec};
use crate::weights::{self, Manifest};

pub(super) fn embed_scimilarity(spec: &TaskSpec, task_dir: &Path) -> Result<TaskResult> {
    let rep = reporter(!spec.progress);
    let wdir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let given = spec.params.get("model_dir").and_then(Value::as_str).filter(|s| !s.is_empty()).map(PathBuf::from);
    let (model_dir, shas) = match given {
        Some(d) => (d, serde_json::Map::new()),
        None => {
            let shas = verified_weights("scimilarity", &wdir, &[scimilarity::ARCHIVE_ENTRY])?;
            (scimilarity::model_dir(&wdir, &Manifest::load()?), shas)
        }
    };
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let mut notes = Vec::new();

    let dev = TaskDevice::start(spec)?;
    let (enc, gene_order) = Encoder::load(&model_dir, dev.device.clone()).map_err(|e| dev.load_error(e, "loading the model's weights", task_dir))?;
    dev.mark_loaded();
    // the data's genes as the model reads them, found and mapped where needed (tasks::genes)
    let mut gene_notes = Vec::new();
    let vocab: std::collections::HashSet<&str> = gene_order.iter().map(String::as_str).collect();
    let (gids, gmatch) = match_genes(&ad, &x, &spec.params, Kind::Symbols, &|g| vocab.contains(g), &mut gene_notes)?;
    let align = Alignment::new(&gids.names, &gene_order);
    if align.matched == 0 {
        let example = ad.var_names.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
        return Err(Error::BadField {
            path: spec.data.clone(),
            field: "var_names".into(),
            detail: format!("none of its {} genes (e.g. {example}) is among the model's {} genes (gene_order.tsv, e.g. {})", ad.n_vars, gene_order.len(), gene_order.iter().take(3).cloned().collect::<Vec<_>>().join(", ")),
            hint: Some("SCimilarity matches gene symbols (e.g. CD3E) in var_names, as upstream's align_dataset; data with Ensembl ids in var_names needs the symbols there".into()),
        });
    }
    notes.push(format!(
        "{} of the model's {} genes are in the data; {} are not and were zero-filled (upstream's align_dataset); {} of the data's {} genes are not in the model and were left out",
        align.matched,
        align.n_genes,
        align.missing,
        align.column.iter().filter(|c| c.is_none()).count(),
        ad.n_vars
    ));
    if align.matched < scimilarity::UPSTREAM_MIN_OVERLAP.min(align.n_genes) {
        notes.push(format!(
            "only {} genes are shared with the model: upstream's align_dataset refuses data with fewer than {} (gene_overlap_threshold); the embedding of such data is unreliable",
            align.matched,
            scimilarity::UPSTREAM_MIN_OVERLAP
        ));
    }
    if !gene_order.windows(2).all(|w| w[0] <= w[1]) {
        notes.push("gene_order.tsv is not sorted: its order is used, as the weights' columns; upstream's align_dataset would put the columns in sorted order instead (anndata's outer concat), which matches the weights only for a sorted file like the released ones".into());
    }
    if align.duplicated > 0 {
        notes.push(format!("{} var_names entries repeat a model gene's symbol: their counts were summed (upstream's consolidate_duplicate_symbols)", align.duplicated));
    }

    let batch = method::task_params::<Params>(spec)?.batch_size;
    let mut batches = Batches::new(dev, batch, task_dir);
    let dim = enc.latent;
    let n_genes = enc.n_genes;
    let key = "X_scimilarity";
    let task_rows = TaskRows::new(spec, ad.n_obs, Scimilarity.block_rows(&x, &spec.params))?;
    let out = EmbeddingOut::create(spec, &task_rows, key, ad.n_obs, dim)?;
    let p = rep.step("scimilarity: embed", task_rows.len() as u64, "cells");
    let (mut fractional, mut empty) = (None::<(usize, f32)>, 0usize);
    for (s, e) in task_rows.blocks() {
        let b = x.read_rows(s, e)?;
        {
            // the block's first non-integer value and its cells without a model gene, on all cores
            use rayon::prelude::*;
            let flags: Vec<(Option<f32>, bool)> = (0..b.n_rows())
                .into_par_iter()
                .map(|i| {
                    let (idx, vals) = b.row(i);
                    (vals.iter().find(|v| v.fract() != 0.0).copied(), !idx.iter().any(|&j| align.column[j as usize].is_some()))
                })
                .collect();
            if fractional.is_none() {
                fractional = flags.iter().enumerate().find_map(|(i, f)| f.0.map(|v| (s + i, v)));
            }
            empty += flags.iter().filter(|f| f.1).count();
        }
        let order: Vec<usize> = (0..b.n_rows()).collect();
        // each batch: its cells' sparse, log-normalised rows built on all cores, scattered into
        // dense rows on the model's device; read back while the next batch is built
        let rows = batches.run_lagged(
            b.n_rows(),
            dim,
            &order,
            None,
            0.0,
            |cells| {
                let sb = SparseRows::build(cells.len(), n_genes, |k, e| {
                    let (idx, vals) = b.row(cells[k]);
                    align.lognorm_sparse(idx, vals, e)
                })
                .map_err(|(k, v)| {
                    let i = cells[k];
                    Error::BadField {
                        path: spec.data.clone(),
                        field: x.field.clone(),
                        detail: format!("cell {} ({}) has the value {v}", s + i, ad.obs_names[s + i]),
                        hint: Some("SCimilarity reads raw counts (non-negative, finite), as upstream's align_dataset requires; pass the counts layer with --layer".into()),
                    }
                })?;
                enc.forward_sparse(&sb).map_err(|e| Error::Model { context: "running the SCimilarity encoder".into(), detail: e.to_string() })
            },
            |k| p.inc(k as u64),
        )?;
        out.write(s, &rows)?;
    }
    p.finish();
    if let Some((row, v)) = fractional {
        notes.push(format!(
            "{} holds non-integer values (e.g. {v} at cell {row}): SCimilarity normalises raw counts itself (upstream reads layers['counts']); pass the counts layer with --layer if this is not one",
            x.field
        ));
    }
    if empty > 0 {
        notes.push(format!("{empty} cell(s) have no count in the model's genes: their input is all zeros, so they share one embedding"));
    }
    let mut params = spec.params.clone();
    batches.finish(&mut notes, true);
    batches.record(spec, &mut params);
    params.insert("model_genes".into(), json!(align.n_genes));
    params.insert("genes_matched".into(), json!(align.matched));
    params.insert("genes_missing_zero_filled".into(), json!(align.missing));
    params.insert("genes_duplicated_summed".into(), json!(align.duplicated));
    params.insert("hidden_dim".into(), json!(enc.hidden));
    params.insert("latent_dim".into(), json!(enc.latent));
    params.insert("normalisation".into(), json!("counts over the model's genes scaled to 1e4 per cell, log1p (upstream's lognorm_counts after align_dataset)"));
    params.insert("cell_embedding".into(), json!("encoder output, L2-normalised (Encoder.forward)"));
    let mut w = serde_json::Map::new();
    w.insert("model_dir".into(), json!(model_dir.display().to_string()));
    genes::commit_matched(out, spec, &x.field, params, w, Value::Object(shas), notes, &gmatch, &gids)
}

/// SCimilarity's options, from `methods/scimilarity.toml`.
#[derive(Debug, Deserialize)]
pub struct Params {
    pub batch_size: usize,
}

/// SCimilarity: the table's entry.
pub struct Scimilarity;

impl Method for Scimilarity {
    fn check(&self, pf: &Preflight) -> Result<()> {
        match pf.model_dir {
            Some(_) => Ok(()),
            None => verified_weights(pf.method, pf.weights_dir, &[scimilarity::ARCHIVE_ENTRY]).map(drop),
        }
    }

    fn embed(&self, spec: &TaskSpec, task_dir: &Path, step: &crate::runner::Step) -> Option<Result<TaskResult>> {
        one_step(step, || embed_scimilarity(spec, task_dir))
    }
}
