//! Novae: Blampey Q, Benkirane H, Bercovici N, Andre F, Cournede P-H, "Novae: a graph-based
//! foundation model for spatial transcriptomics data", Nature Methods 2025,
//! doi:10.1038/s41592-025-02899-6; upstream code https://github.com/MICS-Lab/novae (now
//! prism-oncology/novae; PyPI `novae` 1.1.2 with torch-geometric 2.8.1 is the parity oracle):
//! `novae/model.py` (Novae, compute_representations), `novae/module/embed.py` (CellEmbedder),
//! `novae/module/encode.py` (GraphEncoder: torch_geometric `GAT(v2=True)`),
//! `novae/module/aggregate.py` (AttentionAggregation), `novae/data/dataset.py` (subgraphs),
//! `novae/data/convert.py` (z-score), `novae/utils/_validate.py` (preprocessing, genes),
//! `novae/utils/build.py` (spatial_neighbors).
//!
//! Files: the Hugging Face folder of `Novae.save_pretrained` (PyTorchModelHubMixin):
//! `model.safetensors` (the LightningModule's state_dict) and `config.json` (the init arguments:
//! sizes, n_hops, and `var_names`, the gene vocabulary whose order is the embedding's rows).
//!
//! The graph (spatial_neighbors with its defaults, `coord_type="generic"`, `delaunay=True`):
//! the Delaunay triangulation of obsm['spatial'] (scipy's Qhull upstream, `delaunator` here: the
//! same edges for points in general position; co-circular points, as on a perfect grid, admit
//! several triangulations), edges weighted by Euclidean length, edges outside `[min, max]` of
//! `radius` dropped (none without a radius), zero-length edges dropped (eliminate_zeros).
//!
//! A cell's input (NovaeDataset.to_pyg_data): the nodes within `n_hops_local` hops of the cell
//! (the structure of `(A + I) A^(n-1)`, a ball of that radius for a cell with a neighbour), with
//! every graph edge among them, edge attribute = length * scale_to_microns / 20. A cell is valid
//! when some cell lies exactly `n_hops_view` hops away (`(A + I) A^(n-1)` minus
//! `(A + I) A^(n-2)`); invalid cells are not encoded and get a zero latent (fill_invalid_indices).
//!
//! Expression (_validate_preprocessing, ZScoreTorch): when max(X) >= 10 and is an integer, X is
//! raw counts and becomes `log1p(normalize_total(X))` (target the median count of cells with
//! counts); then the genes used (known to the vocabulary, case-insensitively, and highly variable
//! when there are more than 100 genes) are z-scored per slide, `(x - mean) / (std + 1e-8)` with
//! the population variance.
//!
//! Model: CellEmbedder: `G = normalize(Linear(Embedding[genes]), dim=0)` (each of the E columns
//! L2-normalised over the genes used), node features `x = z @ G`. GraphEncoder: `num_layers`
//! GATv2Conv layers (share_weights=False, edge_dim=1, self-loops added with the mean incoming
//! edge attribute, negative slope 0.2, heads concatenated to `hidden_size` on all layers but
//! the last, which averages its heads to `output_size`), ELU between layers; then
//! AttentionAggregation: softmax over the subgraph's nodes of `gate_nn(x)` times `nn(x)`, summed.
//! The sum is the cell's representation, `obsm['novae_latent']` upstream.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, D};
use candle_nn::{Linear, Module, VarBuilder};

use crate::error::{Error, Result};

/// Characteristic distance between two cells in microns (`Nums.CELLS_CHARACTERISTIC_DISTANCE`).
pub const CELLS_CHARACTERISTIC_DISTANCE: f64 = 20.0;
/// `Nums.EPS` of the z-score.
pub const ZSCORE_EPS: f32 = 1e-8;
/// Above this many genes upstream keeps only highly variable ones (`Nums.MIN_GENES_FOR_HVG`).
pub const MIN_GENES_FOR_HVG: usize = 100;
/// Fewest genes known and used (`Nums.MIN_GENES`).
pub const MIN_GENES: usize = 20;
/// Upstream's `Novae(batch_size=256)`, the subgraphs per forward pass.
pub const UPSTREAM_BATCH_SIZE: usize = 256;
/// Weights entries the embed task needs.
pub const ENTRIES: [&str; 2] = ["novae-human-0-model", "novae-human-0-config"];

fn model_err(context: &str, e: impl std::fmt::Display) -> Error {
    Error::Model { context: context.into(), detail: e.to_string() }
}

// ---- config -------------------------------------------------------------------------------

