//! scVI, pretrained: the encoder of a model trained and saved by scvi-tools, run on raw counts;
//! the latent mean is the cell embedding.
//!
//! Paper: Lopez R, Regier J, Cole MB, Jordan MI, Yosef N, *Deep generative modeling for
//! single-cell transcriptomics*, Nature Methods 2018, doi:10.1038/s41592-018-0229-2.
//! Upstream: scverse/scvi-tools (read at 1.3.3): `src/scvi/model/base/_base_model.py`
//! (`save`: torch.save of {"model_state_dict", "var_names", "attr_dict"} to `<dir>/model.pt`),
//! `src/scvi/model/_scvi.py` (`SCVI.__init__`), `src/scvi/module/_vae.py` (`VAE.__init__`,
//! `_regular_inference`), `src/scvi/nn/_base_components.py` (`FCLayers`, `Encoder`),
//! `src/scvi/model/base/_vaemixin.py` (`get_latent_representation`),
//! `src/scvi/model/base/_archesmixin.py` (`prepare_query_anndata`).
//!
//! The saved model is read as data: `model.pt` is a torch.save zip read by `formats::torch_zip`
//! (its `data.pkl` by our pickle reader, the pandas frames of the training history kept opaque,
//! never rebuilt; the tensors of `model_state_dict` the encoder needs from the zip's `data/`
//! records). From `attr_dict` come `init_params_` (SCVI's arguments and the VAE keyword
//! arguments: n_hidden, n_latent, n_layers, latent_distribution, gene_likelihood, and
//! log_variational, encode_covariates, deeply_inject_covariates, use_batch_norm,
//! use_layer_norm, batch_representation with the VAE's defaults when absent) and `registry_`
//! (the batch field's categories and key, the counts of extra covariates, the model class).
//!
//! The encoder, as `VAE._regular_inference` runs it for `get_latent_representation()`:
//! `x_ = log1p(x)` when `log_variational`; `z_encoder` = FCLayers (per layer Linear ->
//! BatchNorm1d(eps 1e-3, running statistics) if use_batch_norm in {encoder, both} -> LayerNorm
//! (no affine, eps 1e-5) if use_layer_norm in {encoder, both} -> ReLU; dropout is off in
//! evaluation), the batch one-hot concatenated to the first layer's input and, with
//! `deeply_inject_covariates`, to every layer's, only when `encode_covariates` and the model
//! has more than one batch; `q_m = mean_encoder(q)`, `q_v = exp(var_encoder(q)) + 1e-4`.
//! The embedding is `q_m` (`give_mean=True`); for `latent_distribution="ln"` upstream returns
//! the mean of `softmax(z)` over 5,000 draws `z ~ N(q_m, q_v)`: we draw them from a ChaCha8
//! stream seeded per cell with (seed, cell row), so a seed gives the same rows at any batch
//! size, but not torch's draws (the Monte Carlo error, about 1e-3 relative, is far above
//! 1e-4: tests compare q_m and q_v exactly and the ln rows within the Monte Carlo error).
//!
//! Query genes: matched to the model's `var_names` by name; model genes the query lacks are
//! zero-filled (what scvi-tools' `prepare_query_anndata` does), query genes the model lacks are
//! left out. scvi-tools warns below 80 % of the model's genes; we note it, and refuse below
//! 50 %. Query batches: scvi-tools maps the query's batch column to the registry's categories
//! and refuses categories it has not seen (`transfer_fields`, extend_categories=False; only
//! `load_query_data` + training extends them). We do the same and refuse unknown batches with
//! the list of known ones.
//!
//! Not supported (refused with a clear error): batch_representation="embedding", extra
//! categorical or continuous covariates fed to the encoder (encode_covariates with covariate
//! keys), a custom var_activation or extra_encoder_kwargs, and model classes other than SCVI.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

use crate::formats::pickle::Py;
use crate::formats::torch_zip::{TorchZip, TorchZipError};
use super::scvi::{BatchNorm, FcLayers, Linear, ZEncoder};
use crate::error::{Error, Result};
use crate::nn::sparse_rows::SparseRows;

/// The file scvi-tools' `save` writes in the model folder.
pub const MODEL_FILE: &str = "model.pt";
/// scvi-tools' `get_latent_representation(mc_samples=5000)` for the "ln" latent.
pub const MC_SAMPLES: usize = 5000;
/// scvi-tools' `MIN_VAR_NAME_RATIO` (`_archesmixin.py`): below it, a warning.
pub const WARN_GENE_OVERLAP: f64 = 0.8;
/// Below this share of the model's genes in the query, the query is refused.
pub const MIN_GENE_OVERLAP: f64 = 0.5;

