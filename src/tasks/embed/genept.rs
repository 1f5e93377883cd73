//! The `embed` task of GenePT-w (see `methods/genept.rs`): the gene table, the data's genes
//! looked up, each cell's weighted sum on the CPU, provenance.

use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde_json::{json, Value};

use crate::tasks::genes::{self, match_genes, Kind};
use crate::tasks::runtime::verified_weights;
use crate::tasks::shard::{EmbeddingOut, TaskRows};
use crate::tasks::method::{one_step, Method, Preflight};
use crate::anndata::AnnData;
use crate::error::{Error, Result};
use crate::methods::genept::{self, Lookup, Table};
use crate::progress::reporter;
use crate::runner::{TaskResult, TaskSpec};
use crate::weights::{self, Manifest};

pub(super) fn embed_genept(spec: &TaskSpec, _task_dir: &Path) -> Result<TaskResult> {
    let rep = reporter(!spec.progress);
    let wdir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let given = spec.params.get("model_dir").and_then(Value::as_str).filter(|s| !s.is_empty()).map(PathBuf::from);
    let shas = match given {
        Some(_) => serde_json::Map::new(),
        None => verified_weights("genept", &wdir, &[genept::ARCHIVE_ENTRY])?,
    };
    let table_path = genept::table_path(&wdir, &Manifest::load()?, given.as_deref())?;
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let mut notes = Vec::new();
    let p = rep.step("genept: read the gene table", 1, "files");
    let table = Table::load(&table_path)?;
    p.finish();
    // the data's genes as the model reads them, found and mapped where needed (tasks::genes)
    let mut gene_notes = Vec::new();
    let (gids, gmatch) = match_genes(&ad, &x, &spec.params, Kind::Symbols, &|g| table.index.contains_key(g), &mut gene_notes)?;
    let lookup = Lookup::new(&gids.names, &table);
    if lookup.matched() == 0 {
        let example = ad.var_names.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
        return Err(Error::BadField {
            path: spec.data.clone(),
            field: "var_names".into(),
            detail: format!("none of its {} genes (e.g. {example}) has a GenePT embedding in {}", ad.n_vars, table_path.display()),
            hint: Some("GenePT matches gene symbols (e.g. CD3E) in var_names exactly, as upstream; data with Ensembl ids in var_names needs the symbols there".into()),
        });
    }
    // upstream prints "Unable to match N out of M genes in the GenePT-w embedding"
    notes.push(format!(
        "{} of {} genes (var_names) have no GenePT embedding: they count in the average as zero vectors, as upstream's code does",
        lookup.missing, ad.n_vars
    ));
    let dim = table.dim;
    let rows = TaskRows::new(spec, ad.n_obs, GenePt.block_rows(&x, &spec.params))?;
    let key = "X_genept";
    let out = EmbeddingOut::create(spec, &rows, key, ad.n_obs, dim)?;
    let p = rep.step("genept: embed", rows.len() as u64, "cells");
    for (s, e) in rows.blocks() {
        let b = x.read_rows(s, e)?;
        let n = b.n_rows();
        let mut rows = vec![0f32; n * dim];
        rows.par_chunks_mut(dim).enumerate().for_each_init(
            || vec![0f64; dim],
            |acc, (i, row)| {
                let (idx, vals) = b.row(i);
                genept::embed_cell(idx, vals, &lookup, &table, acc);
                for (r, a) in row.iter_mut().zip(acc.iter()) {
                    *r = *a as f32;
                }
            },
        );
        out.write(s, &rows)?;
        p.inc(n as u64);
    }
    p.finish();
    let mut params = spec.params.clone();
    params.insert("device".into(), json!("cpu"));
    params.insert("genes_matched".into(), json!(lookup.matched()));
    params.insert("genes_without_embedding".into(), json!(lookup.missing));
    params.insert("table_genes".into(), json!(table.index.len()));
    params.insert("cell_embedding".into(), json!("sum over genes of expression x gene text embedding, divided by the number of genes in the data (upstream's GenePT-w); not L2-normalised"));
    let mut w = serde_json::Map::new();
    w.insert("table".into(), json!(table_path.display().to_string()));
    genes::commit_matched(out, spec, &x.field, params, w, Value::Object(shas), notes, &gmatch, &gids)
}

/// GenePT: the table's entry.
pub struct GenePt;

impl Method for GenePt {
    fn check(&self, pf: &Preflight) -> Result<()> {
        match pf.model_dir {
            Some(_) => Ok(()),
            None => verified_weights(pf.method, pf.weights_dir, &[genept::ARCHIVE_ENTRY]).map(drop),
        }
    }

    fn embed(&self, spec: &TaskSpec, task_dir: &Path, step: &crate::runner::Step) -> Option<Result<TaskResult>> {
        one_step(step, || embed_genept(spec, task_dir))
    }
}
