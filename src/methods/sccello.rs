//! scCello: Yuan X, Zhan Z, Zhang Z, et al., "Cell ontology guided transcriptome foundation
//! model", NeurIPS 2024, arXiv:2408.12373; upstream code https://github.com/DeepGraphLearning/scCello
//! (commit 767585b: `sccello/src/data/data_proc.py`, `sccello/src/data/tokenizer.py`,
//! `sccello/src/model_prototype_contrastive.py`, `sccello/script/run_cell_type_clustering.py`),
//! weights https://huggingface.co/katarinayuan/scCello-zeroshot.
//!
//! Tokenisation, as `ProcessSingleCellData.from_h5ad_adata` (the CELLxGENE path that built the
//! pre-training corpus) and `TranscriptomeTokenizer.tokenize`:
//! - the genes are the var columns whose id (var['ensembl_ids'] upstream) is a key of the gene
//!   median dictionary, each column on its own (repeated ids are not summed);
//! - the cell's total is its sum over those genes only (0 counted as 1), in the matrix's
//!   float32: `sf = 10_000 / total`, `e = x * sf` in float32, ranked by `e * (1 / median)` in
//!   float64 (`Scaling::Sccello`), largest first; upstream's `np.argsort(-values)` leaves ties to
//!   numpy's unstable sort, we keep them in column order;
//! - `<cls>`, which `data_loading.get_prestored_data` adds as len(token dictionary) = 25,426,
//!   is put in front and the sequence cut at 2,048 tokens (the model's 2,048 positions).
//!
//! Model: `PrototypeContrastiveForMaskedLM` wraps a BERT (`bert.*`) whose embeddings have no
//! token-type table; instead three one-row tables (`tf_class_embeddings`,
//! `tf_superclass_embeddings`, `expbin_embeddings`, "legacy") are looked up at index 0 and added
//! to every position. Their sum is one constant row, so it is loaded as the token-type table of
//! candle's `BertModel` (type_vocab_size 1, every token of type 0); everything else maps by name.
//! The MLM heads, `cell_cls`, the prototypes and the ontology buffers are not read.
//! Cell embedding, as the zero-shot path of `run_cell_type_clustering.py`
//! (`trainer.predict(...).predictions[1][:, -1, :]` with `output_hidden_states=True`): the last
//! layer's state at position 0 (`<cls>`), not normalised (`--normalize 0`, `--pass_cell_cls 0`,
//! the defaults).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::Config;

use crate::nn::packed_bert::PackedBert;

use crate::error::{Error, Result};
use crate::nn::cls_encoder::{Arch, ClsEncoder};
use crate::methods::geneformer::{read_tensors, weights_file, Dictionaries};

/// upstream's var column (`ENSEMBL_IDS_TAG`).
pub const DEFAULT_GENE_COLUMN: &str = "ensembl_ids";
pub const REQUIRED_ENTRIES: &[&str] = &["sccello-zeroshot-model", "sccello-zeroshot-config", "sccello-token-dictionary", "sccello-gene-median-dictionary"];
pub const MODEL_ENTRY: &str = "sccello-zeroshot-model";
/// The three one-row embedding tables upstream adds to every position.
pub const LEGACY_TABLES: [&str; 3] = ["tf_class_embeddings", "tf_superclass_embeddings", "expbin_embeddings"];

/// The model folder (config.json + model.safetensors) for a weights folder.
pub fn model_dir(weights_dir: &Path, manifest: &crate::weights::Manifest) -> PathBuf {
    let file = manifest.weights.get(MODEL_ENTRY).map(|e| e.file.clone()).unwrap_or_else(|| "sccello/scCello-zeroshot/model.safetensors".into());
    weights_dir.join(file).parent().map(Path::to_path_buf).unwrap_or_else(|| weights_dir.to_path_buf())
}

/// Rename a `PrototypeContrastiveForMaskedLM` state dict into candle's `BertModel` names:
/// `bert.` dropped, the legacy rows summed into `embeddings.token_type_embeddings.weight`.
pub fn bert_tensors(mut all: HashMap<String, Tensor>, path: &Path) -> Result<HashMap<String, Tensor>> {
    let mut out: HashMap<String, Tensor> = HashMap::new();
    let prefixed = all.keys().any(|k| k.starts_with("bert."));
    let mut legacy = Vec::new();
    for name in LEGACY_TABLES {
        let key = if prefixed { format!("bert.embeddings.{name}.weight") } else { format!("embeddings.{name}.weight") };
        let t = all.remove(&key).ok_or_else(|| Error::BadWeights {
            path: path.into(),
            detail: format!("no tensor `{key}`: not a scCello (PrototypeContrastiveForMaskedLM) checkpoint; its embeddings hold word, position, tf_class, tf_superclass and expbin tables"),
        })?;
        legacy.push(t);
    }
    let mut row = legacy[0].clone();
    for t in &legacy[1..] {
        row = row.broadcast_add(t).map_err(|e| Error::BadWeights { path: path.into(), detail: format!("the legacy embedding rows do not add up: {e}") })?;
    }
    for (k, t) in all {
        if let Some(rest) = k.strip_prefix("bert.") {
            out.insert(rest.to_string(), t);
        } else if !prefixed {
            out.insert(k, t);
        }
    }
    out.insert("embeddings.token_type_embeddings.weight".into(), row);
    Ok(out)
}

/// Load a scCello folder (config.json + model.safetensors or pytorch_model.bin) with the V1
/// dictionaries `dict`.
pub fn load(dir: &Path, dict: Dictionaries, device: Device) -> Result<ClsEncoder> {
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::Io { path: cfg_path.clone(), source: e })?;
    let mut config: Config = serde_json::from_str(&text).map_err(|e| Error::Config {
        path: cfg_path.clone(),
        detail: format!("not a BERT config: {e}"),
        hint: Some("scCello's config.json is a transformers BertConfig (hidden_size, num_hidden_layers, hidden_act, max_position_embeddings, ...) from huggingface.co/katarinayuan/scCello-zeroshot".into()),
    })?;
    let weights_path = weights_file(dir, "a scCello folder holds config.json and model.safetensors from huggingface.co/katarinayuan/scCello-zeroshot")?;
    let tensors = bert_tensors(read_tensors(&weights_path, &device)?, &weights_path)?;
    // the summed legacy row is the one token type
    config.type_vocab_size = 1;
    let cls = dict.tokens.len() as u32;
    check_vocab(&config, &dict, cls, &cfg_path)?;
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &device);
    let model = PackedBert::load(vb, &config).map_err(|e| Error::BadWeights { path: weights_path.clone(), detail: format!("not a scCello (BERT) checkpoint: {e}") })?;
    Ok(ClsEncoder { arch: Arch::Sccello, model, input_size: config.max_position_embeddings, config, dict, device, cls, proj: None, proj_dim: None, weights_path, proj_path: None })
}

/// `<cls>` (= len(token dictionary)) and every gene token must be rows of the embedding table.
pub fn check_vocab(config: &Config, dict: &Dictionaries, cls: u32, cfg_path: &Path) -> Result<()> {
    if cls as usize >= config.vocab_size {
        return Err(Error::Config {
            path: cfg_path.into(),
            detail: format!("vocab_size is {}, but the token dictionary {} has {} entries, so <cls> (added as len(dictionary)) is token {cls}", config.vocab_size, dict.token_path.display(), dict.tokens.len()),
            hint: Some("use the model's own V1 dictionaries (25,426 entries; the released models have 25,427 tokens with <cls>)".into()),
        });
    }
    Ok(())
}
