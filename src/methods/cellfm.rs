//! CellFM: Zeng Y, Xie J, Shangguan N, et al., "CellFM: a large-scale foundation model
//! pre-trained on transcriptomics of 100 million human cells", Nature Communications 2025,
//! doi:10.1038/s41467-025-59926-5. Upstream code: https://github.com/biomed-AI/CellFM
//! (MindSpore; config.py, model.py, retention.py read at commit 7655797) and its PyTorch port
//! https://github.com/biomed-AI/CellFM-torch (read at commit b6c3673: `layers/torch_finetune.py`
//! FinetuneModel.encode, `layers/torch_retention.py` RetentionLayer / MHRetention /
//! GatedLinearUnit / SRMSNorm, `layers/torch_model.py` ValueEncoder / FFN, `layers/utils.py`
//! read_h5ad, SCrna, Prepare, build_dataset; `model.py` Cell_FM, whose cell embedding is the
//! `cls_token` row of `encode`).
//!
//! Weights: the port's checkpoint format, a torch.save'd state_dict of FinetuneModel (bare names
//! such as `gene_emb`, `encoder.0.attn.q_proj.weight`, or behind the prefix its wrappers add:
//! `net.` for Cell_FM, `extractor.net.` for the Finetune_Cell_FM that main.py saves). It is read
//! by candle's pickle reader as data (nothing in it is run). The port makes that state_dict from
//! the released MindSpore checkpoint (Cell_FM.load_weight: `layer_norm.gamma/beta` renamed to
//! `weight/bias`). The number of heads is not in the state_dict: both released configs use 48.
//!
//! The encoder ("ERetNet"): every gene token is `gene_emb[gene id] + ValueEncoder(value)`, where
//! ValueEncoder is FFN(1, d): Linear(1, 256), LeakyReLU(0.01), `w3(h) + a * h`, softmax over the
//! 256, Linear(256, d). In front go the `cls_token` and the two `ST_emb` rows (the port's
//! `encode` in eval mode: ST_feat is not used then). Each RetentionLayer is post-norm:
//! `x = LN1(alpha x + MHRetention(x))`, `x = LN2(alpha x + GLU(x))` with alpha = (2 depth)^0.25
//! and LayerNorm eps 1e-5. MHRetention is the parallel form, a linear (kernel) attention with no
//! decay and no softmax: Q = relu(x Wq) / sqrt(hd), K = relu(x Wk) / sqrt(hd) (zero at padding),
//! V = x Wv / sqrt(n - 3 + 1e-6) (n the cell's gene count, upstream's len_scale), U = silu(x Wu);
//! per head O = Q (K^T V), then SRMSNorm over the head (x / max(|x / sqrt(hd)|, 1e-12)) times
//! U, and Wo. The GLU is Wo (x Wu * x Wv). The cell embedding is the cls row of the last layer.
//! A state_dict without `ST_emb` (the MindSpore 800M CellFM class has none) runs the port's other
//! read-out, `embedding_infer`: the cls token alone in front, otherwise the same.
//!
//! Tokens (what the port's data path gives with its augmentations off): counts of a cell with a
//! total T0 above 1e5 are scaled to 1e5 and rounded (read_h5ad); the data's genes are matched by
//! symbol to gene_info.csv (id = row + 1) and the first 2,048 matched genes in var order are
//! kept (SCrna); per cell the non-zero ones, in that order, each `log1p(count / T * 1e4)` in
//! float32 with T the sum over the kept genes (Prepare.normalize).
//!
//! Batching: padding tokens get K = 0, so they add nothing to any K^T V, and each cell's rows do
//! not depend on the others': batches are exact (tested).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{LayerNorm, Linear, VarBuilder};

use crate::nn::random_init::{inverse_sqrt_last, Fill};
use crate::error::{Error, Result};

/// The weights entries a run reads (weights.toml).
pub const REQUIRED_ENTRIES: &[&str] = &["cellfm-torch-state-dict", "cellfm-gene-info"];
/// Config.nonz_len: genes a cell may bring (SCrna keeps the first 2,048 matched genes).
pub const NONZ_LEN: usize = 2048;
/// enc_num_heads of both released configs (Config: 800M, Config_80M): not in the state_dict.
pub const RELEASED_HEADS: usize = 48;
/// FFN's hidden width (`FFN(in_dims, emb_dims, b=256)`).
const VALUE_HIDDEN: usize = 256;
/// nn.LayerNorm's default eps, which the port's post_norm1/2 use.
const LN_EPS: f64 = 1e-5;
/// nn.LeakyReLU's default slope, which the port's FFN uses.
const LEAKY_SLOPE: f64 = 0.01;

fn model_err(context: &str) -> impl Fn(candle_core::Error) -> Error + '_ {
    move |e| Error::Model { context: context.into(), detail: e.to_string() }
}

// ------------------------------------------------------------------------------------ genes

