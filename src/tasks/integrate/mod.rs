//! The inputs of an integration task, shared by `scfoundry integrate` (which checks them
//! before any run folder exists) and its methods' tasks: the options and the batch codes.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::anndata::AnnData;
use crate::error::Error;

pub mod harmony;
pub mod scgpt_integrated;
pub mod scvi_denovo;
pub mod seurat;

/// What the task needs besides data, output, method and seed (the spec's params).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IntegrateOptions {
    pub embedding: String,
    pub batch_key: Vec<String>,
    pub theta: Option<f32>,
    #[serde(default)]
    pub layer: Option<String>,
    #[serde(default)]
    pub log_normalized: bool,
    #[serde(default)]
    pub dims: Option<usize>,
    #[serde(default)]
    pub k_weight: Option<usize>,
    /// scvi_denovo's options (absent in specs written before it existed).
    #[serde(default)]
    pub scvi: crate::cli::ScviArgs,
    #[serde(default)]
    pub batch_size: Option<u64>,
    /// scgpt_integrated's options.
    #[serde(default)]
    pub scgpt: crate::cli::ScgptIntegrationArgs,
}

/// The warning of a trained integration method given the options of the
/// classic ones, which it ignores.
pub fn warn_classic_options(args: &crate::cli::IntegrateArgs, method: &str) {
    if args.dims.is_some() || args.k_weight.is_some() || args.theta.is_some() {
        crate::progress::warn(&format!("--dims, --k-weight and --theta are seurat and harmony options; {method} ignores them"));
    }
}

/// An error on a field of an integration input, with an optional hint.
pub fn bad_field(path: &std::path::Path, field: &str, detail: String, hint: Option<String>) -> anyhow::Error {
    Error::BadField { path: path.to_path_buf(), field: field.into(), detail, hint }.into()
}

/// Open the input of a method that trains on one batch column: at least one cell and exactly one
/// `--batch-key`.
pub fn open_with_one_batch_key(path: &std::path::Path, o: &IntegrateOptions, method: &str) -> anyhow::Result<AnnData> {
    let ad = AnnData::open(path)?;
    if ad.n_obs == 0 {
        return Err(Error::ZeroCells { path: ad.path.clone(), n_vars: ad.n_vars }.into());
    }
    if o.batch_key.len() != 1 {
        return Err(Error::BadOption {
            option: "--batch-key".into(),
            detail: format!("{method} takes one batch column, got {}", o.batch_key.len()),
            hint: Some("combine the columns into one (e.g. donor_protocol) and pass that".into()),
        }
        .into());
    }
    Ok(ad)
}

/// The batch codes of each key (levels sorted), checked: present, categorical, no missing
/// value, more than one batch.
pub fn batch_codes(ad: &AnnData, batch_key: &[String]) -> anyhow::Result<(Vec<Vec<u32>>, Vec<usize>)> {
    batch_levels(ad, batch_key).map(|(c, n, _)| (c, n))
}

/// [`batch_codes`] with the level names of each key.
pub fn batch_levels(ad: &AnnData, batch_key: &[String]) -> anyhow::Result<(Vec<Vec<u32>>, Vec<usize>, Vec<Vec<String>>)> {
    let obs = ad.obs()?;
    let mut codes: Vec<Vec<u32>> = Vec::new();
    let mut n_batches = Vec::new();
    let mut all_levels = Vec::new();
    for key in batch_key {
        let col = obs.column(key).ok_or_else(|| Error::BadField {
            path: ad.path.clone(),
            field: format!("obs/{key}"),
            detail: "is missing".into(),
            hint: Some(format!("obs columns in this file: {}", obs.names().join(", "))),
        })?;
        let labels = col.as_labels().ok_or_else(|| Error::BadField {
            path: ad.path.clone(),
            field: format!("obs/{key}"),
            detail: format!("is a {} column; a batch key must be categorical, string or integer", col.kind()),
            hint: None,
        })?;
        if let Some(i) = labels.iter().position(Option::is_none) {
            return Err(Error::BadField {
                path: ad.path.clone(),
                field: format!("obs/{key}"),
                detail: format!("has no value for cell {i} ({})", ad.obs_names[i]),
                hint: Some("give every cell a batch, or drop the cells without one".into()),
            }
            .into());
        }
        let levels: BTreeSet<&str> = labels.iter().map(|l| l.as_deref().unwrap()).collect();
        let levels: Vec<&str> = levels.into_iter().collect();
        n_batches.push(levels.len());
        codes.push(labels.iter().map(|l| levels.binary_search(&l.as_deref().unwrap()).unwrap() as u32).collect());
        all_levels.push(levels.iter().map(|l| l.to_string()).collect());
    }
    if n_batches.iter().all(|&b| b < 2) {
        return Err(Error::BadField {
            path: ad.path.clone(),
            field: format!("obs/{}", batch_key.join(",")),
            detail: "holds a single batch: there is nothing to integrate".into(),
            hint: Some("pass the column that separates the batches with --batch-key".into()),
        }
        .into());
    }
    drop(obs);
    Ok((codes, n_batches, all_levels))
}
