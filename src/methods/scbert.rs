//! scBERT: Yang F, Wang W, Wang F, et al., "scBERT as a large-scale pretrained deep language
//! model for cell type annotation of single-cell RNA-seq data", Nature Machine Intelligence 2022,
//! doi:10.1038/s42256-022-00534-z; upstream code https://github.com/TencentAILabHealthcare/scBERT
//! (`performer_pytorch/performer_pytorch.py` PerformerLM, its vendored copy of lucidrains'
//! performer-pytorch; `preprocess.py`; `predict.py`; read at commit 262fd4b).
//!
//! Files (under the weights folder's `scbert/`): `panglao_pretrained.pth`, upstream's checkpoint
//! (utils.save_ckpt: a torch.save dict whose `model_state_dict` is the PerformerLM state_dict),
//! read as data by candle's pickle reader; `panglao_10000.h5ad`, whose var_names fix the order of
//! the 16,906 genes (preprocess.py). The gene2vec table is the checkpoint's own
//! `pos_emb.emb.weight` (16,906 rows of gene2vec_16906.npy plus the zero row upstream appends,
//! float64 as np.load gives it): gene2vec_16906.npy itself is not read.
//!
//! Input (preprocess.py, then predict.py): the data's counts of the reference genes, matched by
//! exact name (a name present twice: its first column, as `list.index`; a reference gene absent
//! from the data: zero), sc.pp.normalize_total(target_sum=1e4) over those genes only, then
//! sc.pp.log1p(base=2); values above CLASS - 2 = 5 become 5 and `.long()` truncates; a 0 is
//! appended (16,907 tokens, the last one at gene2vec's zero row). The arithmetic follows scanpy
//! 1.11 in float32 (cell total summed in f64 then stored as f32, divided by 1e4, each value
//! divided by it, log1p in f32, then divided by ln 2 in f64 and stored as f32), so bins agree at
//! their edges. preprocess.py's filter_cells(min_genes=200) is not applied: every cell is
//! embedded and the task reports the ones upstream would drop.
//!
//! The model (PerformerLM.forward with return_encodings=True, eval mode): token embedding (7
//! rows: bins 0..5 and the pretraining mask 6) plus the gene2vec rows 0..n; `depth` layers of
//! x + SelfAttention(LayerNorm(x)) then x + FeedForward(LayerNorm(x)) (SequentialSequence with
//! PreLayerNorm); SelfAttention: to_q/to_k/to_v without bias to heads x dim_head (dim_head 64,
//! upstream's default, so 10 x 64 = 640 wide at dim 200), FAVOR+ (FastAttention with the softmax
//! kernel, the checkpoint's `projection_matrix` buffer, never redrawn in eval mode), to_out;
//! FeedForward: w1 (x4), GELU (erf), w2; the final LayerNorm. The softmax kernel
//! (softmax_kernel): data scaled by dim_head^-1/4, projected on the m random features; minus
//! |data|^2/2 scaled alike; minus a stabiliser: for queries each row's max over the features, for
//! keys the max over the whole key tensor; exp; + 1e-4; times m^-1/2. Non-causal linear
//! attention: out = q' (k'^T v) / (q' . sum_n k').
//!
//! Upstream's key stabiliser is the max over its whole batch, so with eps 1e-4 a cell's output
//! depends on the cells batched with it; predict.py runs one cell at a time. We take the max over
//! each cell's own keys: every cell gets predict.py's batch-of-one result, whatever --batch-size.
//!
//! Cell embedding: upstream has none (the maintainers point to attn_sum_save.py, which sums
//! attention weights per gene). We take the encodings (after the final LayerNorm, before to_out)
//! averaged over the 16,906 gene positions, the appended position left out, as BioLLM
//! (github.com/BGIResearch/BioLLM, biollm/base/load_scbert.py get_cell_embedding,
//! cell_emb_type 'mean', its configured default).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{Embedding, LayerNorm, Linear, VarBuilder};

use crate::error::{Error, Result};

