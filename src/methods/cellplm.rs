//! CellPLM: Wen H, Tang W, Dai X, et al., "CellPLM: Pre-training of Cell Language Model Beyond
//! Single Cells", ICLR 2024, doi:10.1101/2023.10.13.562243; upstream code
//! https://github.com/OmicsML/CellPLM (read as the PyPI release cellplm 0.1.0.post2, the same
//! CellPLM/ tree: `pipeline/cell_embedding.py` CellEmbeddingPipeline, `pipeline/__init__.py`
//! load_pretrain and common_preprocess, `utils/data.py` TranscriptomicDataset,
//! `model/cellformer.py` OmicsFormer, `embedder/omics.py`, `layer/flowformer.py`,
//! `latent/autoencoders.py` GMVAELatentLayer).
//!
//! Cells are the tokens. A checkpoint is two files with one prefix (ckpt/README.md):
//! `<prefix>.config.json` (OmicsFormer's keyword arguments, the 19,374-gene `gene_list` among
//! them) and `<prefix>.best.ckpt` (torch.save of `{"model_state_dict": ...}`, read as data by
//! candle's pickle reader; nothing in it is executed). Upstream's load_pretrain keeps the
//! model's random initial value for any key the checkpoint lacks; we refuse such a checkpoint.
//!
//! The embedding (CellEmbeddingPipeline.predict; the model in eval mode, head_type 'embedder'):
//! - input: the data's genes that are in `gene_list` (others dropped, common_preprocess);
//!   model genes the data lacks contribute nothing. Raw counts, `log1p` (no library-size
//!   normalisation: sparse_tpm is commented out upstream).
//! - OmicsEmbeddingLayer: `log1p(x) @ emb[genes]` (a sparse matmul upstream); the positional
//!   term is `pe = 0.` upstream (the spatial encoder is commented out), so coordinates never
//!   matter; then `extra_linear` = Linear, ReLU, Dropout, norm (`norm` of the config:
//!   GroupNorm(4, d) in the released config, LayerNorm otherwise).
//! - the encoder: `enc_layers` Flowformer layers (pre-norm LayerNorm; Flow_Attention with
//!   `enc_head` heads over all cells of the forward pass; a feed-forward d -> 2d -> d with GELU).
//! - PreLatentNorm: LayerNorm(d).
//! - the latent layer: `gmvae` (released): q(y|x) logits over `num_clusters`, a one-hot y, then
//!   Linear(d + K, 512), ReLU, and the Gaussian's mean Linear(512, post_latent_dim) is the
//!   embedding. Upstream draws y in eval mode with Gumbel noise (so its embedding varies from
//!   call to call); we take the noise-free argmax of the logits (docs/cellplm.md). `vae`: the
//!   mean `hid_2mu`.
//!
//! Flow attention (Wu et al., Flowformer, ICML 2022; layer/flowformer.py), per head, with
//! q = sigmoid(x Wq), k = sigmoid(x Wk), v = x Wv over the L cells, eps = 1e-6:
//! incoming_i = 1 / ((q_i + eps) . (sum_j k_j + eps)), outgoing_j = 1 / ((k_j + eps) . (sum_i q_i + eps)),
//! conserved_sink_i = (q_i + eps) . (sum_j k_j outgoing_j + eps),
//! conserved_source_j = clamp((k_j + eps) . (sum_i q_i incoming_i + eps), -1, 1),
//! allocation_i = sigmoid(conserved_sink_i), competition_j = softmax_j(conserved_source) * L,
//! out_i = ((q_i incoming_i) (sum_j k_j^T (v_j competition_j))) allocation_i.
//!
//! Precision: f32 is upstream's computation, what the CPU and `--precision f32` run. On a GPU
//! `embed` runs bf16 by default (methods/cellplm.toml's `[precision]`: lowest cosine 0.999 to
//! f32 on real cells, the same scIB total; docs/cellplm.md). In bf16 the matrix products of the
//! embedder and of the encoder's Linear layers take bf16 inputs and weights and return f32, as
//! torch's autocast runs `nn.Linear`; the flow attention's sums over all cells of the pass, the
//! norms and the latent head (whose argmax picks the cluster) stay in f32.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{LayerNorm, Linear};
use serde_json::Value;

use crate::error::{Error, Result};

/// The checkpoint the tutorials load (tutorials/cell_embedding.ipynb).
pub const RELEASED_PREFIX: &str = "20231027_85M";
/// The weights entries (weights.toml).
pub const REQUIRED_ENTRIES: &[&str] = &["cellplm-20231027-85m-ckpt", "cellplm-20231027-85m-config"];
/// Flow_Attention's eps.
const FLOW_EPS: f64 = 1e-6;
/// nn.LayerNorm / nn.GroupNorm default eps.
const NORM_EPS: f64 = 1e-5;
/// create_norm's groups for 'groupnorm'.
const GROUPS: usize = 4;
/// InferenceNet's q(z|y,x) hidden width (hard-coded upstream).
const QZ_HIDDEN: usize = 512;

/// The norm of the embedder's extra_linear (`norm` in the config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Norm {
    Layer,
    Group,
}

