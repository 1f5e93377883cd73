//! The `embed` task of CellFM (see `methods/cellfm.rs`): the gene table, the port's state_dict,
//! each cell's kept non-zero genes, the encoder in batches (longest cells first, with the GPU
//! back-off), provenance.

use std::path::Path;

use serde_json::{json, Value};

use crate::tasks::genes::{self, match_genes, Kind};
use crate::tasks::runtime::{check_weights_or_folder, weights_or_folder, Batches, LengthStats, TaskDevice};
use crate::tasks::method::{self as method, one_step, Method, Preflight};
use serde::Deserialize;
use crate::tasks::shard::{EmbeddingOut, TaskRows};
use crate::anndata::AnnData;
use crate::error::{Error, Result};
use crate::methods::cellfm::{self, CellFm, CellInput, CellProblem, GeneMap};
use crate::progress::reporter;
use crate::runner::{TaskResult, TaskSpec};
use crate::weights;

pub(super) fn embed_cellfm(spec: &TaskSpec, task_dir: &Path) -> Result<TaskResult> {
    let rep = reporter(!spec.progress);
    let dir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let (dir, manifest, shas) = weights_or_folder("cellfm", &spec.params, &dir, cellfm::REQUIRED_ENTRIES)?;
    let (ckpt, info_path) = cellfm::files(&dir, &manifest);
    let gene_info = cellfm::read_gene_info(&info_path)?;
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    // the data's genes as the model reads them, found and mapped where needed (tasks::genes)
    let mut gene_notes = Vec::new();
    let vocab: std::collections::HashSet<&str> = gene_info.iter().map(String::as_str).collect();
    let (gids, gmatch) = match_genes(&ad, &x, &spec.params, Kind::Symbols, &|g| vocab.contains(g), &mut gene_notes)?;
    let map = GeneMap::new(&gene_info, &gids.names, cellfm::NONZ_LEN);
    if map.kept == 0 {
        let example = ad.var_names.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
        return Err(Error::BadField {
            path: spec.data.clone(),
            field: "var_names".into(),
            detail: format!("none of its {} genes (e.g. {example}) is among the {} genes of {}", ad.n_vars, gene_info.len(), info_path.display()),
            hint: Some("CellFM matches HGNC gene symbols (e.g. CD3E) in var_names exactly, as the port's SCrna; data with Ensembl ids in var_names needs the symbols there".into()),
        });
    }
    let mut notes = vec![format!(
        "{} of the data's {} genes are in the model's {}-gene table (matched by exact symbol){}{}",
        map.matched,
        ad.n_vars,
        gene_info.len(),
        if map.duplicates > 0 { format!("; {} repeated gene names: their first column is used", map.duplicates) } else { String::new() },
        if map.matched > map.kept {
            format!(
                "; as the port's SCrna, only the first {} of them in var order are read and the other {} are left out (also of the total count): select at most {} genes (e.g. highly variable ones) first to choose which",
                map.kept,
                map.matched - map.kept,
                cellfm::NONZ_LEN
            )
        } else {
            String::new()
        }
    )];

    let dev = TaskDevice::start(spec)?;
    let dtype = crate::tasks::runtime::precision(spec, &dev.device, &mut notes);
    let model = CellFm::load_on(&ckpt, dtype, dev.device.clone()).map_err(|e| dev.load_error(e, "loading the model's weights", task_dir))?;
    dev.mark_loaded();
    let need = gene_info.len() + 1;
    if model.dims.gene_rows < need || model.dims.gene_rows >= need + 8 {
        return Err(Error::BadWeights {
            path: ckpt.clone(),
            detail: format!(
                "its gene_emb has {} rows, but {} lists {} genes (gene_emb holds genes + 1 rows, rounded up to a multiple of 8): the checkpoint and the gene table do not belong together",
                model.dims.gene_rows,
                info_path.display(),
                gene_info.len()
            ),
        });
    }
    let dim = model.dim();
    let batch = method::task_params::<Params>(spec)?.batch_size;
    let mut batches = Batches::new(dev, batch, task_dir);
    let key = "X_cellfm";
    let task_rows = TaskRows::new(spec, ad.n_obs, CellFmMethod.block_rows(&x, &spec.params))?;
    let out = EmbeddingOut::create(spec, &task_rows, key, ad.n_obs, dim)?;
    let p = rep.step("cellfm: embed", task_rows.len() as u64, "cells");
    let mut tokens = LengthStats::default();
    for (s, e) in task_rows.blocks() {
        let b = x.read_rows(s, e)?;
        let mut cells: Vec<CellInput> = Vec::with_capacity(b.n_rows());
        for i in 0..b.n_rows() {
            let (idx, vals) = b.row(i);
            let cell = &ad.obs_names[s + i];
            let c = cellfm::cell_input(idx, vals, &map).map_err(|problem| {
                let (detail, hint) = match problem {
                    CellProblem::Negative(v) => (format!("cell {} ({cell}) has the negative value {v}", s + i), "CellFM reads raw counts (it normalises them itself); pass the counts layer with --layer"),
                    CellProblem::NonFinite(v) => (format!("cell {} ({cell}) has the value {v}", s + i), "CellFM reads raw counts; pass the counts layer with --layer"),
                    CellProblem::TooFew(n) => (
                        format!("cell {} ({cell}) expresses {n} of the model's genes read: upstream's length scale rsqrt(n - 3 + 1e-6) needs at least 3 (with fewer the port's embedding is NaN)", s + i),
                        "filter out cells with few genes first (e.g. sc.pp.filter_cells(adata, min_genes=3) on the genes CellFM reads)",
                    ),
                };
                Error::BadField { path: spec.data.clone(), field: x.field.clone(), detail, hint: Some(hint.into()) }
            })?;
            tokens.add(c.genes.len());
            cells.push(c);
        }
        let rows = batches.run_longest_first(&cells, dim, |c| c.genes.len(), |b| model.embed(b), |k| p.inc(k as u64))?;
        out.write(s, &rows)?;
    }
    p.finish();
    notes.extend(tokens.note("genes per cell"));
    if !model.dims.st_tokens {
        notes.push("the state_dict has no ST_emb: the port's embedding_infer read-out (the cls token alone in front of the genes) is used".into());
    }
    let mut params = spec.params.clone();
    batches.finish(&mut notes, true);
    batches.record(spec, &mut params);
    params.insert("precision".into(), json!(crate::tasks::runtime::precision_name(dtype)));
    params.insert("layers".into(), json!(model.dims.depth));
    params.insert("enc_dims".into(), json!(model.dims.dim));
    params.insert("heads".into(), json!(model.dims.heads));
    params.insert("nonz_len".into(), json!(cellfm::NONZ_LEN));
    params.insert("genes_in_table".into(), json!(gene_info.len()));
    params.insert("genes_matched".into(), json!(map.matched));
    params.insert("genes_read".into(), json!(map.kept));
    params.insert("read_out".into(), json!(if model.dims.st_tokens { "encode" } else { "embedding_infer" }));
    params.insert("preprocessing".into(), json!("counts of cells above 1e5 scaled to 1e5 and rounded (read_h5ad); genes by exact symbol, the first 2,048 in var order (SCrna); non-zero ones, log1p(x / T * 1e4) with T their sum (Prepare.normalize); no down-sampling, no masking"));
    params.insert("cell_embedding".into(), json!("the cls token's row of the last RetentionLayer (model.py Cell_FM: cls_token of FinetuneModel.encode, eval mode)"));
    let mut w = serde_json::Map::new();
    w.insert("model".into(), json!(ckpt.display().to_string()));
    w.insert("gene_info".into(), json!(info_path.display().to_string()));
    let cfg = cellfm::config_path(&ckpt);
    w.insert("config".into(), json!(if cfg.is_file() { cfg.display().to_string() } else { format!("none (released: {} heads)", cellfm::RELEASED_HEADS) }));
    genes::commit_matched(out, spec, &x.field, params, w, Value::Object(shas), notes, &gmatch, &gids)
}

/// CellFM's options, from `methods/cellfm.toml`.
#[derive(Debug, Deserialize)]
pub struct Params {
    pub batch_size: usize,
}

/// CellFM: the table's entry.
pub struct CellFmMethod;

impl Method for CellFmMethod {
    fn block_rows(&self, x: &crate::anndata::Matrix, params: &serde_json::Map<String, serde_json::Value>) -> usize {
        let _ = params;
        crate::tasks::shard::block_rows(x, 2_000_000, 1)
    }

    fn check(&self, pf: &Preflight) -> Result<()> {
        check_weights_or_folder(pf.method, pf.weights_dir, pf.model_dir, cellfm::REQUIRED_ENTRIES)
    }

    fn embed(&self, spec: &TaskSpec, task_dir: &Path, step: &crate::runner::Step) -> Option<Result<TaskResult>> {
        one_step(step, || embed_cellfm(spec, task_dir))
    }
}