/// The init arguments in `config.json` that inference needs.
#[derive(Debug, Clone)]
pub struct Config {
    pub embedding_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub output_size: usize,
    pub heads: usize,
    pub n_hops_local: usize,
    pub n_hops_view: usize,
    pub batch_size: usize,
    /// The vocabulary, lower-cased as upstream keeps it; row i of the gene embedding.
    pub var_names: Vec<String>,
}

impl Config {
    /// Novae's defaults at full size (novae/model.py) with a vocabulary of `n_genes` names.
    pub fn full_size(n_genes: usize) -> Config {
        Config {
            embedding_size: 100,
            hidden_size: 128,
            num_layers: 10,
            output_size: 64,
            heads: 8,
            n_hops_local: 2,
            n_hops_view: 2,
            batch_size: UPSTREAM_BATCH_SIZE,
            var_names: (0..n_genes).map(|i| format!("gene{i}")).collect(),
        }
    }

    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Io { path: path.into(), source: e })?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::BadWeights { path: path.into(), detail: format!("is not JSON: {e}") })?;
        let bad = |field: &str, detail: &str| Error::BadField {
            path: path.into(),
            field: field.into(),
            detail: detail.into(),
            hint: Some("config.json should be the one Novae.save_pretrained wrote next to model.safetensors (e.g. MICS-Lab/novae-human-0)".into()),
        };
        let int = |k: &str, default: Option<usize>| -> Result<usize> {
            match v.get(k) {
                Some(x) => x.as_u64().map(|x| x as usize).ok_or_else(|| bad(k, "is not a non-negative integer")),
                None => default.ok_or_else(|| bad(k, "is missing")),
            }
        };
        let full = Config::full_size(0);
        if v.get("embedding_name").map(|x| !x.is_null()).unwrap_or(false) {
            return Err(bad("embedding_name", "is set: this model reads a precomputed obsm embedding instead of genes, which scfoundry does not support"));
        }
        if v.get("scgpt_model_dir").map(|x| !x.is_null()).unwrap_or(false) {
            return Err(bad("scgpt_model_dir", "is set: scGPT gene embeddings are not supported"));
        }
        if v.pointer("/mode_kwargs/multimodal").and_then(|x| x.as_bool()).unwrap_or(false) {
            return Err(bad("mode_kwargs.multimodal", "is true: multimodal (H&E) Novae models are not supported"));
        }
        let names = v.get("var_names").and_then(|x| x.as_array()).ok_or_else(|| bad("var_names", "is missing or not a list of gene names"))?;
        let var_names = names
            .iter()
            .map(|x| x.as_str().map(str::to_lowercase).ok_or_else(|| bad("var_names", "holds a value that is not a string")))
            .collect::<Result<Vec<_>>>()?;
        let cfg = Config {
            embedding_size: int("embedding_size", Some(full.embedding_size))?,
            hidden_size: int("hidden_size", Some(full.hidden_size))?,
            num_layers: int("num_layers", Some(full.num_layers))?,
            output_size: int("output_size", Some(full.output_size))?,
            heads: int("heads", Some(full.heads))?,
            n_hops_local: int("n_hops_local", Some(full.n_hops_local))?,
            n_hops_view: int("n_hops_view", Some(full.n_hops_view))?,
            batch_size: int("batch_size", Some(full.batch_size))?,
            var_names,
        };
        if cfg.heads == 0 || cfg.hidden_size % cfg.heads != 0 {
            return Err(bad("hidden_size", &format!("{} is not a multiple of heads {}", cfg.hidden_size, cfg.heads)));
        }
        if cfg.num_layers < 2 || cfg.n_hops_local == 0 || cfg.n_hops_view == 0 {
            return Err(bad("num_layers", "num_layers must be >= 2 and n_hops_local, n_hops_view >= 1"));
        }
        Ok(cfg)
    }

    /// Row of each vocabulary name (lower-cased).
    pub fn gene_index(&self) -> HashMap<&str, usize> {
        self.var_names.iter().enumerate().map(|(i, g)| (g.as_str(), i)).collect()
    }
}

// ---- the spatial graph ---------------------------------------------------------------------