/// The latent layer (`latent_mod`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LatentKind {
    /// GMVAELatentLayer with this many clusters: the embedding is the mean of q(z|x, y).
    Gmvae(usize),
    /// VAELatentLayer: the embedding is hid_2mu(h).
    Vae,
}

/// What the model needs from `<prefix>.config.json` (OmicsFormer's defaults where absent).
#[derive(Debug, Clone)]
pub struct Config {
    pub gene_list: Vec<String>,
    pub enc_hid: usize,
    pub enc_layers: usize,
    pub enc_head: usize,
    pub post_latent_dim: usize,
    pub norm: Norm,
    pub latent: LatentKind,
}

impl Config {
    /// The released 85M model's architecture (ckpt/20230926_85M.config.json) with `genes` genes
    /// named g0, g1, ...: for throughput runs with random weights.
    pub fn released(genes: usize) -> Config {
        Config {
            gene_list: (0..genes).map(|i| format!("g{i}")).collect(),
            enc_hid: 1024,
            enc_layers: 4,
            enc_head: 8,
            post_latent_dim: 512,
            norm: Norm::Group,
            latent: LatentKind::Gmvae(16),
        }
    }

    /// Read upstream's `<prefix>.config.json`, refusing options whose code path the embedding
    /// pipeline cannot run (or that we do not implement), with the key named.
    pub fn read(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                Error::MissingFile { path: path.into() }
            } else {
                Error::Io { path: path.into(), source: e }
            }
        })?;
        let v: Value = serde_json::from_str(&text).map_err(|e| Error::BadField {
            path: path.into(),
            field: "(json)".into(),
            detail: format!("not JSON: {e}"),
            hint: Some("a CellPLM checkpoint config is the `<prefix>.config.json` beside `<prefix>.best.ckpt`".into()),
        })?;
        Config::from_json(&v, path)
    }

    pub fn from_json(v: &Value, path: &Path) -> Result<Config> {
        let bad = |field: &str, detail: String| Error::BadField {
            path: path.into(),
            field: field.into(),
            detail,
            hint: Some("a CellPLM checkpoint config as upstream's load_pretrain reads it (ckpt/20230926_85M.config.json has the released keys)".into()),
        };
        let num = |k: &str, default: Option<u64>| -> Result<usize> {
            match v.get(k) {
                Some(x) => x.as_u64().map(|n| n as usize).filter(|&n| n > 0).ok_or_else(|| bad(k, format!("is {x}, not a positive integer"))),
                None => default.map(|d| d as usize).ok_or_else(|| bad(k, "is missing".into())),
            }
        };
        let text = |k: &str, default: &str| -> Result<String> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(default.to_string()),
                Some(Value::String(s)) => Ok(s.clone()),
                Some(x) => Err(bad(k, format!("is {x}, not a string"))),
            }
        };
        let flag = |k: &str, default: bool| -> bool { v.get(k).and_then(Value::as_bool).unwrap_or(default) };
        let genes = v.get("gene_list").and_then(Value::as_array).ok_or_else(|| bad("gene_list", "is missing or not a list".into()))?;
        let gene_list: Vec<String> = genes.iter().map(|g| g.as_str().map(str::to_string).ok_or_else(|| bad("gene_list", format!("holds {g}, not a gene name")))).collect::<Result<_>>()?;
        if gene_list.is_empty() {
            return Err(bad("gene_list", "is empty".into()));
        }
        let enc_mod = text("enc_mod", "")?;
        if enc_mod != "flowformer" {
            return Err(bad("enc_mod", format!("is {enc_mod:?}: scfoundry runs CellPLM's flowformer encoder (the released checkpoints')")));
        }
        let enc_hid = num("enc_hid", None)?;
        let enc_head = num("enc_head", Some(8))?;
        if enc_hid % enc_head != 0 {
            return Err(bad("enc_head", format!("{enc_head} heads do not divide enc_hid {enc_hid}")));
        }
        let norm = match text("norm", "layernorm")?.as_str() {
            "layernorm" => Norm::Layer,
            "groupnorm" if enc_hid % GROUPS == 0 => Norm::Group,
            other => return Err(bad("norm", format!("is {other:?}: the embedder's layernorm and groupnorm (with enc_hid divisible by {GROUPS}) are supported"))),
        };
        let latent = match text("latent_mod", "vae")?.as_str() {
            "gmvae" => LatentKind::Gmvae(num("num_clusters", Some(16))?),
            "vae" => LatentKind::Vae,
            other => return Err(bad("latent_mod", format!("is {other:?}: the gmvae (released) and vae latent layers are supported"))),
        };
        // code paths the embedding pipeline cannot take or we do not run
        // pe_type defaults to 'sin' (a positional encoder exists) unless null
        let has_pe = !matches!(v.get("pe_type"), Some(Value::Null));
        if has_pe && flag("cat_pe", true) {
            return Err(bad("cat_pe", "is true (or missing: default true) with a positional encoding: upstream's OmicsEmbeddingLayer then concatenates the constant pe = 0. and fails; the released config has cat_pe false".into()));
        }
        for (k, why) in [
            ("input_covariate", "adds a batch embedding that the embedding pipeline never provides"),
            ("dsbn", "normalises per dataset, which the embedding pipeline never provides"),
            ("dar", "adds an adversarial latent layer"),
            ("ecs", "adds an ECS latent layer"),
        ] {
            if flag(k, false) {
                return Err(bad(k, format!("is true: it {why}; scfoundry runs the released configuration (false)")));
            }
        }
        Ok(Config { gene_list, enc_hid, enc_layers: num("enc_layers", None)?, enc_head, post_latent_dim: num("post_latent_dim", None)?, norm, latent })
    }

    /// Width of the embedding.
    pub fn dim(&self) -> usize {
        self.post_latent_dim
    }

    /// Every tensor the embedding reads, with its shape (state_dict keys of OmicsFormer).
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let d = self.enc_hid;
        let mut t: Vec<(String, Vec<usize>)> = vec![
            ("embedder.feat_enc.emb".into(), vec![self.gene_list.len(), d]),
            ("embedder.extra_linear.0.weight".into(), vec![d, d]),
            ("embedder.extra_linear.0.bias".into(), vec![d]),
            ("embedder.extra_linear.3.weight".into(), vec![d]),
            ("embedder.extra_linear.3.bias".into(), vec![d]),
        ];
        for i in 0..self.enc_layers {
            let p = format!("encoder.layers.{i}");
            for proj in ["query", "key", "value", "out"] {
                t.push((format!("{p}.self_attn.{proj}_projection.weight"), vec![d, d]));
                t.push((format!("{p}.self_attn.{proj}_projection.bias"), vec![d]));
            }
            t.push((format!("{p}._ff_block.0.weight"), vec![2 * d, d]));
            t.push((format!("{p}._ff_block.0.bias"), vec![2 * d]));
            t.push((format!("{p}._ff_block.3.weight"), vec![d, 2 * d]));
            t.push((format!("{p}._ff_block.3.bias"), vec![d]));
            for n in ["norm1", "norm2"] {
                t.push((format!("{p}.{n}.weight"), vec![d]));
                t.push((format!("{p}.{n}.bias"), vec![d]));
            }
        }
        t.push(("pre_latent_norm.norm.weight".into(), vec![d]));
        t.push(("pre_latent_norm.norm.bias".into(), vec![d]));
        let z = self.post_latent_dim;
        match self.latent {
            LatentKind::Gmvae(k) => {
                let p = "latent.layers.1.inference";
                t.push((format!("{p}.inference_qyx.0.logits.weight"), vec![k, d]));
                t.push((format!("{p}.inference_qyx.0.logits.bias"), vec![k]));
                t.push((format!("{p}.inference_qzyx.0.weight"), vec![QZ_HIDDEN, d + k]));
                t.push((format!("{p}.inference_qzyx.0.bias"), vec![QZ_HIDDEN]));
                t.push((format!("{p}.inference_qzyx.2.mu.weight"), vec![z, QZ_HIDDEN]));
                t.push((format!("{p}.inference_qzyx.2.mu.bias"), vec![z]));
            }
            LatentKind::Vae => {
                t.push(("latent.layers.1.hid_2mu.weight".into(), vec![z, d]));
                t.push(("latent.layers.1.hid_2mu.bias".into(), vec![z]));
            }
        }
        t
    }
}

