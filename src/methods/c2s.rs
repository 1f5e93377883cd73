//! Cell2Sentence (C2S): Levine D, Rizvi SA, Levy S, et al., "Cell2Sentence: Teaching Large
//! Language Models the Language of Biology", ICML 2024, doi:10.1101/2023.09.11.557287; upstream
//! code https://github.com/vandijklab/cell2sentence (`src/cell2sentence/utils.py`
//! generate_vocabulary and generate_sentences, `prompt_formatter.py` PromptFormatter,
//! `csmodel.py` CSModel.embed_cells_batched, `tasks.py` embed_cells; read at commit b2bea70).
//! The language model is a Pythia checkpoint (Biderman S et al., "Pythia", ICML 2023,
//! arXiv:2304.01373), GPT-NeoX as Hugging Face transformers' `GPTNeoXForCausalLM` runs it.
//!
//! Cell sentences (generate_vocabulary, generate_sentences): every gene is named by its var name
//! upper-cased; numpy's global RNG is seeded once (`np.random.seed(42)`), then for each cell in
//! order its stored entries (CSR `data`, explicit zeros included; a dense matrix keeps its
//! non-zeros) are shuffled by `sklearn.utils.shuffle` (a legacy `RandomState.shuffle` of
//! `arange(n)`) and ordered by `argsort(-values, kind="stable")`: highest value first, ties in
//! the shuffled order. The words are joined with single spaces.
//!
//! Prompts (PromptFormatter("cell_type_prediction", top_k_genes).format_hf_ds): the sentence is
//! cut to its first k words (`split(" ")[:k]`), Python's `random` is seeded once
//! (`random.seed(42)`) and each cell in order takes `random.choice` of the 15 templates of
//! `prompts/single_cell_cell_type_prediction_prompts.json`, filled with `num_genes` (k, whatever
//! the cell's gene count), `organism` (the dataset's `organism` column) and `cell_sentence`.
//!
//! Embedding (CSModel.embed_cells_batched): the prompt is tokenized by the model's tokenizer
//! (GPT-NeoX byte-level BPE, no special tokens added), run through the causal LM with
//! `output_hidden_states=True`, and the cell embedding is `hidden_states[-1][i].mean(0)`: the
//! last layer's output after `final_layer_norm`, averaged over the sequence.
//!
//! GPT-NeoX (modeling_gpt_neox.py): token embedding `embed_in` (no position embedding); per
//! layer, attention on `input_layernorm(x)`: fused `query_key_value` laid out per head
//! (q, k, v of each head side by side), rotary embeddings (rotate-half form, base
//! `rotary_emb_base`) on the first `rotary_pct` of each head's dims, causal softmax attention
//! scaled by 1/sqrt(head size), `dense`; MLP `dense_h_to_4h`, GELU, `dense_4h_to_h` on
//! `post_attention_layernorm(x)`; residual x + attn + mlp (`use_parallel_residual`, Pythia's) or
//! sequential (x + attn, then + mlp of its norm); then `final_layer_norm`.
//!
//! Departure, batches: upstream pads each batch on the left (pad = eos) but gives every row the
//! positions 0..T-1 and averages over all T rows, padding included, so a cell's embedding depends
//! on its batch (scripts/c2s_reference.py measures up to 19% relative difference at batch 8). We
//! pack a batch's prompts end to end without padding (causal attention within each prompt,
//! rotary positions from each one's start) and average each cell over its own tokens: every cell
//! gets upstream's embedding for that cell alone (a batch of one), whatever the batch size.
//!
//! The layers run as the shared transformer stack (`nn::transformer`, parallel or pre-norm order,
//! causal, rotary): candle's ops in float32 anywhere, and in bf16 on a GPU (`--precision bf16`,
//! the GPU default) the fused path of `gpu::fused_encoder` with the causal attention kernel.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Embedding, LayerNorm, Linear, VarBuilder};
use serde::Deserialize;

use crate::error::{Error, Result};
use crate::formats::numpy_rng::{Mt19937, RngState};
use crate::nn::rotary::Rotary;
use crate::nn::transformer::{Act, TransformerLayer, TransformerStack};

