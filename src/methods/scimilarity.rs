//! SCimilarity: Heimberg G, Kuo T, DePianto DJ, et al., "A cell atlas foundation model for
//! scalable search of similar human cells", Nature 2024, doi:10.1038/s41586-024-08411-y;
//! upstream code https://github.com/Genentech/scimilarity (`src/scimilarity/nn_models.py`
//! Encoder, `cell_embedding.py` CellEmbedding, `utils.py` align_dataset and lognorm_counts;
//! read at commit 3ce3ec8, the same code as the PyPI release 0.4.1).
//!
//! The model folder (upstream's `model_v1.1/`, from the pinned Zenodo tar.gz): `encoder.ckpt`
//! (torch.save of `{"state_dict": Encoder.state_dict()}`, read as data by candle's pickle reader;
//! nothing in it is executed), `gene_order.tsv` (one gene symbol a line: the model's input
//! columns) and `layer_sizes.json` ({state_dict key: shape}). CellEmbedding infers the
//! architecture from layer_sizes.json: the keys sorted, those with "weight" and a 2-d shape are
//! the Linear layers; the last one's rows are the latent size, the others' the hidden sizes.
//! We do the same and check it against the checkpoint's tensors. `label_ints.csv` (the
//! annotation labels) is not needed to embed cells.
//!
//! The encoder (Encoder.forward in eval mode; dropout is off): for each hidden layer
//! `network.{i}` = Sequential(Dropout, Linear `.1`, BatchNorm1d `.2` with its running statistics
//! and eps 1e-5, PReLU `.3`), then Linear `network.{n}` to the latent size, then
//! `F.normalize(p=2, dim=1)` (x / max(||x||, 1e-12)): the embedding is L2-normalised, as
//! CellEmbedding.get_embeddings returns it.
//!
//! Input (align_dataset, then lognorm_counts, as upstream's tutorials call them): the data's
//! genes are matched to gene_order.tsv by symbol (var_names, exactly); model genes absent from
//! the data are zero columns; genes not in the model are dropped; then each cell is normalised
//! to 10,000 counts over the aligned genes (`sc.pp.normalize_total(target_sum=1e4)`; a cell
//! with no counts stays zero) and log1p'd. Genes repeated in var_names are summed first, as
//! upstream's `consolidate_duplicate_symbols` does. Upstream reads `layers['counts']`; we read
//! the matrix chosen by --layer (X by default), which must hold raw counts.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, D};
use candle_nn::{Linear, Module};

use crate::error::{Error, Result};
use crate::nn::sparse_rows::SparseRows;

/// The weights entry (the pinned tar.gz, extracted beside itself by `weights pull`).
pub const ARCHIVE_ENTRY: &str = "scimilarity-model-v1.1";
/// The model folder's name inside the archive.
pub const MODEL_FOLDER: &str = "model_v1.1";
/// Upstream's normalisation target (lognorm_counts: normalize_total target_sum=1e4).
pub const TARGET_SUM: f64 = 1e4;
/// align_dataset's default gene_overlap_threshold: upstream refuses data with fewer genes in common.
pub const UPSTREAM_MIN_OVERLAP: usize = 5000;
/// BatchNorm1d's default eps.
const BN_EPS: f64 = 1e-5;

/// The model folder: weights folder's `scimilarity/model_v1.1/`, or `--model-dir`.
pub fn model_dir(weights_dir: &Path, manifest: &crate::weights::Manifest) -> PathBuf {
    let file = manifest.weights.get(ARCHIVE_ENTRY).map(|e| e.file.clone()).unwrap_or_else(|| "scimilarity/model_v1.1.tar.gz".into());
    let base = weights_dir.join(file).parent().map(Path::to_path_buf).unwrap_or_else(|| weights_dir.to_path_buf());
    base.join(MODEL_FOLDER)
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Error::MissingFile { path: path.to_path_buf() }
        } else {
            Error::Io { path: path.to_path_buf(), source: e }
        }
    })
}

/// gene_order.tsv: one symbol a line, stripped (`[line.strip() for line in fh]`).
pub fn read_gene_order(path: &Path) -> Result<Vec<String>> {
    let text = read_text(path)?;
    let genes: Vec<String> = text.lines().map(|l| l.trim().to_string()).collect();
    if genes.is_empty() {
        return Err(Error::BadWeights { path: path.into(), detail: "holds no gene; expected one gene symbol a line (the model's input order)".into() });
    }
    Ok(genes)
}