/// The two files of a checkpoint in `dir`: `<prefix>.config.json` and `<prefix>.best.ckpt`.
pub fn checkpoint_files(dir: &Path, prefix: &str) -> (PathBuf, PathBuf) {
    (dir.join(format!("{prefix}.config.json")), dir.join(format!("{prefix}.best.ckpt")))
}

/// The prefix of the one checkpoint in `dir` (a `<prefix>.best.ckpt` with its config beside it).
pub fn find_prefix(dir: &Path) -> Result<String> {
    let entries = std::fs::read_dir(dir).map_err(|e| if e.kind() == std::io::ErrorKind::NotFound { Error::MissingFile { path: dir.into() } } else { Error::Io { path: dir.into(), source: e } })?;
    let mut found: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.strip_suffix(".best.ckpt")).map(str::to_string))
        .collect();
    found.sort();
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => Err(Error::BadField {
            path: dir.into(),
            field: "*.best.ckpt".into(),
            detail: "holds no CellPLM checkpoint (`<prefix>.best.ckpt` with `<prefix>.config.json` beside it)".into(),
            hint: Some("--model-dir must name the folder of the two files, as upstream's pretrain_directory".into()),
        }),
        _ => Err(Error::BadField {
            path: dir.into(),
            field: "*.best.ckpt".into(),
            detail: format!("holds {} checkpoints ({}): which one is meant is not clear", found.len(), found.join(", ")),
            hint: Some("keep one `<prefix>.best.ckpt` and its config in the folder given to --model-dir".into()),
        }),
    }
}

/// The data's genes against the model's gene_list (common_preprocess, then OmicsEmbedder):
/// each data column's row of the gene embedding table, or None when the gene is not a model gene.
#[derive(Debug, Clone)]
pub struct Alignment {
    pub column: Vec<Option<u32>>,
    /// Data columns used.
    pub matched: usize,
    /// Model genes present in the data (distinct).
    pub model_genes_present: usize,
}

