//! Geneformer: Theodoris CV, Xiao L, Chopra A, et al., "Transfer learning enables predictions in
//! network biology", Nature 618:616-624 (2023), doi:10.1038/s41586-023-06139-9; upstream code and
//! weights https://huggingface.co/ctheodoris/Geneformer (`geneformer/tokenizer.py`,
//! `geneformer/emb_extractor.py`, `geneformer/perturber_utils.py`).
//!
//! Rank-value encoding, as upstream's `TranscriptomeTokenizer.tokenize_anndata`:
//! - genes are the var entries whose Ensembl id (var column `ensembl_id` by default; upstream
//!   upper-cases it) is a key of the token dictionary; var entries with the same id are summed,
//!   and, as upstream's `sum_ensembl_ids`, the summed genes come after the others;
//! - per cell, `X_view / n_counts * 10_000 / median` in float64, which scipy evaluates as
//!   `((x * (1/n_counts)) * 10_000) * (1/median)` (sparse / dense multiplies by the reciprocal; one
//!   ulp from plain division, enough to reorder near-equal genes), with `n_counts` from obs (upstream
//!   requires obs['n_counts'], the cell's total counts over all genes) or, when obs has no such
//!   column, the row sum of the matrix; `median` from the gene median dictionary;
//! - the non-zero genes ranked by that value, largest first: upstream's `np.argsort(-values)`
//!   (numpy's unstable default sort) leaves the order of equal values to numpy; we break ties by
//!   gene order (a stable sort), and `scripts/geneformer_reference.py` counts the cells where
//!   that differs on the machine that made the fixture;
//! - truncated to the model input size (config.json `max_position_embeddings`: 2,048 for V1,
//!   4,096 for V2); when the token dictionary holds `<cls>` and `<eos>` (V2, upstream's
//!   `special_token=True`) the ranked genes are cut at size - 2 and wrapped in `<cls>` ... `<eos>`.
//!
//! Cells with no gene in the dictionary have no tokens; upstream drops them from its dataset,
//! we keep the row (outputs keep the input's cells) and give it NaN.
//!
//! The encoder is a Hugging Face `BertForMaskedLM` folder (config.json + model.safetensors or
//! pytorch_model.bin, keys under `bert.`), run by candle-transformers' `BertModel` (absolute
//! positions, relu); with `finetune --unfreeze-layers N` the last N layers run are
//! `methods/bert.rs`'s differentiable ones. As `EmbExtractor.extract_embs`, the layer read is
//! `hidden_states[n_layers + emb_layer]` with `emb_layer` -1 (upstream's default: the output of
//! the second-to-last layer) or 0 (the last layer), so the model is built with that many layers.
//! Cell embedding (`emb_mode="cell"`) = mean of that layer over the cell's tokens, leaving out
//! `<cls>` and `<eos>` when the dictionary has them (`get_embs`); `emb_mode="cls"` takes the
//! `<cls>` state (V2 only). Cells are run longest first in batches (upstream's
//! `downsample_and_sort` also sorts by length, descending), padded with `<pad>` and masked.
//!
//! The dictionaries are Python pickles upstream. They are read as data by
//! `formats::pickle`, which runs no code. A JSON object of the same mapping is accepted too.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::Config;

use crate::formats::pickle::{read_pickle, Py};
use crate::nn::bert::Bert;
use crate::nn::packed_bert::{Packed, PackedBert};

use crate::error::{Error, Result};

/// upstream `tokenize_anndata(target_sum=10_000)`.
pub const TARGET_SUM: f64 = 10_000.0;
/// upstream's required var column.
pub const DEFAULT_GENE_COLUMN: &str = "ensembl_id";
/// The manifest entries the model reads.
pub const REQUIRED_ENTRIES: &[&str] = &["geneformer-v1-model", "geneformer-v1-config", "geneformer-v1-token-dictionary", "geneformer-v1-gene-median-dictionary"];
/// The entry whose folder is the model folder.
pub const MODEL_ENTRY: &str = "geneformer-v1-model";
/// The JSON or pickle shapes of the two dictionaries, for error messages.
pub const TOKEN_DICT_FIELDS: &str = "a dict {Ensembl id: token id (int)} with the special tokens `<pad>` and `<mask>` (V2 also `<cls>` and `<eos>`), as upstream's token_dictionary.pkl";
pub const MEDIAN_DICT_FIELDS: &str = "a dict {Ensembl id: non-zero median of normalised expression (float)}, as upstream's gene_median_dictionary.pkl";

// ------------------------------------------------------------------------------------------
// Dictionaries

