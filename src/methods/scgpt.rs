//! scGPT: Cui H, Wang C, Maan H, et al., "scGPT: toward building a foundation model for
//! single-cell multi-omics using generative AI", Nature Methods 21:1470-1480 (2024),
//! doi:10.1038/s41592-024-02201-0; upstream code https://github.com/bowang-lab/scGPT
//! (`scgpt/model/model.py` TransformerModel, `scgpt/tasks/cell_emb.py` embed_data and
//! get_batch_cell_embeddings, `scgpt/data_collator.py` DataCollator, `scgpt/preprocess.py`
//! binning; read at v0.2.4, the PyPI release, and at the repository head of 2025).
//!
//! A checkpoint folder holds `best_model.pt` (a PyTorch state_dict, read as data by candle's
//! pickle reader: nothing in it is executed), `vocab.json` ({gene symbol: id}) and `args.json`
//! (the training arguments). Embedding a cell, as embed_data does:
//! - genes are matched to the vocabulary by symbol (var_names, or a var column), and genes
//!   outside it are dropped; `<pad>`, `<cls>`, `<eoc>` are appended to the vocabulary when absent;
//! - the cell's non-zero genes, in var order, follow a `<cls>` token whose value is `pad_value`
//!   (args.json; -2 for the whole-human checkpoint);
//! - the values (as float32) are binned per cell into `n_bins` (51) bins: edges are the
//!   `np.quantile` of the cell's non-zero values at `linspace(0, 1, n_bins - 1)`, and a value is
//!   digitized against them; where a value equals one or more edges its bin is drawn uniformly
//!   among the tied bins (`_digitize(side="both")`, `np.random.rand`);
//! - a cell longer than `max_length` (1200) keeps `<cls>` and a random `max_length - 1` of its
//!   genes (DataCollator with `sampling=True`, `torch.randperm`);
//! - the transformer's output at `<cls>` is the cell embedding, L2-normalised.
//!
//! Randomness: upstream draws the tie-breaking and the sampling from unseeded global RNGs
//! (numpy's, in DataLoader workers, and torch's), so its embeddings are not reproducible. We draw
//! both from numpy's legacy MT19937 seeded per cell with `(seed + cell index) mod 2^32`: the tie
//! draws are `np.random.rand` exactly as upstream consumes them, and the sampling is
//! `np.random.permutation(n - 1)[:max_length - 1]` in place of `torch.randperm`. With the same
//! seeds numpy gives identical bins and genes (tests/fixtures/scgpt/, scripts/scgpt_reference.py).
//!
//! The model (embed_data builds it with `pre_norm=False`): GeneEncoder (embedding, LayerNorm)
//! plus the value encoder (`input_emb_style` continuous: Linear(1, d), ReLU, Linear(d, d),
//! LayerNorm over values clamped at 512; category: embedding + LayerNorm; scaling: the gene
//! embedding times the value), then `nlayers` post-norm `nn.TransformerEncoderLayer`s (ReLU, LayerNorm
//! eps 1e-5) with the padding positions masked as keys. Checkpoints trained with flash-attn
//! name the attention `self_attn.Wqkv` (and `self_attn._impl.*` in newer flash-attn);
//! they are renamed to `in_proj_*` as upstream's `load_pretrained` does. Upstream embeds under
//! CUDA autocast (float16 matmuls on GPU); we compute in float32.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{Embedding, LayerNorm, Linear, VarBuilder};
use serde_json::Value;

use crate::formats::numpy_rng::Mt19937;
use crate::error::{Error, Result};
use crate::nn::transformer::{Act, TransformerLayer, TransformerStack};

/// The weights entries embedding reads (weights.toml).
pub const REQUIRED_ENTRIES: &[&str] = &["scgpt-whole-human-model", "scgpt-whole-human-vocab", "scgpt-whole-human-args"];
/// What an scGPT checkpoint folder (`--model-dir`) holds, as upstream releases it.
pub const FOLDER: &[crate::weights::Needed<'static>] = &[
    crate::weights::Needed { file: "best_model.pt", upstream: "the checkpoint's state_dict, torch.save'd" },
    crate::weights::Needed { file: "vocab.json", upstream: "the gene vocabulary, GeneVocab" },
    crate::weights::Needed { file: "args.json", upstream: "the model's hyperparameters (embsize, nlayers, nheads, d_hid, ...)" },
];
/// The entry whose folder is the checkpoint folder.
pub const MODEL_ENTRY: &str = "scgpt-whole-human-model";
/// embed_data's `max_length`: genes per cell including `<cls>`.
pub const DEFAULT_MAX_LEN: usize = 1200;
/// DataCollator bins into 51 (hard-coded upstream; args.json's `n_bins` where it says otherwise).
pub const DEFAULT_N_BINS: usize = 51;
/// ContinuousValueEncoder's `max_value`.
const MAX_VALUE: f32 = 512.0;
const SPECIALS: [&str; 3] = ["<pad>", "<cls>", "<eoc>"];
/// Attention scores per forward chunk (floats), to bound memory at long cells.
const MAX_SCORES: usize = 1 << 27;

fn model_err(context: &str) -> impl Fn(candle_core::Error) -> Error + '_ {
    move |e| Error::Model { context: context.into(), detail: e.to_string() }
}

// ------------------------------------------------------------------------------------- args

/// The fields of args.json that embedding reads (names as upstream writes them).
#[derive(Debug, Clone, PartialEq)]
pub struct Args {
    pub embsize: usize,
    pub nheads: usize,
    pub d_hid: usize,
    pub nlayers: usize,
    pub pad_token: String,
    pub pad_value: f32,
    pub n_bins: usize,
    pub input_emb_style: String,
}

