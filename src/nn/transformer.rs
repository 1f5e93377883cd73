//! The transformer encoder layer, run over packed cells (`tokens x d`, the cells end to end;
//! `cu` holds their offsets), in its two orders:
//!
//! ```text
//! post-norm (BERT: Geneformer, scCello, LangCell; nn.TransformerEncoderLayer(norm_first=False):
//! scGPT, UCE, scFoundation)
//! a = attention(x Wqkv^T + bqkv)            each cell's tokens attend to that cell's tokens
//! x = norm1(x + a Wo^T + bo)
//! x = norm2(x + act(x W1^T + b1) W2^T + b2)
//!
//! pre-norm (scPRINT's simpler-flash blocks; norm_first=True; GPT-NeoX without parallel residual)
//! x = x + attention(norm1(x) Wqkv^T + bqkv) Wo^T + bo
//! x = x + act(norm2(x) W1^T + b1) W2^T + b2
//!
//! parallel (GPT-NeoX's use_parallel_residual: Pythia, Cell2Sentence)
//! x = x + attention(norm1(x) Wqkv^T + bqkv) Wo^T + bo + act(norm2(x) W1^T + b1) W2^T + b2
//! ```
//!
//! A stack may also be causal (each token attends to its cell's earlier tokens and itself) and
//! rotate the queries and keys first (`nn::rotary`, positions counted from each cell's start):
//! GPT-NeoX.
//!
//! Two paths with one answer: on a GPU in bf16 with heads 64 wide, `gpu::fused_encoder` (the
//! biases and residuals ride in cuBLASLt's matrix-product epilogues, the attention is our fused
//! variable-length kernel, layer norm and GELU are one in-place pass each, and no buffer is
//! allocated per layer); anywhere else, the candle ops below (`forward_unfused`), which are the
//! reference the fused path is checked against (`__bench-encoder --check`).

use candle_core::{Module, Result, Tensor};
use candle_nn::{LayerNorm, Linear};

use crate::gpu::varlen_attention::{default_scale, varlen_attention_scaled};
use crate::nn::rotary::Rotary;

/// The feed-forward activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// x / 2 (1 + erf(x / sqrt 2)): Hugging Face's "gelu", `nn.GELU()`
    GeluErf,
    /// the tanh approximation: Hugging Face's "gelu_new" / "gelu_pytorch_tanh"
    GeluTanh,
    Relu,
}

impl Act {
    pub fn apply(self, x: &Tensor) -> Result<Tensor> {
        match self {
            Act::GeluErf => x.gelu_erf(),
            Act::GeluTanh => x.gelu(),
            Act::Relu => x.relu(),
        }
    }
}

/// Where a layer's norms sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// after each residual sum (the original transformer, BERT)
    PostNorm,
    /// before attention and before the feed-forward, on the residual branch only
    PreNorm,
    /// pre-norm attention and feed-forward side by side on the same input, both added to it
    Parallel,
}

/// One layer's modules; `qkv`'s rows are the query, key and value projections stacked (as
/// PyTorch's `in_proj_weight`).
#[derive(Clone)]
pub struct TransformerLayer {
    pub qkv: Linear,
    pub out: Linear,
    pub norm1: LayerNorm,
    pub ff1: Linear,
    pub ff2: Linear,
    pub norm2: LayerNorm,
}

impl TransformerLayer {
    /// The tensors of one PyTorch `nn.TransformerEncoderLayer(d_model=d, dim_feedforward=ff)`
    /// under `vb` (`self_attn.in_proj_*` hold the query, key and value rows stacked,
    /// `self_attn.out_proj`, `linear1`, `linear2`, `norm1`, `norm2`; LayerNorm eps 1e-5): UCE's
    /// and scFoundation's layers.
    pub fn from_torch_encoder_layer(d: usize, ff: usize, vb: candle_nn::VarBuilder) -> Result<TransformerLayer> {
        let a = vb.pp("self_attn");
        Ok(TransformerLayer {
            qkv: Linear::new(a.get((3 * d, d), "in_proj_weight")?, Some(a.get(3 * d, "in_proj_bias")?)),
            out: candle_nn::linear(d, d, a.pp("out_proj"))?,
            norm1: candle_nn::layer_norm(d, 1e-5, vb.pp("norm1"))?,
            ff1: candle_nn::linear(d, ff, vb.pp("linear1"))?,
            ff2: candle_nn::linear(ff, d, vb.pp("linear2"))?,
            norm2: candle_nn::layer_norm(d, 1e-5, vb.pp("norm2"))?,
        })
    }