/// One dictionary file as (key, value) pairs: a pickled dict or a JSON object.
fn read_mapping(path: &Path) -> Result<Vec<(String, Py)>> {
    let bytes = std::fs::read(path).map_err(|e| Error::Io { path: path.into(), source: e })?;
    let bad = |detail: String| Error::Config { path: path.into(), detail, hint: None };
    let is_json = path.extension().is_some_and(|e| e == "json") || bytes.first().is_some_and(|&c| c == b'{');
    if is_json {
        let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| bad(format!("not JSON: {e}")))?;
        let obj = v.as_object().ok_or_else(|| bad("the JSON is not an object".into()))?;
        return obj
            .iter()
            .map(|(k, v)| {
                let p = if let Some(i) = v.as_i64() {
                    Py::Int(i)
                } else if let Some(f) = v.as_f64() {
                    Py::Float(f)
                } else {
                    return Err(bad(format!("value of {k:?} is not a number: {v}")));
                };
                Ok((k.clone(), p))
            })
            .collect();
    }
    let v = read_pickle(&bytes).map_err(|e| bad(format!("not readable as a pickled dict: {e}")))?;
    let items = v.into_dict().map_err(|_| bad("the pickle holds no dict".into()))?;
    items.into_iter().map(|(k, v)| k.into_string().map(|k| (k, v)).map_err(|other| bad(format!("a key that is not a string: {other:?}")))).collect()
}

/// The token and gene median dictionaries.
#[derive(Debug, Clone)]
pub struct Dictionaries {
    pub tokens: HashMap<String, u32>,
    pub medians: HashMap<String, f64>,
    pub pad: u32,
    /// `<cls>` and `<eos>`, when the token dictionary has both (V2).
    pub specials: Option<(u32, u32)>,
    pub token_path: PathBuf,
    pub median_path: PathBuf,
}

impl Dictionaries {
    /// Whether the token dictionary has the gene `id` (upper-cased, as upstream; special
    /// tokens are not genes).
    pub fn knows(&self, id: &str) -> bool {
        let k = id.trim().to_uppercase();
        !k.starts_with('<') && self.tokens.contains_key(&k)
    }

    pub fn load(token_path: &Path, median_path: &Path) -> Result<Dictionaries> {
        let bad = |path: &Path, detail: String, fields: &str| Error::Config { path: path.into(), detail, hint: Some(format!("it should be {fields}")) };
        let mut tokens = HashMap::new();
        for (k, v) in read_mapping(token_path)? {
            let t = match v {
                Py::Int(i) if (0..=u32::MAX as i64).contains(&i) => i as u32,
                other => return Err(bad(token_path, format!("token of {k:?} is not a non-negative integer: {other:?}"), TOKEN_DICT_FIELDS)),
            };
            tokens.insert(k, t);
        }
        let mut medians = HashMap::new();
        for (k, v) in read_mapping(median_path)? {
            let m = match v {
                Py::Float(f) => f,
                Py::Int(i) => i as f64,
                other => return Err(bad(median_path, format!("median of {k:?} is not a number: {other:?}"), MEDIAN_DICT_FIELDS)),
            };
            medians.insert(k, m);
        }
        let pad = *tokens.get("<pad>").ok_or_else(|| bad(token_path, "no `<pad>` entry".into(), TOKEN_DICT_FIELDS))?;
        let specials = match (tokens.get("<cls>"), tokens.get("<eos>")) {
            (Some(&c), Some(&e)) => Some((c, e)),
            (None, None) => None,
            _ => return Err(bad(token_path, "has one of `<cls>` and `<eos>` but not both".into(), TOKEN_DICT_FIELDS)),
        };
        Ok(Dictionaries { tokens, medians, pad, specials, token_path: token_path.into(), median_path: median_path.into() })
    }

