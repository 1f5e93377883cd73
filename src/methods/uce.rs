//! UCE (Universal Cell Embeddings): Rosen Y, Roohani Y, Agrawal A, et al., "Universal Cell
//! Embeddings: A Foundation Model for Cell Biology", bioRxiv 2023, doi:10.1101/2023.11.28.568918;
//! upstream code https://github.com/snap-stanford/UCE (`model.py` TransformerModel,
//! `evaluate.py` run_eval, `eval_data.py` MultiDatasetSentences and sample_cell_sentences,
//! `data_proc/data_utils.py`; read at commit 8ead6e0).
//!
//! Files (upstream's names, under the weights folder's `uce/`): the model, a PyTorch state_dict
//! saved with torch.save (`33l_8ep_1024t_1280.torch`, the 33-layer paper model, or
//! `4layer_model.torch`), read as data by candle's pickle reader (nothing in it is executed); the
//! species' ESM2 protein-embedding file `protein_embeddings/Homo_sapiens.GRCh38.
//! gene_symbol_to_embedding_ESM2.pt` (a dict {gene symbol: 5120-d tensor}: only its key order is
//! read), `species_offsets.pkl` ({species: first token row}, a pickle read as data) and
//! `species_chrom.csv` (species, gene_symbol, chromosome, start). The token table is the
//! checkpoint's own `pe_embedding.weight` (145,469 x 5120 = all_tokens.torch's 143,574 rows plus
//! 1,895 chromosome rows): upstream run_eval loads all_tokens.torch, appends the chromosome rows
//! and keeps the checkpoint's table whenever the result has that size, which it has for the
//! released files, so all_tokens.torch is not read here.
//!
//! Genes (process_raw_anndata, load_gene_embeddings_adata, adata_path_to_prot_chrom_starts):
//! genes expressed (> 0) in fewer than 10 cells are dropped (`sc.pp.filter_genes(min_cells=10)`,
//! upstream's `--filter` default), then genes without a protein embedding (matched by symbol,
//! case-insensitive). A gene's token is its position among the embedding file's upper-cased keys
//! (a key repeated in another case counts once, at its first position) plus the species' offset;
//! its chromosome is the code of `species_chromosome` among all of species_chrom.csv's values
//! sorted (pandas Categorical codes), its start the csv's `start`. Counts are the matrix values
//! truncated to integers (upstream writes them to an int64 memmap).
//!
//! A cell's sentence (MultiDatasetSentences.__getitem__, sample_cell_sentences): weights =
//! log1p(counts) / their sum (float32), normalised again (numpy 1.x: a float64 sum); 1,024 genes
//! drawn with replacement by `np.random.choice(p=weights)` (cumulative sum, renormalised,
//! `searchsorted(random_sample(), side="right")`); the distinct chromosomes drawn, ascending, are
//! shuffled (`np.random.shuffle`); the sentence is CLS (3), then per chromosome its open token
//! (code + CHROM_TOKEN_OFFSET 143,574), its genes' tokens by start and the close token (2), padded
//! with 0 to 1,536. Randomness: upstream draws from numpy's global unseeded RNG; we use numpy's
//! legacy MT19937 seeded per cell with `(seed + cell row) mod 2^32` (scgpt.rs's `Mt19937`), so
//! the same seed gives numpy's tokens exactly. Genes on one chromosome with equal starts are put
//! in gene order (upstream's unstable argsort leaves that order to numpy); a gene drawn several
//! times repeats its token, so its copies' order cannot matter.
//!
//! The model (TransformerModel.forward, as run_eval calls it): token embeddings looked up and
//! L2-normalised, Linear(token_dim, d_model), GELU, LayerNorm, times sqrt(d_model), plus the
//! sinusoidal `pos_encoder.pe`; `nlayers` post-norm nn.TransformerEncoderLayers (20 heads, ReLU,
//! d_hid 5120); the decoder (three Linear-LayerNorm-GELU blocks, d_model -> 1024 -> output_dim ->
//! output_dim, then a Linear) on the CLS position; L2-normalised: the 1,280-d cell embedding.
//!
//! Padding: upstream pads each batch to its longest sentence and passes the float mask
//! `1 - mask` as `src_key_padding_mask`, which PyTorch adds to the attention scores (+1 at
//! padding keys, not -inf), so a cell's embedding depends on the other cells of its batch. We
//! pack the sentences (their tokens end to end, each attending to its own tokens, no padding
//! computed; `nn::transformer`, on a GPU in bf16 through `gpu::fused_encoder`): each cell's
//! embedding is upstream's for that cell alone (a batch of one), whatever the batch size.
//! scripts/uce_reference.py measures the difference.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{Embedding, LayerNorm, Linear, VarBuilder};