    /// The same layer with its weights in `dtype` (norms with `eps`); a no-op copy when they
    /// already are.
    pub fn to_dtype(&self, dtype: candle_core::DType, eps: f64) -> Result<TransformerLayer> {
        let lin = |l: &Linear| -> Result<Linear> { Ok(Linear::new(l.weight().to_dtype(dtype)?, l.bias().map(|b| b.to_dtype(dtype)).transpose()?)) };
        let norm = |n: &LayerNorm| layer_norm_to_dtype(n, dtype, eps);
        Ok(TransformerLayer { qkv: lin(&self.qkv)?, out: lin(&self.out)?, norm1: norm(&self.norm1)?, ff1: lin(&self.ff1)?, ff2: lin(&self.ff2)?, norm2: norm(&self.norm2)? })
    }

    /// The unfused layer over packed cells (the stack's heads, activation, order, causality and
    /// rotary embedding).
    pub fn forward_unfused(&self, x: &Tensor, cu: &[u32], s: &TransformerStack) -> Result<Tensor> {
        let attend = |normed: &Tensor| -> Result<Tensor> {
            let mut qkv = self.qkv.forward(normed)?;
            if let Some(r) = &s.rotary {
                qkv = r.apply(&qkv, cu, s.heads)?;
            }
            varlen_attention_scaled(&qkv, cu, s.heads, s.causal, s.attention_scale())
        };
        match s.order {
            Order::PostNorm => {
                let a = attend(x)?;
                let x = self.norm1.forward(&(self.out.forward(&a)? + x)?)?;
                let h = s.act.apply(&self.ff1.forward(&x)?)?;
                self.norm2.forward(&(self.ff2.forward(&h)? + x)?)
            }
            Order::PreNorm => {
                let a = attend(&self.norm1.forward(x)?)?;
                let x = (x + self.out.forward(&a)?)?;
                let h = s.act.apply(&self.ff1.forward(&self.norm2.forward(&x)?)?)?;
                x + self.ff2.forward(&h)?
            }
            Order::Parallel => {
                let a = self.out.forward(&attend(&self.norm1.forward(x)?)?)?;
                let m = self.ff2.forward(&s.act.apply(&self.ff1.forward(&self.norm2.forward(x)?)?)?)?;
                (m + a)? + x
            }
        }
    }
}

/// `n` with its weight and bias in `dtype` (candle's LayerNorm does not expose its eps: give it).
pub fn layer_norm_to_dtype(n: &LayerNorm, dtype: candle_core::DType, eps: f64) -> Result<LayerNorm> {
    let b = n.bias().map(|b| b.to_dtype(dtype)).transpose()?.ok_or_else(|| candle_core::Error::Msg("a layer norm without bias".into()))?;
    Ok(LayerNorm::new(n.weight().to_dtype(dtype)?, b, eps))
}

/// A stack of layers of one order. Every layer norm of the stack has the same `eps`.
#[derive(Clone)]
pub struct TransformerStack {
    pub layers: Vec<TransformerLayer>,
    pub heads: usize,
    pub eps: f64,
    pub act: Act,
    pub order: Order,
    /// Each token attends to its cell's tokens up to itself only (GPT-NeoX), not to all of them.
    pub causal: bool,
    /// Rotary position embedding of the queries and keys (GPT-NeoX), none for the others.
    pub rotary: Option<Rotary>,
    /// Take the fused GPU path where it applies (on by default; benchmarks turn it off to
    /// compare).
    pub fused: bool,
    /// The heads' real width where [`Self::pad_heads`] widened them with zero columns: the
    /// scores are scaled by `1 / sqrt(score_width)`; `None`, the heads' own width.
    pub score_width: Option<usize>,
}

impl TransformerStack {
    /// A post-norm stack.
    pub fn new(layers: Vec<TransformerLayer>, heads: usize, eps: f64, act: Act) -> TransformerStack {
        TransformerStack { layers, heads, eps, act, order: Order::PostNorm, causal: false, rotary: None, fused: true, score_width: None }
    }