impl Alignment {
    pub fn new(data_genes: &[String], gene_list: &[String]) -> Alignment {
        // OmicsEmbedder.gene_index = dict(zip(gene_list, range)): a repeated name keeps its last row
        let index: HashMap<&str, u32> = gene_list.iter().enumerate().map(|(i, g)| (g.as_str(), i as u32)).collect();
        let column: Vec<Option<u32>> = data_genes.iter().map(|g| index.get(g.as_str()).copied()).collect();
        let matched = column.iter().filter(|c| c.is_some()).count();
        let model_genes_present = column.iter().flatten().collect::<std::collections::HashSet<_>>().len();
        Alignment { column, matched, model_genes_present }
    }

    /// The embedding rows of the used columns, in data order (upstream's `gene_idx`).
    pub fn gene_idx(&self) -> Vec<u32> {
        self.column.iter().flatten().copied().collect()
    }

    /// One cell's (model gene row, log1p count) pairs, from a CSR row of the data.
    pub fn cell(&self, idx: &[u32], vals: &[f32]) -> Vec<(u32, f32)> {
        idx.iter().zip(vals).filter_map(|(&j, &v)| self.column[j as usize].map(|g| (g, v.ln_1p()))).filter(|&(_, v)| v != 0.0).collect()
    }
}

/// Which cells share a forward pass, as CellEmbeddingPipeline._inference makes them: cells grouped
/// by their `labels` (TranscriptomicDataset: obs['batch'], groups in sorted label order; one group
/// without labels), each group cut into chunks of `batch_size` cells in data order
/// (`batch_size` 0: the whole group).
pub fn attention_batches(labels: Option<&[String]>, n: usize, batch_size: usize) -> Vec<Vec<usize>> {
    let groups: Vec<Vec<usize>> = match labels {
        None => vec![(0..n).collect()],
        Some(l) => {
            let mut by: std::collections::BTreeMap<&str, Vec<usize>> = std::collections::BTreeMap::new();
            for (i, s) in l.iter().enumerate().take(n) {
                by.entry(s.as_str()).or_default().push(i);
            }
            by.into_values().collect()
        }
    };
    let mut out = Vec::new();
    for g in groups {
        if g.is_empty() {
            continue;
        }
        let step = if batch_size == 0 { g.len() } else { batch_size };
        out.extend(g.chunks(step).map(<[usize]>::to_vec));
    }
    out
}

struct FlowLayer {
    q: Lin,
    k: Lin,
    v: Lin,
    o: Lin,
    norm1: LayerNorm,
    norm2: LayerNorm,
    ff1: Lin,
    ff2: Lin,
    heads: usize,
}

impl FlowLayer {
    /// Flow_Attention over the `l` rows of `x` (one sequence: the cells of the forward pass).
    fn attention(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (l, d) = x.dims2()?;
        let h = self.heads;
        let dh = d / h;
        let split = |t: Tensor| t.reshape((l, h, dh))?.transpose(0, 1)?.contiguous(); // (h, l, dh)
        let x = x.to_dtype(self.q.dtype())?; // cast once for the three projections
        let q = split(candle_nn::ops::sigmoid(&self.q.forward(&x)?)?)?;
        let k = split(candle_nn::ops::sigmoid(&self.k.forward(&x)?)?)?;
        let v = split(self.v.forward(&x)?)?;
        let qe = (&q + FLOW_EPS)?;
        let ke = (&k + FLOW_EPS)?;
        // (h, l, dh) . (h, dh, 1) -> (h, l, 1)
        let dot = |a: &Tensor, s: &Tensor| a.matmul(&s.transpose(1, 2)?.contiguous()?);
        let ksum = (k.sum_keepdim(1)? + FLOW_EPS)?; // (h, 1, dh)
        let qsum = (q.sum_keepdim(1)? + FLOW_EPS)?;
        let incoming = dot(&qe, &ksum)?.recip()?;
        let outgoing = dot(&ke, &qsum)?.recip()?;
        let k_out = (k.broadcast_mul(&outgoing)?.sum_keepdim(1)? + FLOW_EPS)?;
        let q_in = (q.broadcast_mul(&incoming)?.sum_keepdim(1)? + FLOW_EPS)?;
        let conserved_sink = dot(&qe, &k_out)?;
        let conserved_source = dot(&ke, &q_in)?.clamp(-1f32, 1f32)?;
        // sink_allocation: sigmoid(conserved_sink * L / S) with L = S
        let allocation = candle_nn::ops::sigmoid(&conserved_sink)?;
        let competition = (candle_nn::ops::softmax(&conserved_source, 1)? * l as f64)?;
        let kv = k.transpose(1, 2)?.contiguous()?.matmul(&v.broadcast_mul(&competition)?)?; // (h, dh, dh)
        let out = q.broadcast_mul(&incoming)?.matmul(&kv)?.broadcast_mul(&allocation)?; // (h, l, dh)
        let out = out.transpose(0, 1)?.contiguous()?.reshape((l, d))?;
        self.o.forward(&out)
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = (x + self.attention(&self.norm1.forward(x)?)?)?;
        let f = self.ff2.forward(&self.ff1.forward(&self.norm2.forward(&x)?)?.gelu_erf()?)?;
        x + f
    }
}