/// The weights entries every run reads (weights.toml).
pub const REQUIRED_ENTRIES: &[&str] = &["scbert-panglao-pretrained", "scbert-panglao-reference"];
/// Bins of predict.py's default `--bin_num 5`: tokens 0..=5, plus the mask token 6 (CLASS = 7).
pub const MAX_BIN: u32 = 5;
/// sc.pp.normalize_total target in preprocess.py.
pub const TARGET_SUM: f32 = 1e4;
/// preprocess.py's sc.pp.filter_cells(min_genes=200).
pub const MIN_GENES: usize = 200;
/// FAVOR+ softmax_kernel's eps.
const KERNEL_EPS: f64 = 1e-4;
/// nn.LayerNorm's default eps.
const LN_EPS: f64 = 1e-5;

/// The released shape (predict.py: dim 200, depth 6, heads 10; dim_head 64 and
/// nb_features int(64 ln 64) = 266 are PerformerLM's defaults; 16,906 genes + 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub num_tokens: usize,
    pub dim: usize,
    pub depth: usize,
    pub heads: usize,
    pub dim_head: usize,
    pub nb_features: usize,
    pub seq_len: usize,
}

impl Dims {
    pub fn released() -> Dims {
        Dims { num_tokens: 7, dim: 200, depth: 6, heads: 10, dim_head: 64, nb_features: (64.0f64 * 64f64.ln()) as usize, seq_len: 16_907 }
    }

    /// Forward FLOPs of one cell (matmuls only): per layer the q/k/v/out projections, the two
    /// feature projections, k'^T v, q' context and q'.sum k', and the feed-forward.
    pub fn cell_flops(&self) -> f64 {
        let (n, d, i, m, f) = (self.seq_len as f64, self.dim as f64, (self.heads * self.dim_head) as f64, self.nb_features as f64, 4.0 * self.dim as f64);
        let e = self.dim_head as f64;
        let h = self.heads as f64;
        self.depth as f64 * (2.0 * n * (4.0 * d * i + 2.0 * d * f) + h * 2.0 * n * (2.0 * e * m + 2.0 * m * e + m))
    }
}

/// The data's columns of the reference genes.
#[derive(Debug, Clone)]
pub struct GeneAlign {
    /// Per data column, its reference position (the first column of a repeated name only).
    pub position: Vec<Option<u32>>,
    /// Reference genes found in the data.
    pub matched: usize,
    /// Reference genes.
    pub n_genes: usize,
    /// Data columns whose name repeats an earlier column's (left out, as upstream's list.index).
    pub repeated: usize,
}

impl GeneAlign {
    pub fn new(reference: &[String], var_names: &[String]) -> GeneAlign {
        let mut first: HashMap<&str, usize> = HashMap::with_capacity(var_names.len());
        let mut repeated = 0;
        for (j, n) in var_names.iter().enumerate() {
            if first.contains_key(n.as_str()) {
                repeated += 1;
            } else {
                first.insert(n.as_str(), j);
            }
        }
        let mut position = vec![None; var_names.len()];
        let mut matched = 0;
        for (i, g) in reference.iter().enumerate() {
            if let Some(&j) = first.get(g.as_str()) {
                if position[j].is_none() {
                    position[j] = Some(i as u32);
                    matched += 1;
                }
            }
        }
        GeneAlign { position, matched, n_genes: reference.len(), repeated }
    }
}

/// A value's bin: min(trunc(log2(1 + v / (total / 1e4))), 5), in scanpy's float32 steps.
pub fn bin(value: f32, factor: f32) -> u32 {
    let y = value / factor;
    let l = y.ln_1p();
    let b = (l as f64 / std::f64::consts::LN_2) as f32;
    if b > MAX_BIN as f32 {
        MAX_BIN
    } else {
        b as u32
    }
}

/// One cell's tokens (reference genes in order, then the appended 0) from its sparse row, and
/// how many reference genes it expresses. Err(value) on a negative or non-finite value.
pub fn tokens(idx: &[u32], vals: &[f32], align: &GeneAlign) -> std::result::Result<(Vec<u32>, usize), f32> {
    let mut out = vec![0u32; align.n_genes + 1];
    let mut kept: Vec<(u32, f32)> = Vec::new();
    let mut total = 0f64;
    for (&j, &v) in idx.iter().zip(vals) {
        if !v.is_finite() || v < 0.0 {
            return Err(v);
        }
        if let Some(p) = align.position[j as usize] {
            if v != 0.0 {
                kept.push((p, v));
                total += v as f64;
            }
        }
    }
    let total = total as f32;
    if total > 0.0 {
        let factor = total / TARGET_SUM;
        for &(p, v) in &kept {
            out[p as usize] = bin(v, factor);
        }
    }
    Ok((out, kept.len()))
}