    /// A pre-norm stack (no final norm: the caller applies its own).
    pub fn pre_norm(layers: Vec<TransformerLayer>, heads: usize, eps: f64, act: Act) -> TransformerStack {
        TransformerStack { order: Order::PreNorm, ..TransformerStack::new(layers, heads, eps, act) }
    }

    /// A causal decoder stack with rotary embeddings (GPT-NeoX: `parallel` residual as Pythia,
    /// else pre-norm), no final norm.
    pub fn causal(layers: Vec<TransformerLayer>, heads: usize, eps: f64, act: Act, parallel: bool, rotary: Rotary) -> TransformerStack {
        let order = if parallel { Order::Parallel } else { Order::PreNorm };
        TransformerStack { order, causal: true, rotary: Some(rotary), ..TransformerStack::new(layers, heads, eps, act) }
    }

    /// The stack with its weights in `dtype` (in bf16 on a GPU, [`Self::fit_fused`]).
    pub fn to_dtype(&self, dtype: candle_core::DType) -> Result<TransformerStack> {
        let layers = self.layers.iter().map(|l| l.to_dtype(dtype, self.eps)).collect::<Result<Vec<_>>>()?;
        TransformerStack { layers, ..self.clone() }.fit_fused()
    }

    /// The stack, with its heads widened to 64 ([`Self::pad_heads`]) where it is in bf16 on a GPU
    /// with narrower heads and no rotary embeddings: what the fused encoder takes. Models call it
    /// where they build a stack whose weights may already be bf16 on a GPU.
    pub fn fit_fused(self) -> Result<TransformerStack> {
        let on_gpu = self.layers.first().is_some_and(|l| l.qkv.weight().device().is_cuda());
        let hd = self.head_width();
        if self.dtype() == candle_core::DType::BF16 && on_gpu && hd > 0 && hd < 64 && self.rotary.is_none() {
            return self.pad_heads(64);
        }
        Ok(self)
    }

    /// The width of each head's queries, keys and values (padded ones included).
    pub fn head_width(&self) -> usize {
        self.layers.first().and_then(|l| l.qkv.weight().dims2().ok()).map_or(0, |(rows, _)| rows / 3 / self.heads.max(1))
    }

    /// The scores' scale: `1 / sqrt(head width)`, the real width's where the heads are padded.
    pub fn attention_scale(&self) -> f64 {
        default_scale(self.score_width.unwrap_or_else(|| self.head_width()))
    }