/// Globals of a saved scvi-tools model kept as opaque data (tensors, the history's frames).
const OPAQUE: &[&str] = &["torch.", "pandas.", "builtins.slice", "scvi.", "numpy.random."];

/// The encoder's latent distribution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Latent {
    Normal,
    Ln,
}

/// What the saved model says about its encoder and its inputs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Arch {
    pub model_name: String,
    pub scvi_version: String,
    pub n_hidden: usize,
    pub n_latent: usize,
    pub n_layers: usize,
    pub gene_likelihood: String,
    pub latent_distribution: Latent,
    pub log_variational: bool,
    pub encode_covariates: bool,
    pub deeply_inject_covariates: bool,
    pub batch_norm_encoder: bool,
    pub layer_norm_encoder: bool,
    pub n_batch: usize,
    /// The obs column the model was set up with (`setup_args.batch_key`), if any.
    pub batch_key: Option<String>,
    pub batch_categories: Vec<String>,
}

impl Arch {
    /// The encoder reads the batch (one-hot): encode_covariates with more than one batch.
    pub fn uses_batch(&self) -> bool {
        self.encode_covariates && self.n_batch > 1
    }
}

/// A saved model folder, read as data (tensors not loaded yet).
#[derive(Debug, Clone)]
pub struct SavedModel {
    pub path: PathBuf,
    pub arch: Arch,
    pub var_names: Vec<String>,
}

fn model_err(context: &'static str) -> impl Fn(candle_core::Error) -> Error {
    move |e| Error::Model { context: context.into(), detail: e.to_string() }
}

fn bad(path: &Path, detail: impl Into<String>, hint: Option<&str>) -> Error {
    Error::Config { path: path.into(), detail: detail.into(), hint: hint.map(String::from) }
}

fn as_str(v: &Py) -> Option<String> {
    match v {
        Py::Str(s) => Some(s.clone()),
        Py::Int(i) => Some(i.to_string()),
        Py::Float(f) => Some(f.to_string()),
        Py::Bool(b) => Some(if *b { "True" } else { "False" }.into()),
        _ => None,
    }
}

/// A list of strings: a numpy array, list or tuple of strings (numbers written as text).
fn strings(v: &Py) -> Option<Vec<String>> {
    match v {
        Py::Array { items, .. } | Py::List(items) | Py::Tuple(items) => items.iter().map(as_str).collect(),
        _ => None,
    }
}

/// The path of `model.pt`: the folder's, or the file itself.
pub fn model_file(path: &Path) -> Result<PathBuf> {
    if path.is_dir() {
        let f = path.join(MODEL_FILE);
        if f.is_file() {
            return Ok(f);
        }
        if path.join("model_params.pt").is_file() {
            return Err(bad(path, "holds a model saved by scvi-tools before 0.15 (model_params.pt, attr.pkl, var_names.csv), not model.pt", Some("convert it with scvi-tools: `scvi.model.SCVI.convert_legacy_save(old_dir, new_dir)`, then pass the new folder")));
        }
        return Err(Error::MissingFile { path: f });
    }
    if path.is_file() {
        return Ok(path.to_path_buf());
    }
    Err(Error::MissingFile { path: path.into() })
}

/// `model.pt` opened (`formats::torch_zip`) and its data.pkl read, tensors not yet loaded.
fn open_model(file: &Path) -> Result<(TorchZip<std::io::BufReader<std::fs::File>>, Py)> {
    let err = |e: TorchZipError| match e {
        TorchZipError::Io(source) => Error::Io { path: file.into(), source },
        TorchZipError::NotZip(e) => bad(file, format!("not a PyTorch file (torch.save zip): {e}"), Some("pass the folder scvi-tools' `model.save(dir)` wrote (it holds model.pt)")),
        e => bad(file, e.to_string(), None),
    };
    let mut tz = TorchZip::open(file).map_err(err)?;
    let root = tz.read_pickle(OPAQUE).map_err(err)?;
    Ok((tz, root))
}

impl SavedModel {
    /// Read `model.pt` in a scvi-tools model folder (or the file itself).
    pub fn read(path: &Path) -> Result<SavedModel> {
        let file = model_file(path)?;
        let (_, root) = open_model(&file)?;
        Self::from_pickle(&file, &root)
    }

