//! The `embed` task of a pretrained scVI model (see `methods/scvi_pretrained.rs`): the saved
//! model folder, the query's genes aligned to the model's, the batch codes when the encoder
//! reads them, the encoder in batches with the GPU back-off, provenance.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::tasks::runtime::{Batches, TaskDevice};
use crate::tasks::method::{self as method, one_step, Method, Preflight};
use serde::Deserialize;
use crate::tasks::shard::{EmbeddingOut, TaskRows};
use crate::anndata::AnnData;
use crate::error::{Error, Result};
use crate::methods::scvi_pretrained::{self as sp, GeneAlignment, Latent, PretrainedScvi, SavedModel};
use crate::nn::sparse_rows::SparseRows;
use crate::progress::reporter;
use crate::runner::{TaskResult, TaskSpec};

/// The model folder from `--model-dir`: required (a pretrained scVI model is the user's).
pub fn model_dir(spec_params: &serde_json::Map<String, Value>) -> Result<PathBuf> {
    spec_params.get("model_dir").and_then(Value::as_str).filter(|s| !s.is_empty()).map(PathBuf::from).ok_or_else(|| Error::BadOption {
        option: "--model-dir".into(),
        detail: "scvi embeds with a pretrained scVI model, and none was given".into(),
        hint: Some("pass the folder scvi-tools' `model.save(dir)` wrote (it holds model.pt): `--model-dir DIR`; to train scVI on your data instead, use `scfoundry integrate --method scvi_denovo`".into()),
    })
}

/// Each cell's batch code in the model's categories (refusing unseen batches, as scvi-tools
/// does for query data without `load_query_data`).
fn batch_codes(ad: &AnnData, data: &Path, key: &str, categories: &[String], model: &Path) -> Result<Vec<u32>> {
    let obs = ad.obs()?;
    let Some(col) = obs.column(key) else {
        return Err(Error::BadField {
            path: data.into(),
            field: format!("obs/{key}"),
            detail: format!("is absent, but the model's encoder reads the batch (encode_covariates=True, {} batches); obs columns: {}", categories.len(), obs.names().join(", ")),
            hint: Some("name the query's batch column with --batch-key COL; its values must be batches the model was trained on".into()),
        });
    };
    let labels = col.as_labels().ok_or_else(|| Error::BadField { path: data.into(), field: format!("obs/{key}"), detail: "is not a categorical, string or integer column".into(), hint: None })?;
    let pos: std::collections::HashMap<&str, u32> = categories.iter().enumerate().map(|(i, c)| (c.as_str(), i as u32)).collect();
    let mut unknown: Vec<String> = Vec::new();
    let codes: Vec<u32> = labels
        .iter()
        .map(|l| {
            let v = l.clone().unwrap_or_else(|| "nan".into());
            match pos.get(v.as_str()) {
                Some(&c) => c,
                None => {
                    if !unknown.contains(&v) {
                        unknown.push(v);
                    }
                    0
                }
            }
        })
        .collect();
    if !unknown.is_empty() {
        let shown = |v: &[String]| {
            let mut s = v.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
            if v.len() > 5 {
                s.push_str(&format!(", ... ({} in all)", v.len()));
            }
            s
        };
        return Err(Error::BadField {
            path: data.into(),
            field: format!("obs/{key}"),
            detail: format!("holds batches the model {} was not trained on: {} (the model knows {})", model.display(), shown(&unknown), shown(categories)),
            hint: Some("scvi-tools refuses them too; map them to known batches, or extend the model with scvi-tools' load_query_data and train it on the query first".into()),
        });
    }
    Ok(codes)
}

/// What the task needs before the model runs, checked cheaply (also by `scfoundry embed`
/// before any run folder exists): the saved model, the gene alignment, the batch codes.
pub struct Prepared {
    pub saved: SavedModel,
    pub dir: PathBuf,
    pub genes: GeneAlignment,
    pub codes: Vec<u32>,
    pub batch_key: Option<String>,
    pub notes: Vec<String>,
}