impl Args {
    pub fn load(path: &Path) -> Result<Args> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Io { path: path.into(), source: e })?;
        Args::parse(&text, path)
    }

    pub fn parse(text: &str, path: &Path) -> Result<Args> {
        let bad = |field: &str, detail: String| Error::BadField {
            path: path.into(),
            field: field.into(),
            detail,
            hint: Some("args.json comes with the checkpoint (best_model.pt, vocab.json, args.json in one folder); see docs/scgpt.md".into()),
        };
        let v: Value = serde_json::from_str(text).map_err(|e| bad("(json)", e.to_string()))?;
        let obj = v.as_object().ok_or_else(|| bad("(json)", "is not a JSON object".into()))?;
        let uint = |k: &str| -> Result<usize> {
            match obj.get(k) {
                None => Err(bad(k, "missing (scGPT's embed_data reads it)".into())),
                Some(x) => x.as_u64().filter(|&n| n > 0).map(|n| n as usize).ok_or_else(|| bad(k, format!("must be a positive integer, found {x}"))),
            }
        };
        let (embsize, nheads, d_hid, nlayers) = (uint("embsize")?, uint("nheads")?, uint("d_hid")?, uint("nlayers")?);
        if embsize % nheads != 0 {
            return Err(bad("nheads", format!("embsize {embsize} is not divisible by nheads {nheads}")));
        }
        let pad_token = match obj.get("pad_token") {
            None => return Err(bad("pad_token", "missing (scGPT's embed_data reads it)".into())),
            Some(x) => x.as_str().ok_or_else(|| bad("pad_token", format!("must be a string, found {x}")))?.to_string(),
        };
        let pad_value = match obj.get("pad_value") {
            None => return Err(bad("pad_value", "missing (scGPT's embed_data reads it)".into())),
            Some(x) => x.as_f64().ok_or_else(|| bad("pad_value", format!("must be a number, found {x}")))? as f32,
        };
        let n_bins = match obj.get("n_bins") {
            None => DEFAULT_N_BINS,
            Some(_) => uint("n_bins")?,
        };
        if n_bins < 3 {
            return Err(bad("n_bins", format!("{n_bins} is too few bins (scGPT uses 51)")));
        }
        let input_emb_style = match obj.get("input_emb_style") {
            None => "continuous".to_string(),
            Some(x) => x.as_str().ok_or_else(|| bad("input_emb_style", format!("must be a string, found {x}")))?.to_string(),
        };
        if !["continuous", "category", "scaling"].contains(&input_emb_style.as_str()) {
            return Err(bad("input_emb_style", format!("`{input_emb_style}` is not one of continuous, category, scaling")));
        }
        Ok(Args { embsize, nheads, d_hid, nlayers, pad_token, pad_value, n_bins, input_emb_style })
    }
}

// ------------------------------------------------------------------------------------ vocab

/// vocab.json with the special tokens appended as embed_data does.
#[derive(Debug, Clone)]
pub struct Vocab {
    ids: HashMap<String, u32>,
    /// Number of token ids (largest id + 1).
    pub len: usize,
    /// Special tokens that vocab.json lacked and were appended.
    pub appended: Vec<String>,
}

impl Vocab {
    pub fn load(path: &Path) -> Result<Vocab> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Io { path: path.into(), source: e })?;
        Vocab::parse(&text, path)
    }

    pub fn parse(text: &str, path: &Path) -> Result<Vocab> {
        let bad = |detail: String| Error::BadWeights { path: path.into(), detail };
        let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let obj = v.as_object().ok_or_else(|| bad("is not a JSON object {gene: id}".into()))?;
        let mut ids = HashMap::with_capacity(obj.len() + 3);
        let mut seen: HashMap<u32, &str> = HashMap::with_capacity(obj.len());
        let mut len = 0usize;
        for (k, x) in obj {
            let id = x.as_u64().filter(|&i| i < u32::MAX as u64).ok_or_else(|| bad(format!("the id of {k:?} is {x}, not a non-negative integer")))? as u32;
            if let Some(other) = seen.insert(id, k) {
                return Err(bad(format!("{other:?} and {k:?} have the same id {id}")));
            }
            ids.insert(k.clone(), id);
            len = len.max(id as usize + 1);
        }
        let mut appended = Vec::new();
        for s in SPECIALS {
            if !ids.contains_key(s) {
                ids.insert(s.to_string(), len as u32);
                len += 1;
                appended.push(s.to_string());
            }
        }
        Ok(Vocab { ids, len, appended })
    }

    pub fn get(&self, token: &str) -> Option<u32> {
        self.ids.get(token).copied()
    }

    /// Number of entries (genes and special tokens).
    pub fn n_entries(&self) -> usize {
        self.ids.len()
    }
}

/// Each gene's id in the vocabulary (None: not in it, dropped as embed_data does).
pub fn match_genes(names: &[Option<String>], vocab: &Vocab) -> Vec<Option<u32>> {
    names.iter().map(|n| n.as_deref().and_then(|n| vocab.get(n))).collect()
}

/// The RNG of cell `cell` (its row in the data) for run seed `seed`.
pub fn cell_rng(seed: u64, cell: usize) -> Mt19937 {
    Mt19937::new((seed.wrapping_add(cell as u64) & 0xffff_ffff) as u32)
}

// ---------------------------------------------------------------------------------- binning

/// `np.quantile(values, np.linspace(0, 1, n_edges))` for float32 values (numpy 1.x, linear
/// method): the difference of neighbours in float32, the interpolation in float64.
pub fn quantile_edges(values: &[f32], n_edges: usize) -> Vec<f64> {
    let mut s = values.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    let last = (n - 1) as f64;
    let step = 1.0 / (n_edges - 1) as f64;
    (0..n_edges)
        .map(|i| {
            let q = if i == n_edges - 1 { 1.0 } else { i as f64 * step };
            let vi = last * q;
            if vi >= last {
                return s[n - 1] as f64;
            }
            let p = vi.floor();
            let gamma = vi - p;
            let (a, b) = (s[p as usize], s[p as usize + 1]);
            let diff = (b - a) as f64;
            if gamma >= 0.5 {
                b as f64 - diff * (1.0 - gamma)
            } else {
                a as f64 + diff * gamma
            }
        })
        .collect()
}

/// Upstream's `binning(row, n_bins)` of a cell's non-zero values: digitize against the
/// per-cell quantile edges, a value equal to edges drawn uniformly among them (one
/// `np.random.rand` per value, in order).
pub fn bin_values(values: &[f32], n_bins: usize, rng: &mut Mt19937) -> Vec<f32> {
    if values.is_empty() {
        return vec![];
    }
    let edges = quantile_edges(values, n_bins - 1);
    values
        .iter()
        .map(|&v| {
            let x = v as f64;
            let left = edges.partition_point(|&e| e <= x) as i64; // np.digitize(x, bins)
            let right = edges.partition_point(|&e| e < x) as i64; // np.digitize(x, bins, right=True)
            let r = rng.next_f64();
            (r * (right - left) as f64 + left as f64).ceil() as f32
        })
        .collect()
}

// ----------------------------------------------------------------------------- tokenization

/// How cells become model input: ids of the special tokens, `pad_value`, bins and length.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    pub cls_id: u32,
    pub pad_id: u32,
    pub pad_value: f32,
    pub n_bins: usize,
    pub max_len: usize,
}

/// One cell as the model sees it: `<cls>` first, then genes with their bins.
#[derive(Debug, Clone, PartialEq)]
pub struct Cell {
    pub genes: Vec<u32>,
    pub values: Vec<f32>,
    /// The cell had more genes than `max_len` and was sampled.
    pub sampled: bool,
}

