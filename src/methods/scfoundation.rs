//! scFoundation (xTrimoGene): Hao M, Gong J, Zeng X, et al., "Large-scale foundation model on
//! single-cell transcriptomics", Nature Methods 2024, doi:10.1038/s41592-024-02305-7; upstream
//! code https://github.com/biomap-research/scFoundation (`model/get_embedding.py`,
//! `model/load.py` load_model_frommmf, convertconfig, gatherData, main_gene_selection;
//! `model/pretrainmodels/` select_model.py, mae_autobin.py MaeAutobin and
//! AutoDiscretizationEmbedding2, transformer.py pytorchTransformerModule; read at commit d09626a).
//!
//! Files (upstream's names, under the weights folder's `scfoundation/`): `models/models.ckpt`, a
//! torch.save dict with one entry per model version (`cell`, `rde`, `gene`), each holding
//! `state_dict` (parameters named `model.<MaeAutobin parameter>`) and `config` (`model`,
//! `model_config[model]`, `dataset_config['rnaseq']`, merged in that order as convertconfig does).
//! It is read by scfoundry's own pickle reader as data (nothing in it is run); the tensors' bytes
//! come from the zip's `data/` records. `OS_scRNA_gene_index.19264.tsv` gives the gene order
//! (column `gene_name`, in file order).
//!
//! Cell embeddings (`get_embedding.py --input_type singlecell --output_type cell --pool_type all
//! --pre_normalized F --tgthighres t4 --version ce`): the data's genes are aligned by name to the
//! gene list (genes not in the list dropped, list genes the data lacks zero-filled:
//! main_gene_selection); per cell, with `total` the sum over the list's genes, each value is
//! `log1p(count / total * 1e4)` (float64, then float32), and two values are appended: T (the
//! target resolution, 4 for `t4`) at position n_genes and S = log10(total) at n_genes + 1. The
//! encoder sees only the values > 0 with their positions, in position order (gatherData).
//! Each value goes through AutoDiscretizationEmbedding2: Linear(1, bins), LeakyReLU(0.1),
//! `bin_alpha * h + Linear(bins, bins)(h)`, softmax over the bins, times the bin table; values
//! equal to mask_token_id or pad_token_id take the mask or pad row instead. The position (gene
//! index) embedding `pos_emb` is added, then the post-norm nn.TransformerEncoderLayer stack
//! (ReLU, feed-forward 4 x dim) and the encoder's LayerNorm. The cell's 4 x dim embedding is the
//! concatenation of its last token (S), the one before (T), and the max and the mean over the
//! other tokens (the genes). The Performer decoder, which gives gene-level outputs, is not read.
//!
//! Batching: upstream runs one cell at a time. We pad each batch to its longest cell and mask
//! the padding keys (-inf), and pool each cell over its own tokens only, so a cell's embedding
//! does not depend on its batch (up to float rounding).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{Embedding, LayerNorm, Linear, VarBuilder};

use crate::nn::random_init::{inverse_sqrt_last, Fill};
use crate::error::{Error, Result};
use crate::formats::pickle::Py;
use crate::formats::torch_zip::{TorchZip, TorchZipError};

/// The weights entries a run reads (weights.toml).
pub const REQUIRED_ENTRIES: &[&str] = &["scfoundation-models-ckpt", "scfoundation-gene-index"];
/// The model version get_embedding.py reads for cell embeddings (`--version ce`).
pub const CELL_KEY: &str = "cell";
/// get_embedding.py's `--tgthighres` default `t4`: the T token's value is 4.
pub const TGTHIGHRES: f64 = 4.0;
/// Cells per forward pass (upstream: one; the result does not depend on it).
pub const BATCH_SIZE: usize = 8;
/// Attention scores per forward chunk (floats), to bound memory at long cells.
const MAX_SCORES: usize = 1 << 28;

fn model_err(context: &str) -> impl Fn(candle_core::Error) -> Error + '_ {
    move |e| Error::Model { context: context.into(), detail: e.to_string() }
}

// ------------------------------------------------------------------------------------ genes