/// Read the model named by `--model-dir` and check the data against it.
pub fn prepare(params: &serde_json::Map<String, Value>, data: &Path, ad: &AnnData) -> Result<Prepared> {
    let dir = model_dir(params)?;
    let saved = SavedModel::read(&dir)?;
    let a = saved.arch.clone();
    let mut notes = Vec::new();
    let genes = GeneAlignment::new(&saved.var_names, &ad.var_names);
    let frac = genes.fraction();
    if frac < sp::MIN_GENE_OVERLAP {
        let example = genes.missing.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
        return Err(Error::BadField {
            path: data.into(),
            field: "var_names".into(),
            detail: format!(
                "holds {} of the {} genes of the scVI model {} ({:.1}%), fewer than the {:.0}% needed (missing e.g. {example})",
                genes.present,
                genes.n_model,
                saved.path.display(),
                100.0 * frac,
                100.0 * sp::MIN_GENE_OVERLAP
            ),
            hint: Some("the model matches genes by var_names exactly as it was trained (symbols or Ensembl ids, same case): map the query's var_names to the model's first".into()),
        });
    }
    if !genes.missing.is_empty() {
        let shown = genes.missing.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
        notes.push(format!(
            "{} of the model's {} genes are not in the data and are zero-filled (as scvi-tools' prepare_query_anndata does): {shown}{}",
            genes.missing.len(),
            genes.n_model,
            if genes.missing.len() > 5 { ", ..." } else { "" }
        ));
    }
    if frac < sp::WARN_GENE_OVERLAP {
        notes.push(format!("the data holds only {:.1}% of the model's genes; scvi-tools warns below {:.0}% that this may result in poor performance", 100.0 * frac, 100.0 * sp::WARN_GENE_OVERLAP));
    }
    let unused = genes.model_col.iter().filter(|c| c.is_none()).count();
    if unused > 0 {
        notes.push(format!("{unused} of the data's {} genes are not in the model and are not read", ad.n_vars));
    }
    let given_key = params.get("batch_key").and_then(Value::as_str).filter(|s| !s.is_empty()).map(String::from);
    let batch_key = given_key.clone().or_else(|| a.batch_key.clone());
    let codes: Vec<u32> = if a.uses_batch() {
        let key = batch_key.clone().ok_or_else(|| Error::BadOption {
            option: "--batch-key".into(),
            detail: "the model's encoder reads the batch, but the model names no batch column".into(),
            hint: Some("pass --batch-key COL, the query's obs column of batches".into()),
        })?;
        batch_codes(ad, data, &key, &a.batch_categories, &saved.path)?
    } else {
        if a.n_batch > 1 {
            notes.push(format!("the model was trained with {} batches, but its encoder does not read them (encode_covariates=False): the query's batches are not needed", a.n_batch));
        }
        if given_key.is_some() {
            notes.push("--batch-key is not read: this model's encoder takes no batch".into());
        }
        vec![0; ad.n_obs]
    };
    Ok(Prepared { saved, dir, genes, codes, batch_key, notes })
}