/// Undirected edges of the Delaunay triangulation of `coords`, as sorted neighbour lists
/// (scipy's `Delaunay(coords).vertex_neighbor_vertices`). `None` when every point is on one line.
pub fn delaunay_neighbors(coords: &[[f64; 2]]) -> Option<Vec<Vec<usize>>> {
    let pts: Vec<delaunator::Point> = coords.iter().map(|c| delaunator::Point { x: c[0], y: c[1] }).collect();
    let t = delaunator::triangulate(&pts);
    if t.triangles.is_empty() {
        return None;
    }
    let mut nb: Vec<Vec<usize>> = vec![Vec::new(); coords.len()];
    for tri in t.triangles.chunks(3) {
        for (a, b) in [(tri[0], tri[1]), (tri[1], tri[2]), (tri[2], tri[0])] {
            nb[a].push(b);
            nb[b].push(a);
        }
    }
    for l in &mut nb {
        l.sort_unstable();
        l.dedup();
    }
    Some(nb)
}

/// The weighted graph of spatial_neighbors: per cell, (neighbour, distance) sorted by neighbour.
#[derive(Debug, Clone)]
pub struct SpatialGraph {
    pub adj: Vec<Vec<(usize, f64)>>,
}

impl SpatialGraph {
    /// Delaunay edges with their Euclidean lengths, kept when `min <= length <= max` (all when
    /// `radius` is None) and the length is not zero.
    pub fn build(coords: &[[f64; 2]], radius: Option<(f64, f64)>) -> Option<SpatialGraph> {
        let nb = delaunay_neighbors(coords)?;
        let adj = nb
            .iter()
            .enumerate()
            .map(|(i, l)| {
                l.iter()
                    .filter_map(|&j| {
                        let (dx, dy) = (coords[i][0] - coords[j][0], coords[i][1] - coords[j][1]);
                        let d = (dx * dx + dy * dy).sqrt();
                        let keep = d != 0.0 && radius.map(|(lo, hi)| d >= lo && d <= hi).unwrap_or(true);
                        keep.then_some((j, d))
                    })
                    .collect()
            })
            .collect();
        Some(SpatialGraph { adj })
    }

    pub fn n_edges(&self) -> usize {
        self.adj.iter().map(Vec::len).sum()
    }

    /// Hop distance from `i` to every cell within `max_hops` (BFS), `usize::MAX` beyond.
    fn hops(&self, i: usize, max_hops: usize, dist: &mut Vec<usize>, touched: &mut Vec<usize>) {
        for &t in touched.iter() {
            dist[t] = usize::MAX;
        }
        touched.clear();
        dist[i] = 0;
        touched.push(i);
        let mut q = VecDeque::from([i]);
        while let Some(u) = q.pop_front() {
            if dist[u] == max_hops {
                continue;
            }
            for &(v, _) in &self.adj[u] {
                if dist[v] == usize::MAX {
                    dist[v] = dist[u] + 1;
                    touched.push(v);
                    q.push_back(v);
                }
            }
        }
    }

    /// Per cell: whether some cell is exactly `n_hops_view` hops away (upstream's
    /// `obs['neighborhood_valid']`), and its subgraph, the sorted cells within `n_hops_local`
    /// hops, itself included (empty for an invalid cell).
    pub fn subgraphs(&self, n_hops_local: usize, n_hops_view: usize) -> (Vec<bool>, Vec<Vec<usize>>) {
        let n = self.adj.len();
        let mut dist = vec![usize::MAX; n];
        let mut touched = Vec::new();
        let mut valid = vec![false; n];
        let mut sub = vec![Vec::new(); n];
        for i in 0..n {
            self.hops(i, n_hops_view.max(n_hops_local), &mut dist, &mut touched);
            valid[i] = touched.iter().any(|&t| dist[t] == n_hops_view);
            if valid[i] {
                let mut s: Vec<usize> = touched.iter().copied().filter(|&t| dist[t] <= n_hops_local).collect();
                s.sort_unstable();
                sub[i] = s;
            }
        }
        (valid, sub)
    }
}

/// A batch of subgraphs in the padded form the encoder runs on: nodes of all graphs
/// concatenated (`nodes`: cell row of each), each node's incoming neighbours (itself last, as
/// the self-loop) padded to `max_deg` with index `nodes.len()`, their edge attributes, and each
/// graph's node positions padded to `max_nodes`.
#[derive(Debug, Clone)]
pub struct GraphBatch {
    pub nodes: Vec<usize>,
    pub max_deg: usize,
    pub nbr: Vec<u32>,
    pub attr: Vec<f32>,
    pub nbr_mask: Vec<f32>,
    pub max_nodes: usize,
    pub members: Vec<u32>,
    pub member_mask: Vec<f32>,
}

/// Large negative logit for padding slots (their softmax weight is exactly 0 in f32).
const PAD_LOGIT: f32 = -1e30;