/// The architecture from layer_sizes.json, as CellEmbedding infers it: (hidden sizes, latent).
pub fn read_layer_sizes(path: &Path) -> Result<(Vec<usize>, usize)> {
    let text = read_text(path)?;
    let bad = |detail: String| Error::BadWeights { path: path.into(), detail: format!("{detail}; expected {{state_dict key: shape}} as upstream's training writes it") };
    let v: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&text).map_err(|e| bad(format!("not a JSON object: {e}")))?;
    let mut keys: Vec<&String> = v.keys().collect();
    keys.sort();
    let mut rows = Vec::new();
    for k in keys {
        let Some(shape) = v[k].as_array() else { return Err(bad(format!("`{k}` is not a list"))) };
        if k.contains("weight") && shape.len() > 1 {
            rows.push(shape[0].as_u64().ok_or_else(|| bad(format!("`{k}` has a shape that is not integers")))? as usize);
        }
    }
    let Some(latent) = rows.pop() else { return Err(bad("names no 2-d weight".into())) };
    if rows.is_empty() {
        return Err(bad("names one 2-d weight only (an encoder has at least one hidden layer)".into()));
    }
    Ok((rows, latent))
}

struct Block {
    linear: Linear,
    scale: Tensor,
    shift: Tensor,
    slope: Tensor,
}

/// The SCimilarity encoder in eval mode.
pub struct Encoder {
    blocks: Vec<Block>,
    out: Linear,
    pub n_genes: usize,
    pub hidden: Vec<usize>,
    pub latent: usize,
    pub device: Device,
}

fn missing_key(k: &str, have: &HashMap<String, Tensor>) -> String {
    let mut some: Vec<&str> = have.keys().map(String::as_str).collect();
    some.sort();
    some.truncate(6);
    format!("no tensor `{k}` (the checkpoint has {})", if some.is_empty() { "no tensors".into() } else { some.join(", ") })
}

impl Encoder {
    /// The model folder's encoder: `n_genes` from gene_order.tsv, architecture from
    /// layer_sizes.json, weights from encoder.ckpt.
    pub fn load(dir: &Path, device: Device) -> Result<(Encoder, Vec<String>)> {
        let genes = read_gene_order(&dir.join("gene_order.tsv"))?;
        let (hidden, latent) = read_layer_sizes(&dir.join("layer_sizes.json"))?;
        let enc = Encoder::from_checkpoint(&dir.join("encoder.ckpt"), genes.len(), &hidden, latent, device)?;
        Ok((enc, genes))
    }

    pub fn from_checkpoint(path: &Path, n_genes: usize, hidden: &[usize], latent: usize, device: Device) -> Result<Encoder> {
        if !path.is_file() {
            return Err(Error::MissingFile { path: path.into() });
        }
        let bad = |detail: String| Error::BadWeights { path: path.into(), detail };
        // upstream's save_state wraps the state_dict as {"state_dict": ...}; a bare state_dict is read too
        let list = match candle_core::pickle::read_all_with_key(path, Some("state_dict")) {
            Ok(l) => l,
            Err(e) if e.to_string().contains("not found") => candle_core::pickle::read_all(path).map_err(|e| bad(format!("not a PyTorch checkpoint: {e}")))?,
            Err(e) => return Err(bad(format!("not a PyTorch checkpoint (upstream's encoder.ckpt is torch.save of {{\"state_dict\": ...}}): {e}"))),
        };
        let t: HashMap<String, Tensor> = list.into_iter().collect();
        let get = |k: &str, shape: &[usize]| -> Result<Tensor> {
            let x = t.get(k).ok_or_else(|| bad(missing_key(k, &t)))?;
            if x.dims() != shape {
                return Err(bad(format!("`{k}` has shape {:?}, expected {shape:?} (from gene_order.tsv and layer_sizes.json)", x.dims())));
            }
            x.to_dtype(DType::F32).and_then(|x| x.to_device(&device)).map_err(|e| bad(format!("{k}: {e}")))
        };
        let me = |e: candle_core::Error| bad(e.to_string());
        let mut blocks = Vec::new();
        let mut width = n_genes;
        for (i, &h) in hidden.iter().enumerate() {
            let p = format!("network.{i}");
            let w = get(&format!("{p}.1.weight"), &[h, width])?;
            let b = get(&format!("{p}.1.bias"), &[h])?;
            let gamma = get(&format!("{p}.2.weight"), &[h])?;
            let beta = get(&format!("{p}.2.bias"), &[h])?;
            let mean = get(&format!("{p}.2.running_mean"), &[h])?;
            let var = get(&format!("{p}.2.running_var"), &[h])?;
            let slope_key = format!("{p}.3.weight");
            let slope = t.get(&slope_key).ok_or_else(|| bad(missing_key(&slope_key, &t)))?;
            let n = slope.elem_count();
            if n != 1 && n != h {
                return Err(bad(format!("`{slope_key}` (PReLU) has {n} slopes, expected 1 or {h}")));
            }
            let slope = slope.to_dtype(DType::F32).and_then(|s| s.reshape((1, n))).and_then(|s| s.to_device(&device)).map_err(me)?;
            // BatchNorm1d in eval mode: (x - mean) / sqrt(var + eps) * gamma + beta
            let scale = (gamma / (var + BN_EPS).and_then(|v| v.sqrt()).map_err(me)?).map_err(me)?;
            let shift = (beta - (mean * &scale).map_err(me)?).map_err(me)?;
            blocks.push(Block { linear: Linear::new(w, Some(b)), scale: scale.reshape((1, h)).map_err(me)?, shift: shift.reshape((1, h)).map_err(me)?, slope });
            width = h;
        }
        let n = hidden.len();
        let ow = get(&format!("network.{n}.weight"), &[latent, width])?;
        let ob = get(&format!("network.{n}.bias"), &[latent])?;
        let extra = format!("network.{}.weight", n + 1);
        if t.contains_key(&extra) || t.contains_key(&format!("network.{}.1.weight", n + 1)) {
            return Err(bad(format!("has layers beyond the {n} hidden layers of layer_sizes.json (`{extra}`)")));
        }
        Ok(Encoder { blocks, out: Linear::new(ow, Some(ob)), n_genes, hidden: hidden.to_vec(), latent, device })
    }

