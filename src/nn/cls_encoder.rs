//! The Geneformer-family cell encoders whose cell embedding is the `<cls>` state of the last
//! layer: scCello (`methods/sccello.rs`) and LangCell (`methods/langcell.rs`). Both take
//! Geneformer V1's rank-value tokens (`methods/geneformer.rs`: dictionaries, gene table,
//! pickle reader), put `<cls>` = len(token dictionary) in front, cut at the model's input
//! size, and run a Hugging Face BERT encoder over the batch: packed cells
//! (`methods/packed_bert.rs`: each cell attends to its own tokens, the same result as upstream's
//! right-padded, masked batch without computing the padding). LangCell then projects the `<cls>`
//! state with its `cell_proj` linear layer and L2-normalises it.

use std::path::PathBuf;

use candle_core::{Device, Module, Tensor};
use candle_nn::Linear;
use candle_transformers::models::bert::Config;

use crate::error::Result;
use crate::methods::geneformer::{length_order, model_err, Dictionaries, GeneTable, Scaling};
use crate::nn::packed_bert::{Packed, PackedBert};

/// Which upstream the encoder follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Sccello,
    Langcell,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Sccello => "sccello",
            Arch::Langcell => "langcell",
        }
    }

    pub fn parse(s: &str) -> Option<Arch> {
        match s {
            "sccello" => Some(Arch::Sccello),
            "langcell" => Some(Arch::Langcell),
            _ => None,
        }
    }

    /// The released model's shape (for throughput runs with random weights) and its projection.
    /// scCello: sccello/configs/pretrain/sccello_bert_model.json (6 x 256, 4 heads, 512, relu,
    /// 2,048 positions, vocab 25,427, one token type). LangCell: ckpt/cell_bert/config.json is
    /// only in the Google Drive folder, which we could not read; the shape here is Geneformer's
    /// 12L-30M (12 x 512, 8 heads, 1,024, relu, 2,048 positions) with the <cls> row (vocab
    /// 25,427), an assumption to replace with the file's numbers, and cell_proj 512 -> 256.
    pub fn full_size(self) -> (Config, Option<usize>) {
        let (layers, hidden, heads, ffn, types, proj) = match self {
            Arch::Sccello => (6, 256, 4, 512, 1, None),
            Arch::Langcell => (12, 512, 8, 1024, 2, Some(256)),
        };
        let cfg = serde_json::from_value(serde_json::json!({
            "vocab_size": 25427, "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "intermediate_size": ffn, "hidden_act": "relu",
            "hidden_dropout_prob": 0.02, "max_position_embeddings": 2048, "type_vocab_size": types,
            "initializer_range": 0.02, "layer_norm_eps": 1e-12, "pad_token_id": 0,
            "classifier_dropout": null, "model_type": "bert"
        }))
        .expect("a valid BERT config");
        (cfg, proj)
    }
}

/// A loaded encoder with its dictionaries.
pub struct ClsEncoder {
    pub arch: Arch,
    /// The BERT encoder over packed cells (no padding computed; methods/packed_bert.rs).
    pub(crate) model: PackedBert,
    pub dict: Dictionaries,
    pub config: Config,
    pub(crate) device: Device,
    /// config.json's `max_position_embeddings`: the tokens per cell, `<cls>` included
    /// (upstream cuts at 2,048, the released models' size).
    pub input_size: usize,
    /// `<cls>`: upstream adds it to the token dictionary as `len(token_dictionary)`.
    pub cls: u32,
    /// LangCell's `cell_proj` (hidden -> 256); None for scCello.
    pub(crate) proj: Option<Linear>,
    pub proj_dim: Option<usize>,
    pub weights_path: PathBuf,
    pub proj_path: Option<PathBuf>,
}

impl ClsEncoder {
    /// The encoder of `arch` at its released shape with the weights `vb` gives (random ones for
    /// throughput runs): the same forward pass as a loaded checkpoint.
    pub fn with_weights(arch: Arch, vb: candle_nn::VarBuilder, device: Device) -> Result<ClsEncoder> {
        let (config, proj_dim) = arch.full_size();
        let ctx = model_err("building the encoder");
        let model = PackedBert::load(vb.clone(), &config).map_err(&ctx)?;
        let proj = match proj_dim {
            Some(d) => Some(candle_nn::linear(config.hidden_size, d, vb.pp("cell_proj")).map_err(&ctx)?),
            None => None,
        };
        let dict = Dictionaries {
            tokens: Default::default(),
            medians: Default::default(),
            pad: 0,
            specials: None,
            token_path: PathBuf::new(),
            median_path: PathBuf::new(),
        };
        Ok(ClsEncoder { arch, model, dict, input_size: config.max_position_embeddings, cls: 25426, config, device, proj, proj_dim, weights_path: PathBuf::new(), proj_path: None })
    }