impl GraphBatch {
    /// The batch for `cells` (each with its subgraph `sub[cell]`, non-empty), edge attribute =
    /// distance * `scale_to_microns` / 20.
    pub fn new(graph: &SpatialGraph, sub: &[Vec<usize>], cells: &[usize], scale_to_microns: f64) -> GraphBatch {
        let mut nodes = Vec::new();
        let mut lists: Vec<Vec<(u32, f32)>> = Vec::new();
        let mut graphs: Vec<(usize, usize)> = Vec::new();
        let mut local: HashMap<usize, usize> = HashMap::new();
        for &c in cells {
            let s = &sub[c];
            let base = nodes.len();
            local.clear();
            for (k, &v) in s.iter().enumerate() {
                local.insert(v, k);
            }
            for &v in s {
                let mut l: Vec<(u32, f32)> = Vec::new();
                for &(u, d) in &graph.adj[v] {
                    if let Some(&k) = local.get(&u) {
                        l.push(((base + k) as u32, (d * scale_to_microns / CELLS_CHARACTERISTIC_DISTANCE) as f32));
                    }
                }
                // self-loop, attribute = mean of the incoming edges' (0 without any), in f32 as torch
                let mean = if l.is_empty() { 0.0 } else { l.iter().map(|x| x.1).sum::<f32>() / l.len() as f32 };
                l.push(((base + local[&v]) as u32, mean));
                lists.push(l);
            }
            nodes.extend_from_slice(s);
            graphs.push((base, s.len()));
        }
        let n = nodes.len();
        let max_deg = lists.iter().map(Vec::len).max().unwrap_or(1);
        let mut nbr = vec![n as u32; n * max_deg];
        let mut attr = vec![0f32; n * max_deg];
        let mut nbr_mask = vec![PAD_LOGIT; n * max_deg];
        for (i, l) in lists.iter().enumerate() {
            for (k, &(j, a)) in l.iter().enumerate() {
                nbr[i * max_deg + k] = j;
                attr[i * max_deg + k] = a;
                nbr_mask[i * max_deg + k] = 0.0;
            }
        }
        let max_nodes = graphs.iter().map(|g| g.1).max().unwrap_or(1);
        let mut members = vec![n as u32; graphs.len() * max_nodes];
        let mut member_mask = vec![PAD_LOGIT; graphs.len() * max_nodes];
        for (b, &(base, len)) in graphs.iter().enumerate() {
            for k in 0..len {
                members[b * max_nodes + k] = (base + k) as u32;
                member_mask[b * max_nodes + k] = 0.0;
            }
        }
        GraphBatch { nodes, max_deg, nbr, attr, nbr_mask, max_nodes, members, member_mask }
    }

    pub fn n_graphs(&self) -> usize {
        self.members.len() / self.max_nodes.max(1)
    }
}

// ---- expression ----------------------------------------------------------------------------

/// Whether upstream treats X as raw counts (max >= 10 and an integer) and log-normalises it.
pub fn looks_like_counts(max: f32) -> bool {
    max >= 10.0 && max.fract() == 0.0
}

/// scanpy's normalize_total target: the median of the per-cell totals of cells with counts.
pub fn median_total(totals: &[f64]) -> f64 {
    let mut t: Vec<f64> = totals.iter().copied().filter(|&x| x > 0.0).collect();
    if t.is_empty() {
        return 0.0;
    }
    t.sort_by(|a, b| a.total_cmp(b));
    let m = t.len();
    if m % 2 == 1 { t[m / 2] } else { 0.5 * (t[m / 2 - 1] + t[m / 2]) }
}

/// Per-gene mean and population standard deviation (f64 sums) of a dense cells x genes matrix.
pub fn mean_std(x: &[f32], n_cells: usize, n_genes: usize) -> (Vec<f32>, Vec<f32>) {
    let mut s = vec![0f64; n_genes];
    let mut s2 = vec![0f64; n_genes];
    for r in x.chunks(n_genes).take(n_cells) {
        for (j, &v) in r.iter().enumerate() {
            s[j] += v as f64;
            s2[j] += (v as f64) * (v as f64);
        }
    }
    let n = n_cells.max(1) as f64;
    let mean: Vec<f64> = s.iter().map(|v| v / n).collect();
    let std = s2.iter().zip(&mean).map(|(v, m)| ((v / n - m * m).max(0.0)).sqrt() as f32).collect();
    (mean.into_iter().map(|m| m as f32).collect(), std)
}

// ---- the model ------------------------------------------------------------------------------

struct GatV2 {
    lin_l: Linear,
    lin_r: Linear,
    lin_edge: Tensor,
    att: Tensor,
    bias: Tensor,
    heads: usize,
    out: usize,
    concat: bool,
}