use crate::error::{Error, Result};
use crate::nn::packed_bert::Packed;
use crate::nn::transformer::{Act, TransformerLayer, TransformerStack};
use crate::formats::numpy_rng::Mt19937;
use crate::methods::scgpt::cell_rng;

/// The weights entries every run reads (weights.toml); the model entry depends on --nlayers.
pub const COMMON_ENTRIES: &[&str] = &["uce-esm2-human-protein-embeddings", "uce-species-chrom", "uce-species-offsets"];
/// The file of the human protein embeddings inside the extracted archive (data_utils.get_species_to_pe).
pub const HUMAN_PE_FILE: &str = "protein_embeddings/Homo_sapiens.GRCh38.gene_symbol_to_embedding_ESM2.pt";
/// Rows of the released token table (all_tokens.torch's 143,574 plus 1,895 chromosome rows).
pub const RELEASED_TOKENS: usize = 145_469;
/// Items per SETITEMS batch in a pickled dict (pickle.py `_BATCHSIZE`).
const PICKLE_BATCH: usize = 1000;

/// The weights entry of the model with `nlayers` layers.
pub fn model_entry(nlayers: u64) -> Result<&'static str> {
    match nlayers {
        33 => Ok("uce-33l-model"),
        4 => Ok("uce-4l-model"),
        n => Err(Error::BadOption {
            option: "--nlayers".into(),
            detail: format!("{n}: UCE's released models have 33 layers (33l_8ep_1024t_1280.torch) or 4 (4layer_model.torch)"),
            hint: Some("pass --nlayers 33 (the paper model, the default) or --nlayers 4".into()),
        }),
    }
}

/// Every weights entry a run with `nlayers` layers reads.
pub fn required_entries(nlayers: u64) -> Result<Vec<&'static str>> {
    let mut v = vec![model_entry(nlayers)?];
    v.extend_from_slice(COMMON_ENTRIES);
    Ok(v)
}

fn model_err(context: &str) -> impl Fn(candle_core::Error) -> Error + '_ {
    move |e| Error::Model { context: context.into(), detail: e.to_string() }
}

// ------------------------------------------------------------------------------------ config

/// eval_single_anndata.py's arguments that embedding reads (upstream's defaults), and the
/// heads run_eval hard-codes.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub species: String,
    pub nhead: usize,
    pub pad_length: usize,
    pub sample_size: usize,
    pub pad_token_idx: u32,
    pub chrom_token_right_idx: u32,
    pub cls_token_idx: u32,
    #[allow(non_snake_case)]
    pub chrom_token_offset: i64,
    /// `sc.pp.filter_genes(min_cells=10)` before embedding (upstream's `--filter`).
    pub min_cells: usize,
    /// `sc.pp.filter_cells(min_genes=25)`: upstream drops such cells; we embed them and count them.
    pub min_genes: usize,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            species: "human".into(),
            nhead: 20,
            pad_length: 1536,
            sample_size: 1024,
            pad_token_idx: 0,
            chrom_token_right_idx: 2,
            cls_token_idx: 3,
            chrom_token_offset: 143_574,
            min_cells: 10,
            min_genes: 25,
        }
    }
}

// ----------------------------------------------------------------------------- species files