enum Latent {
    Gmvae { logits: Linear, hidden: Linear, mu: Linear, clusters: usize },
    Vae { mu: Linear },
}

/// `nn.Linear` whose product runs in its weight's dtype: the input is cast to it (a no-op when
/// it is already of that dtype) and the result returned as f32 (torch's autocast of a Linear;
/// the plain Linear when the weight is f32).
struct Lin(Linear);

impl Lin {
    fn dtype(&self) -> DType {
        self.0.weight().dtype()
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if self.dtype() == DType::F32 {
            return self.0.forward(x);
        }
        self.0.forward(&x.to_dtype(self.dtype())?)?.to_dtype(DType::F32)
    }
}

/// GroupNorm(groups, d) on (n, d) rows, eps 1e-5, with its affine weight and bias.
fn group_norm(x: &Tensor, groups: usize, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let (n, d) = x.dims2()?;
    let g = x.reshape((n, groups, d / groups))?;
    let mean = g.mean_keepdim(2)?;
    let c = g.broadcast_sub(&mean)?;
    let var = c.sqr()?.mean_keepdim(2)?;
    let y = c.broadcast_div(&(var + NORM_EPS)?.sqrt()?)?.reshape((n, d))?;
    y.broadcast_mul(w)?.broadcast_add(b)
}

/// The model, ready to embed (eval mode: dropout off).
pub struct CellPlm {
    pub cfg: Config,
    emb: Tensor,
    /// The gene table on the host, for the CPU's sparse sum.
    emb_host: Option<Vec<f32>>,
    extra: Lin,
    norm_w: Tensor,
    norm_b: Tensor,
    layers: Vec<FlowLayer>,
    pre_latent: LayerNorm,
    latent: Latent,
    pub device: Device,
    /// What the embedder's and the encoder's products run in (F32 or BF16: tasks ask for BF16 on
    /// a GPU only; the CPU takes it too, for the tests).
    pub dtype: DType,
}

fn missing_key(k: &str, tensors: &HashMap<String, Tensor>) -> String {
    let mut some: Vec<&String> = tensors.keys().collect();
    some.sort();
    let shown: Vec<&str> = some.iter().take(6).map(|s| s.as_str()).collect();
    format!(
        "model_state_dict has no tensor `{k}`, which the config's architecture needs (upstream's load_pretrain would leave it at a random value). It holds {} tensors: {}{}",
        tensors.len(),
        shown.join(", "),
        if tensors.len() > shown.len() { ", ..." } else { "" }
    )
}

impl CellPlm {
    /// Load `<prefix>.config.json` and `<prefix>.best.ckpt` from `dir` on `device`, the products
    /// in `dtype` (F32, upstream's; BF16 on a GPU: the module's "Precision").
    pub fn load(dir: &Path, prefix: &str, dtype: DType, device: Device) -> Result<CellPlm> {
        let (config, ckpt) = checkpoint_files(dir, prefix);
        let cfg = Config::read(&config)?;
        Self::from_checkpoint(&ckpt, cfg, dtype, device)
    }

    /// The weights of `cfg`'s architecture from a `.best.ckpt` (torch.save of
    /// {"model_state_dict": ...}); other keys (the pre-training decoder, the positional tables)
    /// are ignored as upstream's load_pretrain ignores them for the embedding head.
    pub fn from_checkpoint(path: &Path, cfg: Config, dtype: DType, device: Device) -> Result<CellPlm> {
        if !path.is_file() {
            return Err(Error::MissingFile { path: path.into() });
        }
        let bad = |detail: String| Error::BadWeights { path: path.into(), detail };
        let list = candle_core::pickle::read_all_with_key(path, Some("model_state_dict")).map_err(|e| {
            bad(format!("is not a CellPLM checkpoint (torch.save of {{\"model_state_dict\": ...}}, as upstream's load_pretrain reads `torch.load(ckpt)['model_state_dict']`): {e}"))
        })?;
        let all: HashMap<String, Tensor> = list.into_iter().collect();
        let mut needed = HashMap::new();
        for (k, shape) in cfg.tensors() {
            let t = all.get(&k).ok_or_else(|| bad(missing_key(&k, &all)))?;
            if t.dims() != shape.as_slice() {
                return Err(bad(format!("`{k}` has shape {:?}, but the config ({} genes, enc_hid {}, ...) needs {shape:?}: the config and checkpoint are not a pair", t.dims(), cfg.gene_list.len(), cfg.enc_hid)));
            }
            let t = t.to_dtype(DType::F32).and_then(|t| t.to_device(&device)).map_err(|e| bad(format!("{k}: {e}")))?;
            needed.insert(k, t);
        }
        Self::build(cfg, needed, dtype, device).map_err(|e| bad(e.to_string()))
    }

