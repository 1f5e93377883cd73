//! LangCell: Zhao S, Zhang J, Luo Y, Wu Y, Nie Z, "LangCell: Language-Cell Pre-training for Cell
//! Identity Understanding", ICML 2024, arXiv:2405.06708; upstream code
//! https://github.com/PharMolix/LangCell (commit 69e41ef: `data_preprocess/preprocess.py`,
//! `LangCell-annotation-zeroshot/utils.py`, `LangCell-annotation-zeroshot/zero-shot.ipynb`,
//! `geneformer_001/geneformer/tokenizer.py`); checkpoint in the Google Drive folder of the README.
//!
//! Only the cell encoder is needed to embed cells: `ckpt/cell_bert` (a standard Hugging Face
//! `BertModel`: config.json + pytorch_model.bin) and `ckpt/cell_proj.bin` (the state dict of an
//! `nn.Linear(hidden, 256)`). The text encoder (`text_bert`, `text_proj`, `ctm_head`) serves
//! zero-shot annotation against cell-type descriptions and is not read.
//!
//! Tokenisation, as `preprocess.py` + `LangCellTranscriptomeTokenizer.tokenize_anndata` (the
//! vendored geneformer 0.0.1 tokenizer):
//! - `obs['n_counts'] = X.sum(axis=1)`: the cell's total over all var columns (preprocess.py
//!   overwrites any n_counts already there);
//! - the genes are the var columns whose `ensembl_id` is a key of the gene median dictionary,
//!   each column on its own (repeated ids are not summed);
//! - values `x / n_counts * 10_000` in the matrix's float32, then `/ median` in float64
//!   (`Scaling::Langcell`), ranked largest first (`tokenize_cell`; ties in column order here,
//!   numpy's unstable argsort upstream), cut at 2,048 (`create_dataset`);
//! - the collator (`LangCellDataCollatorForCellClassification`, `add_cls=True`) puts `<cls>` =
//!   len(token dictionary) = 25,426 in front and cuts at 2,048 again: `<cls>` and 2,047 genes.
//!   We cut at the model's `max_position_embeddings` (2,048 for the release).
//!
//! Upstream's `tokenize_anndata` reads obs['filter_pass'] and keeps the cells where it is 1; it
//! catches only AttributeError, so without the column it stops with a KeyError. We embed every
//! cell.
//!
//! Cell embedding, zero-shot.ipynb's `Pooler` set as `model.pooler`:
//! `F.normalize(cell_proj(last_hidden_state[:, 0]), dim=-1)`, 256-d, unit length.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use candle_nn::{Linear, VarBuilder};
use candle_transformers::models::bert::Config;

use crate::nn::packed_bert::PackedBert;

use crate::error::{Error, Result};
use crate::nn::cls_encoder::{Arch, ClsEncoder};
use crate::methods::geneformer::{read_tensors, weights_file, Dictionaries};
use crate::methods::sccello::check_vocab;

pub const DEFAULT_GENE_COLUMN: &str = "ensembl_id";
pub const REQUIRED_ENTRIES: &[&str] = &["langcell-cell-bert-model", "langcell-cell-bert-config", "langcell-cell-proj", "langcell-token-dictionary", "langcell-gene-median-dictionary"];
pub const PROJ_ENTRY: &str = "langcell-cell-proj";
pub const PROJ_FILE: &str = "cell_proj.bin";
pub const BERT_FOLDER: &str = "cell_bert";

/// The checkpoint folder (`ckpt/`, holding cell_bert/ and cell_proj.bin) for a weights folder.
pub fn ckpt_dir(weights_dir: &Path, manifest: &crate::weights::Manifest) -> PathBuf {
    let file = manifest.weights.get(PROJ_ENTRY).map(|e| e.file.clone()).unwrap_or_else(|| "langcell/ckpt/cell_proj.bin".into());
    weights_dir.join(file).parent().map(Path::to_path_buf).unwrap_or_else(|| weights_dir.to_path_buf())
}

/// Load LangCell's cell encoder from its checkpoint folder `ckpt` (cell_bert/ with config.json
/// and pytorch_model.bin or model.safetensors, and cell_proj.bin beside it).
pub fn load(ckpt: &Path, dict: Dictionaries, device: Device) -> Result<ClsEncoder> {
    let bert_dir = ckpt.join(BERT_FOLDER);
    let cfg_path = bert_dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::Io { path: cfg_path.clone(), source: e })?;
    let config: Config = serde_json::from_str(&text).map_err(|e| Error::Config {
        path: cfg_path.clone(),
        detail: format!("not a BERT config: {e}"),
        hint: Some("LangCell's ckpt/cell_bert/config.json is a transformers BertConfig (hidden_size, num_hidden_layers, hidden_act, max_position_embeddings, ...)".into()),
    })?;
    let weights_path = weights_file(&bert_dir, "LangCell's ckpt/cell_bert holds config.json and pytorch_model.bin (the Google Drive folder of github.com/PharMolix/LangCell)")?;
    let cls = dict.tokens.len() as u32;
    check_vocab(&config, &dict, cls, &cfg_path)?;
    let mut tensors = read_tensors(&weights_path, &device)?;
    // a BertModel's own keys; a BertForMaskedLM-style `bert.` prefix is accepted too
    if tensors.keys().any(|k| k.starts_with("bert.")) {
        tensors = tensors.into_iter().filter_map(|(k, t)| k.strip_prefix("bert.").map(|r| (r.to_string(), t))).collect();
    }
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &device);
    let model = PackedBert::load(vb, &config).map_err(|e| Error::BadWeights { path: weights_path.clone(), detail: format!("not a LangCell cell_bert (BertModel) checkpoint: {e}") })?;
    let proj_path = ckpt.join(PROJ_FILE);
    if !proj_path.is_file() {
        return Err(Error::Config {
            path: proj_path.clone(),
            detail: "no cell_proj.bin beside cell_bert/".into(),
            hint: Some("LangCell's cell embedding is cell_proj applied to the <cls> state; put ckpt/cell_proj.bin from the LangCell checkpoint folder next to cell_bert/".into()),
        });
    }
    let mut p = read_tensors(&proj_path, &device)?;
    let bad = |detail: String| Error::BadWeights { path: proj_path.clone(), detail };
    let (Some(w), Some(b)) = (p.remove("weight"), p.remove("bias")) else {
        return Err(bad(format!("expected the state dict of an nn.Linear (`weight`, `bias`), found {:?}", p.keys().collect::<Vec<_>>())));
    };
    let (out_dim, in_dim) = w.dims2().map_err(|e| bad(format!("`weight`: {e}")))?;
    if in_dim != config.hidden_size || b.dims() != [out_dim] {
        return Err(bad(format!("`weight` is {out_dim} x {in_dim} and `bias` {:?}; the cell encoder's hidden size is {}", b.dims(), config.hidden_size)));
    }
    Ok(ClsEncoder {
        arch: Arch::Langcell,
        model,
        input_size: config.max_position_embeddings,
        config,
        dict,
        device,
        cls,
        proj: Some(Linear::new(w, Some(b))),
        proj_dim: Some(out_dim),
        weights_path,
        proj_path: Some(proj_path),
    })
}