/// The gene symbols of a gene_info.csv (a header line, then one gene a line; the first column
/// is the symbol, read as pandas' `index_col=0`), in file order. Gene id = position + 1.
pub fn read_gene_info(path: &Path) -> Result<Vec<String>> {
    if !path.is_file() {
        return Err(Error::MissingFile { path: path.into() });
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::Io { path: path.into(), source: e })?;
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header = lines.next().unwrap_or("");
    let first = first_field(header);
    if header.is_empty() || !header.contains(',') {
        return Err(Error::BadField {
            path: path.into(),
            field: "header".into(),
            detail: format!("is not a CSV header (found {:?})", header.chars().take(60).collect::<String>()),
            hint: Some("pass CellFM's csv/gene_info.csv (header HGNC_gene,h5_sample_frequency,...; one gene symbol a line in the first column)".into()),
        });
    }
    let genes: Vec<String> = lines.map(|l| first_field(l)).collect();
    if genes.is_empty() {
        return Err(Error::BadField { path: path.into(), field: first, detail: "lists no genes".into(), hint: None });
    }
    Ok(genes)
}

/// The first field of a CSV line (quoted or not).
fn first_field(line: &str) -> String {
    let line = line.trim_end_matches('\r');
    if let Some(rest) = line.strip_prefix('"') {
        let mut out = String::new();
        let mut chars = rest.chars().peekable();
        while let Some(c) = chars.next() {
            if c == '"' {
                if chars.peek() == Some(&'"') {
                    out.push('"');
                    chars.next();
                } else {
                    break;
                }
            } else {
                out.push(c);
            }
        }
        out
    } else {
        line.split(',').next().unwrap_or("").trim().to_string()
    }
}

/// The data's columns against the gene table (the port's SCrna).
#[derive(Debug, Clone)]
pub struct GeneMap {
    /// For each data column, the gene id it feeds (only the first NONZ_LEN matched columns).
    pub col_gene: Vec<Option<u32>>,
    /// Genes in the table.
    pub vocab: usize,
    /// Data columns whose symbol is in the table (repeats aside).
    pub matched: usize,
    /// Matched columns kept (at most NONZ_LEN).
    pub kept: usize,
    /// Data columns whose name repeats an earlier matched column's (the first one is used).
    pub duplicates: usize,
}

impl GeneMap {
    /// `geneset = {symbol: row + 1}` (a symbol listed twice keeps its last row, as the dict),
    /// then the first `max_genes` data columns whose symbol is in it, in var order.
    pub fn new(gene_info: &[String], var_names: &[String], max_genes: usize) -> GeneMap {
        let ids: HashMap<&str, u32> = gene_info.iter().enumerate().map(|(i, g)| (g.as_str(), i as u32 + 1)).collect();
        let mut seen = std::collections::HashSet::new();
        let (mut matched, mut kept, mut duplicates) = (0, 0, 0);
        let col_gene = var_names
            .iter()
            .map(|g| {
                let id = *ids.get(g.as_str())?;
                if !seen.insert(g.as_str()) {
                    duplicates += 1;
                    return None;
                }
                matched += 1;
                if kept < max_genes {
                    kept += 1;
                    Some(id)
                } else {
                    None
                }
            })
            .collect();
        GeneMap { col_gene, vocab: gene_info.len(), matched, kept, duplicates }
    }
}

/// What the encoder sees of one cell: gene ids and float32 values, in the kept columns' order.
#[derive(Debug, Clone, PartialEq)]
pub struct CellInput {
    pub genes: Vec<u32>,
    pub values: Vec<f32>,
}

/// Why a cell cannot be embedded.
#[derive(Debug, Clone, PartialEq)]
pub enum CellProblem {
    Negative(f32),
    NonFinite(f32),
    /// Fewer than 3 expressed kept genes: upstream's len_scale rsqrt(n - 3 + 1e-6) is NaN.
    TooFew(usize),
}

/// A cell's tokens from its sparse row (`idx`, `vals`: data columns and counts, all columns).
pub fn cell_input(idx: &[u32], vals: &[f32], map: &GeneMap) -> std::result::Result<CellInput, CellProblem> {
    // read_h5ad: T0 = the row sum over all genes; counts / max(1, T0 / 1e5), rounded (float32)
    let mut t0 = 0f32;
    for &v in vals {
        if !v.is_finite() {
            return Err(CellProblem::NonFinite(v));
        }
        if v < 0.0 {
            return Err(CellProblem::Negative(v));
        }
        t0 += v;
    }
    let div = (t0 / 1e5f32).max(1.0);
    let mut kept: Vec<(u32, u32, f32)> = Vec::with_capacity(idx.len());
    for (&j, &v) in idx.iter().zip(vals) {
        if let Some(Some(g)) = map.col_gene.get(j as usize) {
            let c = (v / div).round_ties_even();
            if c != 0.0 {
                kept.push((j, *g, c));
            }
        }
    }
    kept.sort_by_key(|&(j, _, _)| j);
    if kept.len() < 3 {
        return Err(CellProblem::TooFew(kept.len()));
    }
    // SCrna: T = the sum over the kept genes (integers); Prepare.normalize in float32
    let total: f64 = kept.iter().map(|&(_, _, c)| c as f64).sum();
    let t = total as f32;
    let genes = kept.iter().map(|&(_, g, _)| g).collect();
    let values = kept.iter().map(|&(_, _, c)| (c / t * 1e4f32).ln_1p()).collect();
    Ok(CellInput { genes, values })
}