/// The gene names of an `OS_scRNA_gene_index.19264.tsv`-style file (tab-separated, a header
/// with `gene_name`), in file order.
pub fn read_gene_index(path: &Path) -> Result<Vec<String>> {
    if !path.is_file() {
        return Err(Error::MissingFile { path: path.into() });
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::Io { path: path.into(), source: e })?;
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap_or("").split('\t').collect();
    let col = header.iter().position(|h| h.trim() == "gene_name").ok_or_else(|| Error::BadField {
        path: path.into(),
        field: "gene_name".into(),
        detail: format!("the header has no `gene_name` column (it has {:?})", header),
        hint: Some("pass upstream's OS_scRNA_gene_index.19264.tsv (columns gene_name, index)".into()),
    })?;
    let mut genes = Vec::new();
    for (i, line) in lines.enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let g = line.split('\t').nth(col).ok_or_else(|| Error::Parse { path: path.into(), line: i + 2, detail: "fewer columns than the header".into(), hint: None })?;
        genes.push(g.trim().to_string());
    }
    if genes.is_empty() {
        return Err(Error::BadField { path: path.into(), field: "gene_name".into(), detail: "no genes".into(), hint: None });
    }
    Ok(genes)
}

/// The data's columns against the model's gene list (main_gene_selection).
#[derive(Debug, Clone)]
pub struct GeneAlignment {
    /// For each data column, the model gene (position) it feeds.
    pub col_gene: Vec<Option<u32>>,
    pub n_genes: usize,
    /// Model genes the data lacks (zero-filled), in the model's order.
    pub missing: Vec<String>,
    /// Data columns whose name repeats an earlier column's (the first one is used).
    pub duplicates: usize,
}

impl GeneAlignment {
    pub fn new(model_genes: &[String], var_names: &[String]) -> GeneAlignment {
        let pos: HashMap<&str, usize> = model_genes.iter().enumerate().rev().map(|(i, g)| (g.as_str(), i)).collect();
        let mut seen = vec![false; model_genes.len()];
        let mut duplicates = 0;
        let col_gene = var_names
            .iter()
            .map(|g| match pos.get(g.as_str()) {
                Some(&i) if !seen[i] => {
                    seen[i] = true;
                    Some(i as u32)
                }
                Some(_) => {
                    duplicates += 1;
                    None
                }
                None => None,
            })
            .collect();
        let missing = model_genes.iter().zip(&seen).filter(|(_, s)| !**s).map(|(g, _)| g.clone()).collect();
        GeneAlignment { col_gene, n_genes: model_genes.len(), missing, duplicates }
    }

    pub fn present(&self) -> usize {
        self.n_genes - self.missing.len()
    }
}

/// What the encoder sees of one cell: gene positions (T at n_genes, S at n_genes + 1) and
/// values, the values > 0 only, in position order.
#[derive(Debug, Clone, PartialEq)]
pub struct CellInput {
    pub positions: Vec<u32>,
    pub values: Vec<f32>,
}

/// Why a cell cannot be embedded.
#[derive(Debug, Clone, PartialEq)]
pub enum CellProblem {
    Negative(f32),
    NonFinite(f32),
    /// Fewer than three tokens (upstream's max over the genes then has nothing to pool).
    TooFew(usize),
}

/// A cell's input (get_embedding.py, `--pre_normalized F`, `--tgthighres t<tgt>`) from its
/// sparse row (`idx`, `vals`: data columns and counts).
pub fn cell_input(idx: &[u32], vals: &[f32], align: &GeneAlignment, tgt: f64) -> std::result::Result<CellInput, CellProblem> {
    let mut genes: Vec<(u32, f64)> = Vec::with_capacity(idx.len());
    for (&j, &v) in idx.iter().zip(vals) {
        if !v.is_finite() {
            return Err(CellProblem::NonFinite(v));
        }
        if v < 0.0 {
            return Err(CellProblem::Negative(v));
        }
        if let Some(Some(g)) = align.col_gene.get(j as usize) {
            genes.push((*g, v as f64));
        }
    }
    genes.sort_by_key(|&(g, _)| g);
    let total: f64 = genes.iter().map(|&(_, v)| v).sum();
    let mut positions = Vec::with_capacity(genes.len() + 2);
    let mut values = Vec::with_capacity(genes.len() + 2);
    for &(g, v) in &genes {
        let x = ((v / total) * 1e4).ln_1p() as f32;
        if x > 0.0 {
            positions.push(g);
            values.push(x);
        }
    }
    let n = align.n_genes as u32;
    for (p, v) in [(n, tgt as f32), (n + 1, total.log10() as f32)] {
        if v > 0.0 {
            positions.push(p);
            values.push(v);
        }
    }
    if positions.len() < 3 {
        return Err(CellProblem::TooFew(positions.len()));
    }
    Ok(CellInput { positions, values })
}