impl Tokenizer {
    /// A cell from its sparse row (`indices`, `values` over var), the vocab id of each gene
    /// (`gene_ids`), the run seed and the cell's row number.
    pub fn cell(&self, indices: &[u32], values: &[f32], gene_ids: &[Option<u32>], seed: u64, row: usize) -> Cell {
        let mut pairs: Vec<(u32, u32, f32)> = indices
            .iter()
            .zip(values)
            .filter(|(_, &v)| v != 0.0)
            .filter_map(|(&j, &v)| gene_ids.get(j as usize).copied().flatten().map(|id| (j, id, v)))
            .collect();
        pairs.sort_by_key(|p| p.0); // np.nonzero order: var order
        let mut genes = Vec::with_capacity(pairs.len() + 1);
        let mut vals = Vec::with_capacity(pairs.len() + 1);
        genes.push(self.cls_id);
        vals.push(self.pad_value);
        if pairs.is_empty() {
            return Cell { genes, values: vals, sampled: false };
        }
        let mut rng = cell_rng(seed, row);
        let raw: Vec<f32> = pairs.iter().map(|p| p.2).collect();
        genes.extend(pairs.iter().map(|p| p.1));
        vals.extend(bin_values(&raw, self.n_bins, &mut rng));
        if genes.len() > self.max_len {
            let perm = rng.permutation(genes.len() - 1);
            let keep: Vec<usize> = std::iter::once(0).chain(perm.into_iter().take(self.max_len - 1).map(|i| i + 1)).collect();
            genes = keep.iter().map(|&i| genes[i]).collect();
            vals = keep.iter().map(|&i| vals[i]).collect();
            return Cell { genes, values: vals, sampled: true };
        }
        Cell { genes, values: vals, sampled: false }
    }
}

/// The distinct values of `vals` (in order of first appearance) and, for each value, its index
/// among them (values compared bit for bit).
pub fn distinct_values(vals: impl Iterator<Item = f32>) -> (Vec<f32>, Vec<u32>) {
    let mut seen: HashMap<u32, u32> = HashMap::new();
    let mut distinct = Vec::new();
    let which = vals
        .map(|v| {
            *seen.entry(v.to_bits()).or_insert_with(|| {
                distinct.push(v);
                distinct.len() as u32 - 1
            })
        })
        .collect();
    (distinct, which)
}

// ------------------------------------------------------------------------------ checkpoint

/// The upstream key of a checkpoint key: flash-attn names renamed to nn.MultiheadAttention's,
/// as `load_pretrained(use_fast_transformer=False)` does.
pub fn upstream_key(k: &str) -> String {
    k.replace("self_attn._impl.Wqkv.", "self_attn.in_proj_")
        .replace("self_attn.Wqkv.", "self_attn.in_proj_")
        .replace("self_attn._impl.out_proj.", "self_attn.out_proj.")
}

/// The tensors of best_model.pt (a PyTorch zip checkpoint holding a state_dict), renamed by
/// `upstream_key`. Read as data with candle's pickle reader.
pub fn read_checkpoint(path: &Path) -> Result<HashMap<String, Tensor>> {
    if !path.is_file() {
        return Err(Error::MissingFile { path: path.into() });
    }
    let bad = |detail: String| Error::BadWeights { path: path.into(), detail };
    let tensors = candle_core::pickle::read_all(path).map_err(|e| bad(format!("not a PyTorch state_dict checkpoint: {e}")))?;
    if tensors.is_empty() {
        return Err(bad("holds no tensors (expected a PyTorch state_dict saved by torch.save)".into()));
    }
    let mut out = HashMap::with_capacity(tensors.len());
    for (k, t) in tensors {
        let k = upstream_key(k.strip_prefix("module.").unwrap_or(&k));
        out.insert(k, t);
    }
    Ok(out)
}

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
        let out_proj = candle_nn::linear(d, d, vb.pp("out_proj"))?;
        Ok(Attention { in_proj: Linear::new(w, Some(b)), out_proj, heads, head_dim: d / heads })
    }

    /// x: (b, L, d); mask: (b, 1, 1, L) additive (0 or -inf at padding keys).
    /// `diff`: differentiable softmax (candle-nn's fused `softmax_last_dim` has no backward).
    fn forward(&self, x: &Tensor, mask: &Tensor, diff: bool) -> candle_core::Result<Tensor> {
        let (b, l, d) = x.dims3()?;
        let qkv = self.in_proj.forward(x)?;
        let split = |i: usize| -> candle_core::Result<Tensor> {
            qkv.narrow(2, i * d, d)?.reshape((b, l, self.heads, self.head_dim))?.transpose(1, 2)?.contiguous()
        };
        let q = (split(0)? * (1.0 / (self.head_dim as f64).sqrt()))?;
        let (k, v) = (split(1)?, split(2)?);
        let scores = q.matmul(&k.t()?)?.broadcast_add(mask)?;
        let p = if diff { candle_nn::ops::softmax(&scores, D::Minus1)? } else { candle_nn::ops::softmax_last_dim(&scores)? };
        let o = p.matmul(&v)?.transpose(1, 2)?.reshape((b, l, d))?;
        self.out_proj.forward(&o)
    }
}

/// nn.TransformerEncoderLayer(batch_first=True, norm_first=False, activation=relu).
struct EncoderLayer {
    attn: Attention,
    linear1: Linear,
    linear2: Linear,
    norm1: LayerNorm,
    norm2: LayerNorm,
}

impl EncoderLayer {
    fn new(a: &Args, vb: VarBuilder) -> candle_core::Result<EncoderLayer> {
        let d = a.embsize;
        Ok(EncoderLayer {
            attn: Attention::new(d, a.nheads, vb.pp("self_attn"))?,
            linear1: candle_nn::linear(d, a.d_hid, vb.pp("linear1"))?,
            linear2: candle_nn::linear(a.d_hid, d, vb.pp("linear2"))?,
            norm1: candle_nn::layer_norm(d, 1e-5, vb.pp("norm1"))?,
            norm2: candle_nn::layer_norm(d, 1e-5, vb.pp("norm2"))?,
        })
    }

    /// `diff`: run differentiable kernels (candle-nn's fused layer norm and softmax have no
    /// backward pass), for layers that are being fine-tuned.
    fn forward(&self, x: &Tensor, mask: &Tensor, diff: bool) -> candle_core::Result<Tensor> {
        let norm = |n: &LayerNorm, t: &Tensor| -> candle_core::Result<Tensor> {
            match (diff, n.bias()) {
                (true, Some(b)) => candle_nn::ops::layer_norm_slow(t, n.weight(), b, 1e-5),
                _ => n.forward(t),
            }
        };
        let x = norm(&self.norm1, &(x + self.attn.forward(x, mask, diff)?)?)?;
        let h = self.linear2.forward(&self.linear1.forward(&x)?.relu()?)?;
        norm(&self.norm2, &(x + h)?)
    }

    /// The same layer for packed cells (in_proj's rows are already q | k | v).
    fn post_norm(&self) -> TransformerLayer {
        TransformerLayer { qkv: self.attn.in_proj.clone(), out: self.attn.out_proj.clone(), norm1: self.norm1.clone(), ff1: self.linear1.clone(), ff2: self.linear2.clone(), norm2: self.norm2.clone() }
    }
}