    /// Find `token_dictionary*.{pkl,json}` and `gene_median_dictionary*.{pkl,json}` in the model
    /// folder, its parent, or the parent's `geneformer/` (upstream's repository layout).
    pub fn find(model_dir: &Path) -> Result<Dictionaries> {
        let mut dirs = vec![model_dir.to_path_buf()];
        if let Some(p) = model_dir.parent() {
            dirs.push(p.to_path_buf());
            dirs.push(p.join("geneformer"));
        }
        let find = |prefix: &str, fields: &str| -> Result<PathBuf> {
            for d in &dirs {
                let Ok(rd) = std::fs::read_dir(d) else { continue };
                let mut hits: Vec<PathBuf> = rd
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| {
                        let name = p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
                        name.starts_with(prefix) && (name.ends_with(".pkl") || name.ends_with(".json"))
                    })
                    .collect();
                hits.sort();
                match hits.len() {
                    0 => continue,
                    1 => return Ok(hits.remove(0)),
                    _ => {
                        return Err(Error::Config {
                            path: d.clone(),
                            detail: format!("several {prefix}* files: {}", hits.iter().map(|h| h.file_name().unwrap().to_string_lossy().to_string()).collect::<Vec<_>>().join(", ")),
                            hint: Some("keep the one that belongs to the model in its folder (V1: token_dictionary.pkl; V2: token_dictionary_gc104M.pkl)".into()),
                        })
                    }
                }
            }
            Err(Error::Config {
                path: model_dir.join(format!("{prefix}.pkl")),
                detail: format!("no {prefix}.pkl (or .json, or {prefix}_*.pkl) in {}", dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")),
                hint: Some(format!("put upstream's {prefix}.pkl beside the model folder; it is {fields}")),
            })
        };
        let t = find("token_dictionary", TOKEN_DICT_FIELDS)?;
        let m = find("gene_median_dictionary", MEDIAN_DICT_FIELDS)?;
        Dictionaries::load(&t, &m)
    }
}

// ------------------------------------------------------------------------------------------
// Rank-value tokenizer

/// How a cell's counts become the values it ranks. The three upstream tokenisers compute the
/// same quantity, count / total x 10,000 / median, in different orders and float widths; the
/// last bit decides the order of near-equal genes, so each is followed as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scaling {
    /// Geneformer's tokenizer.py: f64 `((x * (1/n)) * 10_000) * (1/median)` (scipy divides a
    /// sparse matrix by multiplying with the reciprocal).
    Geneformer,
    /// scCello's data_proc.py on a float32 matrix: `sf = f32(10_000 / n)` with `n` the cell's
    /// total over the dictionary's genes (0 counted as 1), `e = f32(x * sf)`, then
    /// `f64(e) * (1/median)`.
    Sccello,
    /// LangCell's tokenize_anndata (geneformer 0.0.1) on a float32 matrix:
    /// `e = f32(f32(x / n) * 10_000)`, then `f64(e) / median`.
    Langcell,
}

/// The genes of a dataset that the dictionaries know, in upstream's column order.
#[derive(Debug, Clone)]
pub struct GeneTable {
    /// For each var column: its slot, if its id is in the token dictionary.
    pub slot_of_var: Vec<Option<u32>>,
    /// Token and median of each slot, in upstream's order (unique genes in var order, then the
    /// summed duplicates in order of first appearance).
    pub tokens: Vec<u32>,
    pub medians: Vec<f64>,
    /// Var columns whose id appeared more than once and were summed.
    pub n_duplicated: usize,
    /// Var columns whose id appeared more than once and were kept apart (`per_column`).
    pub n_repeated: usize,
    pub scaling: Scaling,
}

impl GeneTable {
    /// `ids` are the var's Ensembl ids. Errors when a known gene has no median.
    pub fn new(ids: &[String], dict: &Dictionaries) -> Result<GeneTable> {
        let keys: Vec<Option<String>> = ids
            .iter()
            .map(|id| {
                let k = id.trim().to_uppercase();
                (dict.tokens.contains_key(&k) && !k.starts_with('<')).then_some(k)
            })
            .collect();
        let mut count: HashMap<&str, usize> = HashMap::new();
        for k in keys.iter().flatten() {
            *count.entry(k.as_str()).or_default() += 1;
        }
        let mut slot_by_key: HashMap<&str, u32> = HashMap::new();
        let mut order: Vec<&str> = Vec::new();
        // unique genes first, in var order; then duplicated ids, in order of first appearance
        for k in keys.iter().flatten().filter(|k| count[k.as_str()] == 1) {
            slot_by_key.insert(k, order.len() as u32);
            order.push(k);
        }
        for k in keys.iter().flatten().filter(|k| count[k.as_str()] > 1) {
            if !slot_by_key.contains_key(k.as_str()) {
                slot_by_key.insert(k, order.len() as u32);
                order.push(k);
            }
        }
        let mut medians = Vec::with_capacity(order.len());
        for k in &order {
            let m = *dict.medians.get(*k).ok_or_else(|| Error::Config {
                path: dict.median_path.clone(),
                detail: format!("no median for {k}, which the token dictionary has"),
                hint: Some("the token and median dictionaries must come from the same model version".into()),
            })?;
            medians.push(m);
        }
        Ok(GeneTable {
            slot_of_var: keys.iter().map(|k| k.as_ref().map(|k| slot_by_key[k.as_str()])).collect(),
            tokens: order.iter().map(|k| dict.tokens[*k]).collect(),
            medians,
            n_duplicated: count.values().filter(|&&c| c > 1).map(|&c| c).sum(),
            n_repeated: 0,
            scaling: Scaling::Geneformer,
        })
    }