/// The registry's weights entries (methods/c2s.toml).
pub const REQUIRED_ENTRIES: &[&str] = &["c2s-pythia-410m-ctp-config", "c2s-pythia-410m-ctp-model", "c2s-pythia-410m-ctp-tokenizer"];
/// Upstream's seed of both RNGs (generate_sentences' random_state, PromptFormatter's random_seed).
pub const UPSTREAM_SEED: u64 = 42;
/// The organism written into the prompt when the data has no `organism` column.
pub const DEFAULT_ORGANISM: &str = "Homo sapiens";

/// `prompts/single_cell_cell_type_prediction_prompts.json` "model_input", in upstream's order.
pub const TEMPLATES: [&str; 15] = [
    "The following is a list of {num_genes} gene names ordered by descending expression level in a {organism} cell. Your task is to give the cell type which this cell belongs to based on its gene expression.\nCell sentence: {cell_sentence}.\nThe cell type corresponding to these genes is:",
    "Below is a list of {num_genes} gene names in order of descending expression level from a {organism} cell. Based on this, predict what the cell type of this cell is.\nCell sentence: {cell_sentence}.\nThese genes are most likely associated with cell type:",
    "Given the list of {num_genes} gene names ordered by descending expression level from a {organism} cell, identify the cell type.\nCell sentence: {cell_sentence}.\nThe probable cell type for these genes is:",
    "Analyze the following list of {num_genes} genes sorted by decreasing expression levels in a {organism} cell and determine its cell type.\nCell sentence: {cell_sentence}.\nBased on these genes, the corresponding cell type is:",
    "From the list of {num_genes} gene names ordered by decreasing expression level in a {organism} cell, infer the cell type of the cell.\nCell sentence: {cell_sentence}.\nThese genes suggest the cell type is most likely:",
    "The {num_genes} gene names below are listed by descending expression level in a {organism} cell. Predict the cell type based on this information.\nCell sentence: {cell_sentence}.\nThese genes are indicative of cell type:",
    "Below is a list of {num_genes} gene names sorted by descending expression in a {organism} cell. Determine the cell type of this cell from its expressed genes.\nCell sentence: {cell_sentence}.\nThe associated cell type for these genes appears to be:",
    "The following list contains {num_genes} gene names ordered by descending expression level in a {organism} cell. Deduce the cell type based on this.\nCell sentence: {cell_sentence}.\nThese genes typically correspond to cell type:",
    "Here is a list of {num_genes} genes in order of descending expression level from a {organism} cell. Identify the cell type of this cell based on this information.\nCell sentence: {cell_sentence}.\nThe expected cell type based on these genes is:",
    "Examine the list of {num_genes} gene names sorted by decreasing expression in a {organism} cell, and from this, identify its cell type.\nCell sentence: {cell_sentence}.\nThese genes are commonly found in cell type:",
    "The {num_genes} gene names below are arranged by descending expression level in a {organism} cell. Determine the cell type of this cell.\nCell sentence: {cell_sentence}.\nThe cell type that these genes are most commonly linked with is:",
    "Here is a list of {num_genes} genes ordered by expression level in a {organism} cell. Based on this information, identify the cell type.\nCell sentence: {cell_sentence}.\nBased on the expression levels, the cell type would likely be:",
    "From the list of {num_genes} gene names sorted by decreasing expression levels in a {organism} cell, predict the cell type.\nCell sentence: {cell_sentence}.\nThe genes provided are most commonly expressed in cell type:",
    "Below is a list of {num_genes} genes ordered by descending expression in a {organism} cell. Use this information to determine the cell type.\nCell sentence: {cell_sentence}.\nThese genes suggest the cell type is most likely:",
    "The {num_genes} gene names below are listed by descending expression levels in a {organism} cell. Based on this, predict the cell type.\nCell sentence: {cell_sentence}.\nThe cell type corresponding to these genes is:",
];

// ------------------------------------------------------------------------------- sentences

/// Genes of one cell (column indices) in sentence order: the stored entries shuffled by the
/// global numpy RNG (`sklearn.utils.shuffle`), then a stable sort by descending value (NaN last,
/// as numpy sorts it).
pub fn ranked_genes(idx: &[u32], vals: &[f32], rng: &mut Mt19937) -> Vec<u32> {
    let perm = rng.permutation(idx.len());
    let mut order: Vec<usize> = perm;
    order.sort_by(|&a, &b| {
        let (x, y) = (vals[a], vals[b]);
        match (x.is_nan(), y.is_nan()) {
            (false, false) => y.partial_cmp(&x).unwrap_or(std::cmp::Ordering::Equal),
            (a_nan, b_nan) => a_nan.cmp(&b_nan),
        }
    });
    order.into_iter().map(|k| idx[k]).collect()
}

