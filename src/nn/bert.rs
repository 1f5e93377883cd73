//! A BERT encoder whose last layers can be trained: Devlin J, Chang M-W, Lee K, Toutanova K,
//! "BERT: Pre-training of Deep Bidirectional Transformers for Language Understanding", NAACL 2019,
//! arXiv:1810.04805; the layer as Hugging Face transformers runs it
//! (https://github.com/huggingface/transformers, `models/bert/modeling_bert.py`: `BertLayer` =
//! `BertSelfAttention`, `BertSelfOutput`, `BertIntermediate`, `BertOutput`, post-norm, eager
//! attention), which is what candle-transformers' `BertModel` reproduces for inference.
//!
//! Why a second implementation: candle-transformers' `BertModel` normalises with candle-nn's
//! fused layer-norm kernel (`apply_op3_no_bwd` on contiguous input), which has no backward pass,
//! so no gradient reaches a layer's weights through it. [`TrainableLayer`] is the same layer
//! written only from candle ops that have a backward pass (matmul, broadcast add/sub/mul/div,
//! exp, sqrt, max/sum reductions, relu/gelu): layer norm as mean and variance over the last
//! dimension, softmax as `exp(x - max) / sum`. It reads the same checkpoint tensors
//! (`encoder.layer.{i}.*`), so the weights load unchanged.
//!
//! [`Bert`] runs the first layers through candle-transformers' `BertModel` (its fast fused
//! kernels: those layers are frozen and need no gradient) and the last `trainable` layers
//! through [`TrainableLayer`]. With `trainable` 0 it is exactly `BertModel`.
//!
//! As in evaluation mode upstream, dropout is not applied.

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::{Linear, VarBuilder};
use candle_transformers::models::bert::{BertModel, Config, HiddenAct};

/// The tensors of one layer (weights and biases of query, key, value, attention output dense,
/// attention output LayerNorm, intermediate dense, output dense, output LayerNorm).
pub const LAYER_TENSORS: usize = 16;

/// Layer normalisation over the last dimension from differentiable ops, as
/// `torch.nn.LayerNorm`: (x - mean) / sqrt(var + eps) * w + b, with the biased variance.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let centred = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    centred.broadcast_div(&(var + eps)?.sqrt()?)?.broadcast_mul(w)?.broadcast_add(b)
}

/// Softmax over the last dimension from differentiable ops: exp(x - max) / sum.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let e = x.broadcast_sub(&x.max_keepdim(D::Minus1)?)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// The additive attention mask of `modeling_bert.py`'s `get_extended_attention_mask`: a
/// (batch, len) mask of 1 (token) / 0 (padding) becomes (batch, 1, 1, len) holding 0 for tokens
/// and the dtype's lowest value for padding.
pub fn extended_mask(mask: &Tensor, dtype: DType) -> Result<Tensor> {
    let m = mask.unsqueeze(1)?.unsqueeze(1)?.to_dtype(dtype)?;
    let lowest = match dtype {
        DType::F64 => f64::MIN,
        DType::F16 => -65504.0,                  // torch.finfo(torch.float16).min
        DType::BF16 => -3.3895313892515355e38, // torch.finfo(torch.bfloat16).min
        _ => f32::MIN as f64,
    };
    (m.ones_like()? - &m)? * lowest
}

struct Norm {
    w: Tensor,
    b: Tensor,
}

impl Norm {
    fn load(d: usize, vb: VarBuilder) -> Result<Norm> {
        Ok(Norm { w: vb.get(d, "weight")?, b: vb.get(d, "bias")? })
    }
}

/// One BERT encoder layer (`BertLayer`) from differentiable ops.
pub struct TrainableLayer {
    query: Linear,
    key: Linear,
    value: Linear,
    attn_out: Linear,
    attn_norm: Norm,
    intermediate: Linear,
    output: Linear,
    out_norm: Norm,
    act: HiddenAct,
    heads: usize,
    head_dim: usize,
    eps: f64,
}

impl TrainableLayer {
    /// Load from `vb` at `encoder.layer.{i}` (the checkpoint's own names).
    pub fn load(vb: VarBuilder, cfg: &Config) -> Result<TrainableLayer> {
        let (d, f) = (cfg.hidden_size, cfg.intermediate_size);
        if cfg.num_attention_heads == 0 || d % cfg.num_attention_heads != 0 {
            candle_core::bail!("hidden_size {d} is not a multiple of num_attention_heads {}", cfg.num_attention_heads)
        }
        let att = vb.pp("attention");
        let sa = att.pp("self");
        Ok(TrainableLayer {
            query: candle_nn::linear(d, d, sa.pp("query"))?,
            key: candle_nn::linear(d, d, sa.pp("key"))?,
            value: candle_nn::linear(d, d, sa.pp("value"))?,
            attn_out: candle_nn::linear(d, d, att.pp("output").pp("dense"))?,
            attn_norm: Norm::load(d, att.pp("output").pp("LayerNorm"))?,
            intermediate: candle_nn::linear(d, f, vb.pp("intermediate").pp("dense"))?,
            output: candle_nn::linear(f, d, vb.pp("output").pp("dense"))?,
            out_norm: Norm::load(d, vb.pp("output").pp("LayerNorm"))?,
            act: cfg.hidden_act,
            heads: cfg.num_attention_heads,
            head_dim: d / cfg.num_attention_heads,
            eps: cfg.layer_norm_eps,
        })
    }