    /// The table of geneformer 0.0.1's tokenizer, which scCello and LangCell kept: a var column
    /// is a gene when its id is, exactly as written, a key of the median dictionary (upstream's
    /// `genelist_dict`); every such column is its own slot, in var order, repeated ids
    /// included (nothing is summed); its token comes from the token dictionary.
    pub fn per_column(ids: &[String], dict: &Dictionaries, scaling: Scaling) -> Result<GeneTable> {
        let mut slot_of_var = Vec::with_capacity(ids.len());
        let (mut tokens, mut medians) = (Vec::new(), Vec::new());
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for id in ids {
            let known = !id.starts_with('<') && dict.medians.contains_key(id.as_str());
            if !known {
                slot_of_var.push(None);
                continue;
            }
            let t = *dict.tokens.get(id.as_str()).ok_or_else(|| Error::Config {
                path: dict.token_path.clone(),
                detail: format!("no token for {id}, which the median dictionary has"),
                hint: Some("the token and median dictionaries must come from the same model version".into()),
            })?;
            *seen.entry(id.as_str()).or_default() += 1;
            slot_of_var.push(Some(tokens.len() as u32));
            tokens.push(t);
            medians.push(dict.medians[id.as_str()]);
        }
        let n_repeated = seen.values().filter(|&&c| c > 1).sum();
        Ok(GeneTable { slot_of_var, tokens, medians, n_duplicated: 0, n_repeated, scaling })
    }

    /// A cell's total over the table's genes, summed in f32 in column order (scCello's
    /// `batch_data.X.sum(axis=1)` after the gene filter, on a float32 matrix).
    pub fn known_total(&self, indices: &[u32], values: &[f32]) -> f32 {
        indices.iter().zip(values).filter(|(&j, _)| self.slot_of_var.get(j as usize).copied().flatten().is_some()).fold(0f32, |a, (_, &v)| a + v)
    }

    pub fn n_genes(&self) -> usize {
        self.tokens.len()
    }

    /// One count's ranked value, as the table's upstream computes it.
    fn scale(&self, v: f64, n_counts: f64, median: f64) -> f64 {
        match self.scaling {
            Scaling::Geneformer => v * (1.0 / n_counts) * TARGET_SUM * (1.0 / median),
            Scaling::Sccello => {
                // `size_counts += size_counts == 0.`; `size_factor = 10_000 / size_counts`
                let n = if n_counts == 0.0 { 1f32 } else { n_counts as f32 };
                let sf = TARGET_SUM as f32 / n;
                ((v as f32 * sf) as f64) * (1.0 / median)
            }
            Scaling::Langcell => ((v as f32 / n_counts as f32 * TARGET_SUM as f32) as f64) / median,
        }
    }

    /// A cell's ranked gene tokens (untruncated, no special tokens) from its sparse row.
    pub fn rank(&self, indices: &[u32], values: &[f32], n_counts: f64) -> Vec<u32> {
        // (slot, summed count) for the cell's known genes
        let mut acc: Vec<(u32, f64)> = Vec::with_capacity(indices.len());
        let mut dup: HashMap<u32, usize> = HashMap::new();
        for (&j, &v) in indices.iter().zip(values) {
            let Some(s) = self.slot_of_var[j as usize] else { continue };
            if self.n_duplicated > 0 {
                if let Some(&at) = dup.get(&s) {
                    acc[at].1 += v as f64;
                    continue;
                }
                dup.insert(s, acc.len());
            }
            acc.push((s, v as f64));
        }
        let mut scored: Vec<(u32, f64)> = acc
            .into_iter()
            .filter(|&(_, v)| v != 0.0)
            // scipy's sparse / dense is a multiplication by the reciprocal (`_divide`:
            // `self.multiply(np.divide(1, other))`), so upstream computes
            // ((x * (1/n_counts)) * 10_000) * (1/median), which is not x / n * 1e4 / m bit for bit
            .map(|(s, v)| (s, self.scale(v, n_counts, self.medians[s as usize])))
            .filter(|&(_, v)| v != 0.0)
            .collect();
        // slot order first (upstream's column order), then values descending, stable
        scored.sort_by_key(|&(s, _)| s);
        scored.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal));
        scored.into_iter().map(|(s, _)| self.tokens[s as usize]).collect()
    }
}