// ------------------------------------------------------------------------------ checkpoint

/// The port's state_dict from a torch.save file, names relative to FinetuneModel (any wrapper
/// prefix such as `extractor.net.` removed), as f32 on the CPU.
pub fn read_state_dict(path: &Path) -> Result<HashMap<String, Tensor>> {
    if !path.is_file() {
        return Err(Error::MissingFile { path: path.into() });
    }
    let bad = |detail: String| Error::BadWeights { path: path.into(), detail };
    let list = candle_core::pickle::read_all(path).map_err(|e| {
        let mut head = [0u8; 4];
        let zip = std::fs::File::open(path).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head)).map(|_| &head[..2] == b"PK").unwrap_or(false);
        bad(format!(
            "is not a PyTorch state_dict written by torch.save ({e}){}",
            if zip { "" } else { "; a MindSpore .ckpt (upstream's release) must first be converted by the port's Cell_FM.load_weight: scripts/cellfm_convert.py does that" }
        ))
    })?;
    let prefix = list
        .iter()
        .filter_map(|(k, _)| k.strip_suffix("gene_emb"))
        .filter(|p| p.is_empty() || p.ends_with('.'))
        .min_by_key(|p| p.len())
        .map(str::to_string)
        .ok_or_else(|| {
            let mut names: Vec<&str> = list.iter().map(|(k, _)| k.as_str()).collect();
            names.sort();
            let shown: Vec<&str> = names.iter().take(6).copied().collect();
            bad(format!(
                "has no `gene_emb` tensor (the port's FinetuneModel state_dict has gene_emb, cls_token, value_enc.*, encoder.*); it holds {}{}",
                if shown.is_empty() { "no tensors".to_string() } else { shown.join(", ") },
                if names.len() > shown.len() { ", ..." } else { "" }
            ))
        })?;
    Ok(list.into_iter().filter_map(|(k, t)| k.strip_prefix(prefix.as_str()).map(|s| (s.to_string(), t))).collect())
}

// ------------------------------------------------------------------------------------ model

/// FFN(1, d): the value encoder.
struct ValueFfn {
    w1: Linear,
    w3: Linear,
    table: Linear,
    a: Tensor,
}

impl ValueFfn {
    fn new(d: usize, vb: VarBuilder) -> candle_core::Result<ValueFfn> {
        Ok(ValueFfn {
            w1: candle_nn::linear_no_bias(1, VALUE_HIDDEN, vb.pp("w1"))?,
            w3: candle_nn::linear_no_bias(VALUE_HIDDEN, VALUE_HIDDEN, vb.pp("w3"))?,
            table: candle_nn::linear_no_bias(VALUE_HIDDEN, d, vb.pp("table"))?,
            a: vb.get((1, 1), "a")?,
        })
    }

    /// x: (b, L, 1) -> (b, L, d)
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let v = candle_nn::ops::leaky_relu(&self.w1.forward(x)?, LEAKY_SLOPE)?;
        let v = (self.w3.forward(&v)? + v.broadcast_mul(&self.a)?)?;
        self.table.forward(&candle_nn::ops::softmax_last_dim(&v)?)
    }
}

/// SRMSNorm over the last dimension, in float32: x / max(|x / sqrt(dim)|_2, 1e-12).
fn srms_norm(x: &Tensor, dim: usize) -> candle_core::Result<Tensor> {
    let dt = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let norm = x.affine(1.0 / (dim as f64).sqrt(), 0.0)?.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.maximum(1e-12)?;
    x.broadcast_div(&norm)?.to_dtype(dt)
}

/// MHRetention, parallel form (no decay): linear attention with relu kernels.
struct Retention {
    /// q_proj, k_proj, v_proj and u_proj stacked: one product for the four (4d x d)
    qkvu: Linear,
    o: Linear,
    heads: usize,
    head_dim: usize,
}

impl Retention {
    fn new(d: usize, heads: usize, vb: VarBuilder) -> candle_core::Result<Retention> {
        let w = |n: &str| vb.pp(n).get((d, d), "weight");
        let qkvu = Tensor::cat(&[w("q_proj")?, w("k_proj")?, w("v_proj")?, w("u_proj")?], 0)?;
        Ok(Retention { qkvu: Linear::new(qkvu, None), o: candle_nn::linear_no_bias(d, d, vb.pp("o_proj"))?, heads, head_dim: d / heads })
    }

