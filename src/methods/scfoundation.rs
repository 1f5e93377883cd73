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
//! Batching: upstream runs one cell at a time. We pack a batch's cells end to end (no padding):
//! each cell's tokens attend to that cell's tokens only and each cell pools its own tokens, so a
//! cell's embedding does not depend on its batch (up to float rounding). On a GPU in bf16 the
//! transformer is the fused encoder (`gpu::fused_encoder`: heads 64 wide, as the released 12 x
//! 768 model's); the value and position embeddings, the final norm and the pooling run in f32.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{Embedding, LayerNorm, Linear, VarBuilder};

use crate::gpu::segment_pool;
use crate::nn::transformer::{Act, TransformerLayer, TransformerStack};
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
/// Cells per forward pass of the longest cells, batched by tokens (shorter cells fill the same
/// tokens, up to `gpu::backoff::BATCH_GROWTH` times as many; upstream runs one cell at a time,
/// and the result does not depend on the batch: cells run packed, each attending to itself).
pub const BATCH_SIZE: usize = 8;

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

/// The encoder side of MaeAutobin: value embedding, position embedding, transformer. Cells run
/// packed (end to end, no padding; `nn::transformer`), so each cell attends to its own tokens
/// only, as upstream's one cell at a time.
pub struct ScFoundation {
    pub config: Config,
    pub path: PathBuf,
    mlp: Linear,
    mlp2: Linear,
    bins: Tensor,
    emb_mask: Tensor,
    emb_pad: Tensor,
    pos_emb: Embedding,
    /// pytorchTransformerModule's layers (nn.TransformerEncoderLayer: post-norm, ReLU, eps
    /// 1e-5), in the run's precision: in bf16 on a GPU the fused encoder
    stack: TransformerStack,
    norm: LayerNorm,
    device: Device,
}

impl ScFoundation {
    /// Load the `cell` version of a models.ckpt on the CPU in float32.
    pub fn load(path: &Path) -> Result<ScFoundation> {
        Self::load_on(path, CELL_KEY, DType::F32, Device::Cpu)
    }

    /// Load version `key` of a models.ckpt with its encoder layers in `dtype` on `device`.
    pub fn load_on(path: &Path, key: &str, dtype: DType, device: Device) -> Result<ScFoundation> {
        let (config, tensors) = read_checkpoint(path, key)?;
        Self::from_tensors(config, tensors, path, dtype, device)
    }