enum ValueEncoder {
    /// ContinuousValueEncoder: Linear(1, d), ReLU, Linear(d, d), LayerNorm.
    Continuous { linear1: Linear, linear2: Linear, norm: LayerNorm },
    /// CategoryValueEncoder: Embedding(n_input_bins, d), LayerNorm.
    Category { embedding: Embedding, norm: LayerNorm, n: usize },
    /// "scaling": the gene embedding times the value.
    Scaling,
}

/// scGPT's TransformerModel as `_encode` runs it (the decoders are not needed for embedding).
pub struct Model {
    pub args: Args,
    pub vocab: Vocab,
    embedding: Embedding,
    enc_norm: LayerNorm,
    values: ValueEncoder,
    layers: Vec<EncoderLayer>,
    device: Device,
    pub tokenizer: Tokenizer,
    /// Checkpoint tensors that embedding does not use (decoders and such), for diagnostics.
    pub unused_keys: Vec<String>,
    /// The first layer being fine-tuned (run with differentiable kernels); usize::MAX for none.
    first_trained: usize,
    /// The layers as packed inference runs them (`nn::transformer`), in `set_precision`'s
    /// dtype (float32 unless asked).
    packed: TransformerStack,
    /// In bf16 on a GPU: the gene table and enc_norm in bf16 for `gpu::embedding::norm_add`.
    bf16_input: Option<Bf16Input>,
}

/// The gene embedding and its norm in bf16 (see `Model::embed_packed_tensor`).
struct Bf16Input {
    genes: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    /// The value encoder's rows (bf16) for the values binned cells hold: bins 0 .. n_bins - 1,
    /// then pad_value (`bin_rows` indexes them), made once instead of for every batch.
    bins: Tensor,
}

/// Each value's row in `Bf16Input::bins` when every value (capped at MAX_VALUE, as the value
/// encoder sees it) is pad_value or a bin (a whole number below `n_bins`), as binned cells'
/// values are; None when any is not (the batch then makes its own table).
fn bin_rows(vals: &[f32], n_bins: usize, pad_value: f32) -> Option<Vec<u32>> {
    let pad = pad_value.min(MAX_VALUE);
    vals.iter()
        .map(|&v| {
            let v = v.min(MAX_VALUE);
            if v == pad {
                Some(n_bins as u32)
            } else if v >= 0.0 && v < n_bins as f32 && v.fract() == 0.0 {
                Some(v as u32)
            } else {
                None
            }
        })
        .collect()
}

/// The checkpoint files of a scGPT folder.
pub fn folder_files(dir: &Path) -> [PathBuf; 3] {
    [dir.join("best_model.pt"), dir.join("vocab.json"), dir.join("args.json")]
}

impl Model {
    /// Load a checkpoint folder (best_model.pt, vocab.json, args.json).
    pub fn load(dir: &Path, max_len: usize) -> Result<Model> {
        Self::load_on(dir, max_len, Device::Cpu)
    }

    /// As `load`, with the weights on `device` (the CPU or a device of the GPU runtime).
    pub fn load_on(dir: &Path, max_len: usize, device: Device) -> Result<Model> {
        Self::load_hooked(dir, max_len, device, None)
    }

    /// As `load_on`, with the weights read through a fine-tuning hook (trainable last layers,
    /// fine-tuned tensors); see `methods/finetune.rs`.
    pub fn load_hooked(dir: &Path, max_len: usize, device: Device, hook: Option<&crate::nn::finetune::LoadHook>) -> Result<Model> {
        let [pt, vocab_path, args_path] = folder_files(dir);
        for p in [&args_path, &vocab_path, &pt] {
            if !p.is_file() {
                return Err(Error::MissingFile { path: p.clone() });
            }
        }
        let args = Args::load(&args_path)?;
        let vocab = Vocab::load(&vocab_path)?;
        let tensors = read_checkpoint(&pt)?;
        Model::from_parts(args, vocab, tensors, max_len, &pt, &vocab_path, &args_path, device, hook)
    }

    /// A model of the given shape with random weights (normal, sd 0.02; layer norms 1 and 0), on
    /// `device`, for benchmarks: scGPT's continuous value encoder, a vocabulary of `genes` genes
    /// plus the three special tokens. What `embed` runs, less the checkpoint.
    pub fn random(args: Args, genes: usize, max_len: usize, device: Device) -> Result<Model> {
        let here = Path::new("(random weights)");
        let names: serde_json::Map<String, Value> = (0..genes).map(|i| (format!("G{i}"), Value::from(i))).collect();
        let vocab = Vocab::parse(&Value::Object(names).to_string(), here)?;
        let shapes = tensor_shapes(&args, vocab.len);
        let ctx = model_err("drawing random weights");
        let mut tensors = HashMap::new();
        for (name, shape) in shapes {
            let t = if name.contains("norm") && name.ends_with("weight") {
                Tensor::ones(shape, DType::F32, &device)
            } else if name.contains("norm") {
                Tensor::zeros(shape, DType::F32, &device)
            } else {
                Tensor::randn(0f32, 0.02, shape, &device)
            };
            tensors.insert(name, t.map_err(&ctx)?);
        }
        Model::from_parts(args, vocab, tensors, max_len, here, here, here, device, None)
    }

