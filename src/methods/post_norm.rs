//! The post-norm transformer encoder layer that BERT (Geneformer, scCello, LangCell) and
//! PyTorch's `nn.TransformerEncoderLayer(norm_first=False)` (scGPT, UCE) share, run over packed
//! cells (`tokens x d`, the cells end to end; `cu` holds their offsets):
//!
//! ```text
//! a = attention(x Wqkv^T + bqkv)            each cell's tokens attend to that cell's tokens
//! x = norm1(x + a Wo^T + bo)
//! x = norm2(x + act(x W1^T + b1) W2^T + b2)
//! ```
//!
//! Two paths with one answer: on a GPU in bf16 with heads 64 wide, `gpu::fused_encoder` (the
//! biases and residuals ride in cuBLASLt's matrix-product epilogues, the attention is our fused
//! variable-length kernel, layer norm and GELU are one in-place pass each, and no buffer is
//! allocated per layer); anywhere else, the candle ops below (`forward_unfused`), which are the
//! reference the fused path is checked against (`__bench-encoder --check`).

use candle_core::{Module, Result, Tensor};
use candle_nn::{LayerNorm, Linear};

use crate::gpu::varlen_attention::varlen_attention;

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

/// One layer's modules; `qkv`'s rows are the query, key and value projections stacked (as
/// PyTorch's `in_proj_weight`).
#[derive(Clone)]
pub struct PostNormLayer {
    pub qkv: Linear,
    pub out: Linear,
    pub norm1: LayerNorm,
    pub ff1: Linear,
    pub ff2: Linear,
    pub norm2: LayerNorm,
}

impl PostNormLayer {
    /// The unfused layer over packed cells.
    pub fn forward_unfused(&self, x: &Tensor, cu: &[u32], heads: usize, act: Act) -> Result<Tensor> {
        let a = varlen_attention(&self.qkv.forward(x)?, cu, heads)?;
        let x = self.norm1.forward(&(self.out.forward(&a)? + x)?)?;
        let h = act.apply(&self.ff1.forward(&x)?)?;
        self.norm2.forward(&(self.ff2.forward(&h)? + x)?)
    }
}

/// A stack of post-norm layers. Every layer norm of the stack has the same `eps`.
#[derive(Clone)]
pub struct PostNormStack {
    pub layers: Vec<PostNormLayer>,
    pub heads: usize,
    pub eps: f64,
    pub act: Act,
    /// Take the fused GPU path where it applies (on by default; benchmarks turn it off to
    /// compare).
    pub fused: bool,
}

impl PostNormStack {
    pub fn new(layers: Vec<PostNormLayer>, heads: usize, eps: f64, act: Act) -> PostNormStack {
        PostNormStack { layers, heads, eps, act, fused: true }
    }

    /// The last layer's output for packed cells `x` (`tokens x d`).
    pub fn forward(&self, x: &Tensor, cu: &[u32]) -> Result<Tensor> {
        if self.fused && crate::gpu::fused_encoder::applies(self, x) {
            return crate::gpu::fused_encoder::forward(self, x, cu);
        }
        self.forward_unfused(x, cu)
    }

    /// The candle path, whatever the device and dtype.
    pub fn forward_unfused(&self, x: &Tensor, cu: &[u32]) -> Result<Tensor> {
        let mut x = x.clone();
        for l in &self.layers {
            x = l.forward_unfused(&x, cu, self.heads, self.act)?;
        }
        Ok(x)
    }
}