// ------------------------------------------------------------------------------ checkpoint

/// The merged config of one model version (convertconfig), the values the cell path reads.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub model: String,
    pub seq_len: usize,
    pub hidden_dim: usize,
    pub depth: usize,
    pub heads: usize,
    pub module_type: String,
    pub bin_num: usize,
    pub bin_alpha: f64,
    pub pad_token_id: f64,
    pub mask_token_id: f64,
}

impl Config {
    /// The released 0.1B model's config (as load_model_frommmf prints it), for benchmarks.
    pub fn released() -> Config {
        Config {
            model: "mae_autobin".into(),
            seq_len: 19_266,
            hidden_dim: 768,
            depth: 12,
            heads: 12,
            module_type: "transformer".into(),
            bin_num: 100,
            bin_alpha: 1.0,
            pad_token_id: 103.0,
            mask_token_id: 102.0,
        }
    }
}

fn num(v: &Py) -> Option<f64> {
    match v {
        Py::Int(i) => Some(*i as f64),
        Py::Float(f) => Some(*f),
        Py::Bool(b) => Some(*b as u8 as f64),
        _ => None,
    }
}

/// convertconfig: `model_config[model]` then `dataset_config['rnaseq']`, later keys winning.
pub fn parse_config(path: &Path, key: &str, cfg: &Py) -> Result<Config> {
    let bad = |detail: String| Error::BadWeights { path: path.into(), detail: format!("`{key}` config: {detail}") };
    let model = match cfg.get("model") {
        Some(Py::Str(s)) => s.clone(),
        _ => return Err(bad("has no `model` name (upstream's convertconfig reads config['model'])".into())),
    };
    let mut merged: Vec<(String, Py)> = Vec::new();
    for part in [cfg.get("model_config").and_then(|m| m.get(&model)), cfg.get("dataset_config").and_then(|d| d.get("rnaseq"))] {
        if let Some(Py::Dict(items)) = part {
            for (k, v) in items {
                if let Py::Str(k) = k {
                    merged.push((k.clone(), v.clone()));
                }
            }
        }
    }
    if merged.is_empty() {
        return Err(bad(format!("has no `model_config['{model}']` (upstream's convertconfig reads it)")));
    }
    let get = |k: &str| merged.iter().rev().find(|(n, _)| n == k).map(|(_, v)| v);
    let model_name = get("model").and_then(|v| if let Py::Str(s) = v { Some(s.clone()) } else { None }).unwrap_or(model.clone());
    if model_name != "mae_autobin" {
        return Err(bad(format!("model `{model_name}`: only `mae_autobin` (the released xTrimoGene model) is built, as upstream's select_model")));
    }
    let number = |k: &str| get(k).and_then(num).ok_or_else(|| bad(format!("has no number `{k}`")));
    let count = |k: &str| -> Result<usize> {
        let v = number(k)?;
        if v < 1.0 || v.fract() != 0.0 {
            return Err(bad(format!("`{k}` = {v} is not a positive integer")));
        }
        Ok(v as usize)
    };
    let enc = get("encoder").ok_or_else(|| bad("has no `encoder` settings".into()))?;
    let enc_count = |k: &str| -> Result<usize> {
        match enc.get(k).and_then(num) {
            Some(v) if v >= 1.0 && v.fract() == 0.0 => Ok(v as usize),
            _ => Err(bad(format!("encoder `{k}` is missing or not a positive integer"))),
        }
    };
    let module_type = match enc.get("module_type") {
        Some(Py::Str(s)) => s.clone(),
        _ => return Err(bad("encoder has no `module_type`".into())),
    };
    if module_type != "transformer" {
        return Err(bad(format!("encoder module_type `{module_type}`: only `transformer` (the released models' encoder) is built")));
    }
    Ok(Config {
        model: model_name,
        seq_len: count("seq_len")?,
        hidden_dim: enc_count("hidden_dim")?,
        depth: enc_count("depth")?,
        heads: enc_count("heads")?,
        module_type,
        bin_num: count("bin_num")?,
        bin_alpha: number("bin_alpha")?,
        pad_token_id: number("pad_token_id")?,
        mask_token_id: number("mask_token_id")?,
    })
}