/// The whole cell sentence: the ranked genes' upper-cased names joined by spaces.
pub fn cell_sentence(ranked: &[u32], upper_names: &[String]) -> String {
    ranked.iter().map(|&j| upper_names[j as usize].as_str()).collect::<Vec<_>>().join(" ")
}

/// `" ".join(sentence.split(" ")[:k])`.
pub fn first_words(sentence: &str, k: usize) -> String {
    sentence.split(' ').take(k).collect::<Vec<_>>().join(" ")
}

/// numpy's legacy RNG as `np.random.seed(seed)` leaves it; `--seed` must fit in 32 bits, as there.
pub fn numpy_rng(seed: u64) -> Result<Mt19937> {
    let s = u32::try_from(seed).map_err(|_| Error::BadOption {
        option: "--seed".into(),
        detail: format!("{seed} does not fit in 32 bits; Cell2Sentence seeds numpy's RandomState with it"),
        hint: Some("use a seed below 4294967296 (upstream's is 42)".into()),
    })?;
    Ok(Mt19937::new(s))
}

/// CPython's `random` module after `random.seed(seed)` for a non-negative int seed.
#[derive(Clone)]
pub struct PyRandom(Mt19937);

impl PyRandom {
    pub fn new(seed: u64) -> PyRandom {
        let key: Vec<u32> = if seed >> 32 == 0 { vec![seed as u32] } else { vec![seed as u32, (seed >> 32) as u32] };
        PyRandom(Mt19937::by_array(&key))
    }

    /// `random.getrandbits(k)` for 1 <= k <= 32.
    fn getrandbits(&mut self, k: u32) -> u32 {
        self.0.next_u32() >> (32 - k)
    }

    /// The index `random.choice(seq)` takes for a sequence of `n` >= 1 items (`_randbelow`:
    /// rejection sampling on n.bit_length() random bits).
    pub fn choice_index(&mut self, n: usize) -> usize {
        let k = usize::BITS - n.leading_zeros();
        loop {
            let r = self.getrandbits(k) as usize;
            if r < n {
                return r;
            }
        }
    }
}

/// `template.format(num_genes=, organism=, cell_sentence=)` in one pass (the values are not
/// read again for placeholders, as str.format).
pub fn fill(template: &str, num_genes: usize, organism: &str, sentence: &str) -> String {
    let n = num_genes.to_string();
    let mut out = String::with_capacity(template.len() + sentence.len() + 32);
    let mut rest = template;
    while let Some(i) = rest.find('{') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        let (val, len) = if tail.starts_with("{num_genes}") {
            (n.as_str(), "{num_genes}".len())
        } else if tail.starts_with("{organism}") {
            (organism, "{organism}".len())
        } else if tail.starts_with("{cell_sentence}") {
            (sentence, "{cell_sentence}".len())
        } else {
            ("{", 1)
        };
        out.push_str(val);
        rest = &tail[len..];
    }
    out.push_str(rest);
    out
}

/// Where a [`Prompter`]'s two streams stand (a sharded run's shard starts mid-stream).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PrompterState {
    pub numpy: RngState,
    pub python: RngState,
}

/// Prompts of cells in data order: the two upstream RNG streams, advanced cell by cell.
pub struct Prompter {
    numpy: Mt19937,
    python: PyRandom,
    upper: Vec<String>,
    pub top_genes: usize,
}

impl Prompter {
    /// `var_names` are the genes' names as in the data; `seed` seeds both RNGs.
    pub fn new(var_names: &[String], top_genes: usize, seed: u64) -> Result<Prompter> {
        Ok(Prompter { numpy: numpy_rng(seed)?, python: PyRandom::new(seed), upper: var_names.iter().map(|n| n.to_uppercase()).collect(), top_genes })
    }