pub(super) fn embed_scvi(spec: &TaskSpec, task_dir: &Path) -> Result<TaskResult> {
    let rep = reporter(!spec.progress);
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let Prepared { saved, dir, genes, codes, batch_key, mut notes } = prepare(&spec.params, &spec.data, &ad)?;
    let a = saved.arch.clone();
    let unused = genes.model_col.iter().filter(|c| c.is_none()).count();

    let dev = TaskDevice::start(spec)?;
    let mut model = PretrainedScvi::load(&saved, &dev.device).map_err(|e| dev.load_error(e, "loading the scVI encoder", task_dir))?;
    dev.mark_loaded();
    let batch = method::task_params::<Params>(spec)?.batch_size;
    let mut batches = Batches::new(dev, batch, task_dir);
    let dim = model.dim();
    let g = model.n_genes;
    let key = "X_scvi";
    let task_rows = TaskRows::new(spec, ad.n_obs, ScviMethod.block_rows(&x, &spec.params))?;
    let out = EmbeddingOut::create(spec, &task_rows, key, ad.n_obs, dim)?;
    let p = rep.step("scvi: embed", task_rows.len() as u64, "cells");
    let (mut non_integer, mut empty) = (0usize, 0usize);
    for (s, e) in task_rows.blocks() {
        let b = x.read_rows(s, e)?;
        // the checks on all cores: (negative or non-finite value, non-integer, empty in the model's genes)
        let flags: Vec<(Option<f32>, bool, bool)> = {
            use rayon::prelude::*;
            (0..b.n_rows())
                .into_par_iter()
                .map(|i| {
                    let (idx, vals) = b.row(i);
                    let bad = vals.iter().find(|v| **v < 0.0 || !v.is_finite()).copied();
                    let frac = vals.iter().any(|v| v.fract() != 0.0);
                    let empty = !idx.iter().zip(vals).any(|(&j, &v)| v != 0.0 && genes.model_col[j as usize].is_some());
                    (bad, frac, empty)
                })
                .collect()
        };
        if let Some((i, v)) = flags.iter().enumerate().find_map(|(i, f)| f.0.map(|v| (i, v))) {
            return Err(Error::BadField {
                path: spec.data.clone(),
                field: x.field.clone(),
                detail: format!("cell {} ({}) has the value {v}", s + i, ad.obs_names[s + i]),
                hint: Some("scVI reads raw counts; pass the counts layer with --layer".into()),
            });
        }
        non_integer += flags.iter().filter(|f| f.1).count();
        empty += flags.iter().filter(|f| f.2).count();
        let order: Vec<usize> = (0..b.n_rows()).collect();
        // each batch's counts as CSR (built on all cores), made dense on the device; read back
        // while the next batch is built and runs
        let raw = batches.run_lagged(
            b.n_rows(),
            model.raw_width(),
            &order,
            None,
            0.0,
            |idx| {
                let sparse = SparseRows::build(idx.len(), g, |k, e| {
                    let (ci, cv) = b.row(idx[k]);
                    genes.entries(ci, cv, e);
                    Ok::<(), ()>(())
                })
                .unwrap_or_else(|_| unreachable!("entries do not fail"));
                let c: Vec<u32> = idx.iter().map(|&i| codes[s + i]).collect();
                model.forward_sparse(&sparse, &c)
            },
            |k| p.inc(k as u64),
        )?;
        let first_rows: Vec<usize> = (s..e).collect();
        let rows = model.finish_rows(raw, spec.seed, &first_rows);
        out.write(s, &rows)?;
    }
    p.finish();
    if non_integer > 0 {
        notes.push(format!("{non_integer} cell(s) hold non-integer values: scVI models raw counts (scvi-tools warns about such data at setup)"));
    }
    if empty > 0 {
        notes.push(format!("{empty} cell(s) have no count in the model's genes: their embedding is the encoder's output for zeros"));
    }
    let mut params = spec.params.clone();
    batches.finish(&mut notes, true);
    batches.record(spec, &mut params);
    params.insert("model_dir".into(), json!(dir.display().to_string()));
    params.insert("architecture".into(), serde_json::to_value(&a).unwrap_or(Value::Null));
    params.insert("genes_in_model".into(), json!(genes.n_model));
    params.insert("genes_zero_filled".into(), json!(genes.missing.len()));
    params.insert("genes_not_in_model".into(), json!(unused));
    if a.uses_batch() {
        params.insert("batch_key".into(), json!(batch_key));
    }
    params.insert(
        "cell_embedding".into(),
        json!(match a.latent_distribution {
            Latent::Normal => "the encoder's latent mean q_m (scvi-tools get_latent_representation(give_mean=True))".to_string(),
            Latent::Ln => format!("mean of softmax(z) over {} draws z ~ N(q_m, q_v) (scvi-tools get_latent_representation(give_mean=True) for latent_distribution='ln'); ChaCha8 seeded per cell with (seed, row)", sp::MC_SAMPLES),
        }),
    );
    let mut w = serde_json::Map::new();
    w.insert("model".into(), json!(saved.path.display().to_string()));
    out.commit(spec, &x.field, params, w, json!(crate::weights::sha256_file(&saved.path, |_| {})?), notes)
}

/// Pretrained scVI's options, from `methods/scvi.toml`.
#[derive(Debug, Deserialize)]
pub struct Params {
    pub batch_size: usize,
}

/// Pretrained scVI: the table's entry.
pub struct ScviMethod;

impl Method for ScviMethod {
    fn check(&self, pf: &Preflight) -> Result<()> {
        // the saved model is read (as data) first: a wrong folder fails before the data is read
        SavedModel::read(&model_dir(pf.params)?).map(drop)
    }

    fn check_data(&self, pf: &Preflight, ad: &AnnData) -> Result<()> {
        // genes and batches against the model
        prepare(pf.params, pf.data, ad).map(drop)
    }

    fn embed(&self, spec: &TaskSpec, task_dir: &Path, step: &crate::runner::Step) -> Option<Result<TaskResult>> {
        one_step(step, || embed_scvi(spec, task_dir))
    }
}