/// Upstream's `format_cell_features`: truncate to the input size, wrap in `<cls>`/`<eos>` (V2).
pub fn finish_tokens(mut ranked: Vec<u32>, input_size: usize, specials: Option<(u32, u32)>) -> Vec<u32> {
    if ranked.is_empty() {
        return ranked;
    }
    match specials {
        Some((cls, eos)) => {
            ranked.truncate(input_size.saturating_sub(2));
            let mut out = Vec::with_capacity(ranked.len() + 2);
            out.push(cls);
            out.extend(ranked);
            out.push(eos);
            out
        }
        None => {
            ranked.truncate(input_size);
            ranked
        }
    }
}

// ------------------------------------------------------------------------------------------
// Model

/// Which state becomes the cell embedding (upstream `EmbExtractor(emb_mode=...)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmbMode {
    /// Mean over the gene tokens (`<cls>`/`<eos>` left out).
    Cell,
    /// The `<cls>` token's state (V2).
    Cls,
}

impl EmbMode {
    pub fn parse(s: &str) -> Result<EmbMode> {
        match s {
            "cell" => Ok(EmbMode::Cell),
            "cls" => Ok(EmbMode::Cls),
            other => Err(Error::BadOption { option: "--emb-mode".into(), detail: format!("{other:?}"), hint: Some("use `cell` (mean of the gene states) or `cls` (the <cls> state, V2 models)".into()) }),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            EmbMode::Cell => "cell",
            EmbMode::Cls => "cls",
        }
    }
}

pub(crate) fn model_err(context: &str) -> impl Fn(candle_core::Error) -> Error + '_ {
    move |e| Error::Model { context: context.into(), detail: e.to_string() }
}

/// The weights file of a Hugging Face model folder: model.safetensors, else pytorch_model.bin.
pub fn weights_file(dir: &Path, hint: &str) -> Result<PathBuf> {
    let st = dir.join("model.safetensors");
    let bin = dir.join("pytorch_model.bin");
    if st.is_file() {
        Ok(st)
    } else if bin.is_file() {
        Ok(bin)
    } else {
        Err(Error::Config { path: dir.into(), detail: "no model.safetensors or pytorch_model.bin".into(), hint: Some(hint.into()) })
    }
}

/// The floating-point tensors of a safetensors file or a torch pickle (`torch.save` of a
/// state_dict, read as data by candle), as f32 on `device`. Integer and boolean buffers
/// (position ids, scCello's ontology masks) are left out: candle reads no boolean tensors.
pub fn read_tensors(path: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    use candle_core::safetensors::Load;
    let bad = |e: candle_core::Error| Error::BadWeights { path: path.into(), detail: e.to_string() };
    let raw: Vec<(String, Tensor)> = if path.extension().is_some_and(|e| e == "safetensors") {
        // SAFETY: memory-mapped read-only; weights are not modified while scfoundry runs.
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(path) }.map_err(bad)?;
        let mut out = Vec::new();
        for (name, view) in st.tensors() {
            if DType::try_from(view.dtype()).is_ok_and(|d| d.is_float()) {
                out.push((name, view.load(&Device::Cpu).map_err(bad)?));
            }
        }
        out
    } else {
        candle_core::pickle::read_all(path).map_err(bad)?.into_iter().filter(|(_, t)| t.dtype().is_float()).collect()
    };
    raw.into_iter().map(|(k, t)| Ok((k, t.to_dtype(DType::F32).and_then(|t| t.to_device(device)).map_err(bad)?))).collect()
}

/// Token ids and attention mask of a batch padded on the right with `pad`: `(n, longest)` each.
pub fn padded_batch(cells: &[&[u32]], pad: u32, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let n = cells.len();
    let len = cells.iter().map(|c| c.len()).max().unwrap_or(0);
    let mut ids = vec![pad; n * len];
    let mut mask = vec![0u32; n * len];
    for (r, c) in cells.iter().enumerate() {
        ids[r * len..r * len + c.len()].copy_from_slice(c);
        mask[r * len..r * len + c.len()].iter_mut().for_each(|m| *m = 1);
    }
    Ok((Tensor::from_vec(ids, (n, len), device)?, Tensor::from_vec(mask, (n, len), device)?))
}

/// How the encoder runs: packed cells for inference (no padding computed; on a GPU in bf16 the
/// fused attention kernel), or padded batches through layers that can be trained (fine-tuning).
enum Encoder {
    Packed(PackedBert),
    Padded(Bert),
}