    /// Build from a config and MaeAutobin-named tensors (a checkpoint's, or random ones). The
    /// encoder layers take `dtype`; the value and position embeddings, the final norm and the
    /// pooling stay float32.
    pub fn from_tensors(config: Config, tensors: HashMap<String, Tensor>, path: &Path, dtype: DType, device: Device) -> Result<ScFoundation> {
        let bad = |detail: String| Error::BadWeights { path: path.into(), detail };
        let d = config.hidden_dim;
        if config.heads == 0 || d % config.heads != 0 {
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
        let vb = VarBuilder::from_tensors(tensors, DType::F32, &device);
        let build = || -> candle_core::Result<_> {
            let te = vb.pp("token_emb");
            let mlp = candle_nn::linear(1, config.bin_num, te.pp("mlp"))?;
            let mlp2 = candle_nn::linear(config.bin_num, config.bin_num, te.pp("mlp2"))?;
            let bins = te.pp("emb").get((config.bin_num, d), "weight")?;
            let emb_mask = te.pp("emb_mask").get((1, d), "weight")?;
            let emb_pad = te.pp("emb_pad").get((1, d), "weight")?;
            let pos_emb = candle_nn::embedding(config.seq_len + 1, d, vb.pp("pos_emb"))?;
            let enc = vb.pp("encoder");
            let layers = (0..config.depth).map(|i| TransformerLayer::from_torch_encoder_layer(d, ff, enc.pp(format!("transformer_encoder.{i}")))).collect::<candle_core::Result<Vec<_>>>()?;
            let stack = TransformerStack::new(layers, config.heads, 1e-5, Act::Relu).to_dtype(dtype)?;
            let norm = candle_nn::layer_norm(d, 1e-5, enc.pp("norm"))?;
            Ok((mlp, mlp2, bins, emb_mask, emb_pad, pos_emb, stack, norm))
        };
        let (mlp, mlp2, bins, emb_mask, emb_pad, pos_emb, stack, norm) = build().map_err(|e| bad(format!("is not a MaeAutobin model as its config describes: {e}")))?;
        Ok(ScFoundation { config, path: path.into(), mlp, mlp2, bins, emb_mask, emb_pad, pos_emb, stack, norm, device })
    }

    /// Width of the cell embedding (4 x hidden_dim).
    pub fn dim(&self) -> usize {
        4 * self.config.hidden_dim
    }

    /// Genes the checkpoint's position table covers (seq_len - 2: T and S follow them).
    pub fn n_genes(&self) -> usize {
        self.config.seq_len.saturating_sub(2)
    }

    /// The encoder layers' dtype (bf16 takes the fused encoder on a GPU).
    pub fn dtype(&self) -> DType {
        self.stack.dtype()
    }

    /// Cell embeddings (n x 4 hidden_dim, float32) of cells given as `CellInput`s.
    pub fn embed(&self, cells: &[&CellInput]) -> Result<Vec<f32>> {
        if cells.is_empty() {
            return Ok(vec![]);
        }
        self.forward(cells)?.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(model_err("running the scFoundation encoder"))
    }

    /// The cells' embeddings (`cells x 4 hidden_dim`, f32) on the model's device, not read back.
    pub fn forward(&self, cells: &[&CellInput]) -> Result<Tensor> {
        let ctx = model_err("running the scFoundation encoder");
        let max_pos = self.config.seq_len as u32;
        let total: usize = cells.iter().map(|c| c.values.len()).sum();
        let (mut vals, mut pos, mut is_mask, mut is_pad) = (Vec::with_capacity(total), Vec::with_capacity(total), Vec::with_capacity(total), Vec::with_capacity(total));
        let (mut cu, mut last, mut second, mut genes) = (vec![0u32], Vec::with_capacity(cells.len()), Vec::with_capacity(cells.len()), Vec::with_capacity(cells.len()));
        for c in cells {
            let n = c.values.len();
            if n < 3 {
                return Err(Error::Model { context: "running the scFoundation encoder".into(), detail: format!("a cell of {n} tokens (at least 3 are needed)") });
            }
            if let Some(&p) = c.positions.iter().find(|&&p| p > max_pos) {
                return Err(Error::Model { context: "running the scFoundation encoder".into(), detail: format!("gene position {p} is past the checkpoint's position table ({} rows)", max_pos + 1) });
            }
            let at = vals.len();
            for (&v, &p) in c.values.iter().zip(&c.positions) {
                vals.push(v);
                pos.push(p);
                is_mask.push((v as f64 == self.config.mask_token_id) as u8 as f32);
                is_pad.push((v as f64 == self.config.pad_token_id) as u8 as f32);
            }
            cu.push(vals.len() as u32);
            last.push((at + n - 1) as u32);
            second.push((at + n - 2) as u32);
            genes.push((at, n - 2));
        }
        let dev = &self.device;
        let t = vals.len();
        let run = || -> candle_core::Result<Tensor> {
            // (from page-locked memory on a GPU: the host does not wait for the batch before)
            let column = |v: &[f32]| crate::gpu::upload::upload_f32(v, dev)?.reshape((t, 1));
            let v = column(&vals)?;
            // AutoDiscretizationEmbedding2, in f32
            let h = candle_nn::ops::leaky_relu(&self.mlp.forward(&v)?, 0.1)?;
            let cross = self.mlp2.forward(&h)?;
            let h = ((h * self.config.bin_alpha)? + cross)?;
            let x = candle_nn::ops::softmax_last_dim(&h)?.matmul(&self.bins)?;
            let (m, p) = (column(&is_mask)?, column(&is_pad)?);
            let keep = ((1.0 - &m)? - &p)?;
            let x = ((x.broadcast_mul(&keep)? + m.broadcast_mul(&self.emb_mask)?)? + p.broadcast_mul(&self.emb_pad)?)?;
            let x = (x + self.pos_emb.forward(&crate::gpu::upload::upload_u32(&pos, dev)?)?)?;
            let x = self.stack.forward(&x.to_dtype(self.stack.dtype())?, &cu)?;
            let x = self.norm.forward(&x.to_dtype(DType::F32)?)?;
            // pooling: last token (S), the one before (T), max and mean over the genes
            let s_tok = x.index_select(&crate::gpu::upload::upload_u32(&last, dev)?, 0)?;
            let t_tok = x.index_select(&crate::gpu::upload::upload_u32(&second, dev)?, 0)?;
            let max = segment_pool::max_spans(&x, &genes)?;
            let mean = segment_pool::mean_spans(&x, &genes)?;
            Tensor::cat(&[s_tok, t_tok, max, mean], D::Minus1)
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