/// The upper-cased keys of a protein-embedding file, first occurrence kept, in file order
/// (`list({k.upper(): v for k, v in torch.load(f).items()})`). Only the pickle is read.
pub fn protein_embedding_genes(path: &Path) -> Result<Vec<String>> {
    if !path.is_file() {
        return Err(Error::MissingFile { path: path.into() });
    }
    let infos = candle_core::pickle::read_pth_tensor_info(path, false, None).map_err(|e| Error::BadWeights {
        path: path.into(),
        detail: format!("not a PyTorch file of a dict {{gene symbol: tensor}} (UCE's protein embeddings): {e}"),
    })?;
    if infos.is_empty() {
        return Err(Error::BadWeights { path: path.into(), detail: "holds no gene embeddings (expected a dict {gene symbol: tensor} saved by torch.save)".into() });
    }
    // candle's reader adds each SETITEMS batch's pairs last to first; pickle writes a dict in
    // batches of 1,000 items (pickle.py `_BATCHSIZE`, the same in the C pickler), so reversing
    // each run of 1,000 restores the file's order.
    let names: Vec<String> = infos.chunks(PICKLE_BATCH).flat_map(|c| c.iter().rev().map(|t| t.name.to_uppercase())).collect();
    let mut seen = HashSet::with_capacity(names.len());
    Ok(names.into_iter().filter(|g| seen.insert(g.clone())).collect())
}

/// The species' first token row in species_offsets.pkl (a pickled dict {species: int}).
pub fn species_offset(path: &Path, species: &str) -> Result<i64> {
    use crate::formats::pickle::{read_pickle, Py};
    let bytes = std::fs::read(path).map_err(|e| if e.kind() == std::io::ErrorKind::NotFound { Error::MissingFile { path: path.into() } } else { Error::Io { path: path.into(), source: e } })?;
    let bad = |detail: String| Error::BadField {
        path: path.into(),
        field: species.into(),
        detail,
        hint: Some("species_offsets.pkl is a pickled dict {species: first token row}, as upstream's figshare file; see docs/uce.md".into()),
    };
    let v = read_pickle(&bytes).map_err(|e| bad(format!("not a data pickle: {e}")))?;
    let Py::Dict(items) = &v else { return Err(bad("is not a pickled dict".into())) };
    let mut keys = Vec::new();
    for (k, v) in items {
        if let Py::Str(s) = k {
            if s == species {
                return match v {
                    Py::Int(i) if *i >= 0 => Ok(*i),
                    other => Err(bad(format!("the offset of {species:?} is {other:?}, not a non-negative integer"))),
                };
            }
            keys.push(s.clone());
        }
    }
    Err(bad(format!("has no species {species:?}; it has {}", keys.join(", "))))
}

/// Split one CSV line into fields (double quotes, `""` inside them).
fn csv_fields(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                cur.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => out.push(std::mem::take(&mut cur)),
            (c, _) => cur.push(c),
        }
    }
    out.push(cur);
    out
}

/// species_chrom.csv for one species: each gene's chromosome code and start.
#[derive(Debug, Clone)]
pub struct ChromTable {
    /// upper-cased symbol -> (chromosome code, start); NaN start where the csv has none.
    pub genes: HashMap<String, (i64, f64)>,
    /// All `species_chromosome` categories of the csv, sorted (their index is the code).
    pub categories: Vec<String>,
    /// Symbols of the species listed more than once (the first row is used).
    pub duplicates: usize,
}

impl ChromTable {
    pub fn load(path: &Path, species: &str) -> Result<ChromTable> {
        let text = std::fs::read_to_string(path).map_err(|e| if e.kind() == std::io::ErrorKind::NotFound { Error::MissingFile { path: path.into() } } else { Error::Io { path: path.into(), source: e } })?;
        Self::parse(&text, path, species)
    }