/// A Geneformer checkpoint with its dictionaries.
pub struct Geneformer {
    model: Encoder,
    /// The weights' dtype in the encoder (f32, or bf16 on a GPU with `--precision bf16`).
    pub dtype: DType,
    pub dict: Dictionaries,
    pub config: Config,
    device: Device,
    /// upstream's `model_input_size`: config.json's `max_position_embeddings`.
    pub input_size: usize,
    /// -1 (second-to-last layer, upstream's default) or 0 (last layer).
    pub emb_layer: i32,
    pub emb_mode: EmbMode,
    /// The weights file read.
    pub weights_path: PathBuf,
}

/// The cells with tokens, longest first (so a batch's padding is small); empty cells left out.
pub fn length_order(cells: &[Vec<u32>]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..cells.len()).filter(|&i| !cells[i].is_empty()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(cells[i].len()));
    order
}

impl Geneformer {
    /// Load a Hugging Face `BertForMaskedLM` folder (config.json + model.safetensors, or
    /// pytorch_model.bin read as data) and the dictionaries beside it.
    pub fn load(dir: &Path, emb_layer: i32, emb_mode: EmbMode) -> Result<Geneformer> {
        let dict = Dictionaries::find(dir)?;
        Self::load_with(dir, dict, emb_layer, emb_mode)
    }

    pub fn load_with(dir: &Path, dict: Dictionaries, emb_layer: i32, emb_mode: EmbMode) -> Result<Geneformer> {
        Self::load_on(dir, dict, emb_layer, emb_mode, Device::Cpu)
    }

    /// As `load_with`, with the weights on `device` (the CPU or a device of the GPU runtime).
    pub fn load_on(dir: &Path, dict: Dictionaries, emb_layer: i32, emb_mode: EmbMode, device: Device) -> Result<Geneformer> {
        Self::load_hooked(dir, dict, emb_layer, emb_mode, device, None)
    }

    /// As `load_on`, with the weights read through a fine-tuning hook: the last layers of the
    /// ones run (`emb_layer` -1 leaves the last out) become trainable; see `methods/finetune.rs`.
    pub fn load_hooked(dir: &Path, dict: Dictionaries, emb_layer: i32, emb_mode: EmbMode, device: Device, hook: Option<&crate::nn::finetune::LoadHook>) -> Result<Geneformer> {
        Self::load_inner(dir, dict, emb_layer, emb_mode, device, hook, DType::F32)
    }

    /// As `load_on`, with the encoder's weights in `dtype` (bf16 is for a GPU: candle's CPU
    /// matmul in bf16 is slow, so callers keep the CPU at f32).
    pub fn load_dtype(dir: &Path, dict: Dictionaries, emb_layer: i32, emb_mode: EmbMode, device: Device, dtype: DType) -> Result<Geneformer> {
        Self::load_inner(dir, dict, emb_layer, emb_mode, device, None, dtype)
    }