    /// The next cell's whole sentence (the numpy stream moves on by the cell's stored entries).
    pub fn sentence(&mut self, idx: &[u32], vals: &[f32]) -> String {
        let ranked = ranked_genes(idx, vals, &mut self.numpy);
        cell_sentence(&ranked, &self.upper)
    }

    /// Both streams' states (numpy's, CPython's), to resume from with [`Prompter::restore`].
    pub fn rng_state(&self) -> PrompterState {
        PrompterState { numpy: self.numpy.state(), python: self.python.0.state() }
    }

    /// Resume both streams from `s`; false (nothing changed) for a state that is not one.
    pub fn restore(&mut self, s: &PrompterState) -> bool {
        match (Mt19937::from_state(&s.numpy), Mt19937::from_state(&s.python)) {
            (Some(n), Some(p)) => {
                self.numpy = n;
                self.python = PyRandom(p);
                true
            }
            _ => false,
        }
    }

    /// The next cell's prompt (the template stream moves on by one choice).
    pub fn prompt(&mut self, sentence: &str, organism: &str) -> String {
        let t = TEMPLATES[self.python.choice_index(TEMPLATES.len())];
        fill(t, self.top_genes, organism, &first_words(sentence, self.top_genes))
    }
}

/// Upper-cased names that more than one var name maps to (upstream's vocabulary keeps one entry
/// per upper-cased name, which shifts its index-to-name list: see docs/c2s.md).
pub fn upper_case_collisions(var_names: &[String]) -> Vec<String> {
    let mut seen = std::collections::HashMap::<String, usize>::new();
    for n in var_names {
        *seen.entry(n.to_uppercase()).or_default() += 1;
    }
    let mut d: Vec<String> = seen.into_iter().filter(|(_, c)| *c > 1).map(|(n, _)| n).collect();
    d.sort();
    d
}

// ------------------------------------------------------------------------------- tokenizer

/// The model's tokenizer.json, read by the `tokenizers` crate.
pub struct C2sTokenizer {
    tok: tokenizers::Tokenizer,
}

impl C2sTokenizer {
    pub fn load(path: &Path) -> Result<C2sTokenizer> {
        if !path.is_file() {
            return Err(Error::MissingFile { path: path.into() });
        }
        let tok = tokenizers::Tokenizer::from_file(path).map_err(|e| Error::BadWeights { path: path.into(), detail: format!("is not a Hugging Face tokenizer.json: {e}") })?;
        Ok(C2sTokenizer { tok })
    }

    /// Token ids of a prompt as upstream's tokenizer call gives them (GPTNeoXTokenizerFast adds
    /// no BOS/EOS by default).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.tok.encode(text, false).map_err(|e| Error::Model { context: "tokenizing a cell prompt".into(), detail: e.to_string() })?;
        Ok(enc.get_ids().to_vec())
    }
}

// ---------------------------------------------------------------------------------- model

fn default_rotary_pct() -> f64 {
    0.25
}
fn default_base() -> f64 {
    10000.0
}
fn default_eps() -> f64 {
    1e-5
}
fn default_true() -> bool {
    true
}
fn default_act() -> String {
    "gelu".into()
}

#[derive(Debug, Clone, Deserialize, Default)]
struct RopeParameters {
    rope_theta: Option<f64>,
    partial_rotary_factor: Option<f64>,
    rope_type: Option<String>,
}

/// GPT-NeoX's config.json, with transformers 4's key names (rotary_pct, rotary_emb_base) and
/// transformers 5's (rope_parameters) both read.
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    #[serde(default)]
    pub model_type: Option<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default = "default_rotary_pct")]
    pub rotary_pct: f64,
    #[serde(default = "default_base")]
    pub rotary_emb_base: f64,
    #[serde(default)]
    rope_parameters: Option<RopeParameters>,
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    #[serde(default = "default_true")]
    pub use_parallel_residual: bool,
    #[serde(default = "default_true")]
    pub attention_bias: bool,
    #[serde(default)]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

impl Config {
    /// Pythia-160M (EleutherAI/pythia-160m config.json; legacy pythia-160m-c2s is this size).
    pub fn pythia_160m() -> Config {
        Config::preset(768, 12, 12, 3072)
    }

    /// Pythia-410M (EleutherAI/pythia-410m; C2S-Pythia-410m-cell-type-prediction).
    pub fn pythia_410m() -> Config {
        Config::preset(1024, 24, 16, 4096)
    }