    /// The model's description from the unpickled `model.pt`.
    pub fn from_pickle(file: &Path, root: &Py) -> Result<SavedModel> {
        let hint_saved = Some("pass the folder written by scvi-tools' `model.save(dir)` (scvi-tools >= 0.15)");
        for key in ["model_state_dict", "var_names", "attr_dict"] {
            if root.get(key).is_none() {
                return Err(bad(file, format!("has no `{key}`: not a model saved by scvi-tools"), hint_saved));
            }
        }
        let var_names = strings(root.get("var_names").unwrap()).ok_or_else(|| bad(file, "`var_names` is not a list of gene names", None))?;
        let attr = root.get("attr_dict").unwrap();
        let registry = attr.get("registry_").ok_or_else(|| bad(file, "`attr_dict` has no `registry_`", hint_saved))?;
        let model_name = registry.get("model_name").and_then(as_str).unwrap_or_default();
        if model_name != "SCVI" {
            return Err(bad(file, format!("is a scvi-tools `{model_name}` model; scfoundry runs SCVI models' encoders"), None));
        }
        let scvi_version = registry.get("scvi_version").and_then(as_str).unwrap_or_default();
        // SCVI's arguments and the VAE keyword arguments, flattened
        let init = attr.get("init_params_").ok_or_else(|| bad(file, "`attr_dict` has no `init_params_`", hint_saved))?;
        let mut params: Vec<(String, Py)> = Vec::new();
        let mut add = |d: &Py, flatten: bool| {
            if let Py::Dict(items) = d {
                for (k, v) in items {
                    match (k, v) {
                        (Py::Str(_), Py::Dict(_)) if flatten => {
                            if let Py::Dict(inner) = v {
                                params.extend(inner.iter().filter_map(|(k, v)| as_str(k).map(|k| (k, v.clone()))));
                            }
                        }
                        (Py::Str(k), v) => params.push((k.clone(), v.clone())),
                        _ => {}
                    }
                }
            }
        };
        match (init.get("non_kwargs"), init.get("kwargs")) {
            (None, None) => add(init, false),
            (nk, kw) => {
                if let Some(nk) = nk {
                    add(nk, false);
                }
                if let Some(kw) = kw {
                    add(kw, true);
                }
            }
        }
        let param = |k: &str| params.iter().rev().find(|(n, _)| n == k).map(|(_, v)| v);
        let int = |k: &str, default: usize| -> Result<usize> {
            match param(k) {
                None => Ok(default),
                Some(Py::Int(i)) if *i > 0 => Ok(*i as usize),
                Some(v) => Err(bad(file, format!("init parameter {k} = {v:?} is not a positive integer"), None)),
            }
        };
        let flag = |k: &str, default: bool| -> Result<bool> {
            match param(k) {
                None | Some(Py::None) => Ok(default),
                Some(Py::Bool(b)) => Ok(*b),
                Some(v) => Err(bad(file, format!("init parameter {k} = {v:?} is not True or False"), None)),
            }
        };
        let text = |k: &str, default: &str| -> String { param(k).and_then(as_str).unwrap_or_else(|| default.to_string()) };
        let latent_distribution = match text("latent_distribution", "normal").as_str() {
            "normal" => Latent::Normal,
            "ln" => Latent::Ln,
            other => return Err(bad(file, format!("latent_distribution {other:?} is neither \"normal\" nor \"ln\""), None)),
        };
        let side = |k: &str, default: &str| -> Result<bool> {
            match param(k) {
                Some(Py::Bool(b)) => Ok(*b), // scvi-tools < 0.9 took booleans
                _ => match text(k, default).as_str() {
                    "encoder" | "both" => Ok(true),
                    "decoder" | "none" => Ok(false),
                    other => Err(bad(file, format!("{k} {other:?} is not encoder, decoder, both or none"), None)),
                },
            }
        };
        let batch_representation = text("batch_representation", "one-hot");
        if batch_representation != "one-hot" {
            return Err(bad(file, format!("batch_representation {batch_representation:?}: only \"one-hot\" batches are supported"), None));
        }
        for k in ["var_activation", "extra_encoder_kwargs"] {
            match param(k) {
                None | Some(Py::None) => {}
                Some(Py::Dict(d)) if d.is_empty() => {}
                Some(v) => return Err(bad(file, format!("init parameter {k} is set ({v:?}); only scvi-tools' default encoder is supported"), None)),
            }
        }
        let fields = registry.get("field_registries");
        let field = |name: &str| fields.and_then(|f| f.get(name));
        let summary = |name: &str, key: &str| field(name).and_then(|f| f.get("summary_stats")).and_then(|s| s.get(key)).and_then(|v| if let Py::Int(i) = v { Some(*i as usize) } else { None });
        let batch_state = field("batch").and_then(|f| f.get("state_registry"));
        let batch_categories = batch_state.and_then(|s| s.get("categorical_mapping")).and_then(strings).unwrap_or_default();
        let n_batch = summary("batch", "n_batch").unwrap_or(batch_categories.len().max(1));
        let batch_key = registry.get("setup_args").and_then(|s| s.get("batch_key")).and_then(as_str);
        let encode_covariates = flag("encode_covariates", false)?;
        let n_cat = summary("extra_categorical_covs", "n_extra_categorical_covs").unwrap_or(0);
        let n_cont = summary("extra_continuous_covs", "n_extra_continuous_covs").unwrap_or(0);
        if encode_covariates && (n_cat > 0 || n_cont > 0) {
            return Err(bad(file, format!("the encoder takes {n_cat} extra categorical and {n_cont} continuous covariate(s) (encode_covariates=True with covariate keys); only the batch covariate is supported"), None));
        }
        if encode_covariates && n_batch > 1 && batch_categories.len() != n_batch {
            return Err(bad(file, format!("the registry names {} batch categories for n_batch = {n_batch}", batch_categories.len()), None));
        }
        let arch = Arch {
            model_name,
            scvi_version,
            n_hidden: int("n_hidden", 128)?,
            n_latent: int("n_latent", 10)?,
            n_layers: int("n_layers", 1)?,
            gene_likelihood: text("gene_likelihood", "zinb"),
            latent_distribution,
            log_variational: flag("log_variational", true)?,
            encode_covariates,
            deeply_inject_covariates: flag("deeply_inject_covariates", true)?,
            batch_norm_encoder: side("use_batch_norm", "both")?,
            layer_norm_encoder: side("use_layer_norm", "none")?,
            n_batch,
            batch_key,
            batch_categories,
        };
        Ok(SavedModel { path: file.to_path_buf(), arch, var_names })
    }
}