    fn load_inner(dir: &Path, dict: Dictionaries, emb_layer: i32, emb_mode: EmbMode, device: Device, hook: Option<&crate::nn::finetune::LoadHook>, dtype: DType) -> Result<Geneformer> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::Io { path: cfg_path.clone(), source: e })?;
        let config: Config = serde_json::from_str(&text).map_err(|e| Error::Config {
            path: cfg_path.clone(),
            detail: format!("not a BERT config: {e}"),
            hint: Some("Geneformer's config.json is a transformers BertConfig (hidden_size, num_hidden_layers, hidden_act, max_position_embeddings, ...)".into()),
        })?;
        if !matches!(emb_layer, -1 | 0) {
            return Err(Error::BadOption { option: "--emb-layer".into(), detail: format!("{emb_layer}"), hint: Some("upstream offers -1 (second-to-last layer, the default) and 0 (last layer)".into()) });
        }
        if emb_mode == EmbMode::Cls && dict.specials.is_none() {
            return Err(Error::BadOption {
                option: "--emb-mode".into(),
                detail: format!("cls needs a <cls> token, and {} has none (a V1 model)", dict.token_path.display()),
                hint: Some("use --emb-mode cell".into()),
            });
        }
        if config.vocab_size <= dict.tokens.values().copied().max().unwrap_or(0) as usize {
            return Err(Error::Config {
                path: dict.token_path.clone(),
                detail: format!("token ids reach {}, the model's vocabulary has {}", dict.tokens.values().max().unwrap(), config.vocab_size),
                hint: Some("the dictionaries belong to another model version (V1 vocab 25,426; V2 20,275)".into()),
            });
        }
        let weights_path = weights_file(dir, "a Geneformer model folder holds config.json and model.safetensors (or pytorch_model.bin) from huggingface.co/ctheodoris/Geneformer")?;
        let vb = if weights_path.extension().is_some_and(|e| e == "safetensors") {
            // SAFETY: memory-mapped read-only; weights are not modified while scfoundry runs.
            unsafe { VarBuilder::from_mmaped_safetensors(&[&weights_path], dtype, &device) }.map_err(|e| Error::BadWeights { path: weights_path.clone(), detail: e.to_string() })?
        } else {
            // candle's reader takes the tensors out of the zip archive's data.pkl as data
            VarBuilder::from_pth(&weights_path, dtype, &device).map_err(|e| Error::BadWeights { path: weights_path.clone(), detail: e.to_string() })?
        };
        // hidden_states[n_layers + emb_layer]: the model up to that layer
        let mut run_cfg = config.clone();
        run_cfg.num_hidden_layers = (config.num_hidden_layers as i64 + emb_layer as i64).max(0) as usize;
        let vb = match hook {
            Some(h) => h.wrap(vb, "encoder.layer.", run_cfg.num_hidden_layers, &device)?,
            None => vb,
        };
        let vb = if vb.contains_tensor("bert.embeddings.word_embeddings.weight") { vb.pp("bert") } else { vb };
        // the layers a fine-tuning hook unfreezes run as differentiable layers (methods/bert.rs)
        let bad = |e: candle_core::Error| Error::BadWeights { path: weights_path.clone(), detail: format!("not a Geneformer (BERT) checkpoint: {e}") };
        let model = match hook {
            Some(h) => Encoder::Padded(Bert::load(vb, &run_cfg, h.unfreeze).map_err(bad)?),
            None => Encoder::Packed(PackedBert::load(vb, &run_cfg).map_err(bad)?),
        };
        let input_size = config.max_position_embeddings;
        Ok(Geneformer { model, dtype, dict, config, device, input_size, emb_layer, emb_mode, weights_path })
    }

    pub fn hidden(&self) -> usize {
        self.config.hidden_size
    }

    /// The model's token ids for one cell, from its ranked genes.
    pub fn tokens(&self, ranked: Vec<u32>) -> Vec<u32> {
        finish_tokens(ranked, self.input_size, self.dict.specials)
    }

    /// Embeddings of cells (row-major `n x hidden`, in the order given). Cells run longest first
    /// in batches of `batch_size`; a cell without tokens gets NaN.
    pub fn embed(&self, cells: &[Vec<u32>], batch_size: usize, mut progress: impl FnMut(usize)) -> Result<Vec<f32>> {
        let h = self.hidden();
        let mut out = vec![f32::NAN; cells.len() * h];
        let order = length_order(cells);
        let skipped = cells.len() - order.len();
        if skipped > 0 {
            progress(skipped);
        }
        // each batch's embeddings read back while the next one runs (gpu::readback)
        let batch = |chunk: &[usize]| self.forward_tensor(chunk.iter().map(|&i| cells[i].as_slice()).collect());
        crate::gpu::readback::embed_in_order(&mut out, h, &order, batch_size, batch, &mut progress, model_err("reading the Geneformer embeddings back"))?;
        Ok(out)
    }

    /// One padded batch through the encoder: row-major `cells.len() x hidden`.
    pub fn forward_batch(&self, cells: Vec<&[u32]>) -> Result<Vec<f32>> {
        let mean = self.forward_tensor(cells)?;
        mean.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(model_err("running the Geneformer encoder"))
    }

    /// As `forward_batch`, as a `(n, hidden)` tensor on the model's device (gradients flow
    /// through trainable layers).
    pub fn forward_tensor(&self, cells: Vec<&[u32]>) -> Result<Tensor> {
        let ctx = model_err("running the Geneformer encoder");
        let n = cells.len();
        let len = cells.iter().map(|c| c.len()).max().unwrap_or(0);
        // the pooled positions of each cell: (first, count), one run
        let special = self.dict.specials.is_some();
        let spans: Vec<(usize, usize)> = cells
            .iter()
            .map(|c| match self.emb_mode {
                EmbMode::Cls => (0, 1),
                EmbMode::Cell => {
                    let (start, end) = if special { (1, c.len().saturating_sub(1)) } else { (0, c.len()) };
                    (start, end.saturating_sub(start))
                }
            })
            .collect();
        let model = match &self.model {
            Encoder::Padded(m) => m,
            Encoder::Packed(m) => {
                let p = Packed::new(&cells);
                let hidden = m.forward(&p).map_err(&ctx)?; // tokens x h
                let rows: Vec<(usize, usize)> = spans.iter().zip(&p.cu).map(|(&(first, count), &at)| (at as usize + first, count)).collect();
                return crate::gpu::segment_pool::mean_spans(&hidden, &rows).map_err(&ctx);
            }
        };
        // pooling weights over the padded batch; divide after the sum, as upstream's
        // `masked_embs.sum(1) / lens`
        let mut pool = vec![0f32; n * len];
        for (r, &(first, count)) in spans.iter().enumerate() {
            pool[r * len + first..r * len + first + count].iter_mut().for_each(|w| *w = 1.0);
        }
        let counts: Vec<f32> = spans.iter().map(|&(_, count)| (count as f32).max(1.0)).collect();
        let (ids, mask) = padded_batch(&cells, self.dict.pad, &self.device).map_err(&ctx)?;
        let types = ids.zeros_like().map_err(&ctx)?;
        let hidden = model.forward(&ids, &types, Some(&mask)).map_err(&ctx)?; // n x len x h
        let w = Tensor::from_vec(pool, (n, len, 1), &self.device).map_err(&ctx)?;
        let summed = hidden.broadcast_mul(&w).map_err(&ctx)?.sum(1).map_err(&ctx)?;
        let counts = Tensor::from_vec(counts, (n, 1), &self.device).map_err(&ctx)?;
        summed.broadcast_div(&counts).map_err(&ctx)
    }
}