    fn preset(hidden: usize, layers: usize, heads: usize, ffn: usize) -> Config {
        Config {
            model_type: Some("gpt_neox".into()),
            vocab_size: 50304,
            hidden_size: hidden,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            intermediate_size: ffn,
            hidden_act: "gelu".into(),
            rotary_pct: 0.25,
            rotary_emb_base: 10000.0,
            rope_parameters: None,
            rope_scaling: None,
            layer_norm_eps: 1e-5,
            use_parallel_residual: true,
            attention_bias: true,
            max_position_embeddings: 2048,
            tie_word_embeddings: false,
        }
    }

    /// Read and check config.json.
    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path).map_err(|e| if e.kind() == std::io::ErrorKind::NotFound { Error::MissingFile { path: path.into() } } else { Error::Io { path: path.into(), source: e } })?;
        let bad = |field: &str, detail: String, hint: Option<&str>| Error::BadField { path: path.into(), field: field.into(), detail, hint: hint.map(str::to_string) };
        let mut c: Config = serde_json::from_str(&text).map_err(|e| bad("config.json", format!("is not a GPT-NeoX config: {e}"), Some("Cell2Sentence needs the model folder's config.json from Hugging Face (model_type gpt_neox)")))?;
        if let Some(t) = &c.model_type {
            if t != "gpt_neox" {
                return Err(bad("model_type", format!("is {t:?}, not \"gpt_neox\""), Some("scfoundry's c2s runs Pythia (GPT-NeoX) checkpoints, as the released C2S models are")));
            }
        }
        if let Some(r) = c.rope_parameters.take() {
            if let Some(t) = r.rope_type.as_deref() {
                if t != "default" {
                    return Err(bad("rope_parameters.rope_type", format!("is {t:?}; only the default rotary embedding is implemented"), None));
                }
            }
            if let Some(b) = r.rope_theta {
                c.rotary_emb_base = b;
            }
            if let Some(p) = r.partial_rotary_factor {
                c.rotary_pct = p;
            }
        }
        if let Some(v) = &c.rope_scaling {
            if !v.is_null() {
                return Err(bad("rope_scaling", format!("is {v}; only unscaled rotary embeddings are implemented"), None));
            }
        }
        if c.num_attention_heads == 0 || c.hidden_size % c.num_attention_heads != 0 {
            return Err(bad("num_attention_heads", format!("{} does not divide hidden_size {}", c.num_attention_heads, c.hidden_size), None));
        }
        if activation(&c.hidden_act).is_none() {
            return Err(bad("hidden_act", format!("{:?} is not implemented (gelu, gelu_new, gelu_fast, gelu_pytorch_tanh, relu)", c.hidden_act), None));
        }
        let rot = c.rotary_dims();
        if rot % 2 != 0 {
            return Err(bad("rotary_pct", format!("gives {rot} rotary dims per head, an odd number"), None));
        }
        Ok(c)
    }

    pub fn head_size(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// `int(head_size * rotary_pct)`.
    pub fn rotary_dims(&self) -> usize {
        (self.head_size() as f64 * self.rotary_pct) as usize
    }
}

fn activation(name: &str) -> Option<Act> {
    match name {
        "gelu" => Some(Act::GeluErf),
        "gelu_new" | "gelu_fast" | "gelu_pytorch_tanh" => Some(Act::GeluTanh),
        "relu" => Some(Act::Relu),
        _ => None,
    }
}