    /// Random weights at any size (for throughput runs): Linear weights normal with sd 0.02,
    /// BatchNorm at its initial statistics (mean 0, var 1, gamma 1, beta 0), PReLU slope 0.25
    /// (PyTorch's initial value). Seeded on the CPU, then moved to `device`.
    pub fn random(n_genes: usize, hidden: &[usize], latent: usize, device: Device, seed: u64) -> Result<Encoder> {
        use rand::SeedableRng;
        use rand_distr::Distribution;
        let me = |e: candle_core::Error| Error::Model { context: "making random SCimilarity weights".into(), detail: e.to_string() };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let normal = rand_distr::Normal::new(0f32, 0.02).expect("valid normal");
        let mut randn = |r: usize, c: usize| -> Result<Tensor> {
            let v: Vec<f32> = (0..r * c).map(|_| normal.sample(&mut rng)).collect();
            Tensor::from_vec(v, (r, c), &device).map_err(me)
        };
        let mut blocks = Vec::new();
        let mut width = n_genes;
        for &h in hidden {
            let w = randn(h, width)?;
            let b = Tensor::zeros(h, DType::F32, &device).map_err(me)?;
            let scale = (Tensor::ones((1, h), DType::F32, &device).map_err(me)? / (1.0 + BN_EPS).sqrt()).map_err(me)?;
            let shift = Tensor::zeros((1, h), DType::F32, &device).map_err(me)?;
            let slope = Tensor::full(0.25f32, (1, 1), &device).map_err(me)?;
            blocks.push(Block { linear: Linear::new(w, Some(b)), scale, shift, slope });
            width = h;
        }
        let ow = randn(latent, width)?;
        let ob = Tensor::zeros(latent, DType::F32, &device).map_err(me)?;
        Ok(Encoder { blocks, out: Linear::new(ow, Some(ob)), n_genes, hidden: hidden.to_vec(), latent, device })
    }