    #[allow(clippy::too_many_arguments)]
    fn from_parts(args: Args, vocab: Vocab, tensors: HashMap<String, Tensor>, max_len: usize, pt: &Path, vocab_path: &Path, args_path: &Path, device: Device, hook: Option<&crate::nn::finetune::LoadHook>) -> Result<Model> {
        let bad = |detail: String| Error::BadWeights { path: pt.into(), detail };
        let pad_id = vocab.get(&args.pad_token).ok_or_else(|| Error::BadField {
            path: args_path.into(),
            field: "pad_token".into(),
            detail: format!("{:?} is not in {}", args.pad_token, vocab_path.display()),
            hint: None,
        })?;
        let cls_id = vocab.get("<cls>").expect("appended");
        // The gene table must fit the vocabulary: upstream's non-strict load would silently
        // keep a random table where the shapes disagree.
        let emb = tensors.get("encoder.embedding.weight").ok_or_else(|| bad(missing_key("encoder.embedding.weight", &tensors)))?;
        let (rows, cols) = emb.dims2().map_err(|e| bad(e.to_string()))?;
        if rows != vocab.len || cols != args.embsize {
            return Err(bad(format!(
                "encoder.embedding.weight is {rows} x {cols}, but {} has {} tokens (with {:?} appended) and args.json says embsize {}: the three files are not one checkpoint",
                vocab_path.display(),
                vocab.len,
                vocab.appended,
                args.embsize
            )));
        }
        let needed: Vec<String> = tensor_shapes(&args, vocab.len).into_iter().map(|(k, _)| k).collect();
        for k in &needed {
            if !tensors.contains_key(k) {
                return Err(bad(missing_key(k, &tensors)));
            }
        }
        if tensors.contains_key(&format!("transformer_encoder.layers.{}.linear1.weight", args.nlayers)) {
            return Err(bad(format!("holds more than the {} layers args.json's nlayers says", args.nlayers)));
        }
        let mut unused_keys: Vec<String> = tensors.keys().filter(|k| !needed.contains(k)).cloned().collect();
        unused_keys.sort();
        let n_cat = tensors.get("value_encoder.embedding.weight").and_then(|t| t.dims2().ok()).map(|d| d.0).unwrap_or(0);
        let vb = VarBuilder::from_tensors(tensors, DType::F32, &device);
        let vb = match hook {
            Some(h) => h.wrap(vb, "transformer_encoder.layers.", args.nlayers, &device)?,
            None => vb,
        };
        let build = || -> candle_core::Result<(Embedding, LayerNorm, ValueEncoder, Vec<EncoderLayer>)> {
            let d = args.embsize;
            let embedding = candle_nn::embedding(vocab.len, d, vb.pp("encoder.embedding"))?;
            let enc_norm = candle_nn::layer_norm(d, 1e-5, vb.pp("encoder.enc_norm"))?;
            let ve = vb.pp("value_encoder");
            let values = match args.input_emb_style.as_str() {
                "continuous" => ValueEncoder::Continuous {
                    linear1: candle_nn::linear(1, d, ve.pp("linear1"))?,
                    linear2: candle_nn::linear(d, d, ve.pp("linear2"))?,
                    norm: candle_nn::layer_norm(d, 1e-5, ve.pp("norm"))?,
                },
                "category" => ValueEncoder::Category {
                    embedding: candle_nn::embedding(n_cat, d, ve.pp("embedding"))?,
                    norm: candle_nn::layer_norm(d, 1e-5, ve.pp("enc_norm"))?,
                    n: n_cat,
                },
                _ => ValueEncoder::Scaling,
            };
            let layers = (0..args.nlayers).map(|i| EncoderLayer::new(&args, vb.pp(format!("transformer_encoder.layers.{i}")))).collect::<candle_core::Result<Vec<_>>>()?;
            Ok((embedding, enc_norm, values, layers))
        };
        let (embedding, enc_norm, values, layers) = build().map_err(|e| bad(format!("does not fit args.json ({}): {e}", args_path.display())))?;
        let tokenizer = Tokenizer { cls_id, pad_id, pad_value: args.pad_value, n_bins: args.n_bins, max_len: max_len.max(1) };
        let first_trained = hook.filter(|h| h.unfreeze > 0).map(|h| args.nlayers - h.unfreeze).unwrap_or(usize::MAX);
        let packed = packed_stack(&layers, args.nheads);
        Ok(Model { args, vocab, embedding, enc_norm, values, layers, device, tokenizer, unused_keys, first_trained, packed, bf16_input: None })
    }

    /// Run the packed encoder layers in `dtype` (bf16 on a GPU takes `gpu::fused_encoder`); the
    /// value encoder and the `<cls>` read-out stay float32, and in bf16 on a GPU the gene
    /// embedding, its norm and the sum with the value encoding are one kernel
    /// (`gpu::embedding::norm_add`, from a bf16 copy of the gene table). Upstream embeds under
    /// fp16 autocast.
    pub fn set_precision(&mut self, dtype: DType) -> Result<()> {
        let ctx = model_err("converting the encoder layers");
        self.packed = packed_stack(&self.layers, self.args.nheads).to_dtype(dtype).map_err(&ctx)?;
        self.bf16_input = None;
        if dtype == DType::BF16 && matches!(self.values, ValueEncoder::Continuous { .. }) {
            let genes = self.embedding.embeddings().to_dtype(DType::BF16).map_err(&ctx)?;
            if crate::gpu::embedding::applies(&genes) {
                if let Some(bias) = self.enc_norm.bias() {
                    let norm_weight = self.enc_norm.weight().to_dtype(DType::BF16).map_err(&ctx)?;
                    let norm_bias = bias.to_dtype(DType::BF16).map_err(&ctx)?;
                    let values = (0..self.args.n_bins).map(|b| b as f32).chain([self.args.pad_value.min(MAX_VALUE)]).collect();
                    let bins = self.value_rows(values)?.to_dtype(DType::BF16).map_err(&ctx)?;
                    self.bf16_input = Some(Bf16Input { genes, norm_weight, norm_bias, bins });
                }
            }
        }
        Ok(())
    }

    /// The dtype the packed encoder layers run in.
    pub fn precision(&self) -> DType {
        self.packed.dtype()
    }

    pub fn dim(&self) -> usize {
        self.args.embsize
    }

    /// The L2-normalised `<cls>` outputs of cells padded to one length: row-major n x embsize.
    pub fn embed_padded(&self, cells: &[&Cell]) -> Result<Vec<f32>> {
        if cells.is_empty() {
            return Ok(vec![]);
        }
        let out = self.embed_tensor(cells)?;
        out.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(model_err("running the scGPT transformer"))
    }

    /// As `embed_padded`, as a `(n, embsize)` tensor on the model's device (gradients flow
    /// through trainable layers).
    pub fn embed_tensor(&self, cells: &[&Cell]) -> Result<Tensor> {
        let ctx = model_err("running the scGPT transformer");
        let n = cells.len();
        let l = cells.iter().map(|c| c.genes.len()).max().unwrap_or(1);
        let mut ids = Vec::with_capacity(n * l);
        let mut vals = Vec::with_capacity(n * l);
        let mut mask = Vec::with_capacity(n * l);
        for c in cells {
            let pad = l - c.genes.len();
            ids.extend_from_slice(&c.genes);
            ids.extend(std::iter::repeat_n(self.tokenizer.pad_id, pad));
            vals.extend_from_slice(&c.values);
            vals.extend(std::iter::repeat_n(self.tokenizer.pad_value, pad));
        }
        // src_key_padding_mask = genes == <pad> (as get_batch_cell_embeddings)
        for &g in &ids {
            mask.push(if g == self.tokenizer.pad_id { f32::NEG_INFINITY } else { 0.0 });
        }
        let ids = Tensor::from_vec(ids, (n, l), &self.device).map_err(&ctx)?;
        let mask = Tensor::from_vec(mask, (n, 1, 1, l), &self.device).map_err(&ctx)?;
        let x = self.encode_input(&ids, &vals)?;
        // in chunks of cells, to bound the attention scores' memory
        let per_cell = self.args.nheads * l * l;
        let chunk = (MAX_SCORES / per_cell.max(1)).max(1);
        let mut cls = Vec::new();
        let mut start = 0;
        while start < n {
            let m = chunk.min(n - start);
            let mut h = x.narrow(0, start, m).map_err(&ctx)?;
            let mk = mask.narrow(0, start, m).map_err(&ctx)?;
            for (i, layer) in self.layers.iter().enumerate() {
                h = layer.forward(&h, &mk, i >= self.first_trained).map_err(&ctx)?;
            }
            cls.push(h.narrow(1, 0, 1).and_then(|t| t.squeeze(1)).map_err(&ctx)?);
            start += m;
        }
        let cls = Tensor::cat(&cls, 0).map_err(&ctx)?;
        // cell_embeddings / np.linalg.norm(cell_embeddings, axis=1, keepdims=True)
        let norm = cls.sqr().and_then(|t| t.sum_keepdim(D::Minus1)).and_then(|t| t.sqrt()).map_err(&ctx)?;
        cls.broadcast_div(&norm).map_err(&ctx)
    }