/// One GPT-NeoX layer as the shared transformer layer: `query_key_value`'s rows, laid out per
/// head (q, k, v of head 0, then of head 1, ...), reordered to `[q heads | k heads | v heads]`;
/// `input_layernorm` is norm1, `post_attention_layernorm` norm2.
fn layer(c: &Config, vb: VarBuilder) -> candle_core::Result<TransformerLayer> {
    let h = c.hidden_size;
    let (nh, hs) = (c.num_attention_heads, c.head_size());
    let lin = |i: usize, o: usize, bias: bool, vb: VarBuilder| if bias { candle_nn::linear(i, o, vb) } else { candle_nn::linear_no_bias(i, o, vb) };
    let qkv = lin(h, 3 * h, c.attention_bias, vb.pp("attention.query_key_value"))?;
    let w = qkv.weight().reshape((nh, 3, hs, h))?.transpose(0, 1)?.contiguous()?.reshape((3 * h, h))?;
    let b = qkv.bias().map(|b| b.reshape((nh, 3, hs))?.transpose(0, 1)?.contiguous()?.reshape(3 * h)).transpose()?;
    let dense = lin(h, h, c.attention_bias, vb.pp("attention.dense"))?;
    // the fused path wants every linear layer's bias: a model without attention biases gets zeros
    let zeros = |n: usize| Tensor::zeros(n, w.dtype(), w.device());
    let b = match b {
        Some(b) => b,
        None => zeros(3 * h)?,
    };
    let dense = match dense.bias() {
        Some(_) => dense,
        None => Linear::new(dense.weight().clone(), Some(zeros(h)?)),
    };
    Ok(TransformerLayer {
        qkv: Linear::new(w, Some(b)),
        out: dense,
        norm1: candle_nn::layer_norm(h, c.layer_norm_eps, vb.pp("input_layernorm"))?,
        ff1: candle_nn::linear(h, c.intermediate_size, vb.pp("mlp.dense_h_to_4h"))?,
        ff2: candle_nn::linear(c.intermediate_size, h, vb.pp("mlp.dense_4h_to_h"))?,
        norm2: candle_nn::layer_norm(h, c.layer_norm_eps, vb.pp("post_attention_layernorm"))?,
    })
}

/// A GPT-NeoX model (no LM head: C2S embeds from hidden states) on a device: the token
/// embedding and the layers in `dtype`, the final layer norm and the mean in float32.
pub struct GptNeoX {
    pub cfg: Config,
    embed: Embedding,
    stack: TransformerStack,
    final_norm: LayerNorm,
    pub dtype: DType,
    pub device: Device,
}

/// The weights file(s) of a model path: safetensors (one file or a `.index.json` of shards), or a
/// PyTorch pickle (`pytorch_model.bin`).
fn var_builder(path: &Path, dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
    if !path.is_file() {
        return Err(Error::MissingFile { path: path.into() });
    }
    let bad = |detail: String| Error::BadWeights { path: path.into(), detail };
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    if name.ends_with(".index.json") {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Io { path: path.into(), source: e })?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(format!("is not a safetensors index: {e}")))?;
        let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| bad("has no weight_map".into()))?;
        let mut files: Vec<PathBuf> = map.values().filter_map(|f| f.as_str()).map(|f| path.with_file_name(f)).collect();
        files.sort();
        files.dedup();
        for f in &files {
            if !f.is_file() {
                return Err(Error::MissingFile { path: f.clone() });
            }
        }
        // SAFETY: memory-mapped read-only; scfoundry does not modify weights while running.
        return unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, device) }.map_err(|e| bad(e.to_string()));
    }
    if name.ends_with(".safetensors") {
        // SAFETY: as above.
        return unsafe { VarBuilder::from_mmaped_safetensors(&[path], dtype, device) }.map_err(|e| bad(format!("is not a safetensors file: {e}")));
    }
    VarBuilder::from_pth(path, dtype, device).map_err(|e| bad(format!("is neither safetensors nor a PyTorch state_dict (pytorch_model.bin): {e}")))
}

impl GptNeoX {
    /// Load `config.json` and the weights file on `device` in `dtype`.
    pub fn load(config: &Path, weights: &Path, dtype: DType, device: Device) -> Result<GptNeoX> {
        let cfg = Config::load(config)?;
        // read in float32 (the final norm stays so), the embedding and layers then cast to dtype
        let vb = var_builder(weights, DType::F32, &device)?;
        let root = if vb.contains_tensor("gpt_neox.embed_in.weight") {
            vb.pp("gpt_neox")
        } else if vb.contains_tensor("embed_in.weight") {
            vb.clone()
        } else {
            return Err(Error::BadWeights {
                path: weights.into(),
                detail: "has no tensor `gpt_neox.embed_in.weight` (nor `embed_in.weight`): not a GPT-NeoX (Pythia) checkpoint as transformers saves GPTNeoXForCausalLM".into(),
            });
        };
        Self::build(cfg, root, dtype, device).map_err(|e| Error::BadWeights { path: weights.into(), detail: format!("does not fit {}: {e}", config.display()) })
    }