    /// Embeddings of `x` (cells x n_genes, log-normalised and aligned): L2-normalised rows.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        for b in &self.blocks {
            h = b.linear.forward(&h)?;
            h = h.broadcast_mul(&b.scale)?.broadcast_add(&b.shift)?;
            // PReLU: max(0, x) + a * min(0, x)
            h = (h.relu()? + h.minimum(0f32)?.broadcast_mul(&b.slope)?)?;
        }
        let z = self.out.forward(&h)?;
        let norm = z.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.maximum(1e-12f32)?;
        z.broadcast_div(&norm)
    }

    /// Embeddings (`n x latent`, on the model's device, not read back) of a batch of sparse
    /// cells (aligned, log-normalised), made dense on the device ([`SparseRows::to_dense`]: only
    /// the non-zero values travel). The same values as [`Self::embed_rows`] on the same cells.
    pub fn forward_sparse(&self, b: &SparseRows) -> candle_core::Result<Tensor> {
        self.forward(&b.to_dense(&self.device)?)
    }

    /// Rows (`n x latent`, row-major) for a dense row-major batch `n x n_genes`.
    pub fn embed_rows(&self, rows: &[f32], n: usize) -> Result<Vec<f32>> {
        let me = |e: candle_core::Error| Error::Model { context: "running the SCimilarity encoder".into(), detail: e.to_string() };
        let x = Tensor::from_slice(rows, (n, self.n_genes), &self.device).map_err(me)?;
        self.forward(&x).and_then(|z| z.flatten_all()).and_then(|z| z.to_vec1::<f32>()).map_err(me)
    }
}

/// The map from the data's genes to the model's input columns.
pub struct Alignment {
    /// For each data gene: its model column, or None when the model has no such gene.
    pub column: Vec<Option<u32>>,
    /// Model genes found in the data (distinct).
    pub matched: usize,
    /// Model genes absent from the data (zero-filled).
    pub missing: usize,
    /// Data genes whose symbol appears more than once in var_names (summed).
    pub duplicated: usize,
    pub n_genes: usize,
}

impl Alignment {
    pub fn new(var_names: &[String], gene_order: &[String]) -> Alignment {
        let mut pos: HashMap<&str, u32> = HashMap::with_capacity(gene_order.len());
        for (i, g) in gene_order.iter().enumerate() {
            pos.entry(g.as_str()).or_insert(i as u32);
        }
        let column: Vec<Option<u32>> = var_names.iter().map(|g| pos.get(g.as_str()).copied()).collect();
        let mut seen = vec![0u32; gene_order.len()];
        for c in column.iter().flatten() {
            seen[*c as usize] += 1;
        }
        let matched = seen.iter().filter(|&&k| k > 0).count();
        let duplicated = seen.iter().filter(|&&k| k > 1).map(|&k| k as usize).sum();
        Alignment { column, matched, missing: gene_order.len() - matched, duplicated, n_genes: gene_order.len() }
    }

    /// [`Self::lognorm_row`]'s non-zero values as (model column, value) entries in `out`, each
    /// column once (repeated genes summed in the data's order, as there): the same values.
    pub fn lognorm_sparse(&self, indices: &[u32], values: &[f32], out: &mut Vec<(u32, f32)>) -> std::result::Result<(), f32> {
        out.clear();
        let mut total = 0f64;
        for (&j, &v) in indices.iter().zip(values) {
            if !v.is_finite() || v < 0.0 {
                return Err(v);
            }
            if let Some(c) = self.column[j as usize] {
                out.push((c, v));
                total += v as f64;
            }
        }
        if self.duplicated > 0 {
            // a stable sort keeps the data's order within a column: the sums are lognorm_row's
            out.sort_by_key(|e| e.0);
            let mut w = 0;
            for r in 0..out.len() {
                if w > 0 && out[w - 1].0 == out[r].0 {
                    out[w - 1].1 += out[r].1;
                } else {
                    out[w] = (out[r].0, 0.0 + out[r].1);
                    w += 1;
                }
            }
            out.truncate(w);
        }
        out.retain(|e| e.1 != 0.0);
        if total > 0.0 {
            let f = (TARGET_SUM / total) as f32;
            out.iter_mut().for_each(|e| e.1 = (e.1 * f).ln_1p());
        }
        Ok(())
    }