    /// x: (b, L, d); `m`: the key mask and value scales (see [`Masks`]).
    fn forward(&self, x: &Tensor, m: &Masks) -> candle_core::Result<Tensor> {
        let (b, l, d) = x.dims3()?;
        // the four projections in one product over every token row
        let y = self.qkvu.forward(&x.reshape((b * l, d))?)?;
        let scale = (self.head_dim as f64).sqrt();
        let (key_mask, v_scale) = match m {
            Masks::Candle { key_mask, v_scale } => (key_mask, v_scale),
            Masks::Fused { mask, vscale } => {
                // gpu::retention: relu, scale, mask, value scale and silu as the product is split
                // into heads, SRMSNorm times u as the heads go back into token rows
                let parts = crate::gpu::retention::split(&y, mask, vscale, b, l, self.heads, self.head_dim, 1.0 / scale)?;
                let (q, k, v, u) = (parts.get(0)?, parts.get(1)?, parts.get(2)?, parts.get(3)?);
                let o = q.matmul(&k.transpose(2, 3)?.contiguous()?.matmul(&v)?)?;
                let o = crate::gpu::retention::merge(&o, &u)?;
                return self.o.forward(&o.reshape((b * l, d))?)?.reshape((b, l, d));
            }
        };
        // split into heads by one copy: (4, b, heads, L, hd)
        let qkvu = y.reshape((b, l, 4, self.heads, self.head_dim))?.permute((2, 0, 3, 1, 4))?.contiguous()?;
        let q = (qkvu.get(0)?.relu()? / scale)?;
        let k = (qkvu.get(1)?.relu()? / scale)?.broadcast_mul(key_mask)?;
        let v = qkvu.get(2)?.broadcast_mul(v_scale)?;
        let u = qkvu.get(3)?.silu()?;
        let kv = k.transpose(2, 3)?.contiguous()?.matmul(&v)?;
        let o = q.matmul(&kv)?;
        let o = (srms_norm(&o, self.head_dim)? * u)?;
        self.o.forward(&o.transpose(1, 2)?.reshape((b * l, d))?)?.reshape((b, l, d))
    }
}

/// A batch's key mask (1 at tokens, 0 at padding) and value scales for every layer, in the form
/// the layers' path reads them.
enum Masks {
    /// candle's ops: (b, 1, L, 1) and (b, 1, 1, 1) in the model's dtype
    Candle { key_mask: Tensor, v_scale: Tensor },
    /// `gpu::retention`: f32 vectors of b * L and b values
    Fused { mask: Tensor, vscale: Tensor },
}

/// GatedLinearUnit: Wo (x Wu * x Wv) (its SRMSNorm is not applied upstream).
struct Glu {
    /// u_proj and v_proj stacked: one product for the two (2d x d)
    uv: Linear,
    o: Linear,
    d: usize,
}

impl Glu {
    fn new(d: usize, vb: VarBuilder) -> candle_core::Result<Glu> {
        let w = |n: &str| vb.pp(n).get((d, d), "weight");
        let uv = Tensor::cat(&[w("u_proj")?, w("v_proj")?], 0)?;
        Ok(Glu { uv: Linear::new(uv, None), o: candle_nn::linear_no_bias(d, d, vb.pp("o_proj"))?, d })
    }

    /// x: (b, L, d), the products over every token row at once
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, l, d) = x.dims3()?;
        let uv = self.uv.forward(&x.reshape((b * l, d))?)?;
        self.o.forward(&(uv.narrow(1, 0, self.d)? * uv.narrow(1, self.d, self.d)?)?)?.reshape((b, l, d))
    }
}

/// RetentionLayer (eval: dropout off).
struct Layer {
    attn: Retention,
    ffn: Glu,
    norm1: LayerNorm,
    norm2: LayerNorm,
    alpha: f64,
}

impl Layer {
    fn new(d: usize, heads: usize, depth: usize, vb: VarBuilder) -> candle_core::Result<Layer> {
        Ok(Layer {
            attn: Retention::new(d, heads, vb.pp("attn"))?,
            ffn: Glu::new(d, vb.pp("ffn"))?,
            norm1: candle_nn::layer_norm(d, LN_EPS, vb.pp("post_norm1"))?,
            norm2: candle_nn::layer_norm(d, LN_EPS, vb.pp("post_norm2"))?,
            alpha: (2.0 * depth as f64).powf(0.25),
        })
    }

    fn forward(&self, x: &Tensor, m: &Masks) -> candle_core::Result<Tensor> {
        let x = self.norm1.forward(&((x * self.alpha)? + self.attn.forward(x, m)?)?)?;
        self.norm2.forward(&((&x * self.alpha)? + self.ffn.forward(&x)?)?)
    }
}