impl GatV2 {
    fn load(vb: VarBuilder, inp: usize, out: usize, heads: usize, concat: bool) -> candle_core::Result<GatV2> {
        let hc = heads * out;
        let lin = |name: &str| -> candle_core::Result<Linear> { Ok(Linear::new(vb.get((hc, inp), &format!("{name}.weight"))?, Some(vb.get(hc, &format!("{name}.bias"))?))) };
        Ok(GatV2 {
            lin_l: lin("lin_l")?,
            lin_r: lin("lin_r")?,
            lin_edge: vb.get((hc, 1), "lin_edge.weight")?.reshape((1, 1, heads, out))?,
            att: vb.get((1, heads, out), "att")?.reshape((1, 1, heads, out))?,
            bias: vb.get(if concat { hc } else { out }, "bias")?,
            heads,
            out,
            concat,
        })
    }

    /// x: [n, in]; nbr: [n * d] indices into x (n = padding); attr, mask: [n, d].
    /// `fused`: the attention by `gpu::gat_attention` (one kernel on a GPU, its loop on the
    /// host on the CPU) rather than candle's ops below (its reference).
    fn forward(&self, x: &Tensor, nbr: &Tensor, attr: &Tensor, mask: &Tensor, d: usize, fused: bool) -> candle_core::Result<Tensor> {
        let n = x.dim(0)?;
        let (h, c) = (self.heads, self.out);
        let xl = self.lin_l.forward(x)?;
        let xr = self.lin_r.forward(x)?;
        if fused && crate::gpu::gat_attention::applies(&xl, d, h, c) {
            let out = crate::gpu::gat_attention::gatv2_attention(&xl, &xr, nbr, attr, mask, &self.lin_edge, &self.att, h, c)?;
            let out = if self.concat { out } else { out.reshape((n, h, c))?.mean(1)? };
            return out.broadcast_add(&self.bias);
        }
        let pad = Tensor::zeros((1, h * c), xl.dtype(), xl.device())?;
        let xj = Tensor::cat(&[&xl, &pad], 0)?.index_select(nbr, 0)?.reshape((n, d, h, c))?;
        let xi = xr.reshape((n, 1, h, c))?;
        let e = attr.reshape((n, d, 1, 1))?.broadcast_mul(&self.lin_edge)?;
        let e = xj.broadcast_add(&xi)?.add(&e)?;
        let e = e.maximum(&(&e * 0.2)?)?; // leaky_relu(0.2)
        let s = e.broadcast_mul(&self.att)?.sum(D::Minus1)?; // [n, d, h]
        let s = s.broadcast_add(&mask.reshape((n, d, 1))?)?;
        let alpha = group_softmax(&s, 1)?; // over the neighbours
        let out = xj.broadcast_mul(&alpha.reshape((n, d, h, 1))?)?.sum(1)?; // [n, h, c]
        let out = if self.concat { out.reshape((n, h * c))? } else { out.mean(1)? };
        out.broadcast_add(&self.bias)
    }
}

/// Softmax along `dim` as torch_geometric's `softmax`: minus the group max, exp, divided by the
/// sum plus 1e-16.
fn group_softmax(s: &Tensor, dim: usize) -> candle_core::Result<Tensor> {
    let m = s.max_keepdim(dim)?;
    let e = s.broadcast_sub(&m)?.exp()?;
    let z = (e.sum_keepdim(dim)? + 1e-16)?;
    e.broadcast_div(&z)
}

/// Novae's CellEmbedder + GraphEncoder (no multimodal fusion, no SwAV head: inference of the
/// representation only).
pub struct Novae {
    pub cfg: Config,
    embedding: Tensor,
    linear: Linear,
    layers: Vec<GatV2>,
    gate_nn: Linear,
    nn: Linear,
    pub device: Device,
    /// Each GATv2 layer's attention by `gpu::gat_attention` (one kernel on a GPU, its loop on the
    /// host on the CPU) instead of candle's ops. On by default on a GPU (docs/novae.md);
    /// `__bench-encoder --arch novae --unfused` times candle's ops.
    pub fused: bool,
}