    pub fn parse(text: &str, path: &Path, species: &str) -> Result<ChromTable> {
        let mut lines = text.lines();
        let header = csv_fields(lines.next().unwrap_or(""));
        let col = |name: &str| -> Result<usize> {
            header.iter().position(|h| h.trim() == name).ok_or_else(|| Error::BadField {
                path: path.into(),
                field: name.into(),
                detail: format!("column missing; the header is {}", header.join(",")),
                hint: Some("species_chrom.csv has the columns species, gene_symbol, chromosome, start (upstream's figshare file); see docs/uce.md".into()),
            })
        };
        let (cs, cg, cc, cst) = (col("species")?, col("gene_symbol")?, col("chromosome")?, col("start")?);
        let mut rows = Vec::new();
        let mut cats = BTreeSet::new();
        for (i, line) in lines.enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let f = csv_fields(line.trim_end_matches('\r'));
            let get = |c: usize| f.get(c).map(String::as_str).unwrap_or("");
            // pandas: an empty species or chromosome is NaN, and so is their concatenation
            let cat = if get(cs).is_empty() || get(cc).is_empty() { None } else { Some(format!("{}_{}", get(cs), get(cc))) };
            if let Some(c) = &cat {
                cats.insert(c.clone());
            }
            if get(cs) == species {
                let s = get(cst).trim();
                let start = if s.is_empty() {
                    f64::NAN
                } else {
                    s.parse::<f64>().map_err(|e| Error::Parse { path: path.into(), line: i + 2, detail: format!("start {s:?}: {e}"), hint: None })?
                };
                rows.push((get(cg).to_string(), cat, start));
            }
        }
        if rows.is_empty() {
            return Err(Error::BadField { path: path.into(), field: "species".into(), detail: format!("no row for species {species:?}"), hint: None });
        }
        let categories: Vec<String> = cats.into_iter().collect();
        let code: HashMap<&str, i64> = categories.iter().enumerate().map(|(i, c)| (c.as_str(), i as i64)).collect();
        let mut genes = HashMap::with_capacity(rows.len());
        let mut duplicates = 0;
        for (g, cat, start) in rows {
            let c = cat.as_deref().map(|c| code[c]).unwrap_or(-1);
            if genes.contains_key(&g) {
                duplicates += 1;
            } else {
                genes.insert(g, (c, start));
            }
        }
        Ok(ChromTable { genes, categories, duplicates })
    }
}

// ------------------------------------------------------------------------------------- genes

/// What happened to each var gene, and the kept genes' tokens, chromosomes and starts.
#[derive(Debug, Clone)]
pub struct GeneMap {
    /// For each var gene: its index among the kept genes, or None.
    pub kept: Vec<Option<u32>>,
    pub token: Vec<u32>,
    pub chrom: Vec<i64>,
    pub start: Vec<f64>,
    /// Genes dropped as expressed in fewer than `min_cells` cells.
    pub filtered: usize,
    /// Genes (that passed the filter) without a protein embedding.
    pub no_embedding: usize,
    /// Genes with an embedding but no row in species_chrom.csv (upstream fails on them).
    pub no_chromosome: usize,
}

impl GeneMap {
    /// `names`: var symbols; `cells_expressing`: cells with a value > 0, per var gene.
    pub fn new(names: &[String], cells_expressing: &[usize], min_cells: usize, pe_genes: &[String], offset: i64, chroms: &ChromTable) -> GeneMap {
        let pos: HashMap<&str, usize> = pe_genes.iter().enumerate().map(|(i, g)| (g.as_str(), i)).collect();
        let mut m = GeneMap { kept: vec![None; names.len()], token: vec![], chrom: vec![], start: vec![], filtered: 0, no_embedding: 0, no_chromosome: 0 };
        for (j, n) in names.iter().enumerate() {
            if cells_expressing[j] < min_cells {
                m.filtered += 1;
                continue;
            }
            let up = n.to_uppercase();
            let Some(&p) = pos.get(up.as_str()) else {
                m.no_embedding += 1;
                continue;
            };
            let Some(&(c, s)) = chroms.genes.get(&up) else {
                m.no_chromosome += 1;
                continue;
            };
            m.kept[j] = Some(m.token.len() as u32);
            m.token.push((p as i64 + offset) as u32);
            m.chrom.push(c);
            m.start.push(s);
        }
        m
    }

    pub fn n_kept(&self) -> usize {
        self.token.len()
    }
}

/// Cells with a value > 0 in each gene over the whole matrix (`sc.pp.filter_genes` counts).
pub fn cells_expressing(x: &crate::anndata::Matrix, n_vars: usize) -> Result<Vec<usize>> {
    let mut n = vec![0usize; n_vars];
    for (s, e) in x.blocks(4_000_000) {
        let b = x.read_rows(s, e)?;
        for i in 0..b.n_rows() {
            let (idx, vals) = b.row(i);
            for (&j, &v) in idx.iter().zip(vals) {
                if v > 0.0 {
                    n[j as usize] += 1;
                }
            }
        }
    }
    Ok(n)
}

/// A cell's kept genes (ascending, indices into `map`) with their counts, the values truncated
/// to integers as upstream's int64 memmap does; Err(value) at a negative value.
pub fn cell_counts(idx: &[u32], vals: &[f32], map: &GeneMap) -> std::result::Result<(Vec<u32>, Vec<i64>), f32> {
    let mut pairs = Vec::with_capacity(idx.len());
    for (&j, &v) in idx.iter().zip(vals) {
        if v < 0.0 {
            return Err(v);
        }
        if let Some(k) = map.kept.get(j as usize).copied().flatten() {
            let c = v as i64;
            if c > 0 {
                pairs.push((k, c));
            }
        }
    }
    pairs.sort_by_key(|p| p.0);
    Ok(pairs.into_iter().unzip())
}