/// The model folder for a weights folder, from the manifest entry of the model file.
pub fn model_dir(weights_dir: &Path, manifest: &crate::weights::Manifest) -> PathBuf {
    let file = manifest.weights.get(MODEL_ENTRY).map(|e| e.file.clone()).unwrap_or_else(|| "geneformer/gf-6L-30M-i2048/model.safetensors".into());
    weights_dir.join(file).parent().map(Path::to_path_buf).unwrap_or_else(|| weights_dir.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dict(specials: bool) -> Dictionaries {
        let mut tokens: HashMap<String, u32> = [("<pad>", 0), ("<mask>", 1), ("ENSG1", 2), ("ENSG2", 3), ("ENSG3", 4), ("ENSG4", 5)].iter().map(|(k, v)| (k.to_string(), *v)).collect();
        if specials {
            tokens.insert("<cls>".into(), 6);
            tokens.insert("<eos>".into(), 7);
        }
        let medians = [("ENSG1", 1.0), ("ENSG2", 2.0), ("ENSG3", 0.5), ("ENSG4", 1.0)].iter().map(|(k, v)| (k.to_string(), *v)).collect();
        Dictionaries { tokens, medians, pad: 0, specials: specials.then_some((6, 7)), token_path: "t.pkl".into(), median_path: "m.pkl".into() }
    }

    #[test]
    fn rank_value_encoding_as_upstream() {
        let d = dict(false);
        let ids: Vec<String> = ["ENSG1", "x", "ensg2", "ENSG3", "ENSG4"].iter().map(|s| s.to_string()).collect();
        let t = GeneTable::new(&ids, &d).unwrap();
        assert_eq!(t.slot_of_var, vec![Some(0), None, Some(1), Some(2), Some(3)]);
        // counts 4, 9 (unknown), 4, 1, 2 over n_counts 20: /median -> 2000, -, 1000, 1000, 1000
        let r = t.rank(&[0, 1, 2, 3, 4], &[4.0, 9.0, 4.0, 1.0, 2.0], 20.0);
        // ties in gene order (stable)
        assert_eq!(r, vec![2, 3, 4, 5]);
        assert_eq!(finish_tokens(r.clone(), 3, None), vec![2, 3, 4]);
        assert_eq!(finish_tokens(r, 4, Some((6, 7))), vec![6, 2, 3, 7]);
        assert!(finish_tokens(vec![], 4, Some((6, 7))).is_empty());
        // no known gene: no tokens
        assert!(t.rank(&[1], &[5.0], 5.0).is_empty());
    }

    #[test]
    fn duplicated_ids_are_summed_and_placed_last() {
        let d = dict(false);
        let ids: Vec<String> = ["ENSG1", "ENSG2", "ENSG3", "ENSG1"].iter().map(|s| s.to_string()).collect();
        let t = GeneTable::new(&ids, &d).unwrap();
        assert_eq!(t.slot_of_var, vec![Some(2), Some(0), Some(1), Some(2)]);
        assert_eq!(t.tokens, vec![3, 4, 2]);
        // ENSG1 = 1 + 1 = 2 -> 2/1; ENSG2 = 4 -> 4/2 = 2; ENSG3 = 1 -> 1/0.5 = 2: all tie
        assert_eq!(t.rank(&[0, 1, 2, 3], &[1.0, 4.0, 1.0, 1.0], 10.0), vec![3, 4, 2]);
    }
}
