//! The `embed` task of Novae (see `methods/novae.rs`): coordinates, the Delaunay graph,
//! normalisation and genes as upstream, the graph encoder over each valid cell's subgraph in
//! batches with the GPU back-off, provenance.

use std::path::Path;

use serde_json::{json, Value};

use crate::tasks::runtime::{commit_embedding, verified_weights, Batches, TaskDevice};
use crate::tasks::method::{self as method, one_step, Method, Preflight};
use serde::Deserialize;
use crate::anndata::write::{write_rows, PendingOutput};
use crate::anndata::AnnData;
use crate::error::{Error, Result};
use crate::methods::novae::{self, Config, GraphBatch, Novae, SpatialGraph};
use crate::progress::reporter;
use crate::runner::{TaskResult, TaskSpec};
use crate::weights::{self, Manifest};

/// `obsm['spatial']` as (x, y) per cell in f64: a clear error when it is missing, not n_obs x 2,
/// or holds a non-finite value.
pub fn coords(ad: &AnnData) -> Result<Vec<[f64; 2]>> {
    let hint = "Novae builds its graph from 2-D cell coordinates in microns in obsm['spatial'], e.g. in Python `adata.obsm['spatial'] = adata.obs[['x_centroid', 'y_centroid']].to_numpy()` (Xenium), then write the file again";
    let bad = |detail: String| Error::BadField { path: ad.path.clone(), field: "obsm/spatial".into(), detail, hint: Some(hint.into()) };
    let ds = match ad.file.dataset("obsm/spatial") {
        Ok(ds) => ds,
        Err(_) => {
            let have = ad.group_keys("obsm");
            let what = if ad.file.link_exists("obsm/spatial") { "is not a dense array (a dataframe?)".to_string() } else if have.is_empty() { "is missing (the file has no obsm entries)".to_string() } else { format!("is missing (obsm holds: {})", have.join(", ")) };
            return Err(bad(what));
        }
    };
    let shape = ds.shape();
    if shape.len() != 2 || shape[0] != ad.n_obs || shape[1] != 2 {
        return Err(bad(format!("has shape {shape:?}, expected ({}, 2): one (x, y) row per cell (upstream asserts 2-D coordinates)", ad.n_obs)));
    }
    let v: Vec<f64> = ds.read_raw().map_err(|e| bad(format!("cannot be read as numbers: {e}")))?;
    let mut out = Vec::with_capacity(ad.n_obs);
    for (i, c) in v.chunks(2).enumerate() {
        if !c[0].is_finite() || !c[1].is_finite() {
            return Err(bad(format!("row {i} (cell {}) is ({}, {}): every coordinate must be finite", ad.obs_names[i], c[0], c[1])));
        }
        out.push([c[0], c[1]]);
    }
    Ok(out)
}