    /// Random weights (normal, sd 0.02; norms at scale 1, shift 0) at `cfg`'s size, seeded on the
    /// CPU then moved to `device`: for throughput runs.
    pub fn random(cfg: Config, dtype: DType, device: Device, seed: u64) -> Result<CellPlm> {
        use rand::SeedableRng;
        use rand_distr::Distribution;
        let me = |e: candle_core::Error| Error::Model { context: "making random CellPLM weights".into(), detail: e.to_string() };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let normal = rand_distr::Normal::new(0f32, 0.02).expect("valid normal");
        let mut t = HashMap::new();
        for (k, shape) in cfg.tensors() {
            let n: usize = shape.iter().product();
            let v: Vec<f32> = if k.contains("norm") && shape.len() == 1 || k.starts_with("embedder.extra_linear.3") {
                vec![if k.ends_with("weight") { 1.0 } else { 0.0 }; n]
            } else {
                (0..n).map(|_| normal.sample(&mut rng)).collect()
            };
            t.insert(k, Tensor::from_vec(v, shape, &device).map_err(me)?);
        }
        Self::build(cfg, t, dtype, device).map_err(me)
    }

    fn build(cfg: Config, mut t: HashMap<String, Tensor>, dtype: DType, device: Device) -> candle_core::Result<CellPlm> {
        fn take(t: &mut HashMap<String, Tensor>, k: &str) -> candle_core::Result<Tensor> {
            t.remove(k).ok_or_else(|| candle_core::Error::Msg(format!("no tensor `{k}`")))
        }
        fn linear(t: &mut HashMap<String, Tensor>, p: &str) -> candle_core::Result<Linear> {
            Ok(Linear::new(take(t, &format!("{p}.weight"))?, Some(take(t, &format!("{p}.bias"))?)))
        }
        // the products of the embedder and the encoder in `dtype`; the latent head stays f32
        let lin = |t: &mut HashMap<String, Tensor>, p: &str| -> candle_core::Result<Lin> {
            let l = linear(t, p)?;
            Ok(Lin(Linear::new(l.weight().to_dtype(dtype)?, l.bias().map(|b| b.to_dtype(dtype)).transpose()?)))
        };
        fn layer_norm(t: &mut HashMap<String, Tensor>, p: &str) -> candle_core::Result<LayerNorm> {
            Ok(LayerNorm::new(take(t, &format!("{p}.weight"))?, take(t, &format!("{p}.bias"))?, NORM_EPS))
        }
        let emb = take(&mut t, "embedder.feat_enc.emb")?;
        let extra = lin(&mut t, "embedder.extra_linear.0")?;
        let norm_w = take(&mut t, "embedder.extra_linear.3.weight")?;
        let norm_b = take(&mut t, "embedder.extra_linear.3.bias")?;
        let mut layers = Vec::with_capacity(cfg.enc_layers);
        for i in 0..cfg.enc_layers {
            let p = format!("encoder.layers.{i}");
            layers.push(FlowLayer {
                q: lin(&mut t, &format!("{p}.self_attn.query_projection"))?,
                k: lin(&mut t, &format!("{p}.self_attn.key_projection"))?,
                v: lin(&mut t, &format!("{p}.self_attn.value_projection"))?,
                o: lin(&mut t, &format!("{p}.self_attn.out_projection"))?,
                norm1: layer_norm(&mut t, &format!("{p}.norm1"))?,
                norm2: layer_norm(&mut t, &format!("{p}.norm2"))?,
                ff1: lin(&mut t, &format!("{p}._ff_block.0"))?,
                ff2: lin(&mut t, &format!("{p}._ff_block.3"))?,
                heads: cfg.enc_head,
            });
        }
        let pre_latent = layer_norm(&mut t, "pre_latent_norm.norm")?;
        let latent = match cfg.latent {
            LatentKind::Gmvae(clusters) => {
                let p = "latent.layers.1.inference";
                Latent::Gmvae {
                    logits: linear(&mut t, &format!("{p}.inference_qyx.0.logits"))?,
                    hidden: linear(&mut t, &format!("{p}.inference_qzyx.0"))?,
                    mu: linear(&mut t, &format!("{p}.inference_qzyx.2.mu"))?,
                    clusters,
                }
            }
            LatentKind::Vae => Latent::Vae { mu: linear(&mut t, "latent.layers.1.hid_2mu")? },
        };
        let emb_host = if device.is_cpu() { Some(emb.flatten_all()?.to_vec1::<f32>()?) } else { None };
        let emb = emb.to_dtype(dtype)?;
        Ok(CellPlm { cfg, emb, emb_host, extra, norm_w, norm_b, layers, pre_latent, latent, device, dtype })
    }

    pub fn dim(&self) -> usize {
        self.cfg.dim()
    }

    /// OmicsEmbedder's features of the cells of one forward pass: `log1p(x) @ emb`, each cell
    /// its (gene row, log1p value) pairs (`Alignment::cell`). On the CPU a sparse sum on the
    /// host; on a GPU `features_scattered`.
    pub fn features(&self, cells: &[Vec<(u32, f32)>]) -> candle_core::Result<Tensor> {
        let n = cells.len();
        let d = self.cfg.enc_hid;
        if let Some(table) = &self.emb_host {
            let mut out = vec![0f32; n * d];
            for (i, c) in cells.iter().enumerate() {
                let row = &mut out[i * d..(i + 1) * d];
                for &(g, v) in c {
                    let g = g as usize;
                    for (o, e) in row.iter_mut().zip(&table[g * d..(g + 1) * d]) {
                        *o += v * e;
                    }
                }
            }
            return Tensor::from_vec(out, (n, d), &self.device);
        }
        self.features_scattered(cells)
    }