/// The sizes a state_dict gives (heads aside, which it does not hold).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dims {
    /// Rows of gene_emb (n_genes + 1, rounded up to a multiple of 8).
    pub gene_rows: usize,
    pub dim: usize,
    pub depth: usize,
    pub heads: usize,
    /// `ST_emb` present: the port's `encode` (cls + 2 ST tokens); else `embedding_infer`.
    pub st_tokens: bool,
}

impl Dims {
    /// The 800M model (config.py Config: 40 x 1536, 48 heads) over gene_info.csv's 24,078
    /// genes, with the port's ST tokens.
    pub fn released() -> Dims {
        let n = 24_078;
        Dims { gene_rows: n + 1 + (8 - (n + 1) % 8) % 8, dim: 1536, depth: 40, heads: RELEASED_HEADS, st_tokens: true }
    }
}

/// The port's FinetuneModel, encoder side.
pub struct CellFm {
    pub dims: Dims,
    pub path: PathBuf,
    gene_emb: Tensor,
    prefix: Tensor,
    value_enc: ValueFfn,
    layers: Vec<Layer>,
    dtype: DType,
    device: Device,
    /// Retention's elementwise steps by `gpu::retention` (two kernels a layer on a GPU, their loops
    /// on the host on the CPU) instead of candle's ops. On by default on a GPU (docs/cellfm.md);
    /// `__bench-encoder --arch cellfm --unfused` times candle's ops.
    pub fused: bool,
}

/// The config sizes the state_dict cannot give, from an optional JSON file beside it
/// (`<stem>.json`, the port's Config attribute names; scripts/cellfm_convert.py writes it).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct PortConfig {
    #[serde(default = "released_heads")]
    pub enc_num_heads: usize,
    #[serde(default)]
    pub enc_dims: Option<usize>,
    #[serde(default)]
    pub enc_nlayers: Option<usize>,
}

fn released_heads() -> usize {
    RELEASED_HEADS
}

impl Default for PortConfig {
    fn default() -> PortConfig {
        PortConfig { enc_num_heads: RELEASED_HEADS, enc_dims: None, enc_nlayers: None }
    }
}

/// Where the config of a state_dict is looked for: the same name with `.json`.
pub fn config_path(state_dict: &Path) -> PathBuf {
    state_dict.with_extension("json")
}

/// The config beside a state_dict, or the released one (48 heads) when there is none.
pub fn read_config(state_dict: &Path) -> Result<(PortConfig, Option<PathBuf>)> {
    let p = config_path(state_dict);
    if !p.is_file() {
        return Ok((PortConfig::default(), None));
    }
    let text = std::fs::read_to_string(&p).map_err(|e| Error::Io { path: p.clone(), source: e })?;
    let cfg: PortConfig = serde_json::from_str(&text).map_err(|e| Error::BadField {
        path: p.clone(),
        field: "enc_num_heads".into(),
        detail: format!("is not a CellFM config: {e}"),
        hint: Some("a JSON object with the port's Config names, e.g. {\"enc_dims\": 1536, \"enc_nlayers\": 40, \"enc_num_heads\": 48}; or remove it to use the released 48 heads".into()),
    })?;
    Ok((cfg, Some(p)))
}

impl CellFm {
    /// Load a state_dict (and its config, if any) on the CPU in float32.
    pub fn load(path: &Path) -> Result<CellFm> {
        Self::load_on(path, DType::F32, Device::Cpu)
    }

    /// Load a state_dict with the heads of the config beside it (48 without one).
    pub fn load_on(path: &Path, dtype: DType, device: Device) -> Result<CellFm> {
        let (cfg, cfg_path) = read_config(path)?;
        let tensors = read_state_dict(path)?;
        let m = Self::from_tensors(tensors, cfg.enc_num_heads, path, dtype, device)?;
        if let Some(cp) = cfg_path {
            for (name, want, got) in [("enc_dims", cfg.enc_dims, m.dims.dim), ("enc_nlayers", cfg.enc_nlayers, m.dims.depth)] {
                if let Some(w) = want {
                    if w != got {
                        return Err(Error::BadField { path: cp, field: name.into(), detail: format!("says {w} but the state_dict {} has {got}", path.display()), hint: Some("the config and the state_dict must come from one model".into()) });
                    }
                }
            }
        }
        Ok(m)
    }