    /// Run the encoder in `dtype` (bf16 on a GPU takes the fused encoder); the `<cls>` read-out
    /// and LangCell's projection stay float32.
    pub fn set_precision(&mut self, dtype: candle_core::DType) -> Result<()> {
        self.model = self.model.to_dtype(dtype).map_err(model_err("converting the encoder"))?;
        Ok(())
    }

    /// The dtype the encoder runs in.
    pub fn precision(&self) -> candle_core::DType {
        self.model.encoder.dtype()
    }

    /// Width of the cell embedding.
    pub fn dim(&self) -> usize {
        self.proj_dim.unwrap_or(self.config.hidden_size)
    }

    /// The dataset's genes as upstream's tokeniser sees them (`ids`: the var's Ensembl ids).
    pub fn gene_table(&self, ids: &[String]) -> Result<GeneTable> {
        let scaling = match self.arch {
            Arch::Sccello => Scaling::Sccello,
            Arch::Langcell => Scaling::Langcell,
        };
        GeneTable::per_column(ids, &self.dict, scaling)
    }

    /// One cell's tokens from its sparse row (all var columns), and whether genes were cut.
    pub fn cell_tokens(&self, table: &GeneTable, indices: &[u32], values: &[f32]) -> (Vec<u32>, bool) {
        let total = match self.arch {
            // data_proc.py: the sum over the dictionary's genes, after the gene filter
            Arch::Sccello => table.known_total(indices, values),
            // preprocess.py: obs['n_counts'] = X.sum(axis=1), every gene
            Arch::Langcell => values.iter().fold(0f32, |a, &v| a + v),
        };
        let ranked = table.rank(indices, values, total as f64);
        let cut = ranked.len() >= self.input_size;
        (self.tokens(ranked), cut)
    }

    /// A cell's tokens from its ranked genes: `<cls>` then the genes, `input_size` in all. A cell
    /// with no known gene is `<cls>` alone, which upstream embeds like any other.
    pub fn tokens(&self, mut ranked: Vec<u32>) -> Vec<u32> {
        ranked.truncate(self.input_size.saturating_sub(1));
        let mut out = Vec::with_capacity(ranked.len() + 1);
        out.push(self.cls);
        out.extend(ranked);
        out
    }

    /// Embeddings of cells (row-major `n x dim`, in the order given), longest first in batches.
    pub fn embed(&self, cells: &[Vec<u32>], batch_size: usize, mut progress: impl FnMut(usize)) -> Result<Vec<f32>> {
        let d = self.dim();
        let mut out = vec![f32::NAN; cells.len() * d];
        // each batch's embeddings read back while the next one runs (gpu::readback)
        let batch = |chunk: &[usize]| self.forward_tensor(&chunk.iter().map(|&i| cells[i].as_slice()).collect::<Vec<_>>());
        crate::gpu::readback::embed_in_order(&mut out, d, &length_order(cells), batch_size, batch, &mut progress, model_err("reading the embeddings back"))?;
        Ok(out)
    }

    /// One batch: row-major `cells.len() x dim`.
    pub fn forward_batch(&self, cells: Vec<&[u32]>) -> Result<Vec<f32>> {
        let ctx = model_err("running the encoder");
        let t = self.forward_tensor(&cells)?;
        t.to_dtype(candle_core::DType::F32).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1::<f32>()).map_err(ctx)
    }

    /// `(n, dim)` on the model's device, float32.
    pub fn forward_tensor(&self, cells: &[&[u32]]) -> Result<Tensor> {
        let ctx = model_err("running the encoder");
        let run = || -> candle_core::Result<Tensor> {
            if cells.is_empty() {
                return Tensor::zeros((0, self.dim()), candle_core::DType::F32, &self.device);
            }
            let p = Packed::new(cells);
            let cls = p.first_rows(&self.model.forward(&p)?)?.to_dtype(candle_core::DType::F32)?;
            match &self.proj {
                None => Ok(cls),
                Some(p) => {
                    // zero-shot.ipynb Pooler: F.normalize(self.proj(hidden[:, 0]), dim=-1)
                    let z = p.forward(&cls)?;
                    let norm = z.sqr()?.sum_keepdim(1)?.sqrt()?.clamp(1e-12, f64::INFINITY)?;
                    z.broadcast_div(&norm)
                }
            }
        };
        run().map_err(ctx)
    }
}