    /// The features on the model's device without a dense host matrix: the genes the cells
    /// express become the columns of row blocks (at most 2^28 values each); each block's
    /// (column, value) pairs travel padded to its longest cell (padding adds 0 to column 0), are
    /// scattered into a zeroed block on the device (one thread a cell) and multiplied with
    /// those genes' rows of the table. The host work and the copy are O(non-zeros), not
    /// O(cells x genes) (a 3.9 GB dense pass of 50,000 cells was the cost before).
    pub fn features_scattered(&self, cells: &[Vec<(u32, f32)>]) -> candle_core::Result<Tensor> {
        let n = cells.len();
        let d = self.cfg.enc_hid;
        let table_rows = self.emb.dims2()?.0;
        let mut col = vec![u32::MAX; table_rows];
        let mut genes: Vec<u32> = Vec::new();
        for &(g, _) in cells.iter().flatten() {
            let slot = col.get_mut(g as usize).ok_or_else(|| candle_core::Error::Msg(format!("gene row {g} is past the table's {table_rows} rows")))?;
            if *slot == u32::MAX {
                *slot = 0;
                genes.push(g);
            }
        }
        if genes.is_empty() {
            return Tensor::zeros((n, d), DType::F32, &self.device);
        }
        genes.sort_unstable();
        for (j, &g) in genes.iter().enumerate() {
            col[g as usize] = j as u32;
        }
        let m = genes.len();
        let rows = self.emb.index_select(&Tensor::new(genes.as_slice(), &self.device)?, 0)?;
        let block = ((1usize << 28) / m).clamp(1, n);
        let mut parts = Vec::with_capacity(n.div_ceil(block));
        for chunk in cells.chunks(block) {
            let width = chunk.iter().map(Vec::len).max().unwrap_or(0).max(1);
            let mut ids = vec![0u32; chunk.len() * width];
            let mut vals = vec![0f32; chunk.len() * width];
            for (i, c) in chunk.iter().enumerate() {
                for (p, &(g, v)) in c.iter().enumerate() {
                    ids[i * width + p] = col[g as usize];
                    vals[i * width + p] = v;
                }
            }
            let ids = Tensor::from_vec(ids, (chunk.len(), width), &self.device)?;
            let vals = Tensor::from_vec(vals, (chunk.len(), width), &self.device)?;
            let dense = Tensor::zeros((chunk.len(), m), DType::F32, &self.device)?.scatter_add(&ids, &vals, 1)?;
            parts.push(dense.to_dtype(self.dtype)?.matmul(&rows)?.to_dtype(DType::F32)?);
        }
        Tensor::cat(&parts, 0)
    }

    /// OmicsEmbeddingLayer after the features: extra_linear (Linear, ReLU, norm); pe is 0.
    pub fn embedder(&self, feat: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.extra.forward(feat)?.relu()?;
        match self.cfg.norm {
            Norm::Group => group_norm(&h, GROUPS, &self.norm_w, &self.norm_b),
            Norm::Layer => LayerNorm::new(self.norm_w.clone(), self.norm_b.clone(), NORM_EPS).forward(&h),
        }
    }

    /// Encoder, pre-latent norm and latent mean of the embedder's output `h` (one forward pass:
    /// its rows attend to each other).
    pub fn encode(&self, h: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = h.clone();
        for l in &self.layers {
            h = l.forward(&h)?;
        }
        let h = self.pre_latent.forward(&h)?;
        match &self.latent {
            Latent::Vae { mu } => mu.forward(&h),
            Latent::Gmvae { logits, hidden, mu, clusters } => {
                // the one-hot y of q(y|x): the argmax of the logits (upstream adds Gumbel noise)
                let best = logits.forward(&h)?.argmax(D::Minus1)?; // (n,) u32
                let n = h.dims2()?.0;
                let y = Tensor::arange(0u32, *clusters as u32, &self.device)?.unsqueeze(0)?.broadcast_as((n, *clusters))?.broadcast_eq(&best.unsqueeze(1)?)?.to_dtype(DType::F32)?;
                let z = hidden.forward(&Tensor::cat(&[&h, &y], 1)?)?.relu()?;
                mu.forward(&z)
            }
        }
    }