/// Read one version (`key`) of a models.ckpt: its config and its tensors, named as MaeAutobin's
/// parameters (the `model.` prefix removed as convertconfig does), as f32 on the CPU.
pub fn read_checkpoint(path: &Path, key: &str) -> Result<(Config, HashMap<String, Tensor>)> {
    if !path.is_file() {
        return Err(Error::MissingFile { path: path.into() });
    }
    let bad = |detail: String| Error::BadWeights { path: path.into(), detail };
    let (mut tz, root) = open_checkpoint(path)?;
    let Py::Dict(items) = &root else {
        return Err(bad("is not a dict of model versions (upstream's models.ckpt holds 'cell', 'rde' and 'gene')".into()));
    };
    let keys: Vec<String> = items.iter().filter_map(|(k, _)| if let Py::Str(s) = k { Some(format!("'{s}'")) } else { None }).collect();
    let version = root.get(key).ok_or_else(|| {
        bad(format!(
            "has no `{key}` model (it holds {}); upstream's models.ckpt holds 'cell', 'rde' and 'gene', and get_embedding.py reads 'cell' for cell embeddings",
            if keys.is_empty() { "no named entries".to_string() } else { keys.join(", ") }
        ))
    })?;
    let cfg = version.get("config").ok_or_else(|| bad(format!("`{key}` has no `config`")))?;
    let config = parse_config(path, key, cfg)?;
    let Some(Py::Dict(sd)) = version.get("state_dict") else {
        return Err(bad(format!("`{key}` has no `state_dict` dict")));
    };
    let mut tensors = HashMap::new();
    for (k, v) in sd {
        let Py::Str(name) = k else { continue };
        let Some(at) = name.find("model.") else {
            return Err(bad(format!("`{key}` state_dict entry `{name}` has no `model.` prefix (convertconfig keeps what follows it)")));
        };
        let short = name[at + "model.".len()..].to_string();
        if !(short.starts_with("token_emb.") || short.starts_with("pos_emb.") || short.starts_with("encoder.")) {
            continue; // the decoder side: not used for cell embeddings
        }
        let t = tz.tensor(v).map_err(|e| bad(format!("tensor `{name}`: {e}")))?;
        tensors.insert(short, t);
    }
    Ok((config, tensors))
}

/// A models.ckpt opened (`formats::torch_zip`) and its data.pkl read, tensors not yet loaded.
fn open_checkpoint(path: &Path) -> Result<(TorchZip<std::io::BufReader<std::fs::File>>, Py)> {
    let err = |e: TorchZipError| match e {
        TorchZipError::Io(source) => Error::Io { path: path.into(), source },
        TorchZipError::NotZip(e) => Error::BadWeights { path: path.into(), detail: format!("not a PyTorch file written by torch.save (upstream's models.ckpt): {e}") },
        e => Error::BadWeights { path: path.into(), detail: e.to_string() },
    };
    let mut tz = TorchZip::open(path).map_err(err)?;
    let root = tz.read_pickle(&["torch."]).map_err(err)?;
    Ok((tz, root))
}

// ------------------------------------------------------------------------------------ model

struct Attention {
    in_proj: Linear,
    out_proj: Linear,
    heads: usize,
    head_dim: usize,
}

impl Attention {
    fn new(d: usize, heads: usize, vb: VarBuilder) -> candle_core::Result<Attention> {
        let w = vb.get((3 * d, d), "in_proj_weight")?;
        let b = vb.get(3 * d, "in_proj_bias")?;
        Ok(Attention { in_proj: Linear::new(w, Some(b)), out_proj: candle_nn::linear(d, d, vb.pp("out_proj"))?, heads, head_dim: d / heads })
    }

    /// x: (b, L, d); mask: (b, 1, 1, L), 0 at tokens and -inf at padding keys.
    fn forward(&self, x: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
        let (b, l, d) = x.dims3()?;
        let qkv = self.in_proj.forward(x)?;
        let heads = |i: usize| qkv.narrow(2, i * d, d)?.reshape((b, l, self.heads, self.head_dim))?.transpose(1, 2)?.contiguous();
        let q = (heads(0)? * (1.0 / (self.head_dim as f64).sqrt()))?;
        let (k, v) = (heads(1)?, heads(2)?);
        let p = candle_nn::ops::softmax_last_dim(&q.matmul(&k.t()?)?.broadcast_add(mask)?)?;
        self.out_proj.forward(&p.matmul(&v)?.transpose(1, 2)?.reshape((b, l, d))?)
    }
}

