//! What a method provides to the commands and the task process. Each implemented method has
//! one entry in [`crate::tasks::table::METHODS`]; its defaults, device support and honoured
//! options come from its `methods/<name>.toml` alone.

use std::path::{Path, PathBuf};

use candle_core::Device;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::anndata::AnnData;
use crate::cli::IntegrateArgs;
use crate::tasks::integrate::IntegrateOptions;
use crate::error::{Error, Result};
use crate::nn::finetune::{Features, LoadHook};
use crate::runner::{Step, TaskResult, TaskSpec};

/// What the checks before a run may read: nothing here is written.
pub struct Preflight<'a> {
    /// The method's name, as in its toml.
    pub method: &'a str,
    /// The weights folder in effect.
    pub weights_dir: &'a Path,
    /// The method parameters in effect (the toml's defaults and the options given).
    pub params: &'a Map<String, Value>,
    /// `--model-dir`, when given.
    pub model_dir: Option<&'a Path>,
    /// The input .h5ad.
    pub data: &'a Path,
}

/// One method. Every function has a default that says "not supported"; an adapter overrides
/// those that apply.
pub trait Method: Sync {
    /// Checks of `embed` before any run folder exists (weights first, the usual miss).
    fn check(&self, _p: &Preflight) -> Result<()> {
        Ok(())
    }

    /// Checks of `embed` against the opened input, before any run folder exists.
    fn check_data(&self, _p: &Preflight, _ad: &AnnData) -> Result<()> {
        Ok(())
    }

    /// For a method whose cells see each other in groups (CellPLM's forward passes): the
    /// groups of `ad`'s cells, in the order a sharded run cuts them (`tasks::shard::GroupOrder`;
    /// a shard is whole groups, whatever `block_rows` says). `None`: shards are whole blocks of
    /// rows. The planner asks it before any task runs, so it reads no more than obs.
    fn shard_groups(&self, _ad: &AnnData, _params: &Map<String, Value>) -> Result<Option<crate::tasks::shard::GroupOrder>> {
        Ok(None)
    }

    /// Rows of the blocks an embedding reads X in, laid over the whole file (see
    /// `tasks::shard`): shards are whole blocks, so a sharded run batches cells as an unsharded
    /// one. About a million stored values a block unless the method says otherwise.
    fn block_rows(&self, x: &crate::anndata::Matrix, _params: &Map<String, Value>) -> usize {
        crate::tasks::shard::block_rows(x, 1_000_000, 1)
    }

    /// Whether a sharded embedding computes something over the whole data first (a
    /// `Step::Fit` task before the shards; its result in the run's work folder).
    fn fits_before_shards(&self) -> bool {
        false
    }

    /// One step of an `embed` task; `None` where the method has no such step.
    fn embed(&self, _spec: &TaskSpec, _task_dir: &Path, _step: &Step) -> Option<Result<TaskResult>> {
        None
    }

    /// One step of a `transfer` task (the reference's fit, an embedding); `None` where the
    /// method does not transfer labels.
    fn transfer(&self, _spec: &TaskSpec, _task_dir: &Path, _step: &Step) -> Option<Result<TaskResult>> {
        None
    }

    /// Whether `scfoundry transfer` embeds with this method.
    fn transfers(&self) -> bool {
        false
    }

    /// Whether the method's transfer fits a model to the reference first (a `Step::Fit` task,
    /// then the reference and the query projected with that fit).
    fn fits_reference(&self) -> bool {
        false
    }

    /// Checks of `transfer` before any run folder exists (`data`: the reference).
    fn check_transfer(&self, _p: &Preflight) -> Result<()> {
        Ok(())
    }

    /// Whether `scfoundry finetune` trains a head on this method.
    fn finetunes(&self) -> bool {
        false
    }

    /// The backbone `finetune` trains a head on; `None` where the method is not fine-tuned.
    fn backbone(&self, _load: &BackboneLoad) -> Option<Result<LoadedBackbone>> {
        None
    }

    /// Whether `finetune --unfreeze-layers` trains some of the method's encoder layers.
    fn unfreezes(&self) -> bool {
        false
    }

    /// Where the method's encoder states its layer count, for `finetune --unfreeze-layers`;
    /// `None` when it has no such file.
    fn layer_count(&self, _weights_dir: &Path, _params: &Map<String, Value>) -> Result<Option<LayerCount>> {
        Ok(None)
    }

    /// Whether this is an integration method (`scfoundry integrate`).
    fn integrates(&self) -> bool {
        false
    }

    /// Whether `embed` runs this integration method: its embedding is integrate's task (a
    /// model fine-tuned on the batches of `--batch-key`), the same output as `integrate`.
    fn embeds_by_integrating(&self) -> bool {
        false
    }