    /// x: (batch, len, hidden); mask: the additive (batch, 1, 1, len) mask of [`extended_mask`].
    pub fn forward(&self, x: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (b, l, d) = x.dims3()?;
        let heads = |t: Tensor| -> Result<Tensor> { t.reshape((b, l, self.heads, self.head_dim))?.transpose(1, 2)?.contiguous() };
        let q = heads(self.query.forward(x)?)?;
        let k = heads(self.key.forward(x)?)?;
        let v = heads(self.value.forward(x)?)?;
        // scores / sqrt(head_dim) + mask, as modeling_bert.py's eager attention
        let scores = (q.matmul(&k.t()?)? / (self.head_dim as f64).sqrt())?.broadcast_add(mask)?;
        let probs = softmax_last_dim(&scores)?;
        let context = probs.matmul(&v)?.transpose(1, 2)?.contiguous()?.reshape((b, l, d))?;
        let a = layer_norm(&(self.attn_out.forward(&context)? + x)?, &self.attn_norm.w, &self.attn_norm.b, self.eps)?;
        let h = self.intermediate.forward(&a)?;
        let h = match self.act {
            HiddenAct::Gelu => h.gelu_erf()?,
            HiddenAct::GeluApproximate => h.gelu()?,
            HiddenAct::Relu => h.relu()?,
        };
        layer_norm(&(self.output.forward(&h)? + a)?, &self.out_norm.w, &self.out_norm.b, self.eps)
    }
}

/// A BERT encoder: candle-transformers' `BertModel` for the embeddings and the frozen layers,
/// then the trainable last layers.
pub struct Bert {
    frozen: BertModel,
    trained: Vec<TrainableLayer>,
}

impl Bert {
    /// `vb` at the model's root (where `embeddings.*` and `encoder.layer.*` are, or under
    /// `{model_type}.`), `cfg` with the number of layers to run; the last `trainable` of them
    /// run as [`TrainableLayer`]s.
    pub fn load(vb: VarBuilder, cfg: &Config, trainable: usize) -> Result<Bert> {
        let n = cfg.num_hidden_layers;
        if trainable > n {
            candle_core::bail!("{trainable} trainable layers asked, the model runs {n}")
        }
        let mut frozen_cfg = cfg.clone();
        frozen_cfg.num_hidden_layers = n - trainable;
        let frozen = BertModel::load(vb.clone(), &frozen_cfg)?;
        let first = n - trainable;
        // the same fallback as BertModel::load: `encoder.` at the root, else `{model_type}.encoder.`
        let probe = format!("encoder.layer.{first}.attention.self.query.weight");
        let enc = match &cfg.model_type {
            Some(mt) if trainable > 0 && !vb.contains_tensor(&probe) && vb.contains_tensor(&format!("{mt}.{probe}")) => vb.pp(format!("{mt}.encoder")),
            _ => vb.pp("encoder"),
        };
        let trained = (first..n).map(|i| TrainableLayer::load(enc.pp(format!("layer.{i}")), cfg)).collect::<Result<Vec<_>>>()?;
        Ok(Bert { frozen, trained })
    }

    /// The number of trainable layers.
    pub fn trainable(&self) -> usize {
        self.trained.len()
    }

    /// Hidden states (batch, len, hidden) of the last layer, as `BertModel::forward`.
    pub fn forward(&self, ids: &Tensor, types: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let mut h = self.frozen.forward(ids, types, mask)?;
        if self.trained.is_empty() {
            return Ok(h);
        }
        let mask = match mask {
            Some(m) => m.clone(),
            None => ids.ones_like()?,
        };
        let ext = extended_mask(&mask, h.dtype())?;
        for layer in &self.trained {
            h = layer.forward(&h, &ext)?;
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn layer_norm_and_softmax_match_candle_nn() {
        let dev = Device::Cpu;
        let x = Tensor::from_vec((0..24).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.3).collect::<Vec<_>>(), (2, 3, 4), &dev).unwrap();
        let w = Tensor::new(&[1.0f32, 0.5, -1.0, 2.0], &dev).unwrap();
        let b = Tensor::new(&[0.1f32, 0.0, 0.2, -0.3], &dev).unwrap();
        let ours = layer_norm(&x, &w, &b, 1e-12).unwrap();
        let fused = candle_nn::ops::layer_norm(&x, &w, &b, 1e-12).unwrap();
        let diff = (ours - fused).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-5, "layer norm differs by {diff}");
        let ours = softmax_last_dim(&x).unwrap();
        let fused = candle_nn::ops::softmax_last_dim(&x).unwrap();
        let diff = (ours - fused).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-6, "softmax differs by {diff}");
        let m = extended_mask(&Tensor::new(&[[1u32, 1, 0]], &dev).unwrap(), DType::F32).unwrap();
        assert_eq!(m.dims(), [1, 1, 1, 3]);
        assert_eq!(m.flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![0.0, 0.0, f32::MIN]);
    }
}