// ---------------------------------------------------------------------------------- genes

/// The query's genes against the model's.
#[derive(Debug, Clone)]
pub struct GeneAlignment {
    /// For each query column, the model gene it feeds (None: not a model gene).
    pub model_col: Vec<Option<u32>>,
    pub n_model: usize,
    pub present: usize,
    /// Model genes the query lacks (zero-filled), in the model's order.
    pub missing: Vec<String>,
}

impl GeneAlignment {
    /// Match by exact name (`var_names`); a query gene named twice feeds its model gene from
    /// its first column.
    pub fn new(model_genes: &[String], query_genes: &[String]) -> GeneAlignment {
        let pos: std::collections::HashMap<&str, usize> = model_genes.iter().enumerate().rev().map(|(i, g)| (g.as_str(), i)).collect();
        let mut seen = vec![false; model_genes.len()];
        let model_col = query_genes
            .iter()
            .map(|g| match pos.get(g.as_str()) {
                Some(&i) if !seen[i] => {
                    seen[i] = true;
                    Some(i as u32)
                }
                _ => None,
            })
            .collect();
        let missing: Vec<String> = model_genes.iter().zip(&seen).filter(|(_, s)| !**s).map(|(g, _)| g.clone()).collect();
        GeneAlignment { model_col, n_model: model_genes.len(), present: model_genes.len() - missing.len(), missing }
    }

    pub fn fraction(&self) -> f64 {
        self.present as f64 / self.n_model.max(1) as f64
    }

    /// A cell's CSR row as (model column, count) entries in `out` (a gene given twice keeps its
    /// last count, as [`Self::fill`]).
    pub fn entries(&self, idx: &[u32], vals: &[f32], out: &mut Vec<(u32, f32)>) {
        out.clear();
        out.extend(idx.iter().zip(vals).filter_map(|(&j, &v)| self.model_col[j as usize].map(|c| (c, v))));
    }

    /// A cell's CSR row as dense model-gene counts, added to `out` (n_model long, zeroed).
    pub fn fill(&self, idx: &[u32], vals: &[f32], out: &mut [f32]) {
        for (&j, &v) in idx.iter().zip(vals) {
            if let Some(c) = self.model_col[j as usize] {
                out[c as usize] = v;
            }
        }
    }
}

// ---------------------------------------------------------------------------------- model

