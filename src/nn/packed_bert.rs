//! A BERT encoder for inference over packed cells: the cells of a batch are laid end to end
//! (`tokens x hidden`, no padding) and attend within themselves through
//! `gpu::varlen_attention` (a fused kernel on a GPU in bf16). It reads the same tensors as
//! candle-transformers' `BertModel` (`embeddings.*`, `encoder.layer.{i}.*`; Devlin et al. 2019,
//! arXiv:1810.04805, as Hugging Face's `modeling_bert.py` runs it: post-norm layers, absolute
//! positions counted from each cell's first token, token type 0) and gives the same hidden states
//! for every real token (tests below check it against `BertModel` with a padding mask).
//!
//! What packing changes: every linear layer, norm and activation runs on the real tokens only
//! (a batch of cells sorted by length still pads 2-4%; in file order upstream pads 28-53%), and
//! the query, key and value projections are one matrix product.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Embedding, LayerNorm, Linear, VarBuilder};
use candle_transformers::models::bert::{Config, HiddenAct};

use crate::nn::transformer::{layer_norm_to_dtype, Act, TransformerLayer, TransformerStack};

pub struct PackedBert {
    word: Embedding,
    position: Embedding,
    token_type: Tensor,
    emb_norm: LayerNorm,
    /// the encoder layers (on a GPU in bf16, `gpu::fused_encoder`)
    pub encoder: TransformerStack,
    max_positions: usize,
    eps: f64,
}

/// The cells of one batch, packed: token ids end to end, each token's position in its cell,
/// and the cells' offsets (`cu[c]..cu[c + 1]` are cell c's tokens).
pub struct Packed {
    pub ids: Vec<u32>,
    pub positions: Vec<u32>,
    pub cu: Vec<u32>,
}

impl Packed {
    pub fn new(cells: &[&[u32]]) -> Packed {
        let total: usize = cells.iter().map(|c| c.len()).sum();
        let mut p = Packed { ids: Vec::with_capacity(total), positions: Vec::with_capacity(total), cu: Vec::with_capacity(cells.len() + 1) };
        p.cu.push(0);
        for c in cells {
            p.ids.extend_from_slice(c);
            p.positions.extend(0..c.len() as u32);
            p.cu.push(p.ids.len() as u32);
        }
        p
    }

    pub fn tokens(&self) -> usize {
        self.ids.len()
    }

    /// Each cell's first row of `hidden` (`tokens x hidden`, these cells packed): the `<cls>`
    /// state for models that put it first. Every cell must have a token.
    pub fn first_rows(&self, hidden: &Tensor) -> Result<Tensor> {
        if self.cu.windows(2).any(|w| w[0] == w[1]) {
            candle_core::bail!("a cell without tokens (every cell starts with <cls>)");
        }
        let cells = self.cu.len() - 1;
        // (from page-locked memory on a GPU: the host does not wait for the encoder queued before)
        hidden.index_select(&crate::gpu::upload::upload_u32(&self.cu[..cells], hidden.device())?, 0)
    }
}