/// numpy's `np.random.choice(n, size, p=p, replace=True)` over the genes with weight > 0 (in
/// order): indices into `p`.
pub fn choice(p: &[f64], size: usize, rng: &mut Mt19937) -> Vec<usize> {
    let mut cdf = Vec::with_capacity(p.len());
    let mut acc = 0f64;
    for &x in p {
        acc += x;
        cdf.push(acc);
    }
    let last = acc;
    for c in &mut cdf {
        *c /= last;
    }
    (0..size)
        .map(|_| {
            let u = rng.next_f64();
            cdf.partition_point(|&c| c <= u).min(p.len() - 1)
        })
        .collect()
}

/// One cell's sentence: token ids from CLS to the last close token (no padding). `genes` and
/// `counts` are the cell's kept genes (indices into `map`, ascending) and their counts; None when
/// the cell has no count in any kept gene.
pub fn sentence(genes: &[u32], counts: &[i64], map: &GeneMap, cfg: &Config, seed: u64, row: usize) -> Result<Option<Vec<u32>>> {
    // MultiDatasetSentences.__getitem__: log1p of the int64 counts (float32), over their sum
    let l: Vec<f32> = counts.iter().map(|&c| (c as f64).ln_1p() as f32).collect();
    let s1 = l.iter().map(|&x| x as f64).sum::<f64>() as f32;
    if !(s1 > 0.0) {
        return Ok(None);
    }
    let w: Vec<f32> = l.iter().map(|&x| x / s1).collect();
    // sample_cell_sentences: `weights / sum(weights)`, the builtin sum giving a float64 in numpy 1.x
    let s2 = w.iter().fold(0f64, |a, &x| a + x as f64) as f32;
    let p: Vec<f64> = w.iter().map(|&x| (x / s2) as f64).collect();
    let mut rng = cell_rng(seed, row);
    let idx = choice(&p, cfg.sample_size, &mut rng);
    let chosen: Vec<usize> = idx.iter().map(|&i| genes[i] as usize).collect();
    let uq: Vec<i64> = chosen.iter().map(|&g| map.chrom[g]).collect::<BTreeSet<_>>().into_iter().collect();
    let perm = rng.permutation(uq.len());
    let mut out = Vec::with_capacity(cfg.sample_size + 2 * uq.len() + 1);
    out.push(cfg.cls_token_idx);
    for &k in &perm {
        let c = uq[k];
        out.push((c + cfg.chrom_token_offset) as u32);
        let mut on: Vec<usize> = chosen.iter().copied().filter(|&g| map.chrom[g] == c).collect();
        on.sort_by(|&a, &b| map.start[a].total_cmp(&map.start[b]).then(a.cmp(&b)));
        out.extend(on.iter().map(|&g| map.token[g]));
        out.push(cfg.chrom_token_right_idx);
    }
    if out.len() > cfg.pad_length {
        return Err(Error::Model {
            context: "building a UCE cell sentence".into(),
            detail: format!("cell {row}: {} tokens ({} genes on {} chromosomes) exceed pad_length {}", out.len(), cfg.sample_size, uq.len(), cfg.pad_length),
        });
    }
    Ok(Some(out))
}

// ------------------------------------------------------------------------------------- model

/// The sizes read from a checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Dims {
    pub tokens: usize,
    pub token_dim: usize,
    pub d_model: usize,
    pub d_hid: usize,
    pub nlayers: usize,
    pub decoder_hidden: usize,
    pub output_dim: usize,
}

/// UCE's TransformerModel as run_eval runs it (binary_decoder and gene_embedding_layer, used in
/// training only, are not read).
pub struct Uce {
    pub cfg: Config,
    pub dims: Dims,
    pub path: PathBuf,
    table: Embedding,
    pe: Tensor,
    enc_linear: Linear,
    enc_norm: LayerNorm,
    /// the transformer's layers over packed sentences (on a GPU in bf16, `gpu::fused_encoder`)
    encoder: TransformerStack,
    decoder: Vec<(Linear, LayerNorm)>,
    dec_out: Linear,
    device: Device,
}