    /// Build from FinetuneModel-named tensors (a state_dict's, or random ones).
    pub fn from_tensors(tensors: HashMap<String, Tensor>, heads: usize, path: &Path, dtype: DType, device: Device) -> Result<CellFm> {
        let bad = |detail: String| Error::BadWeights { path: path.into(), detail };
        for k in ["gene_emb", "cls_token", "value_enc.value_enc.w1.weight", "encoder.0.attn.q_proj.weight"] {
            if !tensors.contains_key(k) {
                let mut names: Vec<&String> = tensors.keys().collect();
                names.sort();
                let shown: Vec<&str> = names.iter().take(6).map(|s| s.as_str()).collect();
                return Err(bad(format!("has no tensor `{k}` (the port's FinetuneModel state_dict has it); it holds {}{}", shown.join(", "), if names.len() > shown.len() { ", ..." } else { "" })));
            }
        }
        if let Some(k) = tensors.keys().find(|k| k.contains(".lora_")) {
            return Err(bad(format!("holds LoRA adapters (`{k}`): merge them first (MHRetention.combine_weight upstream); the released weights have none")));
        }
        let (gene_rows, dim) = tensors["gene_emb"].dims2().map_err(|e| bad(format!("gene_emb: {e}")))?;
        let depth = (0..).take_while(|i| tensors.contains_key(&format!("encoder.{i}.attn.q_proj.weight"))).count();
        if heads == 0 || dim % heads != 0 {
            return Err(bad(format!("enc_dims {dim} is not divisible by {heads} heads")));
        }
        let st_tokens = tensors.contains_key("ST_emb");
        let dims = Dims { gene_rows, dim, depth, heads, st_tokens };
        let vb = VarBuilder::from_tensors(tensors, dtype, &device);
        Self::build(dims, vb, path, dtype, device).map_err(|e| bad(format!("is not a CellFM FinetuneModel state_dict of {depth} layers x {dim}: {e}")))
    }

    /// Build from a VarBuilder that holds every tensor at `dims`.
    pub fn build(dims: Dims, vb: VarBuilder, path: &Path, dtype: DType, device: Device) -> candle_core::Result<CellFm> {
        let d = dims.dim;
        let gene_emb = vb.get((dims.gene_rows, d), "gene_emb")?;
        let cls = vb.get((1, 1, d), "cls_token")?;
        let prefix = if dims.st_tokens { Tensor::cat(&[cls, vb.get((1, 2, d), "ST_emb")?], 1)? } else { cls };
        let value_enc = ValueFfn::new(d, vb.pp("value_enc").pp("value_enc"))?;
        let layers = (0..dims.depth).map(|i| Layer::new(d, dims.heads, dims.depth, vb.pp(format!("encoder.{i}")))).collect::<candle_core::Result<Vec<_>>>()?;
        let fused = device.is_cuda();
        Ok(CellFm { dims, path: path.into(), gene_emb, prefix, value_enc, layers, dtype, device, fused })
    }

    /// Width of the cell embedding (enc_dims).
    pub fn dim(&self) -> usize {
        self.dims.dim
    }

    /// Tokens in front of the genes (cls, and the two ST tokens when present).
    pub fn n_prefix(&self) -> usize {
        if self.dims.st_tokens {
            3
        } else {
            1
        }
    }

    /// Cell embeddings (n x dim, float32): the cls row of the last layer.
    pub fn embed(&self, cells: &[&CellInput]) -> Result<Vec<f32>> {
        let ctx = model_err("running the CellFM encoder");
        if cells.is_empty() {
            return Ok(vec![]);
        }
        let b = cells.len();
        let lg = cells.iter().map(|c| c.genes.len()).max().unwrap_or(0).max(1);
        let p = self.n_prefix();
        let d = self.dims.dim;
        let (mut ids, mut vals, mut mask, mut vscale) = (Vec::with_capacity(b * lg), Vec::with_capacity(b * lg), Vec::with_capacity(b * (p + lg)), Vec::with_capacity(b));
        for c in cells {
            let n = c.genes.len();
            if let Some(&g) = c.genes.iter().find(|&&g| g as usize >= self.dims.gene_rows) {
                return Err(Error::Model { context: "running the CellFM encoder".into(), detail: format!("gene id {g} is past gene_emb's {} rows", self.dims.gene_rows) });
            }
            for k in 0..lg {
                ids.push(if k < n { c.genes[k] } else { 0 });
                vals.push(if k < n { c.values[k] } else { 0.0 });
            }
            mask.extend(std::iter::repeat_n(1f32, p));
            mask.extend((0..lg).map(|k| (k < n) as u8 as f32));
            // len_scale = rsqrt(zero_idx.sum() - 3 + 1e-6), zero_idx over the genes only
            vscale.push(1.0 / ((n as f32 - 3.0) + 1e-6f32).sqrt());
        }
        let dev = &self.device;
        let run = || -> candle_core::Result<Vec<f32>> {
            let ids = Tensor::from_vec(ids, b * lg, dev)?;
            let gene = self.gene_emb.index_select(&ids, 0)?.reshape((b, lg, d))?;
            let v = Tensor::from_vec(vals, (b, lg, 1), dev)?.to_dtype(self.dtype)?;
            let mask_f32 = Tensor::from_vec(mask, (b, p + lg, 1), dev)?;
            let mask = mask_f32.to_dtype(self.dtype)?;
            let genes = (gene + self.value_enc.forward(&v)?)?;
            let x = Tensor::cat(&[self.prefix.broadcast_as((b, p, d))?, genes], 1)?;
            // pad_zero: padded tokens zeroed; their keys masked in every layer
            let mut x = x.broadcast_mul(&mask)?;
            let m = if self.fused && crate::gpu::retention::applies(&x) {
                Masks::Fused { mask: mask_f32.flatten_all()?, vscale: Tensor::from_vec(vscale, b, dev)? }
            } else {
                Masks::Candle { key_mask: mask.unsqueeze(1)?, v_scale: Tensor::from_vec(vscale, (b, 1, 1, 1), dev)?.to_dtype(self.dtype)? }
            };
            for layer in &self.layers {
                x = layer.forward(&x, &m)?;
            }
            x.narrow(1, 0, 1)?.squeeze(1)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
        };
        run().map_err(ctx)
    }
}