    /// Checks of `integrate`'s options for this method (warnings for those it ignores).
    fn check_integrate_options(&self, _args: &IntegrateArgs) -> anyhow::Result<()> {
        Ok(())
    }

    /// Checks of `integrate`'s input, before any run folder exists.
    fn check_integrate_data(&self, _data: &Path, _opts: &IntegrateOptions) -> anyhow::Result<()> {
        Ok(())
    }

    /// The task of `integrate`; `None` for a method that does not integrate.
    fn integrate(&self, _spec: &TaskSpec) -> Option<anyhow::Result<TaskResult>> {
        None
    }
}

/// What fine-tuning trains a head on: a method's model, or its fit.
pub trait Backbone {
    /// The width of the features.
    fn dim(&self) -> usize;

    /// The features of the cells of `ad`, and which cells have any (the others get no
    /// prediction). `train`: `ad` is the training data.
    fn features<'a>(&'a self, ad: &AnnData, seed: u64, device: &Device, train: bool, notes: &mut Vec<String>) -> Result<(Box<dyn Features + 'a>, Vec<bool>)>;
}

/// Where a fine-tuning backbone comes from.
pub enum BackboneFrom<'a> {
    /// Training on `data`: a method that fits (rather than loads weights) fits it and saves
    /// the fit in `out`.
    Training { data: &'a AnnData, out: &'a Path },
    /// A fine-tuned model's folder, the `--out` of training.
    Saved(&'a Path),
    /// The method's weights only (prediction right after training).
    Weights,
}

/// What loading a fine-tuning backbone reads.
pub struct BackboneLoad<'a> {
    pub spec: &'a TaskSpec,
    /// The method's parameters in effect (the toml's defaults and the options given).
    pub params: &'a Map<String, Value>,
    /// Model weights load through this hook: it makes the last layers trainable, or puts
    /// fine-tuned tensors in their place.
    pub hook: &'a LoadHook,
    pub device: &'a Device,
    pub from: BackboneFrom<'a>,
}

/// A loaded fine-tuning backbone and what the record says of it.
pub struct LoadedBackbone {
    pub backbone: Box<dyn Backbone>,
    /// The base weights' folder.
    pub base_dir: Option<PathBuf>,
    /// The base weights' sha256, by file name.
    pub shas: Map<String, Value>,
    /// Files written beside the fine-tuned model: (key in finetune.json's `files`, path).
    pub files: Vec<(String, PathBuf)>,
    pub notes: Vec<String>,
}

/// An integer parameter, or `default`.
pub fn param_u64(p: &Map<String, Value>, key: &str, default: u64) -> u64 {
    p.get(key).and_then(Value::as_u64).unwrap_or(default)
}

/// `--model-dir` as the commands resolved it (a Hugging Face cache entry is already its
/// snapshot), when given.
pub fn model_dir(p: &Map<String, Value>) -> Option<PathBuf> {
    crate::tasks::runtime::given_model_dir(p)
}

/// A non-empty string parameter.
pub fn param_str(p: &Map<String, Value>, key: &str) -> Option<String> {
    p.get(key).and_then(Value::as_str).filter(|s| !s.is_empty()).map(String::from)
}

/// A model config's layer count: the file, its key, and the layers at the end that a run
/// does not use.
pub struct LayerCount {
    pub path: std::path::PathBuf,
    pub key: &'static str,
    pub left_out: u64,
}

/// A task's method parameters as the adapter's typed struct. The commands put every default
/// of the method's toml into the parameters, so a missing field is an error, never a fallback.
pub fn params<P: DeserializeOwned>(method: &str, params: &Map<String, Value>) -> Result<P> {
    serde_json::from_value(Value::Object(params.clone())).map_err(|e| Error::BadOption {
        option: "task spec".into(),
        detail: format!("the parameters of {method} do not match methods/{method}.toml: {e}"),
        hint: None,
    })
}

/// [`params`] of a task.
pub fn task_params<P: DeserializeOwned>(spec: &TaskSpec) -> Result<P> {
    params(&spec.method, &spec.params)
}

/// `embed`'s step for a method whose cells embed independently: the whole data
/// (`Step::Embed`) or one shard's rows (`Step::Project`), the same function (it reads its rows
/// from `tasks::shard::TaskRows`); the merge is the shared one (`tasks::shard::merge`).
pub fn one_step(step: &Step, run: impl FnOnce() -> Result<TaskResult>) -> Option<Result<TaskResult>> {
    matches!(step, Step::Embed | Step::Project { .. }).then(run)
}