impl PackedBert {
    /// From the tensors `BertModel::load` reads (`vb` at the level of `embeddings` and `encoder`).
    pub fn load(vb: VarBuilder, cfg: &Config) -> Result<PackedBert> {
        let (d, f) = (cfg.hidden_size, cfg.intermediate_size);
        if cfg.num_attention_heads == 0 || d % cfg.num_attention_heads != 0 {
            candle_core::bail!("hidden size {d} is not a multiple of {} heads", cfg.num_attention_heads);
        }
        let e = vb.pp("embeddings");
        let word = candle_nn::embedding(cfg.vocab_size, d, e.pp("word_embeddings"))?;
        let position = candle_nn::embedding(cfg.max_position_embeddings, d, e.pp("position_embeddings"))?;
        let token_type = e.pp("token_type_embeddings").get((cfg.type_vocab_size, d), "weight")?.narrow(0, 0, 1)?;
        let emb_norm = candle_nn::layer_norm(d, cfg.layer_norm_eps, e.pp("LayerNorm"))?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let l = vb.pp(format!("encoder.layer.{i}"));
            let a = l.pp("attention");
            let s = a.pp("self");
            let (q, k, v) = (s.pp("query"), s.pp("key"), s.pp("value"));
            let w = Tensor::cat(&[q.get((d, d), "weight")?, k.get((d, d), "weight")?, v.get((d, d), "weight")?], 0)?;
            let b = Tensor::cat(&[q.get(d, "bias")?, k.get(d, "bias")?, v.get(d, "bias")?], 0)?;
            layers.push(TransformerLayer {
                qkv: Linear::new(w, Some(b)),
                out: candle_nn::linear(d, d, a.pp("output.dense"))?,
                norm1: candle_nn::layer_norm(d, cfg.layer_norm_eps, a.pp("output.LayerNorm"))?,
                ff1: candle_nn::linear(d, f, l.pp("intermediate.dense"))?,
                ff2: candle_nn::linear(f, d, l.pp("output.dense"))?,
                norm2: candle_nn::layer_norm(d, cfg.layer_norm_eps, l.pp("output.LayerNorm"))?,
            });
        }
        let act = match cfg.hidden_act {
            HiddenAct::Gelu => Act::GeluErf,
            HiddenAct::GeluApproximate => Act::GeluTanh,
            HiddenAct::Relu => Act::Relu,
        };
        // (heads narrower than 64 are widened for the fused encoder in bf16 on a GPU: all-MiniLM-L6-v2's)
        let encoder = TransformerStack::new(layers, cfg.num_attention_heads, cfg.layer_norm_eps, act).fit_fused()?;
        Ok(PackedBert { word, position, token_type, emb_norm, encoder, max_positions: cfg.max_position_embeddings, eps: cfg.layer_norm_eps })
    }

    /// The same model with its weights in `dtype` (bf16 on a GPU takes the fused encoder).
    pub fn to_dtype(&self, dtype: DType) -> Result<PackedBert> {
        let emb = |e: &Embedding| -> Result<Embedding> { Ok(Embedding::new(e.embeddings().to_dtype(dtype)?, e.hidden_size())) };
        Ok(PackedBert {
            word: emb(&self.word)?,
            position: emb(&self.position)?,
            token_type: self.token_type.to_dtype(dtype)?,
            emb_norm: layer_norm_to_dtype(&self.emb_norm, dtype, self.eps)?,
            encoder: self.encoder.to_dtype(dtype)?,
            max_positions: self.max_positions,
            eps: self.eps,
        })
    }

    /// Hidden states of the last layer, `tokens x hidden`, for the packed cells.
    pub fn forward(&self, p: &Packed) -> Result<Tensor> {
        self.encoder.forward(&self.embed(p)?, &p.cu)
    }

    /// The encoder's input for the packed cells (`tokens x hidden`): the word, position and
    /// token-type rows summed and normalised. In bf16 on a GPU one kernel (`gpu::embedding`);
    /// elsewhere [`Self::embed_candle`].
    pub fn embed(&self, p: &Packed) -> Result<Tensor> {
        if let Some(&pos) = p.positions.iter().max().filter(|&&m| m as usize >= self.max_positions) {
            candle_core::bail!("a cell of {} tokens is longer than the model's {} positions", pos + 1, self.max_positions);
        }
        if let (true, Some(bias)) = (crate::gpu::embedding::applies(self.word.embeddings()), self.emb_norm.bias()) {
            let t = crate::gpu::embedding::Tables { word: self.word.embeddings(), position: self.position.embeddings(), token_type: &self.token_type, norm_weight: self.emb_norm.weight(), norm_bias: bias, eps: self.eps };
            return crate::gpu::embedding::embed_norm(&t, &p.ids, &p.positions);
        }
        self.embed_candle(p)
    }

    /// [`Self::embed`] in candle's ops (the CPU's path, and the kernel's reference in
    /// `__bench-encoder --check`).
    pub fn embed_candle(&self, p: &Packed) -> Result<Tensor> {
        let dev = self.token_type.device();
        let ids = Tensor::new(p.ids.as_slice(), dev)?;
        let pos = Tensor::new(p.positions.as_slice(), dev)?;
        let x = (self.word.forward(&ids)? + self.position.forward(&pos)?)?.broadcast_add(&self.token_type)?;
        self.emb_norm.forward(&x)
    }

    /// The mean over each cell's tokens `lo..len - hi` of `hidden` (`tokens x hidden`), as f32
    /// `cells x hidden`; a cell with nothing in its range gets zeros.
    pub fn mean_pool(hidden: &Tensor, cu: &[u32], lo: usize, hi: usize) -> Result<Tensor> {
        let spans: Vec<(usize, usize)> = cu.windows(2).map(|w| (w[0] as usize + lo, ((w[1] - w[0]) as usize).saturating_sub(lo + hi))).collect();
        crate::gpu::segment_pool::mean_spans(hidden, &spans)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use candle_transformers::models::bert::BertModel;
    use std::collections::HashMap;

    fn config() -> Config {
        serde_json::from_value(serde_json::json!({
            "vocab_size": 40, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 24, "hidden_act": "gelu", "hidden_dropout_prob": 0.0,
            "max_position_embeddings": 12, "type_vocab_size": 2, "initializer_range": 0.02,
            "layer_norm_eps": 1e-12, "pad_token_id": 0, "classifier_dropout": null, "model_type": "bert"
        }))
        .unwrap()
    }

    /// Seeded random tensors under every name BertModel reads.
    fn weights(cfg: &Config) -> HashMap<String, Tensor> {
        let (d, f) = (cfg.hidden_size, cfg.intermediate_size);
        let mut shapes: Vec<(String, Vec<usize>)> = vec![
            ("embeddings.word_embeddings.weight".into(), vec![cfg.vocab_size, d]),
            ("embeddings.position_embeddings.weight".into(), vec![cfg.max_position_embeddings, d]),
            ("embeddings.token_type_embeddings.weight".into(), vec![cfg.type_vocab_size, d]),
            ("embeddings.LayerNorm.weight".into(), vec![d]),
            ("embeddings.LayerNorm.bias".into(), vec![d]),
        ];
        for i in 0..cfg.num_hidden_layers {
            let p = format!("encoder.layer.{i}");
            for (n, s) in [
                ("attention.self.query", (d, d)),
                ("attention.self.key", (d, d)),
                ("attention.self.value", (d, d)),
                ("attention.output.dense", (d, d)),
                ("intermediate.dense", (f, d)),
                ("output.dense", (d, f)),
            ] {
                shapes.push((format!("{p}.{n}.weight"), vec![s.0, s.1]));
                shapes.push((format!("{p}.{n}.bias"), vec![s.0]));
            }
            for n in ["attention.output.LayerNorm", "output.LayerNorm"] {
                shapes.push((format!("{p}.{n}.weight"), vec![d]));
                shapes.push((format!("{p}.{n}.bias"), vec![d]));
            }
        }
        let mut state = 12345u64;
        shapes
            .into_iter()
            .map(|(k, s)| {
                let n: usize = s.iter().product();
                let v: Vec<f32> = (0..n)
                    .map(|_| {
                        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        let u = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                        if k.ends_with("LayerNorm.weight") { 1.0 + u * 0.2 } else { u * 0.6 }
                    })
                    .collect();
                (k, Tensor::from_vec(v, s, &Device::Cpu).unwrap())
            })
            .collect()
    }

    #[test]
    fn packed_cells_match_bert_with_a_padding_mask() {
        let cfg = config();
        let w = weights(&cfg);
        let vb = VarBuilder::from_tensors(w, DType::F32, &Device::Cpu);
        let bert = BertModel::load(vb.clone(), &cfg).unwrap();
        let packed = PackedBert::load(vb, &cfg).unwrap();
        let cells: Vec<Vec<u32>> = vec![(1..11).collect(), vec![5, 7, 9], vec![30, 2, 2, 17, 39, 8]];
        let refs: Vec<&[u32]> = cells.iter().map(|c| c.as_slice()).collect();
        let p = Packed::new(&refs);
        assert_eq!(p.cu, vec![0, 10, 13, 19]);
        let got = packed.forward(&p).unwrap().to_vec2::<f32>().unwrap();
        // BertModel on the padded batch, with a mask
        let len = 10;
        let mut ids = vec![0u32; 3 * len];
        let mut mask = vec![0u32; 3 * len];
        for (r, c) in cells.iter().enumerate() {
            for (j, &t) in c.iter().enumerate() {
                ids[r * len + j] = t;
                mask[r * len + j] = 1;
            }
        }
        let ids = Tensor::from_vec(ids, (3, len), &Device::Cpu).unwrap();
        let mask = Tensor::from_vec(mask, (3, len), &Device::Cpu).unwrap();
        let want = bert.forward(&ids, &ids.zeros_like().unwrap(), Some(&mask)).unwrap().to_vec3::<f32>().unwrap();
        let mut worst = 0f32;
        for (r, c) in cells.iter().enumerate() {
            for j in 0..c.len() {
                let a = &got[p.cu[r] as usize + j];
                for (x, y) in a.iter().zip(&want[r][j]) {
                    worst = worst.max((x - y).abs());
                }
            }
        }
        assert!(worst < 1e-4, "packed vs padded BERT differ by {worst}");
        // mean pooling over each cell's tokens, leaving out the first and last
        let hidden = packed.forward(&p).unwrap();
        let pooled = PackedBert::mean_pool(&hidden, &p.cu, 1, 1).unwrap().to_vec2::<f32>().unwrap();
        let want0: f32 = (1..9).map(|j| got[j][0]).sum::<f32>() / 8.0;
        assert!((pooled[0][0] - want0).abs() < 1e-5, "{} vs {want0}", pooled[0][0]);
        assert_eq!(pooled.len(), 3);
    }

    #[test]
    fn first_rows_are_each_cells_first_token() {
        let a: &[u32] = &[1, 2, 3];
        let b: &[u32] = &[4];
        let p = Packed::new(&[a, b, a]);
        let hidden = Tensor::arange(0f32, 7.0, &Device::Cpu).unwrap().reshape((7, 1)).unwrap();
        assert_eq!(p.first_rows(&hidden).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![0.0, 3.0, 4.0]);
        let empty: &[u32] = &[];
        let p = Packed::new(&[a, empty]);
        let err = p.first_rows(&hidden.narrow(0, 0, 3).unwrap()).unwrap_err().to_string();
        assert!(err.contains("a cell without tokens"), "{err}");
    }

    #[test]
    fn cells_longer_than_the_positions_are_refused() {
        let cfg = config();
        let vb = VarBuilder::from_tensors(weights(&cfg), DType::F32, &Device::Cpu);
        let packed = PackedBert::load(vb, &cfg).unwrap();
        let long: Vec<u32> = (0..13).collect();
        let err = packed.forward(&Packed::new(&[long.as_slice()])).unwrap_err().to_string();
        assert!(err.contains("13 tokens") && err.contains("12 positions"), "{err}");
    }
}