/// A pretrained scVI encoder on a device.
pub struct PretrainedScvi {
    enc: ZEncoder,
    pub arch: Arch,
    pub n_genes: usize,
    device: Device,
}

impl PretrainedScvi {
    /// Load `z_encoder`'s weights from the saved model onto `device`.
    pub fn load(m: &SavedModel, device: &Device) -> Result<PretrainedScvi> {
        let file = &m.path;
        let (mut tz, root) = open_model(file)?;
        let hint = Some("the file must hold an scvi-tools SCVI model (its encoder's keys start with z_encoder.)");
        let Some(Py::Dict(sd)) = root.get("model_state_dict") else {
            return Err(bad(file, "`model_state_dict` is not a dict of tensors", hint));
        };
        let sd: std::collections::HashMap<&str, &Py> = sd.iter().filter_map(|(k, v)| if let Py::Str(k) = k { Some((k.as_str(), v)) } else { None }).collect();
        let mut get = |k: &str| -> Result<Tensor> {
            let v = sd.get(k).ok_or_else(|| bad(file, format!("model_state_dict has no `{k}`"), hint))?;
            let t = tz.tensor(v).map_err(|e| bad(file, format!("tensor {k}: {e}"), None))?;
            t.to_device(device).map_err(model_err("loading the scVI encoder's weights"))
        };
        let a = &m.arch;
        let n_layers = (0..).take_while(|i| sd.contains_key(format!("z_encoder.encoder.fc_layers.Layer {i}.0.weight").as_str())).count();
        if n_layers != a.n_layers {
            return Err(bad(file, format!("model_state_dict has {n_layers} encoder layer(s), init_params_ says n_layers = {}", a.n_layers), None));
        }
        let mut layers = Vec::new();
        for i in 0..n_layers {
            let p = format!("z_encoder.encoder.fc_layers.Layer {i}");
            let lin = Linear::from_tensors(get(&format!("{p}.0.weight"))?, get(&format!("{p}.0.bias"))?).map_err(model_err("loading the scVI encoder's weights"))?;
            let bn = if a.batch_norm_encoder {
                Some(BatchNorm::from_tensors(get(&format!("{p}.1.weight"))?, get(&format!("{p}.1.bias"))?, &get(&format!("{p}.1.running_mean"))?, &get(&format!("{p}.1.running_var"))?).map_err(model_err("loading the scVI encoder's weights"))?)
            } else {
                None
            };
            layers.push((lin, bn));
        }
        let n_cat = if a.uses_batch() { a.n_batch } else { 0 };
        let fc = FcLayers::from_layers(layers, a.layer_norm_encoder, n_cat, a.deeply_inject_covariates).map_err(|e| bad(file, format!("z_encoder: {e}"), None))?;
        let mean = Linear::from_tensors(get("z_encoder.mean_encoder.weight")?, get("z_encoder.mean_encoder.bias")?).map_err(model_err("loading the scVI encoder's weights"))?;
        let var = Linear::from_tensors(get("z_encoder.var_encoder.weight")?, get("z_encoder.var_encoder.bias")?).map_err(model_err("loading the scVI encoder's weights"))?;
        let enc = ZEncoder::new(fc, mean, var).map_err(|e| bad(file, format!("z_encoder: {e}"), None))?;
        let n_genes = enc.n_input() - n_cat;
        if n_genes != m.var_names.len() {
            return Err(bad(file, format!("the encoder takes {} inputs ({n_cat} batch columns), but var_names has {} genes", enc.n_input(), m.var_names.len()), None));
        }
        if enc.n_latent() != a.n_latent {
            return Err(bad(file, format!("the encoder gives {} latent dimensions, init_params_ says n_latent = {}", enc.n_latent(), a.n_latent), None));
        }
        Ok(PretrainedScvi { enc, arch: a.clone(), n_genes, device: device.clone() })
    }