    /// The continuous value encoder's output (`distinct x d`, f32) for the distinct values of
    /// `vals` (capped at MAX_VALUE as upstream), and each value's row in it.
    ///
    /// The continuous value encoder (Linear(1, d), ReLU, Linear(d, d), LayerNorm) is a function of
    /// the value alone, and the values are bins (0 .. n_bins - 1) and pad_value: it runs once for
    /// each distinct value of the batch and its rows are gathered for the tokens, the same
    /// arithmetic row by row as running it on every token (a d x d float32 product a token: with
    /// the rest of the input encoding, 22% of scGPT's GPU time at the whole-human shape in bf16,
    /// BENCHMARKS.md).
    fn value_table(&self, vals: &[f32]) -> Result<(Tensor, Vec<u32>)> {
        let (distinct, which) = distinct_values(vals.iter().map(|v| v.min(MAX_VALUE)));
        Ok((self.value_rows(distinct)?, which))
    }

    /// The continuous value encoder's output (float32, a row each) for `values` (already capped).
    fn value_rows(&self, values: Vec<f32>) -> Result<Tensor> {
        let ctx = model_err("running the scGPT value encoder");
        let ValueEncoder::Continuous { linear1, linear2, norm } = &self.values else { unreachable!("value_rows is for the continuous value encoder") };
        let u = values.len();
        let v = Tensor::from_vec(values, (u, 1), &self.device).map_err(&ctx)?;
        linear1.forward(&v).and_then(|h| h.relu()).and_then(|h| linear2.forward(&h)).and_then(|h| norm.forward(&h)).map_err(&ctx)
    }

    /// The transformer's input for token ids (a 2-D tensor) and their values (on the host, the
    /// ids' elements in row-major order): the gene embedding (encoder + enc_norm) combined with
    /// the value encoder's output (for the continuous encoder, gathered from `value_table`).
    fn encode_input(&self, ids: &Tensor, vals: &[f32]) -> Result<Tensor> {
        let ctx = model_err("running the scGPT transformer");
        let shape = ids.dims().to_vec();
        let src = self.enc_norm.forward(&self.embedding.forward(&ids).map_err(&ctx)?).map_err(&ctx)?;
        let x = match &self.values {
            ValueEncoder::Continuous { .. } => {
                let (table, which) = self.value_table(vals)?;
                let which = Tensor::from_vec(which, vals.len(), &self.device).map_err(&ctx)?;
                let mut out_shape = shape.clone();
                out_shape.push(self.args.embsize);
                let h = table.index_select(&which, 0).and_then(|h| h.reshape(out_shape)).map_err(&ctx)?;
                (src + h).map_err(&ctx)?
            }
            ValueEncoder::Category { embedding, norm, n: nc } => {
                if let Some(bad) = vals.iter().find(|&&v| v < 0.0 || v as usize >= *nc) {
                    return Err(Error::Model { context: "encoding values".into(), detail: format!("value {bad} is outside the {nc} categories of value_encoder.embedding (is pad_value negative?)") });
                }
                let cat = Tensor::from_vec(vals.iter().map(|&v| v as u32).collect::<Vec<u32>>(), shape, &self.device).map_err(&ctx)?;
                let h = embedding.forward(&cat).and_then(|h| norm.forward(&h)).map_err(&ctx)?;
                (src + h).map_err(&ctx)?
            }
            ValueEncoder::Scaling => {
                let v = Tensor::from_vec(vals.to_vec(), shape, &self.device).and_then(|v| v.unsqueeze(D::Minus1)).map_err(&ctx)?;
                src.broadcast_mul(&v).map_err(&ctx)?
            }
        };
        Ok(x)
    }

    /// The L2-normalised `<cls>` outputs (row-major n x embsize) with the cells packed: their
    /// tokens end to end, no padding computed, each cell attending to its own tokens (the same
    /// result as `embed_padded`; for inference, the layers being fine-tuned run padded).
    pub fn embed_packed(&self, cells: &[&Cell]) -> Result<Vec<f32>> {
        if cells.is_empty() {
            return Ok(vec![]);
        }
        self.embed_packed_tensor(cells)?.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(model_err("running the scGPT transformer"))
    }

    /// As [`Self::embed_packed`], as an f32 `cells x d` tensor on the model's device (not read
    /// back; `Batches::run_lagged` reads it while the next batch runs).
    pub fn embed_packed_tensor(&self, cells: &[&Cell]) -> Result<Tensor> {
        let ctx = model_err("running the scGPT transformer");
        if cells.is_empty() {
            return Tensor::zeros((0, self.dim()), DType::F32, &self.device).map_err(&ctx);
        }
        let refs: Vec<&[u32]> = cells.iter().map(|c| c.genes.as_slice()).collect();
        let p = crate::nn::packed_bert::Packed::new(&refs);
        let t = p.tokens();
        let vals: Vec<f32> = cells.iter().flat_map(|c| c.values.iter().copied()).collect();
        debug_assert_eq!(vals.len(), t);
        // (set_precision keeps bf16_input only for the continuous value encoder)
        let x = match &self.bf16_input {
            Some(b) => {
                // the value encoder's rows: made once for binned values (nothing to upload or
                // run a batch), else for the batch's distinct values; then one kernel
                let (table, which) = match bin_rows(&vals, self.args.n_bins, self.args.pad_value) {
                    Some(which) => (b.bins.clone(), which),
                    None => {
                        let (table, which) = self.value_table(&vals)?;
                        (table.to_dtype(DType::BF16).map_err(&ctx)?, which)
                    }
                };
                crate::gpu::embedding::norm_add(&b.genes, &b.norm_weight, &b.norm_bias, self.enc_norm.eps(), &table, &p.ids, &which).map_err(&ctx)?
            }
            None => {
                let ids = Tensor::new(p.ids.as_slice(), &self.device).and_then(|t| t.unsqueeze(0)).map_err(&ctx)?;
                self.encode_input(&ids, &vals)?.squeeze(0).and_then(|x| x.to_dtype(self.precision())).map_err(&ctx)?
            }
        };
        let h = self.packed.forward(&x, &p.cu).map_err(&ctx)?;
        let cls = p.first_rows(&h).and_then(|c| c.to_dtype(DType::F32)).map_err(&ctx)?;
        let norm = cls.sqr().and_then(|t| t.sum_keepdim(D::Minus1)).and_then(|t| t.sqrt()).map_err(&ctx)?;
        cls.broadcast_div(&norm).map_err(&ctx)
    }