    /// The embeddings (n x dim, row-major) of the cells of one forward pass.
    pub fn embed(&self, cells: &[Vec<(u32, f32)>]) -> Result<Vec<f32>> {
        let me = |e: candle_core::Error| Error::Model { context: "running CellPLM".into(), detail: e.to_string() };
        if cells.is_empty() {
            return Ok(Vec::new());
        }
        let h = self.embedder(&self.features(cells).map_err(me)?).map_err(me)?;
        let z = self.encode(&h).map_err(me)?;
        z.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(me)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_group_then_chunk_in_data_order() {
        let l: Vec<String> = ["b", "a", "b", "b", "a", "c"].iter().map(|s| s.to_string()).collect();
        assert_eq!(attention_batches(Some(&l), 6, 0), vec![vec![1, 4], vec![0, 2, 3], vec![5]]);
        assert_eq!(attention_batches(Some(&l), 6, 2), vec![vec![1, 4], vec![0, 2], vec![3], vec![5]]);
        assert_eq!(attention_batches(None, 5, 2), vec![vec![0, 1], vec![2, 3], vec![4]]);
        assert_eq!(attention_batches(None, 5, 0), vec![vec![0, 1, 2, 3, 4]]);
    }

    #[test]
    fn alignment_drops_genes_outside_the_model() {
        let model: Vec<String> = ["A", "B", "C"].iter().map(|s| s.to_string()).collect();
        let data: Vec<String> = ["C", "X", "A"].iter().map(|s| s.to_string()).collect();
        let a = Alignment::new(&data, &model);
        assert_eq!(a.column, vec![Some(2), None, Some(0)]);
        assert_eq!(a.gene_idx(), vec![2, 0]);
        assert_eq!(a.matched, 2);
        let c = a.cell(&[0, 1, 2], &[1.0, 5.0, 0.0]);
        assert_eq!(c, vec![(2, 1f32.ln_1p())]);
    }

    #[test]
    fn scattered_features_equal_the_sparse_host_sum() {
        let cfg = Config { enc_hid: 8, enc_head: 2, enc_layers: 1, ..Config::released(30) };
        let model = CellPlm::random(cfg, DType::F32, Device::Cpu, 5).unwrap();
        // cells of different lengths, one empty, one with a repeated gene
        let cells = vec![vec![(0u32, 0.5f32), (7, 1.5), (29, 2.0)], vec![], vec![(3, 1.0), (3, 0.25), (7, 0.75)], vec![(12, 3.0)]];
        let host = model.features(&cells).unwrap().to_vec2::<f32>().unwrap();
        let scattered = model.features_scattered(&cells).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(host.len(), 4);
        assert!(host[0].iter().any(|&v| v != 0.0), "{host:?}");
        assert!(host[1].iter().all(|&v| v == 0.0));
        for (a, b) in host.iter().flatten().zip(scattered.iter().flatten()) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{host:?} vs {scattered:?}");
        }
        let none = model.features_scattered(&[vec![], vec![]]).unwrap();
        assert_eq!(none.dims(), &[2, 8]);
    }

    #[test]
    fn bf16_products_stay_close_to_f32() {
        let cfg = Config { enc_hid: 32, enc_head: 4, enc_layers: 2, post_latent_dim: 16, ..Config::released(60) };
        let f32m = CellPlm::random(cfg.clone(), DType::F32, Device::Cpu, 7).unwrap();
        let bf16m = CellPlm::random(cfg, DType::BF16, Device::Cpu, 7).unwrap();
        let cells: Vec<Vec<(u32, f32)>> = (0..24u32).map(|i| (0..12u32).map(|p| ((i * 7 + p * 5) % 60, (1.0 + ((i + p) % 4) as f32).ln_1p())).collect()).collect();
        let cells: Vec<Vec<(u32, f32)>> = cells.into_iter().map(|mut c| { c.sort_by_key(|x| x.0); c.dedup_by_key(|x| x.0); c }).collect();
        // the gene sum's product in bf16 (the GPU's path), against f32
        let a = f32m.features_scattered(&cells).unwrap().to_vec2::<f32>().unwrap();
        let b = bf16m.features_scattered(&cells).unwrap().to_vec2::<f32>().unwrap();
        let (mut worst, mut differs) = (0f32, false);
        for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
            worst = worst.max((x - y).abs() / (1.0 + x.abs()));
            differs |= x != y;
        }
        assert!(differs && worst < 2e-2, "features: largest difference {worst}");
        // the embeddings: per cell cosine against f32
        let (za, zb) = (f32m.embed(&cells).unwrap(), bf16m.embed(&cells).unwrap());
        let mut lowest = 1f64;
        for (x, y) in za.chunks(16).zip(zb.chunks(16)) {
            let dot: f64 = x.iter().zip(y).map(|(p, q)| *p as f64 * *q as f64).sum();
            let n = |v: &[f32]| v.iter().map(|p| (*p as f64).powi(2)).sum::<f64>().sqrt();
            lowest = lowest.min(dot / (n(x) * n(y)));
        }
        assert!(za != zb && lowest > 0.99, "lowest cosine {lowest}");
    }

    #[test]
    fn group_norm_normalises_each_group() {
        let x = Tensor::new(&[[1f32, 2., 3., 4., 10., 20., 30., 40.]], &Device::Cpu).unwrap();
        let w = Tensor::ones(8, DType::F32, &Device::Cpu).unwrap();
        let b = Tensor::zeros(8, DType::F32, &Device::Cpu).unwrap();
        let y = group_norm(&x, 2, &w, &b).unwrap().to_vec2::<f32>().unwrap();
        // each half normalised alone: the same pattern in both
        for j in 0..4 {
            assert!((y[0][j] - y[0][j + 4]).abs() < 1e-4, "{y:?}");
        }
        assert!((y[0][0] + 1.3416).abs() < 1e-3, "{y:?}");
    }
}