/// nn.TransformerEncoderLayer(d_model=dim, nhead, dim_feedforward=4 dim, batch_first=True):
/// post-norm, ReLU, eps 1e-5 (dropout is off in eval).
struct EncoderLayer {
    attn: Attention,
    linear1: Linear,
    linear2: Linear,
    norm1: LayerNorm,
    norm2: LayerNorm,
}

impl EncoderLayer {
    fn new(d: usize, heads: usize, ff: usize, vb: VarBuilder) -> candle_core::Result<EncoderLayer> {
        Ok(EncoderLayer {
            attn: Attention::new(d, heads, vb.pp("self_attn"))?,
            linear1: candle_nn::linear(d, ff, vb.pp("linear1"))?,
            linear2: candle_nn::linear(ff, d, vb.pp("linear2"))?,
            norm1: candle_nn::layer_norm(d, 1e-5, vb.pp("norm1"))?,
            norm2: candle_nn::layer_norm(d, 1e-5, vb.pp("norm2"))?,
        })
    }

    fn forward(&self, x: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
        let x = self.norm1.forward(&(x + self.attn.forward(x, mask)?)?)?;
        let h = self.linear2.forward(&self.linear1.forward(&x)?.relu()?)?;
        self.norm2.forward(&(x + h)?)
    }
}

/// The encoder side of MaeAutobin: value embedding, position embedding, transformer.
pub struct ScFoundation {
    pub config: Config,
    pub path: PathBuf,
    mlp: Linear,
    mlp2: Linear,
    bins: Tensor,
    emb_mask: Tensor,
    emb_pad: Tensor,
    pos_emb: Embedding,
    layers: Vec<EncoderLayer>,
    norm: LayerNorm,
    dtype: DType,
    device: Device,
}

impl ScFoundation {
    /// Load the `cell` version of a models.ckpt on the CPU in float32.
    pub fn load(path: &Path) -> Result<ScFoundation> {
        Self::load_on(path, CELL_KEY, DType::F32, Device::Cpu)
    }

    /// Load version `key` of a models.ckpt with its weights in `dtype` on `device`.
    pub fn load_on(path: &Path, key: &str, dtype: DType, device: Device) -> Result<ScFoundation> {
        let (config, tensors) = read_checkpoint(path, key)?;
        Self::from_tensors(config, tensors, path, dtype, device)
    }

    /// Build from a config and MaeAutobin-named tensors (a checkpoint's, or random ones).
    pub fn from_tensors(config: Config, tensors: HashMap<String, Tensor>, path: &Path, dtype: DType, device: Device) -> Result<ScFoundation> {
        let bad = |detail: String| Error::BadWeights { path: path.into(), detail };
        let d = config.hidden_dim;
        if d % config.heads != 0 {
            return Err(bad(format!("hidden_dim {d} is not divisible by {} heads", config.heads)));
        }
        for k in ["token_emb.emb.weight", "pos_emb.weight", "encoder.transformer_encoder.0.linear1.weight", "encoder.norm.weight"] {
            if !tensors.contains_key(k) {
                let mut some: Vec<&String> = tensors.keys().collect();
                some.sort();
                let shown: Vec<&str> = some.iter().take(6).map(|s| s.as_str()).collect();
                return Err(bad(format!(
                    "has no tensor `model.{k}` (a MaeAutobin state_dict with a transformer encoder has it); its encoder-side tensors are: {}{}",
                    if shown.is_empty() { "none".to_string() } else { shown.join(", ") },
                    if some.len() > shown.len() { ", ..." } else { "" }
                )));
            }
        }
        let ff = tensors["encoder.transformer_encoder.0.linear1.weight"].dims().first().copied().unwrap_or(4 * d);
        let depth = (0..).take_while(|i| tensors.contains_key(&format!("encoder.transformer_encoder.{i}.linear1.weight"))).count();
        if depth != config.depth {
            return Err(bad(format!("the config says {} encoder layers but the state_dict has {depth}", config.depth)));
        }
        let vb = VarBuilder::from_tensors(tensors, dtype, &device);
        let build = || -> candle_core::Result<_> {
            let te = vb.pp("token_emb");
            let mlp = candle_nn::linear(1, config.bin_num, te.pp("mlp"))?;
            let mlp2 = candle_nn::linear(config.bin_num, config.bin_num, te.pp("mlp2"))?;
            let bins = te.pp("emb").get((config.bin_num, d), "weight")?;
            let emb_mask = te.pp("emb_mask").get((1, d), "weight")?;
            let emb_pad = te.pp("emb_pad").get((1, d), "weight")?;
            let pos_emb = candle_nn::embedding(config.seq_len + 1, d, vb.pp("pos_emb"))?;
            let enc = vb.pp("encoder");
            let layers = (0..config.depth).map(|i| EncoderLayer::new(d, config.heads, ff, enc.pp(format!("transformer_encoder.{i}")))).collect::<candle_core::Result<Vec<_>>>()?;
            let norm = candle_nn::layer_norm(d, 1e-5, enc.pp("norm"))?;
            Ok((mlp, mlp2, bins, emb_mask, emb_pad, pos_emb, layers, norm))
        };
        let (mlp, mlp2, bins, emb_mask, emb_pad, pos_emb, layers, norm) = build().map_err(|e| bad(format!("is not a MaeAutobin model as its config describes: {e}")))?;
        Ok(ScFoundation { config, path: path.into(), mlp, mlp2, bins, emb_mask, emb_pad, pos_emb, layers, norm, dtype, device })
    }