struct Layer {
    norm1: LayerNorm,
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
    /// (nb_features, dim_head), transposed once: (dim_head, nb_features).
    projection_t: Tensor,
    norm2: LayerNorm,
    w1: Linear,
    w2: Linear,
}

/// PerformerLM's encoder (everything before to_out).
pub struct ScBert {
    pub dims: Dims,
    pub path: PathBuf,
    token_emb: Embedding,
    /// gene2vec rows (seq_len, dim).
    pos: Tensor,
    layers: Vec<Layer>,
    norm: LayerNorm,
    pub device: Device,
    /// The FAVOR+ features by `gpu::favor` (one kernel on a GPU, its loop on the host on the CPU)
    /// instead of candle's ops, and the linear attention's sums and denominators taken inside its
    /// two products (a column of ones beside the values). On by default on a GPU (docs/scbert.md);
    /// `__bench-encoder --arch scbert --unfused` times candle's ops.
    pub fused: bool,
}

fn missing_key(k: &str, tensors: &HashMap<String, Tensor>) -> String {
    let mut some: Vec<&String> = tensors.keys().collect();
    some.sort();
    let shown: Vec<&str> = some.iter().take(6).map(|s| s.as_str()).collect();
    format!(
        "its model_state_dict has no tensor `{k}` (upstream's PerformerLM state_dict has it). It holds {} tensors: {}{}",
        tensors.len(),
        shown.join(", "),
        if tensors.len() > shown.len() { ", ..." } else { "" }
    )
}

fn layer_prefix(i: usize) -> String {
    format!("performer.net.layers.{i}")
}

impl ScBert {
    /// Upstream's checkpoint: a torch.save dict with `model_state_dict` (or a bare state_dict).
    /// `dtype`: F32, or BF16 on a GPU (weights and activations in bfloat16; the features' math,
    /// the layer norms' statistics and the final mean in f32).
    pub fn load_on(path: &Path, dtype: DType, device: Device) -> Result<ScBert> {
        if !path.is_file() {
            return Err(Error::MissingFile { path: path.into() });
        }
        let bad = |detail: String| Error::BadWeights { path: path.into(), detail };
        let list = match candle_core::pickle::read_all_with_key(path, Some("model_state_dict")) {
            Ok(l) => l,
            Err(e) if e.to_string().contains("not found") => candle_core::pickle::read_all(path).map_err(|e| bad(format!("is not a PyTorch checkpoint: {e}")))?,
            Err(e) => return Err(bad(format!("is not a PyTorch checkpoint with a model_state_dict (upstream's utils.save_ckpt format): {e}"))),
        };
        let tensors: HashMap<String, Tensor> = list.into_iter().map(|(k, t)| (k.strip_prefix("module.").map(str::to_string).unwrap_or(k), t)).collect();
        let dims2 = |k: &str| -> Result<(usize, usize)> { tensors.get(k).ok_or_else(|| bad(missing_key(k, &tensors)))?.dims2().map_err(|e| bad(format!("{k}: {e}"))) };
        let (num_tokens, dim) = dims2("token_emb.weight")?;
        let (seq_len, pos_dim) = dims2("pos_emb.emb.weight").map_err(|e| match e {
            Error::BadWeights { path, detail } => Error::BadWeights { path, detail: format!("{detail}; a model trained with g2v_position_emb=False is not supported (predict.py uses gene2vec)") },
            e => e,
        })?;
        if pos_dim != dim {
            return Err(bad(format!("pos_emb.emb.weight is {pos_dim} wide but token_emb.weight {dim}")));
        }
        let mut depth = 0;
        while tensors.contains_key(&format!("{}.0.fn.to_q.weight", layer_prefix(depth))) {
            depth += 1;
        }
        if depth == 0 {
            return Err(bad(missing_key("performer.net.layers.0.0.fn.to_q.weight", &tensors)));
        }
        let (inner, _) = dims2(&format!("{}.0.fn.to_q.weight", layer_prefix(0)))?;
        let (nb_features, dim_head) = dims2(&format!("{}.0.fn.fast_attention.projection_matrix", layer_prefix(0)))?;
        if dim_head == 0 || inner % dim_head != 0 {
            return Err(bad(format!("to_q is {inner} wide, not a multiple of the projection's {dim_head} columns (dim_head)")));
        }
        let (ffn, _) = dims2(&format!("{}.1.fn.fn.w1.weight", layer_prefix(0)))?;
        let dims = Dims { num_tokens, dim, depth, heads: inner / dim_head, dim_head, nb_features, seq_len };
        let vb = VarBuilder::from_tensors(tensors, dtype, &device);
        Self::build(dims, ffn, vb, path, device).map_err(|e| bad(format!("is not a scBERT PerformerLM state_dict: {e}")))
    }