impl Novae {
    /// Load `model.safetensors` with `cfg` (from config.json).
    pub fn load(weights: &Path, cfg: Config, device: Device) -> Result<Novae> {
        if !weights.exists() {
            return Err(Error::MissingFile { path: weights.into() });
        }
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[weights], DType::F32, &device) }
            .map_err(|e| Error::BadWeights { path: weights.into(), detail: format!("is not a safetensors file: {e}") })?;
        Novae::from_vb(vb, cfg, device).map_err(|e| Error::BadWeights {
            path: weights.into(),
            detail: format!("does not hold a Novae model of config.json's sizes: {e} (expected e.g. cell_embedder.embedding.weight, encoder.gnn.convs.0.lin_l.weight)"),
        })
    }

    pub fn from_vb(vb: VarBuilder, cfg: Config, device: Device) -> candle_core::Result<Novae> {
        let e = cfg.embedding_size;
        let ce = vb.pp("cell_embedder");
        let embedding = ce.get((cfg.var_names.len(), e), "embedding.weight")?;
        let linear = Linear::new(ce.get((e, e), "linear.weight")?, Some(ce.get(e, "linear.bias")?));
        let gnn = vb.pp("encoder.gnn.convs");
        let mut layers = Vec::new();
        for i in 0..cfg.num_layers {
            let inp = if i == 0 { e } else { cfg.hidden_size };
            let last = i + 1 == cfg.num_layers;
            let l = if last {
                GatV2::load(gnn.pp(i.to_string()), inp, cfg.output_size, cfg.heads, false)?
            } else {
                GatV2::load(gnn.pp(i.to_string()), inp, cfg.hidden_size / cfg.heads, cfg.heads, true)?
            };
            layers.push(l);
        }
        let agg = vb.pp("encoder.node_aggregation.attention_aggregation");
        let o = cfg.output_size;
        let gate_nn = Linear::new(agg.get((1, o), "gate_nn.weight")?, Some(agg.get(1, "gate_nn.bias")?));
        let nn = Linear::new(agg.get((o, o), "nn.weight")?, Some(agg.get(o, "nn.bias")?));
        let fused = device.is_cuda();
        Ok(Novae { cfg, embedding, linear, layers, gate_nn, nn, device, fused })
    }

    /// Random weights at `cfg`'s sizes (the bench path): normal(0, 0.05) everywhere.
    pub fn random(cfg: Config, device: Device, seed: u64) -> Result<Novae> {
        let vm = candle_nn::VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &device);
        // candle's CPU generator cannot be seeded: there the random weights differ between runs,
        // which a timing does not mind; a GPU's generator takes the seed.
        if !device.is_cpu() {
            device.set_seed(seed).map_err(|e| model_err("seeding the device", e))?;
        }
        let init = candle_nn::Init::Randn { mean: 0.0, stdev: 0.05 };
        let vbi = vb.clone();
        // create every variable with the init, then load them through from_vb
        let e = cfg.embedding_size;
        let mk = |name: &str, shape: &[usize]| -> candle_core::Result<Tensor> { vbi.get_with_hints(shape, name, init) };
        mk("cell_embedder.embedding.weight", &[cfg.var_names.len(), e]).map_err(|x| model_err("initialising", x))?;
        mk("cell_embedder.linear.weight", &[e, e]).map_err(|x| model_err("initialising", x))?;
        mk("cell_embedder.linear.bias", &[e]).map_err(|x| model_err("initialising", x))?;
        for i in 0..cfg.num_layers {
            let inp = if i == 0 { e } else { cfg.hidden_size };
            let last = i + 1 == cfg.num_layers;
            let (c, concat) = if last { (cfg.output_size, false) } else { (cfg.hidden_size / cfg.heads, true) };
            let hc = cfg.heads * c;
            let p = format!("encoder.gnn.convs.{i}");
            for name in ["lin_l", "lin_r"] {
                mk(&format!("{p}.{name}.weight"), &[hc, inp]).map_err(|x| model_err("initialising", x))?;
                mk(&format!("{p}.{name}.bias"), &[hc]).map_err(|x| model_err("initialising", x))?;
            }
            mk(&format!("{p}.lin_edge.weight"), &[hc, 1]).map_err(|x| model_err("initialising", x))?;
            mk(&format!("{p}.att"), &[1, cfg.heads, c]).map_err(|x| model_err("initialising", x))?;
            mk(&format!("{p}.bias"), &[if concat { hc } else { c }]).map_err(|x| model_err("initialising", x))?;
        }
        let o = cfg.output_size;
        let a = "encoder.node_aggregation.attention_aggregation";
        mk(&format!("{a}.gate_nn.weight"), &[1, o]).map_err(|x| model_err("initialising", x))?;
        mk(&format!("{a}.gate_nn.bias"), &[1]).map_err(|x| model_err("initialising", x))?;
        mk(&format!("{a}.nn.weight"), &[o, o]).map_err(|x| model_err("initialising", x))?;
        mk(&format!("{a}.nn.bias"), &[o]).map_err(|x| model_err("initialising", x))?;
        Novae::from_vb(vb, cfg, device).map_err(|x| model_err("building the random model", x))
    }

    pub fn dim(&self) -> usize {
        self.cfg.output_size
    }

    /// The CellEmbedder's gene matrix for the genes used (vocabulary rows `rows`): [g, E].
    pub fn gene_matrix(&self, rows: &[u32]) -> Result<Tensor> {
        let f = || -> candle_core::Result<Tensor> {
            let idx = Tensor::from_slice(rows, rows.len(), &self.device)?;
            let g = self.linear.forward(&self.embedding.index_select(&idx, 0)?)?;
            let norm = g.sqr()?.sum_keepdim(0)?.sqrt()?.maximum(1e-12)?;
            g.broadcast_div(&norm)
        };
        f().map_err(|e| model_err("embedding the genes", e))
    }

    /// Representations of a batch of subgraphs; `z` holds each node's z-scored expression
    /// ([batch.nodes.len(), g], row-major, in node order); returns [graphs, output_size].
    pub fn encode(&self, genes: &Tensor, z: &[f32], batch: &GraphBatch) -> Result<Vec<f32>> {
        let f = || -> candle_core::Result<Vec<f32>> {
            let dev = &self.device;
            let n = batch.nodes.len();
            let g = genes.dim(0)?;
            let d = batch.max_deg;
            let z = Tensor::from_slice(z, (n, g), dev)?;
            let mut x = z.matmul(genes)?;
            let nbr = Tensor::from_slice(&batch.nbr, n * d, dev)?;
            let attr = Tensor::from_slice(&batch.attr, (n, d), dev)?;
            let mask = Tensor::from_slice(&batch.nbr_mask, (n, d), dev)?;
            for (i, l) in self.layers.iter().enumerate() {
                x = l.forward(&x, &nbr, &attr, &mask, d, self.fused)?;
                if i + 1 < self.layers.len() {
                    x = x.elu(1.0)?;
                }
            }
            let b = batch.n_graphs();
            let m = batch.max_nodes;
            let o = self.cfg.output_size;
            let gate = self.gate_nn.forward(&x)?; // [n, 1]
            let h = self.nn.forward(&x)?; // [n, o]
            let members = Tensor::from_slice(&batch.members, b * m, dev)?;
            let gate = Tensor::cat(&[&gate, &Tensor::zeros((1, 1), DType::F32, dev)?], 0)?.index_select(&members, 0)?.reshape((b, m))?;
            let gate = gate.add(&Tensor::from_slice(&batch.member_mask, (b, m), dev)?)?;
            let alpha = group_softmax(&gate, 1)?;
            let h = Tensor::cat(&[&h, &Tensor::zeros((1, o), DType::F32, dev)?], 0)?.index_select(&members, 0)?.reshape((b, m, o))?;
            let out = h.broadcast_mul(&alpha.reshape((b, m, 1))?)?.sum(1)?;
            out.flatten_all()?.to_vec1::<f32>()
        };
        f().map_err(|e| model_err("running the graph encoder", e))
    }
}