    /// Width of the cell embedding (4 x hidden_dim).
    pub fn dim(&self) -> usize {
        4 * self.config.hidden_dim
    }

    /// Genes the checkpoint's position table covers (seq_len - 2: T and S follow them).
    pub fn n_genes(&self) -> usize {
        self.config.seq_len.saturating_sub(2)
    }

    /// Cell embeddings (n x 4 hidden_dim, float32) of cells given as `CellInput`s.
    pub fn embed(&self, cells: &[&CellInput]) -> Result<Vec<f32>> {
        if cells.is_empty() {
            return Ok(vec![]);
        }
        let l = cells.iter().map(|c| c.values.len()).max().unwrap_or(1);
        let per_cell = self.config.heads * l * l;
        let chunk = (MAX_SCORES / per_cell.max(1)).max(1);
        let mut out = Vec::with_capacity(cells.len() * self.dim());
        for part in cells.chunks(chunk) {
            out.extend(self.forward(part)?);
        }
        Ok(out)
    }

    fn forward(&self, cells: &[&CellInput]) -> Result<Vec<f32>> {
        let ctx = model_err("running the scFoundation encoder");
        let b = cells.len();
        let l = cells.iter().map(|c| c.values.len()).max().unwrap_or(1);
        let d = self.config.hidden_dim;
        let max_pos = self.config.seq_len as u32;
        let (mut vals, mut pos, mut mask, mut is_mask, mut is_pad) = (Vec::with_capacity(b * l), Vec::with_capacity(b * l), Vec::with_capacity(b * l), Vec::with_capacity(b * l), Vec::with_capacity(b * l));
        let (mut last, mut second, mut genes_keep, mut counts) = (Vec::with_capacity(b), Vec::with_capacity(b), Vec::with_capacity(b * l), Vec::with_capacity(b));
        for (i, c) in cells.iter().enumerate() {
            let n = c.values.len();
            if n < 3 {
                return Err(Error::Model { context: "running the scFoundation encoder".into(), detail: format!("a cell of {n} tokens (at least 3 are needed)") });
            }
            if let Some(&p) = c.positions.iter().find(|&&p| p > max_pos) {
                return Err(Error::Model { context: "running the scFoundation encoder".into(), detail: format!("gene position {p} is past the checkpoint's position table ({} rows)", max_pos + 1) });
            }
            for k in 0..l {
                let real = k < n;
                let v = if real { c.values[k] } else { self.config.pad_token_id as f32 };
                vals.push(v);
                pos.push(if real { c.positions[k] } else { 0 });
                mask.push(if real { 0f32 } else { f32::NEG_INFINITY });
                is_mask.push((real && v as f64 == self.config.mask_token_id) as u8 as f32);
                is_pad.push((!real || v as f64 == self.config.pad_token_id) as u8 as f32);
                genes_keep.push(if k + 2 < n { 0f32 } else { f32::NEG_INFINITY });
            }
            last.push((i * l + n - 1) as u32);
            second.push((i * l + n - 2) as u32);
            counts.push((n - 2) as f32);
        }
        let dev = &self.device;
        let run = || -> candle_core::Result<Vec<f32>> {
            let v = Tensor::from_vec(vals, (b, l, 1), dev)?.to_dtype(self.dtype)?;
            // AutoDiscretizationEmbedding2
            let h = self.mlp.forward(&v)?;
            let h = candle_nn::ops::leaky_relu(&h, 0.1)?;
            let cross = self.mlp2.forward(&h)?;
            let h = ((h * self.config.bin_alpha)? + cross)?;
            let w = candle_nn::ops::softmax_last_dim(&h)?;
            let x = w.broadcast_matmul(&self.bins)?;
            let m = Tensor::from_vec(is_mask, (b, l, 1), dev)?.to_dtype(self.dtype)?;
            let p = Tensor::from_vec(is_pad, (b, l, 1), dev)?.to_dtype(self.dtype)?;
            let keep = ((1.0 - &m)? - &p)?;
            let x = ((x.broadcast_mul(&keep)? + m.broadcast_mul(&self.emb_mask)?)? + p.broadcast_mul(&self.emb_pad)?)?;
            let pos = Tensor::from_vec(pos, (b, l), dev)?;
            let mut x = (x + self.pos_emb.forward(&pos)?)?;
            let mask = Tensor::from_vec(mask, (b, 1, 1, l), dev)?.to_dtype(self.dtype)?;
            for layer in &self.layers {
                x = layer.forward(&x, &mask)?;
            }
            let x = self.norm.forward(&x)?.to_dtype(DType::F32)?;
            // pooling: last token (S), the one before (T), max and mean over the genes
            let flat = x.reshape((b * l, d))?;
            let s_tok = flat.index_select(&Tensor::from_vec(last, b, dev)?, 0)?;
            let t_tok = flat.index_select(&Tensor::from_vec(second, b, dev)?, 0)?;
            let keep = Tensor::from_vec(genes_keep, (b, l, 1), dev)?;
            let max = x.broadcast_add(&keep)?.max(1)?;
            let on = keep.exp()?; // 1 at genes, 0 elsewhere
            let mean = x.broadcast_mul(&on)?.sum(1)?.broadcast_div(&Tensor::from_vec(counts, (b, 1), dev)?)?;
            Tensor::cat(&[s_tok, t_tok, max, mean], D::Minus1)?.flatten_all()?.to_vec1::<f32>()
        };
        run().map_err(ctx)
    }
}