pub(super) fn embed_novae(spec: &TaskSpec, task_dir: &Path) -> Result<TaskResult> {
    let rep = reporter(!spec.progress);
    let dir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let shas = verified_weights("novae", &dir, &novae::ENTRIES)?;
    let (model_path, config_path) = novae::files(&dir, &Manifest::load()?)?;
    let cfg = Config::load(&config_path)?;
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let xy = coords(&ad)?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let mut notes = Vec::new();

    // genes: known to the vocabulary (case-insensitive), and highly variable above 100 genes
    let vocab = cfg.gene_index();
    let known: Vec<Option<usize>> = ad.var_names.iter().map(|g| vocab.get(g.to_lowercase().as_str()).copied()).collect();
    let n_known = known.iter().flatten().count();
    if n_known < novae::MIN_GENES {
        let example = ad.var_names.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
        return Err(Error::BadField {
            path: spec.data.clone(),
            field: "var_names".into(),
            detail: format!("only {n_known} of {} genes are in the model's vocabulary of {} (e.g. {example}); Novae needs at least {}", ad.n_vars, cfg.var_names.len(), novae::MIN_GENES),
            hint: Some("Novae matches gene symbols (e.g. CD3E, any case) in var_names; data with Ensembl ids in var_names needs the symbols there".into()),
        });
    }
    let hvg: Option<Vec<bool>> = if ad.n_vars > novae::MIN_GENES_FOR_HVG {
        match ad.var()?.column("highly_variable") {
            Some(crate::anndata::dataframe::Column::Bool(v)) => Some(v.clone()),
            _ => {
                return Err(Error::BadField {
                    path: spec.data.clone(),
                    field: "var/highly_variable".into(),
                    detail: format!("is missing: with {} genes (more than {}) Novae keeps only highly variable ones, and scfoundry does not compute scanpy's default highly_variable_genes itself", ad.n_vars, novae::MIN_GENES_FOR_HVG),
                    hint: Some("run `sc.pp.normalize_total(adata); sc.pp.log1p(adata); sc.pp.highly_variable_genes(adata)` on a copy and store its var['highly_variable'] (a boolean column) in the file, as novae does before embedding".into()),
                });
            }
        }
    } else {
        None
    };
    let used: Vec<usize> = (0..ad.n_vars).filter(|&j| known[j].is_some() && hvg.as_ref().map(|h| h[j]).unwrap_or(true)).collect();
    if used.len() < novae::MIN_GENES {
        return Err(Error::BadField {
            path: spec.data.clone(),
            field: "var/highly_variable".into(),
            detail: format!("only {} genes are both known by the model and highly variable; Novae needs at least {}", used.len(), novae::MIN_GENES),
            hint: Some("mark more genes in var['highly_variable']".into()),
        });
    }
    let rows: Vec<u32> = used.iter().map(|&j| known[j].unwrap_or(0) as u32).collect();
    let mut col = vec![usize::MAX; ad.n_vars];
    for (k, &j) in used.iter().enumerate() {
        col[j] = k;
    }
    notes.push(format!("{} of {} genes used: {n_known} known to the model's vocabulary of {}{}", used.len(), ad.n_vars, cfg.var_names.len(), if hvg.is_some() { ", then those in var['highly_variable']" } else { " (100 genes or fewer: no highly-variable selection, as upstream)" }));

    // expression: totals and max over all genes, then the used genes, dense
    let g = used.len();
    let n = ad.n_obs;
    let mut totals = vec![0f64; n];
    let (mut max, mut min) = (f32::NEG_INFINITY, 0f32);
    let mut z = vec![0f32; n * g];
    let mut nnz = 0usize;
    let p = rep.step("novae: read", n as u64, "cells");
    for (s, e) in x.blocks(2_000_000) {
        let b = x.read_rows(s, e)?;
        nnz += b.nnz();
        for i in 0..b.n_rows() {
            let (idx, vals) = b.row(i);
            for (&j, &v) in idx.iter().zip(vals) {
                if !v.is_finite() {
                    return Err(Error::NonFinite { path: spec.data.clone(), value: v, row: s + i, col: j as usize, cell: ad.obs_names[s + i].clone(), gene: ad.var_names[j as usize].clone() });
                }
                totals[s + i] += v as f64;
                max = max.max(v);
                min = min.min(v);
                let k = col[j as usize];
                if k != usize::MAX {
                    z[(s + i) * g + k] = v;
                }
            }
        }
        p.inc(b.n_rows() as u64);
    }
    p.finish();
    if (nnz as u64) < (n as u64) * (ad.n_vars as u64) {
        max = max.max(0.0); // the implicit zeros
    }
    if min < 0.0 {
        notes.push(format!("{} has negative values: upstream warns that it expects raw counts or log1p data", x.field));
    }
    let counts = novae::looks_like_counts(max);
    let target = novae::median_total(&totals);
    if counts {
        for (i, r) in z.chunks_mut(g).enumerate() {
            let t = if totals[i] > 0.0 { totals[i] / target } else { 1.0 };
            for v in r.iter_mut() {
                *v = ((*v as f64 / t) as f32).ln_1p();
            }
        }
        notes.push(format!("{} holds raw counts (max {max}): normalize_total to the median count {target} and log1p, as upstream", x.field));
    } else if max >= 10.0 {
        notes.push(format!("{} has values up to {max} that are not counts: used as they are (upstream warns and recommends normalize_total + log1p)", x.field));
    }
    let (mean, std) = novae::mean_std(&z, n, g);
    for r in z.chunks_mut(g) {
        for ((v, m), s) in r.iter_mut().zip(&mean).zip(&std) {
            *v = (*v - m) / (s + novae::ZSCORE_EPS);
        }
    }

    // the graph and the subgraphs
    let p: Params = method::task_params(spec)?;
    let radius = p.radius;
    let graph = SpatialGraph::build(&xy, (radius > 0).then_some((0.0, radius as f64))).ok_or_else(|| Error::BadField {
        path: spec.data.clone(),
        field: "obsm/spatial".into(),
        detail: "has no Delaunay triangulation: fewer than 3 cells, or all cells on one line".into(),
        hint: Some("Novae needs 2-D coordinates of at least 3 cells not all on one line".into()),
    })?;
    if graph.n_edges() == 0 {
        return Err(Error::BadOption { option: "--radius".into(), detail: format!("no spatial edge is {radius} microns or shorter"), hint: Some("raise --radius (0 keeps all Delaunay edges); coordinates must be in microns".into()) });
    }
    let (valid, sub) = graph.subgraphs(cfg.n_hops_local, cfg.n_hops_view);
    let order: Vec<usize> = (0..n).filter(|&i| valid[i]).collect();
    if order.len() < n {
        notes.push(format!(
            "{} of {n} cells have no cell exactly {} hops away in the graph: upstream leaves them out and writes zeros, as here{}",
            n - order.len(),
            cfg.n_hops_view,
            if radius > 0 { " (a larger --radius keeps more edges)" } else { "" }
        ));
    }
    let mean_deg = graph.n_edges() as f64 / n.max(1) as f64;

    let dev = TaskDevice::start(spec)?;
    let model = Novae::load(&model_path, cfg.clone(), dev.device.clone()).map_err(|e| dev.load_error(e, "loading the model's weights", task_dir))?;
    let genes = model.gene_matrix(&rows)?;
    dev.mark_loaded();
    let batch = p.batch_size;
    let mut batches = Batches::new(dev, batch, task_dir);
    let dim = model.dim();
    let p = rep.step("novae: embed", order.len() as u64, "cells");
    let emb = batches.run(
        n,
        dim,
        &order,
        0.0,
        |cells| {
            let b = GraphBatch::new(&graph, &sub, cells, 1.0);
            let mut zb = Vec::with_capacity(b.nodes.len() * g);
            for &v in &b.nodes {
                zb.extend_from_slice(&z[v * g..(v + 1) * g]);
            }
            model.encode(&genes, &zb, &b)
        },
        |k| p.inc(k as u64),
    )?;
    p.finish();
    batches.finish(&mut notes, true);
    if spec.command == "transfer" {
        // label transfer: the rows as a raw f32 file (see task.rs)
        crate::tasks::runtime::write_f32_file(&spec.out, &emb)?;
        return Ok(TaskResult { output: Some(spec.out.clone()), obsm_key: Some("X_novae".into()), n_obs: n, dim, notes, phases: Vec::new(), ..Default::default() });
    }

    let out = PendingOutput::create(&spec.data, &spec.out)?;
    let key = "X_novae";
    let ds = out.create_obsm(key, n, dim)?;
    write_rows(&ds, 0, &emb, dim)?;
    drop(ds);
    let mut params = spec.params.clone();
    batches.record(spec, &mut params);
    params.insert("radius".into(), json!(radius));
    params.insert("graph".into(), json!("Delaunay triangulation of obsm['spatial'] (novae.spatial_neighbors, coord_type generic), edges longer than radius dropped (0: none)"));
    params.insert("edges".into(), json!(graph.n_edges()));
    params.insert("mean_neighbours".into(), json!(mean_deg));
    params.insert("n_hops_local".into(), json!(cfg.n_hops_local));
    params.insert("n_hops_view".into(), json!(cfg.n_hops_view));
    params.insert("cells_valid".into(), json!(order.len()));
    params.insert("genes_used".into(), json!(used.len()));
    params.insert("normalised".into(), json!(counts));
    params.insert("normalize_total_target".into(), json!(if counts { target } else { 0.0 }));
    params.insert("scale_to_microns".into(), json!(1.0));
    params.insert("cell_embedding".into(), json!("upstream obsm['novae_latent']: the attention-aggregated GATv2 encoding of the cell's n_hops_local subgraph; zeros for cells without a valid neighbourhood"));
    let mut w = serde_json::Map::new();
    w.insert("model".into(), json!(model_path.display().to_string()));
    w.insert("config".into(), json!(config_path.display().to_string()));
    commit_embedding(spec, out, key, &x.field, params, w, Value::Object(shas), n, dim, notes)
}

/// Novae's options, from `methods/novae.toml`.
#[derive(Debug, Deserialize)]
pub struct Params {
    pub batch_size: usize,
    pub radius: u64,
}

/// Novae: the table's entry.
pub struct NovaeMethod;

impl Method for NovaeMethod {
    fn check(&self, pf: &Preflight) -> Result<()> {
        verified_weights(pf.method, pf.weights_dir, &novae::ENTRIES)?;
        coords(&AnnData::open(pf.data)?).map(drop)
    }

    fn embed(&self, spec: &TaskSpec, task_dir: &Path, step: &crate::runner::Step) -> Option<Result<TaskResult>> {
        one_step(step, || embed_novae(spec, task_dir))
    }

    fn transfer(&self, spec: &TaskSpec, task_dir: &Path, step: &crate::runner::Step) -> Option<Result<TaskResult>> {
        one_step(step, || embed_novae(spec, task_dir))
    }
}