    /// One batch's L2-normalised `<cls>` outputs: packed for inference, padded (differentiable)
    /// when layers are being fine-tuned.
    pub fn embed_batch(&self, cells: &[&Cell]) -> Result<Vec<f32>> {
        if self.first_trained == usize::MAX {
            self.embed_packed(cells)
        } else {
            self.embed_padded(cells)
        }
    }

    /// As [`Self::embed_batch`], as an f32 `cells x d` tensor: on the model's device when
    /// packed (not read back yet), on the CPU when padded.
    pub fn embed_batch_tensor(&self, cells: &[&Cell]) -> Result<Tensor> {
        if self.first_trained == usize::MAX {
            self.embed_packed_tensor(cells)
        } else {
            let n = cells.len();
            Tensor::from_vec(self.embed_padded(cells)?, (n, self.dim()), &Device::Cpu).map_err(model_err("running the scGPT transformer"))
        }
    }

    /// Embed cells in batches of `batch_size`, longest first so that each batch pads little;
    /// rows come back in the cells' order. `progress` is told of each batch's size.
    pub fn embed(&self, cells: &[Cell], batch_size: usize, mut progress: impl FnMut(usize)) -> Result<Vec<f32>> {
        let d = self.dim();
        let mut order: Vec<usize> = (0..cells.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(cells[i].genes.len()));
        let mut out = vec![0f32; cells.len() * d];
        // each batch's embeddings read back while the next one runs (gpu::readback)
        let batch = |chunk: &[usize]| self.embed_batch_tensor(&chunk.iter().map(|&i| &cells[i]).collect::<Vec<_>>());
        crate::gpu::readback::embed_in_order(&mut out, d, &order, batch_size, batch, &mut progress, model_err("reading the scGPT embeddings back"))?;
        Ok(out)
    }
}

/// The checkpoint tensors embedding reads, with their shapes for `args` and a vocabulary of
/// `genes` entries (from_parts checks the names, Model::random draws the tensors; the category
/// value table's rows, 0 here, come from the checkpoint: random draws only "continuous").
fn tensor_shapes(args: &Args, genes: usize) -> Vec<(String, Vec<usize>)> {
    let (d, h) = (args.embsize, args.d_hid);
    let mut shapes: Vec<(String, Vec<usize>)> = vec![("encoder.embedding.weight".into(), vec![genes, d]), ("encoder.enc_norm.weight".into(), vec![d]), ("encoder.enc_norm.bias".into(), vec![d])];
    let ve = |p: &str, s: Vec<usize>| (format!("value_encoder.{p}"), s);
    match args.input_emb_style.as_str() {
        "continuous" => shapes.extend([
            ve("linear1.weight", vec![d, 1]),
            ve("linear1.bias", vec![d]),
            ve("linear2.weight", vec![d, d]),
            ve("linear2.bias", vec![d]),
            ve("norm.weight", vec![d]),
            ve("norm.bias", vec![d]),
        ]),
        "category" => shapes.extend([ve("embedding.weight", vec![0, d]), ve("enc_norm.weight", vec![d]), ve("enc_norm.bias", vec![d])]),
        _ => {}
    }
    for i in 0..args.nlayers {
        let l = |p: &str, s: Vec<usize>| (format!("transformer_encoder.layers.{i}.{p}"), s);
        shapes.extend([
            l("self_attn.in_proj_weight", vec![3 * d, d]),
            l("self_attn.in_proj_bias", vec![3 * d]),
            l("self_attn.out_proj.weight", vec![d, d]),
            l("self_attn.out_proj.bias", vec![d]),
            l("linear1.weight", vec![h, d]),
            l("linear1.bias", vec![h]),
            l("linear2.weight", vec![d, h]),
            l("linear2.bias", vec![d]),
            l("norm1.weight", vec![d]),
            l("norm1.bias", vec![d]),
            l("norm2.weight", vec![d]),
            l("norm2.bias", vec![d]),
        ]);
    }
    shapes
}

/// The layers as one post-norm stack (the same tensors, float32).
fn packed_stack(layers: &[EncoderLayer], heads: usize) -> TransformerStack {
    TransformerStack::new(layers.iter().map(EncoderLayer::post_norm).collect(), heads, 1e-5, Act::Relu)
}

fn missing_key(k: &str, tensors: &HashMap<String, Tensor>) -> String {
    let mut some: Vec<&String> = tensors.keys().collect();
    some.sort();
    let shown: Vec<&str> = some.iter().take(6).map(|s| s.as_str()).collect();
    format!(
        "has no tensor `{k}` (a scGPT TransformerModel state_dict has it; flash-attn's self_attn.Wqkv names are accepted). It holds {} tensors: {}{}",
        tensors.len(),
        shown.join(", "),
        if tensors.len() > shown.len() { ", ..." } else { "" }
    )
}