/// The files of a run under a weights folder: (state_dict, gene_info.csv).
pub fn files(weights_dir: &Path, manifest: &crate::weights::Manifest) -> (PathBuf, PathBuf) {
    let file = |id: &str, default: &str| weights_dir.join(manifest.weights.get(id).map(|e| e.file.clone()).unwrap_or_else(|| default.into()));
    (file(REQUIRED_ENTRIES[0], "cellfm/cellfm_torch.pt"), file(REQUIRED_ENTRIES[1], "cellfm/gene_info.csv"))
}

/// FinetuneModel encoder-side tensors at `dims`, seeded random (benchmarks and tests only):
/// splitmix64 uniforms, Box-Muller normals, the same weights on every device for a seed.
pub fn random_tensors(dims: &Dims, seed: u64, device: &Device) -> candle_core::Result<HashMap<String, Tensor>> {
    let d = dims.dim;
    let h = VALUE_HIDDEN;
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("gene_emb".into(), vec![dims.gene_rows, d]),
        ("cls_token".into(), vec![1, 1, d]),
        ("value_enc.value_enc.w1.weight".into(), vec![h, 1]),
        ("value_enc.value_enc.w3.weight".into(), vec![h, h]),
        ("value_enc.value_enc.table.weight".into(), vec![d, h]),
        ("value_enc.value_enc.a".into(), vec![1, 1]),
    ];
    if dims.st_tokens {
        shapes.push(("ST_emb".into(), vec![1, 2, d]));
    }
    for i in 0..dims.depth {
        for n in ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.u_proj", "attn.o_proj", "ffn.u_proj", "ffn.v_proj", "ffn.o_proj"] {
            shapes.push((format!("encoder.{i}.{n}.weight"), vec![d, d]));
        }
        for n in ["post_norm1", "post_norm2"] {
            shapes.push((format!("encoder.{i}.{n}.weight"), vec![d]));
            shapes.push((format!("encoder.{i}.{n}.bias"), vec![d]));
        }
    }
    crate::nn::random_init::seeded_tensors(shapes, seed, device, |n, s| {
        if n.contains("norm") {
            Fill::Const(if n.ends_with("weight") { 1.0 } else { 0.0 })
        } else if n.ends_with(".a") {
            Fill::Normal(0.1)
        } else {
            Fill::Normal(inverse_sqrt_last(s))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(max: usize) -> GeneMap {
        let info: Vec<String> = ["A", "B", "C", "D", "E"].iter().map(|s| s.to_string()).collect();
        let var: Vec<String> = ["C", "X", "A", "B", "C", "E", "D"].iter().map(|s| s.to_string()).collect();
        GeneMap::new(&info, &var, max)
    }

    #[test]
    fn genes_map_in_var_order_and_the_first_ones_are_kept() {
        let m = map(3);
        assert_eq!(m.col_gene, vec![Some(3), None, Some(1), Some(2), None, None, None]);
        assert_eq!((m.matched, m.kept, m.duplicates, m.vocab), (5, 3, 1, 5));
        let m = map(10);
        assert_eq!(m.col_gene, vec![Some(3), None, Some(1), Some(2), None, Some(5), Some(4)]);
    }

    #[test]
    fn cell_input_follows_the_port() {
        let m = map(10);
        // columns C=2, X=100 (unmapped: counts in T0 only), A=0 (stored zero), B=6, E=1, D=1
        let c = cell_input(&[6, 0, 1, 2, 3, 5], &[1.0, 2.0, 100.0, 0.0, 6.0, 1.0], &m).unwrap();
        assert_eq!(c.genes, vec![3, 2, 5, 4]);
        let t = 10f32;
        let want: Vec<f32> = [2f32, 6.0, 1.0, 1.0].iter().map(|&x| (x / t * 1e4f32).ln_1p()).collect();
        assert_eq!(c.values, want);
        // a total above 1e5 scales counts to 1e5 and rounds (half to even)
        let c = cell_input(&[0, 1, 3, 5], &[2.5, 199_992.5, 5.0, 3.0], &m).unwrap();
        let div = (200_003f32 / 1e5f32).max(1.0);
        assert_eq!(c.genes.len(), 3);
        assert_eq!(c.values[0], (((2.5f32 / div).round_ties_even()) / ((2.5f32 / div).round_ties_even() + (5.0f32 / div).round_ties_even() + (3.0f32 / div).round_ties_even()) * 1e4f32).ln_1p());
        assert_eq!(cell_input(&[0, 3], &[1.0, 2.0], &m), Err(CellProblem::TooFew(2)));
        assert_eq!(cell_input(&[0], &[-1.0], &m), Err(CellProblem::Negative(-1.0)));
        assert_eq!(cell_input(&[0], &[f32::NAN], &m).is_err(), true);
    }

    #[test]
    fn gene_info_reads_the_first_column() {
        let dir = std::env::temp_dir().join(format!("cellfm-gi-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("gene_info.csv");
        std::fs::write(&p, "HGNC_gene,h5_sample_frequency,biotype\nA1BG,17850,gene with protein product\n\"A1BG-AS1\",16096,\"RNA, long non-coding\"\n").unwrap();
        assert_eq!(read_gene_info(&p).unwrap(), vec!["A1BG", "A1BG-AS1"]);
        std::fs::write(&p, "just one line without commas\n").unwrap();
        let e = read_gene_info(&p).unwrap_err().to_string();
        assert!(e.contains("gene_info.csv"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn random_model_runs_and_batches_do_not_matter() {
        for st in [true, false] {
            let dims = Dims { gene_rows: 24, dim: 16, depth: 2, heads: 4, st_tokens: st };
            let t = random_tensors(&dims, 7, &Device::Cpu).unwrap();
            let m = CellFm::from_tensors(t, 4, Path::new("random"), DType::F32, Device::Cpu).unwrap();
            assert_eq!(m.dims, dims);
            let cells: Vec<CellInput> = (0..3).map(|i| CellInput { genes: (0..(4 + 3 * i)).map(|k| 1 + k as u32 * 2).collect(), values: (0..(4 + 3 * i)).map(|k| 1.0 + k as f32 * 0.3).collect() }).collect();
            let refs: Vec<&CellInput> = cells.iter().collect();
            let all = m.embed(&refs).unwrap();
            assert_eq!(all.len(), 3 * 16);
            assert!(all.iter().all(|v| v.is_finite()));
            let one = m.embed(&refs[0..1]).unwrap();
            let d = one.iter().zip(&all[0..16]).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(d < 1e-5, "{d}");
        }
        assert_eq!(Dims::released().gene_rows, 24_080);
    }

    #[test]
    fn retention_kernels_equal_candle_ops() {
        // gpu::retention's loops (the kernels' on a GPU) against candle's ops: padded cells of
        // different lengths, so the key mask and the value scales matter
        let dims = Dims { gene_rows: 40, dim: 24, depth: 3, heads: 3, st_tokens: true };
        let mut m = CellFm::from_tensors(random_tensors(&dims, 11, &Device::Cpu).unwrap(), 3, Path::new("random"), DType::F32, Device::Cpu).unwrap();
        let cells: Vec<CellInput> = (0..4).map(|i| CellInput { genes: (0..(5 + 4 * i)).map(|k| 1 + (k as u32 * 3 + i as u32) % 38).collect(), values: (0..(5 + 4 * i)).map(|k| 0.5 + ((k * 7 + i) % 5) as f32 * 0.4).collect() }).collect();
        let refs: Vec<&CellInput> = cells.iter().collect();
        let want = m.embed(&refs).unwrap();
        m.fused = true;
        let got = m.embed(&refs).unwrap();
        let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = got.iter().zip(&want).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(d <= 1e-5 * scale, "{d} of {scale}");
        // a wrong key mask (every slot a token) is caught
        let (q, mask, vs) = (Tensor::randn(0f32, 1.0, (2 * 3, 4 * 6), &Device::Cpu).unwrap(), Tensor::new(&[1f32, 1.0, 0.0, 1.0, 1.0, 1.0], &Device::Cpu).unwrap(), Tensor::new(&[0.5f32, 2.0], &Device::Cpu).unwrap());
        let a = crate::gpu::retention::split(&q, &mask, &vs, 2, 3, 2, 3, 0.5).unwrap();
        let b = crate::gpu::retention::split(&q, &mask.ones_like().unwrap(), &vs, 2, 3, 2, 3, 0.5).unwrap();
        assert_ne!(a.flatten_all().unwrap().to_vec1::<f32>().unwrap(), b.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        assert!(crate::gpu::retention::split(&q, &mask, &vs, 2, 4, 2, 3, 0.5).is_err());
    }
}