    /// A model of `arch`'s shape on `n_genes` genes with random weights (normal, sd
    /// 1/sqrt(fan_in); BatchNorm statistics mean 0, variance 1), for throughput runs.
    pub fn random(arch: &Arch, n_genes: usize, device: &Device) -> Result<PretrainedScvi> {
        let lin = |n_in: usize, n_out: usize| -> candle_core::Result<Linear> {
            let sd = 1.0 / (n_in as f64).sqrt();
            Linear::from_tensors(Tensor::randn(0f32, sd as f32, (n_out, n_in), device)?, Tensor::randn(0f32, sd as f32, n_out, device)?)
        };
        let build = || -> candle_core::Result<ZEncoder> {
            let n_cat = if arch.uses_batch() { arch.n_batch } else { 0 };
            let mut layers = Vec::new();
            for i in 0..arch.n_layers {
                let n_in = if i == 0 { n_genes } else { arch.n_hidden };
                let cat = if i == 0 || arch.deeply_inject_covariates { n_cat } else { 0 };
                let bn = if arch.batch_norm_encoder {
                    let h = arch.n_hidden;
                    Some(BatchNorm::from_tensors(Tensor::ones(h, DType::F32, device)?, Tensor::zeros(h, DType::F32, device)?, &Tensor::zeros(h, DType::F32, &Device::Cpu)?, &Tensor::ones(h, DType::F32, &Device::Cpu)?)?)
                } else {
                    None
                };
                layers.push((lin(n_in + cat, arch.n_hidden)?, bn));
            }
            let fc = FcLayers::from_layers(layers, arch.layer_norm_encoder, n_cat, arch.deeply_inject_covariates).map_err(candle_core::Error::msg)?;
            ZEncoder::new(fc, lin(arch.n_hidden, arch.n_latent)?, lin(arch.n_hidden, arch.n_latent)?).map_err(candle_core::Error::msg)
        };
        let enc = build().map_err(model_err("building a random scVI encoder"))?;
        Ok(PretrainedScvi { enc, arch: arch.clone(), n_genes, device: device.clone() })
    }

    /// The device the encoder runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn dim(&self) -> usize {
        self.arch.n_latent
    }

    /// q_m and q_v (each b x n_latent, row-major) of `b` cells of dense model-gene counts
    /// (b x n_genes) with their batch codes (read only when the encoder uses the batch).
    pub fn qz(&mut self, counts: Vec<f32>, codes: &[u32]) -> Result<(Vec<f32>, Vec<f32>)> {
        self.qz_inner(counts, codes).map_err(model_err("running the scVI encoder"))
    }

    fn qz_inner(&mut self, counts: Vec<f32>, codes: &[u32]) -> candle_core::Result<(Vec<f32>, Vec<f32>)> {
        let b = counts.len() / self.n_genes.max(1);
        let x = Tensor::from_vec(counts, (b, self.n_genes), &self.device)?;
        self.qz_of(x, codes)
    }

    /// q_m and q_v of the dense counts `x` (cells x genes, on the model's device).
    fn qz_of(&mut self, x: Tensor, codes: &[u32]) -> candle_core::Result<(Vec<f32>, Vec<f32>)> {
        let (qm, qv) = self.qz_tensors(x, codes)?;
        Ok((qm.flatten_all()?.to_vec1()?, qv.flatten_all()?.to_vec1()?))
    }

    /// q_m and q_v (`cells x n_latent` each, on the device) of the dense counts `x`.
    fn qz_tensors(&mut self, x: Tensor, codes: &[u32]) -> candle_core::Result<(Tensor, Tensor)> {
        let b = x.dim(0)?;
        let x = if self.arch.log_variational { x.affine(1.0, 1.0)?.log()? } else { x };
        let onehot = if self.arch.uses_batch() {
            let k = self.arch.n_batch;
            let mut v = vec![0f32; b * k];
            for (i, &c) in codes.iter().enumerate().take(b) {
                v[i * k + c as usize] = 1.0;
            }
            Some(Tensor::from_vec(v, (b, k), &self.device)?)
        } else {
            None
        };
        let mut rng = ChaCha8Rng::seed_from_u64(0); // unused in evaluation mode
        self.enc.forward(&x, onehot.as_ref(), false, &mut rng)
    }

    /// How wide [`Self::forward_sparse`]'s rows are: n_latent (q_m), or 2 n_latent (q_m, then
    /// q_v) for the "ln" latent, whose embedding [`Self::finish_rows`] computes on the host.
    pub fn raw_width(&self) -> usize {
        match self.arch.latent_distribution {
            Latent::Normal => self.arch.n_latent,
            Latent::Ln => 2 * self.arch.n_latent,
        }
    }

    /// The encoder's rows ([`Self::raw_width`] wide) of cells given as sparse counts (the model's
    /// genes as columns), made dense on the device, left there: a caller reads them back while
    /// the next batch runs (`gpu::readback`), then [`Self::finish_rows`] gives the embedding.
    pub fn forward_sparse(&mut self, rows: &SparseRows, codes: &[u32]) -> Result<Tensor> {
        let mut run = || -> candle_core::Result<Tensor> {
            let (qm, qv) = self.qz_tensors(rows.to_dense(&self.device)?, codes)?;
            match self.arch.latent_distribution {
                Latent::Normal => Ok(qm),
                Latent::Ln => Tensor::cat(&[qm, qv], 1),
            }
        };
        run().map_err(model_err("running the scVI encoder"))
    }

    /// The embedding (`cells x n_latent`) of [`Self::forward_sparse`]'s rows read back (cells in
    /// `first_rows`' order, as `embed` would give): q_m itself, or for the "ln" latent the mean
    /// of softmax(z) as [`Self::embed`].
    pub fn finish_rows(&self, raw: Vec<f32>, seed: u64, first_rows: &[usize]) -> Vec<f32> {
        match self.arch.latent_distribution {
            Latent::Normal => raw,
            Latent::Ln => {
                let d = self.arch.n_latent;
                let (mut qm, mut qv) = (Vec::with_capacity(raw.len() / 2), Vec::with_capacity(raw.len() / 2));
                for r in raw.chunks(2 * d) {
                    qm.extend_from_slice(&r[..d]);
                    qv.extend_from_slice(&r[d..]);
                }
                ln_mean(&qm, &qv, d, seed, first_rows, MC_SAMPLES)
            }
        }
    }

    /// [`Self::embed`] of cells given as sparse counts, read back at once.
    pub fn embed_sparse(&mut self, rows: &SparseRows, codes: &[u32], seed: u64, first_rows: &[usize]) -> Result<Vec<f32>> {
        let raw = self.forward_sparse(rows, codes)?;
        let raw = raw.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(model_err("reading the scVI encoder's output"))?;
        Ok(self.finish_rows(raw, seed, first_rows))
    }

    /// The embedding rows of `b` cells: q_m, or for the "ln" latent the mean of softmax(z)
    /// over `MC_SAMPLES` draws seeded with (seed, first_row + i) for cell i.
    pub fn embed(&mut self, counts: Vec<f32>, codes: &[u32], seed: u64, first_rows: &[usize]) -> Result<Vec<f32>> {
        let (qm, qv) = self.qz(counts, codes)?;
        match self.arch.latent_distribution {
            Latent::Normal => Ok(qm),
            Latent::Ln => Ok(ln_mean(&qm, &qv, self.arch.n_latent, seed, first_rows, MC_SAMPLES)),
        }
    }
}