    /// Random weights of the given shape (benchmarks): `vb` supplies every tensor.
    pub fn build(dims: Dims, ffn: usize, vb: VarBuilder, path: &Path, device: Device) -> candle_core::Result<ScBert> {
        let inner = dims.heads * dims.dim_head;
        let token_emb = candle_nn::embedding(dims.num_tokens, dims.dim, vb.pp("token_emb"))?;
        let pos = vb.pp("pos_emb.emb").get((dims.seq_len, dims.dim), "weight")?;
        let layers = (0..dims.depth)
            .map(|i| {
                let a = vb.pp(format!("{}.0", layer_prefix(i)));
                let f = vb.pp(format!("{}.1", layer_prefix(i)));
                Ok(Layer {
                    norm1: candle_nn::layer_norm(dims.dim, LN_EPS, a.pp("norm"))?,
                    to_q: candle_nn::linear_no_bias(dims.dim, inner, a.pp("fn.to_q"))?,
                    to_k: candle_nn::linear_no_bias(dims.dim, inner, a.pp("fn.to_k"))?,
                    to_v: candle_nn::linear_no_bias(dims.dim, inner, a.pp("fn.to_v"))?,
                    to_out: candle_nn::linear(inner, dims.dim, a.pp("fn.to_out"))?,
                    projection_t: a.pp("fn.fast_attention").get((dims.nb_features, dims.dim_head), "projection_matrix")?.t()?.contiguous()?,
                    norm2: candle_nn::layer_norm(dims.dim, LN_EPS, f.pp("norm"))?,
                    w1: candle_nn::linear(dims.dim, ffn, f.pp("fn.fn.w1"))?,
                    w2: candle_nn::linear(ffn, dims.dim, f.pp("fn.fn.w2"))?,
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let norm = candle_nn::layer_norm(dims.dim, LN_EPS, vb.pp("norm"))?;
        let fused = device.is_cuda();
        Ok(ScBert { dims, path: path.into(), token_emb, pos, layers, norm, device, fused })
    }

    pub fn dim(&self) -> usize {
        self.dims.dim
    }

    /// The precision the model runs in (its weights' dtype).
    pub fn dtype(&self) -> DType {
        self.pos.dtype()
    }

    /// The same model with its weights in `dtype` (benchmarks: bf16 against f32 with one set of
    /// weights).
    pub fn to_dtype(&self, dtype: DType) -> candle_core::Result<ScBert> {
        let lin = |l: &Linear| -> candle_core::Result<Linear> { Ok(Linear::new(l.weight().to_dtype(dtype)?, l.bias().map(|b| b.to_dtype(dtype)).transpose()?)) };
        let ln = |l: &LayerNorm| -> candle_core::Result<LayerNorm> {
            let b = l.bias().ok_or_else(|| candle_core::Error::Msg("scbert: a layer norm without bias".into()))?;
            Ok(LayerNorm::new(l.weight().to_dtype(dtype)?, b.to_dtype(dtype)?, LN_EPS))
        };
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(Layer {
                    norm1: ln(&l.norm1)?,
                    to_q: lin(&l.to_q)?,
                    to_k: lin(&l.to_k)?,
                    to_v: lin(&l.to_v)?,
                    to_out: lin(&l.to_out)?,
                    projection_t: l.projection_t.to_dtype(dtype)?,
                    norm2: ln(&l.norm2)?,
                    w1: lin(&l.w1)?,
                    w2: lin(&l.w2)?,
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(ScBert {
            dims: self.dims,
            path: self.path.clone(),
            token_emb: Embedding::new(self.token_emb.embeddings().to_dtype(dtype)?, self.dims.dim),
            pos: self.pos.to_dtype(dtype)?,
            layers,
            norm: ln(&self.norm)?,
            device: self.device.clone(),
            fused: self.fused,
        })
    }

    /// FAVOR+ features (softmax_kernel) of `data` (b, h, n, e): queries stabilised by each row's
    /// max, keys by the max over each cell's whole key tensor.
    fn softmax_kernel(&self, data: &Tensor, projection_t: &Tensor, is_query: bool) -> candle_core::Result<Tensor> {
        let (b, h, n, e) = data.dims4()?;
        let m = self.dims.nb_features;
        let normalizer = (e as f64).powf(-0.25);
        let ratio = (m as f64).powf(-0.5);
        let dash = (data * normalizer)?.reshape((b * h * n, e))?.matmul(projection_t)?.reshape((b, h, n, m))?;
        // the diagonal in f32 whatever the rows' dtype
        let diag = (data.to_dtype(DType::F32)?.sqr()?.sum_keepdim(D::Minus1)? * (normalizer * normalizer / 2.0))?;
        if self.fused {
            // the steps below in one op (one kernel on a GPU; the keys' maximum still by candle),
            // the stabilisers in f32 too
            let stab = if is_query { None } else { Some(dash.max_keepdim(D::Minus1)?.reshape((b, h * n))?.max_keepdim(1)?.to_dtype(DType::F32)?) };
            return crate::gpu::favor::features(&dash, &diag, stab.as_ref(), ratio, KERNEL_EPS);
        }
        let diag = diag.to_dtype(dash.dtype())?;
        let row_max = dash.max_keepdim(D::Minus1)?;
        // keys: the max over the cell's whole key tensor, taken in two steps (rows, then the
        // cell), since one reduction over h x n x m values runs as a single CUDA block a cell
        let stab = if is_query { row_max } else { row_max.reshape((b, h * n))?.max_keepdim(1)?.reshape((b, 1, 1, 1))? };
        let z = dash.broadcast_sub(&diag)?.broadcast_sub(&stab)?.exp()?;
        (z + KERNEL_EPS)? * ratio
    }

    fn attention(&self, layer: &Layer, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        let (h, e) = (self.dims.heads, self.dims.dim_head);
        let split = |t: Tensor| -> candle_core::Result<Tensor> { t.reshape((b, n, h, e))?.transpose(1, 2)?.contiguous() };
        let q = split(layer.to_q.forward(x)?)?;
        let k = split(layer.to_k.forward(x)?)?;
        let v = split(layer.to_v.forward(x)?)?;
        let q = self.softmax_kernel(&q, &layer.projection_t, true)?;
        let k = self.softmax_kernel(&k, &layer.projection_t, false)?;
        if self.fused {
            // v with a column of ones: k'^T [v | 1] is the context beside sum_n k', and q' times
            // it the numerators beside q' . sum_n k', so neither the sum over the genes nor the
            // denominators take a pass of their own over the features (each ~180 MB a cell);
            // k'^T is read transposed by the product, not copied
            let ones = Tensor::ones((b, h, n, 1), v.dtype(), v.device())?;
            let v1 = Tensor::cat(&[&v, &ones], 3)?;
            let ctx = k.transpose(2, 3)?.matmul(&v1)?; // (b, h, m, e + 1)
            let o = q.matmul(&ctx)?.transpose(1, 2)?; // (b, n, h, e + 1)
            // numerators over denominators, laid out (b, n, h, e) by the division itself
            let out = o.narrow(3, 0, e)?.broadcast_div(&o.narrow(3, e, 1)?)?.reshape((b, n, h * e))?;
            return layer.to_out.forward(&out);
        }
        // linear_attention: D_inv = 1 / (q' . sum_n k'); context = k'^T v; out = q' context * D_inv
        let k_sum = k.sum_keepdim(2)?.transpose(2, 3)?.contiguous()?; // (b, h, m, 1)
        let d_inv = q.matmul(&k_sum)?.recip()?; // (b, h, n, 1)
        let context = k.transpose(2, 3)?.contiguous()?.matmul(&v)?; // (b, h, m, e)
        let out = q.matmul(&context)?.broadcast_mul(&d_inv)?;
        let out = out.transpose(1, 2)?.contiguous()?.reshape((b, n, h * e))?;
        layer.to_out.forward(&out)
    }

    /// Encodings (b, n, dim) of token rows (b, n), n = the checkpoint's positions.
    pub fn encode(&self, tokens: &Tensor) -> candle_core::Result<Tensor> {
        let (_, n) = tokens.dims2()?;
        let mut x = self.token_emb.forward(tokens)?.broadcast_add(&self.pos.narrow(0, 0, n)?)?;
        for layer in &self.layers {
            x = (&x + self.attention(layer, &layer.norm1.forward(&x)?)?)?;
            let f = layer.w2.forward(&layer.w1.forward(&layer.norm2.forward(&x)?)?.gelu_erf()?)?;
            x = (x + f)?;
        }
        self.norm.forward(&x)
    }

    /// Cell embeddings (cells x dim, row-major): the encodings averaged over the gene positions
    /// (all but the appended last one). Every cell must have the checkpoint's seq_len tokens.
    pub fn embed(&self, cells: &[&[u32]]) -> Result<Vec<f32>> {
        let n = self.dims.seq_len;
        if let Some(c) = cells.iter().find(|c| c.len() != n) {
            return Err(Error::Model { context: "scbert".into(), detail: format!("a cell has {} tokens; the checkpoint {} has {n} positions", c.len(), self.path.display()) });
        }
        if let Some(&t) = cells.iter().flat_map(|c| c.iter()).find(|&&t| t as usize >= self.dims.num_tokens) {
            return Err(Error::Model { context: "scbert".into(), detail: format!("token {t} is past the checkpoint's {} token rows", self.dims.num_tokens) });
        }
        let run = || -> candle_core::Result<Vec<f32>> {
            let flat: Vec<u32> = cells.iter().flat_map(|c| c.iter().copied()).collect();
            let ids = Tensor::from_vec(flat, (cells.len(), n), &self.device)?;
            let enc = self.encode(&ids)?;
            enc.narrow(1, 0, n - 1)?.to_dtype(DType::F32)?.mean(1)?.flatten_all()?.to_vec1::<f32>()
        };
        run().map_err(|e| Error::Model { context: format!("scbert forward on {}", self.device_name()), detail: e.to_string() })
    }

    fn device_name(&self) -> &'static str {
        if self.device.is_cuda() {
            "cuda"
        } else {
            "cpu"
        }
    }
}

/// The files of a run under a weights folder: (checkpoint, reference gene h5ad).
pub fn files(weights_dir: &Path, manifest: &crate::weights::Manifest) -> (PathBuf, PathBuf) {
    let file = |id: &str, default: &str| weights_dir.join(manifest.weights.get(id).map(|e| e.file.clone()).unwrap_or_else(|| default.into()));
    (file("scbert-panglao-pretrained", "scbert/panglao_pretrained.pth"), file("scbert-panglao-reference", "scbert/panglao_10000.h5ad"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bins_truncate_log2_and_clip_at_5() {
        // factor 1: the bin is floor(log2(1 + v)), clipped at 5
        assert_eq!(bin(0.0, 1.0), 0);
        assert_eq!(bin(0.99, 1.0), 0);
        assert_eq!(bin(1.0, 1.0), 1);
        assert_eq!(bin(2.9, 1.0), 1);
        assert_eq!(bin(3.0, 1.0), 2);
        assert_eq!(bin(30.0, 1.0), 4);
        assert_eq!(bin(31.0, 1.0), 5);
        assert_eq!(bin(1e6, 1.0), 5);
        // factor = total / 1e4
        assert_eq!(bin(1.0, 2.0), 0);
        assert_eq!(bin(2.0, 2.0), 1);
    }

    #[test]
    fn genes_align_by_first_exact_name() {
        let reference: Vec<String> = ["A", "B", "C", "D"].iter().map(|s| s.to_string()).collect();
        let names: Vec<String> = ["C", "x", "A", "C", "a"].iter().map(|s| s.to_string()).collect();
        let al = GeneAlign::new(&reference, &names);
        assert_eq!(al.position, vec![Some(2), None, Some(0), None, None]);
        assert_eq!((al.matched, al.repeated, al.n_genes), (2, 1, 4));
        // the total counts only reference genes: C (2) + A (2) = 4, factor 4e-4
        let (t, expressed) = tokens(&[0, 1, 2, 3], &[2.0, 100.0, 2.0, 7.0], &al).unwrap();
        assert_eq!(t, vec![5, 0, 5, 0, 0]);
        assert_eq!(expressed, 2);
        assert_eq!(tokens(&[1], &[-1.0], &al).unwrap_err(), -1.0);
        let (t, e) = tokens(&[1], &[5.0], &al).unwrap();
        assert_eq!((t, e), (vec![0; 5], 0));
    }

    /// A small PerformerLM (dim 16) on the CPU, its projections random (a VarMap's default would
    /// leave them 0), candle's ops selected; and three cells of its 20 tokens.
    fn small_model() -> (ScBert, Vec<Vec<u32>>) {
        let dims = Dims { num_tokens: 7, dim: 16, depth: 2, heads: 2, dim_head: 8, nb_features: 12, seq_len: 20 };
        let vm = candle_nn::VarMap::new();
        for i in 0..dims.depth {
            let name = format!("{}.0.fn.fast_attention.projection_matrix", layer_prefix(i));
            vm.get((dims.nb_features, dims.dim_head), &name, candle_nn::Init::Randn { mean: 0.0, stdev: 1.0 }, DType::F32, &Device::Cpu).unwrap();
        }
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
        let model = ScBert::build(dims, 32, vb, Path::new("random"), Device::Cpu).unwrap();
        let cells = (0..3).map(|c| (0..20).map(|p| if p == 19 { 0 } else { ((c * 5 + p * 3) % 6) as u32 }).collect()).collect();
        (model, cells)
    }

    #[test]
    fn one_op_features_equal_candle_ops() {
        let (mut model, cells) = small_model();
        let rows: Vec<&[u32]> = cells.iter().map(Vec::as_slice).collect();
        let want = model.embed(&rows).unwrap();
        model.fused = true;
        let got = model.embed(&rows).unwrap();
        assert_eq!(got.len(), 3 * 16);
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(scale > 0.0);
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-6 * scale, "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn bf16_weights_embed_close_to_f32() {
        // the same random PerformerLM in f32 and, through to_dtype, in bf16 (the fused path, on
        // the CPU through f32 conversions around the features)
        let (mut model, cells) = small_model();
        model.fused = true;
        let rows: Vec<&[u32]> = cells.iter().map(Vec::as_slice).collect();
        let want = model.embed(&rows).unwrap();
        let half = model.to_dtype(DType::BF16).unwrap();
        assert_eq!(half.dtype(), DType::BF16);
        let got = half.embed(&rows).unwrap();
        assert_eq!(got.len(), want.len());
        for (a, b) in got.chunks(16).zip(want.chunks(16)) {
            let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
            let cos = dot / (a.iter().map(|x| x * x).sum::<f32>().sqrt() * b.iter().map(|x| x * x).sum::<f32>().sqrt());
            assert!(cos > 0.99, "cosine {cos}");
            assert!(a != b, "bf16 rounds somewhere");
        }
        // and back: the f32 copy of the bf16 weights is f32 again
        assert_eq!(half.to_dtype(DType::F32).unwrap().dtype(), DType::F32);
    }

    #[test]
    fn released_dims() {
        let d = Dims::released();
        assert_eq!(d.nb_features, 266);
        assert_eq!(d.seq_len, 16_907);
    }
}