/// The two files of a Novae folder (weights.toml's novae-human-0 entries under `dir`).
pub fn files(dir: &Path, manifest: &crate::weights::Manifest) -> Result<(PathBuf, PathBuf)> {
    let get = |id: &str| -> Result<PathBuf> {
        manifest.weights.get(id).map(|e| dir.join(&e.file)).ok_or_else(|| Error::Config { path: "weights.toml".into(), detail: format!("has no entry {id}"), hint: None })
    };
    Ok((get(ENTRIES[0])?, get(ENTRIES[1])?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid_jitter() -> Vec<[f64; 2]> {
        // a jittered 4 x 4 grid: general position, easy to reason about
        (0..16).map(|i| [(i % 4) as f64 * 10.0 + 0.37 * ((i * 7 % 5) as f64), (i / 4) as f64 * 10.0 + 0.29 * ((i * 3 % 7) as f64)]).collect()
    }

    #[test]
    fn delaunay_is_symmetric_and_planar_sized() {
        let c = grid_jitter();
        let nb = delaunay_neighbors(&c).unwrap();
        let m: usize = nb.iter().map(Vec::len).sum::<usize>() / 2;
        // a planar triangulation of n points with h on the hull has 3n - 3 - h edges
        assert!(m <= 3 * 16 - 6 && m >= 2 * 16 - 3, "{m} edges");
        for (i, l) in nb.iter().enumerate() {
            for &j in l {
                assert!(nb[j].contains(&i));
                assert_ne!(i, j);
            }
        }
    }

    #[test]
    fn one_op_attention_equals_candle_ops() {
        // a small encoder (3 GATv2 layers: concatenated heads, then averaged) over real subgraphs
        let cfg = Config { embedding_size: 12, hidden_size: 16, num_layers: 3, output_size: 8, heads: 4, ..Config::full_size(10) };
        let mut model = Novae::random(cfg.clone(), Device::Cpu, 0).unwrap();
        // attention vectors large enough that the softmax is far from uniform (N(0, 0.05) is not)
        for l in &mut model.layers {
            l.att = (&l.att * 60.0).unwrap();
        }
        let graph = SpatialGraph::build(&grid_jitter(), None).unwrap();
        let (valid, sub) = graph.subgraphs(cfg.n_hops_local, cfg.n_hops_view);
        let cells: Vec<usize> = (0..16).filter(|&i| valid[i]).collect();
        assert!(cells.len() >= 4);
        let batch = GraphBatch::new(&graph, &sub, &cells, 1.0);
        assert!(batch.nbr_mask.contains(&PAD_LOGIT), "some nodes have padded neighbour slots");
        let genes = model.gene_matrix(&(0..10).collect::<Vec<u32>>()).unwrap();
        let z: Vec<f32> = (0..batch.nodes.len() * 10).map(|i| ((i * 37 % 11) as f32 - 5.0) / 3.0).collect();
        let want = model.encode(&genes, &z, &batch).unwrap();
        model.fused = true;
        let got = model.encode(&genes, &z, &batch).unwrap();
        assert_eq!(got.len(), cells.len() * 8);
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(scale > 0.0);
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * scale, "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn collinear_points_have_no_triangulation() {
        assert!(delaunay_neighbors(&[[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]).is_none());
    }

    #[test]
    fn radius_drops_long_edges_and_isolates_far_cell() {
        let mut c = grid_jitter();
        c.push([500.0, 500.0]);
        let all = SpatialGraph::build(&c, None).unwrap();
        assert!(!all.adj[16].is_empty());
        let g = SpatialGraph::build(&c, Some((0.0, 25.0))).unwrap();
        assert!(g.adj[16].is_empty());
        assert!(g.adj.iter().flatten().all(|&(_, d)| d <= 25.0));
        let (valid, sub) = g.subgraphs(2, 2);
        assert!(!valid[16] && sub[16].is_empty());
        assert!(valid[0] && sub[0].contains(&0));
    }

    #[test]
    fn subgraph_is_two_hop_ball_and_valid_needs_exact_hops() {
        // path 0 - 1 - 2 - 3 as a graph
        let adj = vec![vec![(1, 1.0)], vec![(0, 1.0), (2, 1.0)], vec![(1, 1.0), (3, 1.0)], vec![(2, 1.0)]];
        let g = SpatialGraph { adj };
        let (valid, sub) = g.subgraphs(2, 2);
        assert_eq!(valid, vec![true; 4]);
        assert_eq!(sub[0], vec![0, 1, 2]);
        assert_eq!(sub[1], vec![0, 1, 2, 3]);
        let pair = SpatialGraph { adj: vec![vec![(1, 1.0)], vec![(0, 1.0)]] };
        assert_eq!(pair.subgraphs(2, 2).0, vec![false, false]);
    }

    #[test]
    fn batch_self_loop_gets_mean_incoming_attribute() {
        let adj = vec![vec![(1, 20.0), (2, 60.0)], vec![(0, 20.0)], vec![(0, 60.0)]];
        let g = SpatialGraph { adj };
        let sub = vec![vec![0, 1, 2]];
        let b = GraphBatch::new(&g, &sub, &[0], 1.0);
        assert_eq!(b.max_deg, 3);
        // node 0: neighbours 1 (1.0), 2 (3.0), then itself with (1 + 3) / 2
        assert_eq!(&b.attr[0..3], &[1.0, 3.0, 2.0]);
        assert_eq!(&b.nbr[0..3], &[1, 2, 0]);
        // node 1: neighbour 0, itself, one padding slot
        assert_eq!(&b.nbr[3..6], &[0, 1, 3]);
        assert_eq!(b.nbr_mask[5], PAD_LOGIT);
    }

    #[test]
    fn counts_detection_and_median() {
        assert!(looks_like_counts(12.0));
        assert!(!looks_like_counts(9.0));
        assert!(!looks_like_counts(12.5));
        assert_eq!(median_total(&[0.0, 3.0, 1.0, 2.0, 10.0]), 2.5);
    }
}