/// The Monte Carlo mean of softmax(z), z ~ N(q_m, q_v), per cell (rows of `d`).
pub fn ln_mean(qm: &[f32], qv: &[f32], d: usize, seed: u64, rows: &[usize], samples: usize) -> Vec<f32> {
    let mut out = vec![0f32; qm.len()];
    let mut z = vec![0f64; d];
    for (i, &row) in rows.iter().enumerate() {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (row as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let m = &qm[i * d..(i + 1) * d];
        let s: Vec<f64> = qv[i * d..(i + 1) * d].iter().map(|&v| (v as f64).sqrt()).collect();
        let mut acc = vec![0f64; d];
        for _ in 0..samples {
            let mut max = f64::NEG_INFINITY;
            for k in 0..d {
                let e: f64 = StandardNormal.sample(&mut rng);
                z[k] = m[k] as f64 + s[k] * e;
                max = max.max(z[k]);
            }
            let mut sum = 0.0;
            for zk in z.iter_mut() {
                *zk = (*zk - max).exp();
                sum += *zk;
            }
            for k in 0..d {
                acc[k] += z[k] / sum;
            }
        }
        for k in 0..d {
            out[i * d + k] = (acc[k] / samples as f64) as f32;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn genes_align_by_name_with_zero_fill() {
        let model = names(&["A", "B", "C", "D"]);
        let query = names(&["X", "C", "A", "C", "Y"]);
        let g = GeneAlignment::new(&model, &query);
        assert_eq!(g.model_col, vec![None, Some(2), Some(0), None, None]);
        assert_eq!(g.missing, names(&["B", "D"]));
        assert_eq!(g.present, 2);
        assert!((g.fraction() - 0.5).abs() < 1e-12);
        let mut out = vec![0f32; 4];
        g.fill(&[0, 1, 2, 3, 4], &[9.0, 3.0, 1.0, 7.0, 5.0], &mut out);
        assert_eq!(out, vec![1.0, 0.0, 3.0, 0.0]);
    }

    #[test]
    fn ln_mean_is_a_seeded_softmax_average() {
        // q_v tiny: the mean is softmax(q_m)
        let qm = [1.0f32, 0.0, -1.0];
        let qv = [1e-12f32; 3];
        let got = ln_mean(&qm, &qv, 3, 0, &[0], 200);
        let e: Vec<f64> = qm.iter().map(|&v| (v as f64).exp()).collect();
        let s: f64 = e.iter().sum();
        for k in 0..3 {
            assert!((got[k] as f64 - e[k] / s).abs() < 1e-6);
        }
        // a wide q_v: rows sum to 1, the same seed and row give the same values, another row not
        let qv = [1.0f32; 3];
        let a = ln_mean(&qm, &qv, 3, 7, &[5], 1000);
        assert!((a.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        assert_eq!(a, ln_mean(&qm, &qv, 3, 7, &[5], 1000));
        assert_ne!(a, ln_mean(&qm, &qv, 3, 7, &[6], 1000));
    }

    #[test]
    fn init_params_and_registry_are_read() {
        let s = |v: &str| Py::Str(v.into());
        let d = |items: Vec<(&str, Py)>| Py::Dict(items.into_iter().map(|(k, v)| (s(k), v)).collect());
        let arr = |v: &[&str]| Py::Array { dtype: "O8".into(), shape: vec![v.len()], items: v.iter().map(|x| s(x)).collect() };
        let root = |init: Py, model: &str| {
            d(vec![
                ("model_state_dict", Py::Dict(vec![])),
                ("var_names", arr(&["G1", "G2"])),
                (
                    "attr_dict",
                    d(vec![
                        ("init_params_", init),
                        (
                            "registry_",
                            d(vec![
                                ("model_name", s(model)),
                                ("scvi_version", s("1.3.3")),
                                ("setup_args", d(vec![("batch_key", s("donor"))])),
                                (
                                    "field_registries",
                                    d(vec![(
                                        "batch",
                                        d(vec![("state_registry", d(vec![("categorical_mapping", arr(&["a", "b", "c"]))])), ("summary_stats", d(vec![("n_batch", Py::Int(3))]))]),
                                    )]),
                                ),
                            ]),
                        ),
                    ]),
                ),
            ])
        };
        let init = d(vec![
            ("kwargs", d(vec![("kwargs", d(vec![("encode_covariates", Py::Bool(true)), ("use_layer_norm", s("both")), ("use_batch_norm", s("none"))]))])),
            ("non_kwargs", d(vec![("n_hidden", Py::Int(32)), ("n_layers", Py::Int(2)), ("latent_distribution", s("ln"))])),
        ]);
        let m = SavedModel::from_pickle(Path::new("m.pt"), &root(init.clone(), "SCVI")).unwrap();
        let a = &m.arch;
        assert_eq!((a.n_hidden, a.n_latent, a.n_layers), (32, 10, 2));
        assert!(a.encode_covariates && a.layer_norm_encoder && !a.batch_norm_encoder && a.log_variational && a.deeply_inject_covariates);
        assert_eq!(a.latent_distribution, Latent::Ln);
        assert_eq!(a.batch_categories, names(&["a", "b", "c"]));
        assert_eq!(a.batch_key.as_deref(), Some("donor"));
        assert!(a.uses_batch());
        assert_eq!(m.var_names, names(&["G1", "G2"]));
        // defaults when init_params_ is silent
        let m = SavedModel::from_pickle(Path::new("m.pt"), &root(d(vec![("non_kwargs", d(vec![])), ("kwargs", d(vec![]))]), "SCVI")).unwrap();
        assert!(m.arch.batch_norm_encoder && !m.arch.layer_norm_encoder && !m.arch.uses_batch());
        assert_eq!(m.arch.latent_distribution, Latent::Normal);
        // another model class, an embedding batch representation: refused, naming the file
        let e = SavedModel::from_pickle(Path::new("m.pt"), &root(init, "SCANVI")).unwrap_err();
        assert!(e.to_string().contains("m.pt") && e.to_string().contains("SCANVI"), "{e}");
        let emb = d(vec![("kwargs", d(vec![("kwargs", d(vec![("batch_representation", s("embedding"))]))]))]);
        let e = SavedModel::from_pickle(Path::new("m.pt"), &root(emb, "SCVI")).unwrap_err();
        assert!(e.to_string().contains("batch_representation"), "{e}");
        // not an scvi-tools model
        let e = SavedModel::from_pickle(Path::new("m.pt"), &d(vec![("state_dict", Py::Dict(vec![]))])).unwrap_err();
        assert!(e.to_string().contains("model_state_dict"), "{e}");
    }
}