    /// One cell's aligned, log-normalised row into `out` (length n_genes): counts summed into
    /// the model's columns, scaled to 1e4 over the aligned genes, log1p. Err(value) when a
    /// count is negative or not finite.
    pub fn lognorm_row(&self, indices: &[u32], values: &[f32], out: &mut [f32]) -> std::result::Result<(), f32> {
        out.iter_mut().for_each(|o| *o = 0.0);
        let mut total = 0f64;
        for (&j, &v) in indices.iter().zip(values) {
            if !v.is_finite() || v < 0.0 {
                return Err(v);
            }
            if let Some(c) = self.column[j as usize] {
                out[c as usize] += v;
                total += v as f64;
            }
        }
        if total > 0.0 {
            let f = (TARGET_SUM / total) as f32;
            out.iter_mut().for_each(|o| {
                if *o != 0.0 {
                    *o = (*o * f).ln_1p();
                }
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn alignment_zero_fills_drops_and_sums() {
        let order = names(&["A", "B", "C", "D"]);
        let data = names(&["C", "X", "A", "C"]);
        let a = Alignment::new(&data, &order);
        assert_eq!(a.column, vec![Some(2), None, Some(0), Some(2)]);
        assert_eq!((a.matched, a.missing, a.duplicated), (2, 2, 2));
        let mut row = vec![0f32; 4];
        // C=3, X=100 (not in the model: not in the total), A=1, C again=1
        a.lognorm_row(&[0, 1, 2, 3], &[3.0, 100.0, 1.0, 1.0], &mut row).unwrap();
        let want = |c: f64| ((c * 1e4 / 5.0) as f32).ln_1p();
        assert_eq!(row, vec![want(1.0), 0.0, want(4.0), 0.0]);
        // a cell with no counts in the model's genes stays zero
        a.lognorm_row(&[1], &[7.0], &mut row).unwrap();
        assert!(row.iter().all(|&v| v == 0.0));
        assert_eq!(a.lognorm_row(&[0], &[-1.0], &mut row), Err(-1.0));
    }

    #[test]
    fn sparse_rows_scattered_equal_the_dense_rows() {
        let order = names(&["A", "B", "C", "D", "E"]);
        let data = names(&["C", "X", "A", "C", "E"]);
        let a = Alignment::new(&data, &order);
        let cells: Vec<(Vec<u32>, Vec<f32>)> = vec![(vec![0, 1, 2, 3, 4], vec![3.0, 100.0, 1.0, 1.0, 0.0]), (vec![1], vec![7.0]), (vec![4, 2], vec![2.0, 5.0]), (vec![], vec![])];
        let mut sparse = Vec::new();
        let mut dense = vec![0f32; cells.len() * 5];
        for (i, (idx, v)) in cells.iter().enumerate() {
            let mut e = Vec::new();
            a.lognorm_sparse(idx, v, &mut e).unwrap();
            a.lognorm_row(idx, v, &mut dense[i * 5..(i + 1) * 5]).unwrap();
            sparse.push(e);
        }
        assert_eq!(a.lognorm_sparse(&[0], &[f32::NAN], &mut Vec::new()).unwrap_err().is_nan(), true);
        let enc = Encoder::random(5, &[4], 3, Device::Cpu, 7).unwrap();
        let want = enc.embed_rows(&dense, cells.len()).unwrap();
        let b = SparseRows::new(&sparse, 5);
        let got = enc.forward_sparse(&b).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(got, want);
    }

    #[test]
    fn layer_sizes_as_upstream_infers_them() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("layer_sizes.json");
        std::fs::write(
            &p,
            r#"{"network.0.1.weight": [1024, 28231], "network.0.1.bias": [1024], "network.0.2.weight": [1024], "network.0.3.weight": [1],
                "network.1.1.weight": [1024, 1024], "network.1.2.weight": [1024], "network.2.weight": [128, 1024], "network.2.bias": [128]}"#,
        )
        .unwrap();
        assert_eq!(read_layer_sizes(&p).unwrap(), (vec![1024, 1024], 128));
        std::fs::write(&p, r#"{"network.0.bias": [3]}"#).unwrap();
        assert!(read_layer_sizes(&p).unwrap_err().to_string().contains("no 2-d weight"));
    }

    #[test]
    fn forward_is_prelu_batchnorm_and_l2() {
        let dev = Device::Cpu;
        let enc = Encoder {
            blocks: vec![Block {
                linear: Linear::new(Tensor::new(&[[1f32, 0.0], [0.0, 1.0]], &dev).unwrap(), None),
                scale: Tensor::new(&[[2f32, 1.0]], &dev).unwrap(),
                shift: Tensor::new(&[[0f32, -1.0]], &dev).unwrap(),
                slope: Tensor::new(&[[0.5f32]], &dev).unwrap(),
            }],
            out: Linear::new(Tensor::new(&[[1f32, 0.0], [0.0, 1.0]], &dev).unwrap(), None),
            n_genes: 2,
            hidden: vec![2],
            latent: 2,
            device: dev.clone(),
        };
        // [3, 0] -> bn [6, -1] -> prelu [6, -0.5] -> normalised
        let z = enc.embed_rows(&[3.0, 0.0], 1).unwrap();
        let n = (36f32 + 0.25).sqrt();
        assert!((z[0] - 6.0 / n).abs() < 1e-6 && (z[1] + 0.5 / n).abs() < 1e-6, "{z:?}");
    }
}