/// `PositionalEncoding`'s buffer, computed as upstream does in float32 (for a checkpoint without
/// `pos_encoder.pe`; the released ones have it).
fn positional_table(max_len: usize, d: usize) -> Vec<f32> {
    let f = (-(10000f64.ln()) / d as f64) as f32;
    let div: Vec<f32> = (0..d).step_by(2).map(|k| ((k as f32) * f).exp()).collect();
    let mut pe = vec![0f32; max_len * d];
    for p in 0..max_len {
        for (i, &dv) in div.iter().enumerate() {
            let a = (p as f32 * dv) as f64;
            pe[p * d + 2 * i] = a.sin() as f32;
            if 2 * i + 1 < d {
                pe[p * d + 2 * i + 1] = a.cos() as f32;
            }
        }
    }
    pe
}

impl Uce {
    /// Load a UCE .torch checkpoint on the CPU in float32.
    pub fn load(path: &Path, cfg: Config) -> Result<Uce> {
        Self::load_on(path, cfg, DType::F32, Device::Cpu)
    }

    /// Load a UCE .torch checkpoint (a state_dict) with its weights in `dtype` on `device`.
    pub fn load_on(path: &Path, cfg: Config, dtype: DType, device: Device) -> Result<Uce> {
        if !path.is_file() {
            return Err(Error::MissingFile { path: path.into() });
        }
        let bad = |detail: String| Error::BadWeights { path: path.into(), detail };
        let list = candle_core::pickle::read_all(path).map_err(|e| bad(format!("not a PyTorch state_dict checkpoint (UCE's .torch): {e}")))?;
        let tensors: HashMap<String, Tensor> = list.into_iter().map(|(k, t)| (k.strip_prefix("module.").map(str::to_string).unwrap_or(k), t)).collect();
        let dims2 = |k: &str| -> Result<(usize, usize)> {
            tensors.get(k).ok_or_else(|| bad(missing_key(k, &tensors)))?.dims2().map_err(|e| bad(format!("{k}: {e}")))
        };
        let (tokens, token_dim) = dims2("pe_embedding.weight")?;
        let (d_model, td) = dims2("encoder.0.weight")?;
        if td != token_dim {
            return Err(bad(format!("encoder.0.weight takes {td}-d tokens but pe_embedding.weight has {token_dim}")));
        }
        let mut nlayers = 0;
        while tensors.contains_key(&format!("transformer_encoder.layers.{nlayers}.linear1.weight")) {
            nlayers += 1;
        }
        if nlayers == 0 {
            return Err(bad(missing_key("transformer_encoder.layers.0.linear1.weight", &tensors)));
        }
        let (d_hid, _) = dims2("transformer_encoder.layers.0.linear1.weight")?;
        let (decoder_hidden, _) = dims2("decoder.0.0.weight")?;
        let (output_dim, _) = dims2("decoder.3.weight")?;
        if d_model % cfg.nhead != 0 {
            return Err(bad(format!("d_model {d_model} is not divisible by {} heads", cfg.nhead)));
        }
        let dims = Dims { tokens, token_dim, d_model, d_hid, nlayers, decoder_hidden, output_dim };
        let pe = match tensors.get("pos_encoder.pe") {
            Some(t) => {
                let n = t.elem_count() / d_model;
                t.reshape((n, d_model)).map_err(|e| bad(format!("pos_encoder.pe: {e}")))?
            }
            None => Tensor::from_vec(positional_table(cfg.pad_length, d_model), (cfg.pad_length, d_model), &Device::Cpu).map_err(|e| bad(e.to_string()))?,
        };
        if pe.dims()[0] < cfg.pad_length {
            return Err(bad(format!("pos_encoder.pe has {} positions, fewer than pad_length {}", pe.dims()[0], cfg.pad_length)));
        }
        let pe = pe.to_dtype(dtype).and_then(|t| t.to_device(&device)).map_err(|e| bad(e.to_string()))?;
        let vb = VarBuilder::from_tensors(tensors, dtype, &device);
        let build = || -> candle_core::Result<_> {
            let table = candle_nn::embedding(tokens, token_dim, vb.pp("pe_embedding"))?;
            let enc_linear = candle_nn::linear(token_dim, d_model, vb.pp("encoder.0"))?;
            let enc_norm = candle_nn::layer_norm(d_model, 1e-5, vb.pp("encoder.2"))?;
            let layers = (0..nlayers).map(|i| TransformerLayer::from_torch_encoder_layer(d_model, d_hid, vb.pp(format!("transformer_encoder.layers.{i}")))).collect::<candle_core::Result<Vec<_>>>()?;
            let widths = [(d_model, decoder_hidden), (decoder_hidden, output_dim), (output_dim, output_dim)];
            let decoder = widths
                .iter()
                .enumerate()
                .map(|(i, &(a, b))| Ok((candle_nn::linear(a, b, vb.pp(format!("decoder.{i}.0")))?, candle_nn::layer_norm(b, 1e-5, vb.pp(format!("decoder.{i}.1")))?)))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let dec_out = candle_nn::linear(output_dim, output_dim, vb.pp("decoder.3"))?;
            Ok((table, enc_linear, enc_norm, layers, decoder, dec_out))
        };
        let (table, enc_linear, enc_norm, layers, decoder, dec_out) = build().map_err(|e| bad(format!("is not a UCE TransformerModel state_dict: {e}")))?;
        let encoder = TransformerStack::new(layers, cfg.nhead, 1e-5, Act::Relu);
        Ok(Uce { cfg, dims, path: path.into(), table, pe, enc_linear, enc_norm, encoder, decoder, dec_out, device })
    }