    /// Build from any var builder rooted at the `gpt_neox` module (tests, random weights); the
    /// weights are read in the var builder's dtype and the embedding and layers then held in
    /// `dtype`.
    pub fn build(cfg: Config, vb: VarBuilder, dtype: DType, device: Device) -> candle_core::Result<GptNeoX> {
        let embed = candle_nn::embedding(cfg.vocab_size, cfg.hidden_size, vb.pp("embed_in"))?;
        let layers = (0..cfg.num_hidden_layers).map(|i| layer(&cfg, vb.pp(format!("layers.{i}")))).collect::<candle_core::Result<Vec<_>>>()?;
        let norm = candle_nn::layer_norm(cfg.hidden_size, cfg.layer_norm_eps, vb.pp("final_layer_norm"))?;
        let final_norm = crate::nn::transformer::layer_norm_to_dtype(&norm, DType::F32, cfg.layer_norm_eps)?;
        let act = activation(&cfg.hidden_act).ok_or_else(|| candle_core::Error::Msg(format!("activation {}", cfg.hidden_act)))?;
        let rotary = Rotary::new(cfg.rotary_dims(), cfg.rotary_emb_base);
        let stack = TransformerStack::causal(layers, cfg.num_attention_heads, cfg.layer_norm_eps, act, cfg.use_parallel_residual, rotary).to_dtype(dtype)?;
        let embed = Embedding::new(embed.embeddings().to_dtype(dtype)?, cfg.hidden_size);
        Ok(GptNeoX { cfg, embed, stack, final_norm, dtype, device })
    }

    pub fn hidden(&self) -> usize {
        self.cfg.hidden_size
    }

    /// The same model with its embedding and layers in `dtype` (the final norm stays float32).
    pub fn to_dtype(&self, dtype: DType) -> candle_core::Result<GptNeoX> {
        Ok(GptNeoX {
            cfg: self.cfg.clone(),
            embed: Embedding::new(self.embed.embeddings().to_dtype(dtype)?, self.cfg.hidden_size),
            stack: self.stack.to_dtype(dtype)?,
            final_norm: self.final_norm.clone(),
            dtype,
            device: self.device.clone(),
        })
    }

    /// Last hidden states (after final_layer_norm, float32), `tokens x hidden`, of packed token
    /// sequences (`cu`: their offsets): causal attention within each, positions from each
    /// one's start.
    pub fn forward_packed(&self, ids: &[u32], cu: &[u32]) -> candle_core::Result<Tensor> {
        let ids = Tensor::from_slice(ids, ids.len(), &self.device)?;
        let x = self.embed.forward(&ids)?;
        let x = self.stack.forward(&x, cu)?;
        self.final_norm.forward(&x.to_dtype(DType::F32)?)
    }

    /// Cell embeddings (rows of `hidden` floats, in input order): the token sequences packed end
    /// to end (no padding), each one's last hidden states averaged over its own tokens.
    pub fn embed(&self, seqs: &[&[u32]]) -> Result<Vec<f32>> {
        if let Some(s) = seqs.iter().find(|s| s.iter().any(|&i| i as usize >= self.cfg.vocab_size)) {
            let bad = s.iter().find(|&&i| i as usize >= self.cfg.vocab_size).copied().unwrap_or(0);
            return Err(Error::Model { context: "embedding cell prompts".into(), detail: format!("token id {bad} is outside the model's vocabulary of {} (tokenizer.json and config.json disagree)", self.cfg.vocab_size) });
        }
        if seqs.iter().any(|s| s.is_empty()) {
            return Err(Error::Model { context: "embedding cell prompts".into(), detail: "a prompt has no tokens".into() });
        }
        let run = || -> candle_core::Result<Vec<f32>> {
            let mut cu = Vec::with_capacity(seqs.len() + 1);
            cu.push(0u32);
            for s in seqs {
                cu.push(cu[cu.len() - 1] + s.len() as u32);
            }
            let h = self.forward_packed(&seqs.concat(), &cu)?;
            let spans: Vec<(usize, usize)> = cu.windows(2).map(|w| (w[0] as usize, (w[1] - w[0]) as usize)).collect();
            crate::gpu::segment_pool::mean_spans(&h, &spans)?.flatten_all()?.to_vec1::<f32>()
        };
        run().map_err(|e| Error::Model { context: "running the GPT-NeoX model".into(), detail: e.to_string() })
    }
}