/// The files of a run under a weights folder: (models.ckpt, gene index).
pub fn files(weights_dir: &Path, manifest: &crate::weights::Manifest) -> (PathBuf, PathBuf) {
    let file = |id: &str, default: &str| weights_dir.join(manifest.weights.get(id).map(|e| e.file.clone()).unwrap_or_else(|| default.into()));
    (file(REQUIRED_ENTRIES[0], "scfoundation/models/models.ckpt"), file(REQUIRED_ENTRIES[1], "scfoundation/OS_scRNA_gene_index.19264.tsv"))
}

/// MaeAutobin encoder-side tensors at `config`'s sizes, seeded random (benchmarks only).
pub fn random_tensors(config: &Config, seed: u64, device: &Device) -> candle_core::Result<HashMap<String, Tensor>> {
    let d = config.hidden_dim;
    let bn = config.bin_num;
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("token_emb.mlp.weight".into(), vec![bn, 1]),
        ("token_emb.mlp.bias".into(), vec![bn]),
        ("token_emb.mlp2.weight".into(), vec![bn, bn]),
        ("token_emb.mlp2.bias".into(), vec![bn]),
        ("token_emb.emb.weight".into(), vec![bn, d]),
        ("token_emb.emb_mask.weight".into(), vec![1, d]),
        ("token_emb.emb_pad.weight".into(), vec![1, d]),
        ("pos_emb.weight".into(), vec![config.seq_len + 1, d]),
        ("encoder.norm.weight".into(), vec![d]),
        ("encoder.norm.bias".into(), vec![d]),
    ];
    for i in 0..config.depth {
        let p = format!("encoder.transformer_encoder.{i}.");
        for (n, s) in [
            ("self_attn.in_proj_weight", vec![3 * d, d]),
            ("self_attn.in_proj_bias", vec![3 * d]),
            ("self_attn.out_proj.weight", vec![d, d]),
            ("self_attn.out_proj.bias", vec![d]),
            ("linear1.weight", vec![4 * d, d]),
            ("linear1.bias", vec![4 * d]),
            ("linear2.weight", vec![d, 4 * d]),
            ("linear2.bias", vec![d]),
            ("norm1.weight", vec![d]),
            ("norm1.bias", vec![d]),
            ("norm2.weight", vec![d]),
            ("norm2.bias", vec![d]),
        ] {
            shapes.push((format!("{p}{n}"), s));
        }
    }
    crate::nn::random_init::seeded_tensors(shapes, seed, device, |n, s| {
        if n.contains("norm") && n.ends_with("weight") {
            Fill::Const(1.0)
        } else {
            Fill::Normal(inverse_sqrt_last(s))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn align(n: usize) -> GeneAlignment {
        let genes: Vec<String> = (0..n).map(|i| format!("G{i}")).collect();
        let data: Vec<String> = vec!["G3".into(), "X".into(), "G0".into(), "G1".into(), "G3".into()];
        GeneAlignment::new(&genes, &data)
    }

    #[test]
    fn genes_align_by_name_and_missing_are_listed() {
        let a = align(5);
        assert_eq!(a.col_gene, vec![Some(3), None, Some(0), Some(1), None]);
        assert_eq!(a.missing, vec!["G2".to_string(), "G4".to_string()]);
        assert_eq!(a.duplicates, 1);
        assert_eq!(a.present(), 3);
    }

    #[test]
    fn cell_input_follows_get_embedding() {
        let a = align(5);
        // columns: G3=2, X=100 (not a model gene: not in the total), G0=0 (stored zero), G1=6
        let c = cell_input(&[0, 1, 2, 3], &[2.0, 100.0, 0.0, 6.0], &a, 4.0).unwrap();
        assert_eq!(c.positions, vec![1, 3, 5, 6]);
        let want = [((6.0f64 / 8.0) * 1e4).ln_1p() as f32, ((2.0f64 / 8.0) * 1e4).ln_1p() as f32, 4.0, 8f64.log10() as f32];
        assert_eq!(c.values, want);
        // a total of 1 gives S = log10(1) = 0, which gatherData drops; then only 2 tokens
        assert_eq!(cell_input(&[3], &[1.0], &a, 4.0), Err(CellProblem::TooFew(2)));
        assert_eq!(cell_input(&[3], &[-1.0], &a, 4.0), Err(CellProblem::Negative(-1.0)));
        assert_eq!(cell_input(&[1], &[5.0], &a, 4.0), Err(CellProblem::TooFew(1)));
    }

    #[test]
    fn random_model_runs_and_batches_do_not_matter() {
        let mut cfg = Config::released();
        cfg.seq_len = 52;
        cfg.hidden_dim = 16;
        cfg.depth = 2;
        cfg.heads = 4;
        cfg.bin_num = 10;
        let t = random_tensors(&cfg, 7, &Device::Cpu).unwrap();
        let a = random_tensors(&cfg, 7, &Device::Cpu).unwrap()["pos_emb.weight"].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let b = t["pos_emb.weight"].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(a, b, "the seed fixes the weights");
        let m = ScFoundation::from_tensors(cfg, t, Path::new("random"), DType::F32, Device::Cpu).unwrap();
        let cells: Vec<CellInput> = (0..3).map(|i| CellInput { positions: (0..(5 + 3 * i)).map(|k| k as u32 * 3).chain([50, 51]).collect(), values: (0..(5 + 3 * i)).map(|k| 1.0 + k as f32 * 0.3).chain([4.0, 2.5]).collect() }).collect();
        let refs: Vec<&CellInput> = cells.iter().collect();
        let all = m.embed(&refs).unwrap();
        assert_eq!(all.len(), 3 * 64);
        assert!(all.iter().all(|v| v.is_finite()));
        let one = m.embed(&refs[1..2]).unwrap();
        let d = one.iter().zip(&all[64..128]).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(d < 1e-5, "{d}");
    }

    #[test]
    fn gene_index_needs_gene_name() {
        let dir = std::env::temp_dir().join(format!("scf-gi-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("g.tsv");
        std::fs::write(&p, "gene_name\tindex\nA1BG\t0\nA1CF\t1\n").unwrap();
        assert_eq!(read_gene_index(&p).unwrap(), vec!["A1BG", "A1CF"]);
        std::fs::write(&p, "symbol\tindex\nA1BG\t0\n").unwrap();
        let e = read_gene_index(&p).unwrap_err().to_string();
        assert!(e.contains("g.tsv") && e.contains("gene_name"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