    pub fn dim(&self) -> usize {
        self.dims.output_dim
    }

    /// CHROM_TOKEN_OFFSET for this checkpoint and a csv with `n_categories` chromosome
    /// categories: upstream's 143,574 for the released table (145,469 rows); for another table,
    /// built as upstream builds it (the token rows, then one row per chromosome category), the
    /// rows before the chromosome rows.
    pub fn chrom_offset(&self, n_categories: usize) -> i64 {
        if self.dims.tokens == RELEASED_TOKENS || self.dims.tokens < n_categories {
            self.cfg.chrom_token_offset
        } else {
            (self.dims.tokens - n_categories) as i64
        }
    }

    /// The largest token id a sentence may hold.
    pub fn check_tokens(&self, max_token: u32) -> Result<()> {
        if max_token as usize >= self.dims.tokens {
            return Err(Error::BadWeights {
                path: self.path.clone(),
                detail: format!(
                    "its token table (pe_embedding.weight) has {} rows, but the species files give token {max_token}: the checkpoint and the species files do not belong together",
                    self.dims.tokens
                ),
            });
        }
        Ok(())
    }

    /// The L2-normalised cell embeddings of sentences (each from CLS on, unpadded): n x output_dim,
    /// the sentences packed (see the module's note on padding).
    pub fn embed(&self, sentences: &[&[u32]]) -> Result<Vec<f32>> {
        if sentences.is_empty() {
            return Ok(vec![]);
        }
        self.embed_tensor(sentences)?.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(model_err("running the UCE transformer"))
    }

    /// As [`Self::embed`], as an f32 `n x output_dim` tensor on the model's device (not read
    /// back; `Batches::run_lagged` reads it while the next batch runs).
    pub fn embed_tensor(&self, sentences: &[&[u32]]) -> Result<Tensor> {
        let ctx = model_err("running the UCE transformer");
        if sentences.is_empty() {
            let out = self.dec_out.weight().dims2().map_err(&ctx)?.0;
            return Tensor::zeros((0, out), DType::F32, &self.device).map_err(&ctx);
        }
        let p = Packed::new(sentences);
        let longest = sentences.iter().map(|s| s.len()).max().unwrap_or(0);
        if longest > self.pe.dims()[0] {
            return Err(Error::Model { context: "running the UCE transformer".into(), detail: format!("a sentence of {longest} tokens is longer than the positional table") });
        }
        (|| -> candle_core::Result<Tensor> {
            let ids = crate::gpu::upload::upload_u32(&p.ids, &self.device)?;
            let pos = crate::gpu::upload::upload_u32(&p.positions, &self.device)?;
            // run_eval: lookup, then nn.functional.normalize(dim=2) (eps 1e-12)
            let t = self.table.forward(&ids)?;
            let norm = t.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.maximum(1e-12)?;
            let t = t.broadcast_div(&norm)?;
            let h = self.enc_norm.forward(&self.enc_linear.forward(&t)?.gelu_erf()?)?;
            let h = ((h * (self.dims.d_model as f64).sqrt())? + self.pe.index_select(&pos, 0)?)?;
            let h = self.encoder.forward(&h, &p.cu)?;
            // the decoder on the CLS position, then nn.functional.normalize(dim=1)
            let mut h = p.first_rows(&h)?;
            for (lin, norm) in &self.decoder {
                h = norm.forward(&lin.forward(&h)?)?.gelu_erf()?;
            }
            let h = self.dec_out.forward(&h)?.to_dtype(DType::F32)?;
            let norm = h.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.maximum(1e-12)?;
            h.broadcast_div(&norm)
        })()
        .map_err(&ctx)
    }
}