/// The checkpoint folder for a weights folder, from the manifest entry of best_model.pt.
pub fn model_dir(weights_dir: &Path, manifest: &crate::weights::Manifest) -> PathBuf {
    let file = manifest.weights.get(MODEL_ENTRY).map(|e| e.file.clone()).unwrap_or_else(|| "scgpt/whole_human/best_model.pt".into());
    weights_dir.join(file).parent().map(Path::to_path_buf).unwrap_or_else(|| weights_dir.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_values_index_every_value_once() {
        let (d, w) = distinct_values([-2.0f32, 3.0, 0.0, 3.0, 50.0, -2.0, 0.0].into_iter());
        assert_eq!(d, vec![-2.0, 3.0, 0.0, 50.0]);
        assert_eq!(w, vec![0, 1, 2, 1, 3, 0, 2]);
        assert!(w.iter().zip([-2.0f32, 3.0, 0.0, 3.0, 50.0, -2.0, 0.0]).all(|(&i, v)| d[i as usize] == v));
        assert_eq!(distinct_values(std::iter::empty()), (vec![], vec![]));
    }

    #[test]
    fn binned_values_index_the_bin_table() {
        // bins 0 .. 50 are rows 0 .. 50, pad_value row 51; capped as the encoder sees values
        assert_eq!(bin_rows(&[-2.0, 0.0, 50.0, 7.0, -0.0], 51, -2.0), Some(vec![51, 0, 50, 7, 0]));
        assert_eq!(bin_rows(&[600.0, 3.0], 51, 900.0), Some(vec![51, 3]));
        assert_eq!(bin_rows(&[], 51, -2.0), Some(vec![]));
        // anything else makes the batch's own table
        for bad in [51.0, 2.5, -1.0, f32::NAN] {
            assert_eq!(bin_rows(&[1.0, bad], 51, -2.0), None, "{bad}");
        }
    }

    /// The value encoder run once a distinct value and gathered gives what running it on every
    /// token gives (the parity tests against upstream's fixtures check the whole model).
    #[test]
    fn value_encoder_table_matches_per_token() {
        let dev = Device::Cpu;
        let d = 8;
        let vb = VarBuilder::from_tensors(
            [
                ("l1.weight", Tensor::randn(0f32, 1.0, (d, 1), &dev).unwrap()),
                ("l1.bias", Tensor::randn(0f32, 1.0, d, &dev).unwrap()),
                ("l2.weight", Tensor::randn(0f32, 1.0, (d, d), &dev).unwrap()),
                ("l2.bias", Tensor::randn(0f32, 1.0, d, &dev).unwrap()),
                ("n.weight", Tensor::ones(d, DType::F32, &dev).unwrap()),
                ("n.bias", Tensor::zeros(d, DType::F32, &dev).unwrap()),
            ]
            .into_iter()
            .map(|(k, t)| (k.to_string(), t))
            .collect(),
            DType::F32,
            &dev,
        );
        let (l1, l2, n) = (candle_nn::linear(1, d, vb.pp("l1")).unwrap(), candle_nn::linear(d, d, vb.pp("l2")).unwrap(), candle_nn::layer_norm(d, 1e-5, vb.pp("n")).unwrap());
        let mlp = |v: &Tensor| l1.forward(v).and_then(|h| h.relu()).and_then(|h| l2.forward(&h)).and_then(|h| n.forward(&h)).unwrap();
        let vals = [-2.0f32, 7.0, 0.0, 7.0, 50.0, 1.0, -2.0];
        let per_token = mlp(&Tensor::new(&vals, &dev).unwrap().unsqueeze(1).unwrap());
        let (distinct, which) = distinct_values(vals.into_iter());
        let table = mlp(&Tensor::from_vec(distinct.clone(), (distinct.len(), 1), &dev).unwrap());
        let gathered = table.index_select(&Tensor::new(which.as_slice(), &dev).unwrap(), 0).unwrap();
        let diff = (per_token - gathered).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-5, "{diff}");
        assert_eq!(table.dims(), &[5, d]);
    }

    #[test]
    fn mt19937_matches_numpy() {
        // the first outputs of MT19937 seeded with 5489 (the reference implementation's default)
        let mut r = Mt19937::new(5489);
        assert_eq!(r.next_u32(), 3499211612);
        assert_eq!(r.next_u32(), 581869302);
        // np.random.seed(0); np.random.rand() == 0.5488135039273248
        let mut r = Mt19937::new(0);
        assert_eq!(r.next_f64(), 0.5488135039273248);
        assert_eq!(r.next_f64(), 0.7151893663724195);
    }

    #[test]
    fn quantiles_as_numpy() {
        // np.quantile(np.float32([1, 2, 3, 4]), np.linspace(0, 1, 5)) == [1, 1.75, 2.5, 3.25, 4]
        assert_eq!(quantile_edges(&[4.0, 1.0, 3.0, 2.0], 5), vec![1.0, 1.75, 2.5, 3.25, 4.0]);
        assert_eq!(quantile_edges(&[7.0], 4), vec![7.0; 4]);
    }

    #[test]
    fn binning_spreads_ties_and_keeps_range() {
        let vals: Vec<f32> = (0..200).map(|i| (i % 7 + 1) as f32).collect();
        let mut r = Mt19937::new(3);
        let b = bin_values(&vals, 51, &mut r);
        assert!(b.iter().all(|&x| (1.0..=50.0).contains(&x)));
        // a single value equals all 50 edges: its bin is drawn from 1..=50
        let b = bin_values(&[5.0], 51, &mut Mt19937::new(1))[0];
        assert!((1.0..=50.0).contains(&b));
        // distinct values: the largest is in bin 50, the smallest in bin 1 or 0..
        let b = bin_values(&[1.0, 2.0, 3.0], 51, &mut Mt19937::new(1));
        assert_eq!(b[2], 50.0);
    }

    #[test]
    fn flash_attention_keys_are_renamed() {
        assert_eq!(upstream_key("transformer_encoder.layers.3.self_attn.Wqkv.weight"), "transformer_encoder.layers.3.self_attn.in_proj_weight");
        assert_eq!(upstream_key("transformer_encoder.layers.0.self_attn.Wqkv.bias"), "transformer_encoder.layers.0.self_attn.in_proj_bias");
        assert_eq!(upstream_key("transformer_encoder.layers.0.self_attn._impl.Wqkv.bias"), "transformer_encoder.layers.0.self_attn.in_proj_bias");
        assert_eq!(upstream_key("transformer_encoder.layers.0.self_attn._impl.out_proj.weight"), "transformer_encoder.layers.0.self_attn.out_proj.weight");
        assert_eq!(upstream_key("transformer_encoder.layers.0.self_attn.out_proj.weight"), "transformer_encoder.layers.0.self_attn.out_proj.weight");
        assert_eq!(upstream_key("encoder.embedding.weight"), "encoder.embedding.weight");
    }

    #[test]
    fn args_name_the_missing_field() {
        let p = Path::new("ckpt/args.json");
        let e = Args::parse(r#"{"embsize": 8, "nheads": 2, "nlayers": 1, "pad_token": "<pad>", "pad_value": -2}"#, p).unwrap_err();
        assert_eq!(e.to_string(), "ckpt/args.json: d_hid: missing (scGPT's embed_data reads it)");
        let a = Args::parse(r#"{"embsize": 8, "nheads": 2, "d_hid": 4, "nlayers": 1, "pad_token": "<pad>", "pad_value": -2}"#, p).unwrap();
        assert_eq!((a.n_bins, a.input_emb_style.as_str(), a.pad_value), (51, "continuous", -2.0));
    }

    #[test]
    fn vocab_appends_missing_specials() {
        let v = Vocab::parse(r#"{"A": 0, "<pad>": 1, "B": 2}"#, Path::new("v.json")).unwrap();
        assert_eq!((v.get("<cls>"), v.get("<eoc>"), v.len), (Some(3), Some(4), 5));
        assert!(Vocab::parse(r#"{"A": 0, "B": 0}"#, Path::new("v.json")).is_err());
    }

    #[test]
    fn tokenizer_prepends_cls_and_samples_long_cells() {
        let t = Tokenizer { cls_id: 9, pad_id: 8, pad_value: -2.0, n_bins: 51, max_len: 3 };
        let ids = [Some(0), None, Some(2), Some(3), Some(4)];
        // unsorted indices, a stored zero, a gene outside the vocab
        let c = t.cell(&[2, 0, 1, 4], &[5.0, 1.0, 7.0, 0.0], &ids, 0, 0);
        assert_eq!(c.genes, vec![9, 0, 2]);
        assert_eq!(c.values[0], -2.0);
        assert!(!c.sampled);
        let c = t.cell(&[0, 2, 3, 4], &[1.0, 2.0, 3.0, 4.0], &ids, 0, 0);
        assert_eq!((c.genes.len(), c.genes[0], c.sampled), (3, 9, true));
        let empty = t.cell(&[1], &[3.0], &ids, 0, 0);
        assert_eq!((empty.genes, empty.values), (vec![9], vec![-2.0]));
    }
}