/// FLOPs of one forward pass over `s` tokens (matmuls only), as the bench binary (src/bin/scfoundry-bench) counts them:
/// L x (2 s (4 d^2 + 2 d f) + 4 s^2 d); causal attention is counted whole, as PyTorch runs it.
pub fn forward_flops(c: &Config, s: usize) -> f64 {
    crate::nn::cell_flops(c.num_hidden_layers, c.hidden_size, c.intermediate_size, s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_random_matches_cpython() {
        // python3 -c "import random; random.seed(42); print([random.choice(range(15)) for _ in range(12)])"
        let mut r = PyRandom::new(42);
        let got: Vec<usize> = (0..12).map(|_| r.choice_index(15)).collect();
        assert_eq!(got, vec![10, 1, 0, 11, 4, 3, 3, 2, 11, 1, 10, 11]);
        // random.seed(0); [random.getrandbits(32) for _ in range(3)]
        let mut r = PyRandom::new(0);
        let got: Vec<u32> = (0..3).map(|_| r.getrandbits(32)).collect();
        assert_eq!(got, vec![3626764237, 1654615998, 3255389356]);
    }

    #[test]
    fn ties_follow_the_shuffle_and_values_descend() {
        let mut rng = numpy_rng(42).unwrap();
        // np.random.seed(42); np.random.permutation(5) -> [1, 4, 2, 0, 3]
        let ranked = ranked_genes(&[10, 11, 12, 13, 14], &[1.0, 1.0, 1.0, 1.0, 1.0], &mut rng);
        assert_eq!(ranked, vec![11, 14, 12, 10, 13]);
        let mut rng = numpy_rng(42).unwrap();
        let ranked = ranked_genes(&[0, 1, 2, 3, 4], &[1.0, 5.0, 2.0, f32::NAN, 5.0], &mut rng);
        assert_eq!(ranked, vec![1, 4, 2, 0, 3]);
        assert!(numpy_rng(1 << 32).is_err());
    }

    #[test]
    fn prompts_cut_the_sentence_and_fill_once() {
        assert_eq!(first_words("A B C D", 2), "A B");
        assert_eq!(first_words("", 3), "");
        let p = fill("{num_genes} in {organism}: {cell_sentence}.", 100, "Homo {cell_sentence}", "CD3E {organism}");
        assert_eq!(p, "100 in Homo {cell_sentence}: CD3E {organism}.");
        let mut pr = Prompter::new(&["cd3e".into(), "Ms4a1".into(), "LYZ".into()], 2, 42).unwrap();
        let s = pr.sentence(&[0, 1, 2], &[3.0, 1.0, 2.0]);
        assert_eq!(s, "CD3E LYZ MS4A1");
        let p = pr.prompt(&s, "Homo sapiens");
        // random.seed(42); random.choice(templates) is template 10
        assert_eq!(p, fill(TEMPLATES[10], 2, "Homo sapiens", "CD3E LYZ"));
        assert_eq!(upper_case_collisions(&["Cd3e".into(), "CD3E".into(), "x".into()]), vec!["CD3E".to_string()]);
    }

    #[test]
    fn config_reads_both_key_styles() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        std::fs::write(&p, r#"{"model_type":"gpt_neox","vocab_size":10,"hidden_size":32,"num_hidden_layers":1,"num_attention_heads":2,"intermediate_size":64,"rope_parameters":{"rope_type":"default","rope_theta":500.0,"partial_rotary_factor":0.5}}"#).unwrap();
        let c = Config::load(&p).unwrap();
        assert_eq!((c.rotary_dims(), c.rotary_emb_base), (8, 500.0));
        std::fs::write(&p, r#"{"model_type":"llama","vocab_size":10,"hidden_size":32,"num_hidden_layers":1,"num_attention_heads":2,"intermediate_size":64}"#).unwrap();
        let e = Config::load(&p).unwrap_err().to_string();
        assert!(e.contains("model_type"), "{e}");
        assert_eq!(Config::pythia_160m().rotary_dims(), 16);
    }
}