fn missing_key(k: &str, tensors: &HashMap<String, Tensor>) -> String {
    let mut some: Vec<&String> = tensors.keys().collect();
    some.sort();
    let shown: Vec<&str> = some.iter().take(6).map(|s| s.as_str()).collect();
    format!(
        "has no tensor `{k}` (a UCE TransformerModel state_dict, as run_eval loads it, has it). It holds {} tensors: {}{}",
        tensors.len(),
        shown.join(", "),
        if tensors.len() > shown.len() { ", ..." } else { "" }
    )
}

/// The files of a run under a weights folder: (model, protein embeddings, chromosome csv, offsets).
pub fn files(weights_dir: &Path, manifest: &crate::weights::Manifest, nlayers: u64) -> Result<(PathBuf, PathBuf, PathBuf, PathBuf)> {
    let file = |id: &str, default: &str| weights_dir.join(manifest.weights.get(id).map(|e| e.file.clone()).unwrap_or_else(|| default.into()));
    let model = file(model_entry(nlayers)?, if nlayers == 4 { "uce/4layer_model.torch" } else { "uce/33l_8ep_1024t_1280.torch" });
    // the archive is extracted beside its file: uce/protein_embeddings/<species file>
    let archive = file("uce-esm2-human-protein-embeddings", "uce/protein_embeddings.tar.gz");
    let pe = archive.parent().unwrap_or(weights_dir).join(HUMAN_PE_FILE);
    Ok((model, pe, file("uce-species-chrom", "uce/species_chrom.csv"), file("uce-species-offsets", "uce/species_offsets.pkl")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_quotes() {
        assert_eq!(csv_fields(r#"human,"A,B",1,"x""y""#), vec!["human", "A,B", "1", "x\"y"]);
    }

    #[test]
    fn chrom_codes_are_sorted_categories_over_all_species() {
        let t = ChromTable::parse("species,gene_symbol,chromosome,start\nmouse,G1,2,5\nhuman,A,X,10\nhuman,B,10,3\nhuman,C,2,1\nhuman,A,1,9\nhuman,D,,4\n", Path::new("c.csv"), "human").unwrap();
        assert_eq!(t.categories, vec!["human_1", "human_10", "human_2", "human_X", "mouse_2"]);
        assert_eq!(t.genes["A"], (3, 10.0));
        assert_eq!(t.genes["B"], (1, 3.0));
        assert_eq!(t.genes["D"].0, -1);
        assert_eq!(t.duplicates, 1);
        let e = ChromTable::parse("species,gene,chromosome,start\n", Path::new("c.csv"), "human").unwrap_err();
        assert!(e.to_string().contains("gene_symbol"), "{e}");
    }

    #[test]
    fn choice_follows_the_cdf() {
        let mut r = Mt19937::new(0);
        let c = choice(&[0.0, 1.0, 0.0], 20, &mut r);
        assert!(c.iter().all(|&i| i == 1));
        let mut r = Mt19937::new(1);
        let c = choice(&[0.5, 0.5], 2000, &mut r);
        let ones = c.iter().filter(|&&i| i == 1).count();
        assert!((900..1100).contains(&ones), "{ones}");
    }

    #[test]
    fn nlayers_selects_the_model() {
        assert_eq!(model_entry(33).unwrap(), "uce-33l-model");
        assert_eq!(model_entry(4).unwrap(), "uce-4l-model");
        assert!(model_entry(12).unwrap_err().to_string().contains("33"));
    }
}