    /// The same stack with each head's queries, keys and values widened to `width` columns of
    /// which the new ones are zero (rows of zeros in the QKV product, columns of zeros in the
    /// output projection): the same answer (a zero column adds nothing to a score, and a zero
    /// value column is read by a zero weight), at the width the fused attention kernel takes
    /// (64: all-MiniLM-L6-v2's 32-wide heads). The scores keep the real width's scale. Stacks
    /// with rotary embeddings are refused (their pairs are laid out across the head's width).
    pub fn pad_heads(&self, width: usize) -> Result<TransformerStack> {
        let hd = self.head_width();
        if hd == width {
            return Ok(self.clone());
        }
        if hd == 0 || hd > width || self.rotary.is_some() {
            candle_core::bail!("cannot widen {}-wide heads to {width}{}", hd, if self.rotary.is_some() { " (rotary embeddings)" } else { "" });
        }
        let (h, extra) = (self.heads, width - hd);
        let layers = self
            .layers
            .iter()
            .map(|l| -> Result<TransformerLayer> {
                let (rows, d) = l.qkv.weight().dims2()?;
                let w = l.qkv.weight().reshape((3, h, hd, d))?.pad_with_zeros(2, 0, extra)?.reshape((3 * h * width, d))?;
                let b = l.qkv.bias().map(|b| b.reshape((3, h, hd))?.pad_with_zeros(2, 0, extra)?.reshape(3 * h * width)).transpose()?;
                let (out_rows, _) = l.out.weight().dims2()?;
                let wo = l.out.weight().reshape((out_rows, h, hd))?.pad_with_zeros(2, 0, extra)?.reshape((out_rows, h * width))?;
                debug_assert_eq!(rows, 3 * h * hd);
                Ok(TransformerLayer { qkv: Linear::new(w, b), out: Linear::new(wo, l.out.bias().cloned()), ..l.clone() })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(TransformerStack { layers, score_width: Some(self.score_width.unwrap_or(hd)), ..self.clone() })
    }

    /// The dtype of the weights (float32 for an empty stack).
    pub fn dtype(&self) -> candle_core::DType {
        self.layers.first().map(|l| l.ff1.weight().dtype()).unwrap_or(candle_core::DType::F32)
    }

    /// The candle path, whatever the device and dtype.
    pub fn forward_unfused(&self, x: &Tensor, cu: &[u32]) -> Result<Tensor> {
        let mut x = x.clone();
        for l in &self.layers {
            x = l.forward_unfused(&x, cu, self)?;
        }
        Ok(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn stack() -> TransformerStack {
        let (d, f) = (8, 12);
        let mut state = 7u64;
        let mut t = |shape: &[usize], centre: f32| {
            let n: usize = shape.iter().product();
            let v: Vec<f32> = (0..n)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    centre + ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.6
                })
                .collect();
            Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
        };
        let layers = (0..2)
            .map(|_| TransformerLayer {
                qkv: Linear::new(t(&[3 * d, d], 0.0), Some(t(&[3 * d], 0.0))),
                out: Linear::new(t(&[d, d], 0.0), Some(t(&[d], 0.0))),
                norm1: LayerNorm::new(t(&[d], 1.0), t(&[d], 0.0), 1e-5),
                ff1: Linear::new(t(&[f, d], 0.0), Some(t(&[f], 0.0))),
                ff2: Linear::new(t(&[d, f], 0.0), Some(t(&[d], 0.0))),
                norm2: LayerNorm::new(t(&[d], 1.0), t(&[d], 0.0), 1e-5),
            })
            .collect();
        TransformerStack::new(layers, 2, 1e-5, Act::GeluErf)
    }

    #[test]
    fn the_cpu_takes_the_candle_path_and_dtype_conversion_keeps_the_answer() {
        let s = stack();
        let x = Tensor::arange(0f32, 40.0, &Device::Cpu).unwrap().reshape((5, 8)).unwrap().affine(0.05, -1.0).unwrap();
        let cu = [0u32, 2, 5];
        assert!(!crate::gpu::fused_encoder::applies(&s, &x), "no fused path on the CPU");
        let a = s.forward(&x, &cu).unwrap();
        assert_eq!(a.dims(), &[5, 8]);
        let b = s.to_dtype(DType::F32).unwrap().forward(&x, &cu).unwrap();
        let diff = (a.clone() - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(diff, 0.0);
        // each cell attends to itself only: the second cell alone gives its rows
        let alone = s.forward(&x.narrow(0, 2, 3).unwrap(), &[0, 3]).unwrap();
        let diff = (a.narrow(0, 2, 3).unwrap() - alone).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-6, "{diff}");
        let half = s.to_dtype(DType::BF16).unwrap();
        assert_eq!(half.dtype(), DType::BF16);
        assert_eq!((half.heads, half.act, half.fused), (2, Act::GeluErf, true));
    }

    #[test]
    fn padded_heads_give_the_same_answer() {
        let s = stack();
        let x = Tensor::arange(0f32, 56.0, &Device::Cpu).unwrap().reshape((7, 8)).unwrap().affine(0.07, -1.5).unwrap();
        let cu = [0u32, 3, 3, 7];
        let want = s.forward_unfused(&x, &cu).unwrap();
        let wide = s.pad_heads(16).unwrap();
        assert_eq!((s.head_width(), wide.head_width(), wide.score_width), (4, 16, Some(4)));
        assert_eq!(wide.layers[0].qkv.weight().dims(), &[3 * 2 * 16, 8]);
        assert_eq!(wide.layers[0].out.weight().dims(), &[8, 2 * 16]);
        assert_eq!(wide.attention_scale(), s.attention_scale());
        let got = wide.forward_unfused(&x, &cu).unwrap();
        let diff = (got - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-5, "{diff}");
        // widening again keeps the real width's scale; the wrong scale changes the answer
        let wider = wide.pad_heads(32).unwrap();
        assert_eq!(wider.score_width, Some(4));
        let unscaled = TransformerStack { score_width: None, ..wide.clone() }.forward_unfused(&x, &cu).unwrap();
        let diff = (unscaled - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff > 1e-3, "the scale matters: {diff}");
        assert!(s.pad_heads(2).is_err(), "narrower is refused");
    }
}
