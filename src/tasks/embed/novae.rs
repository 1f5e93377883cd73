//! The `embed` task of Novae (see `methods/novae.rs`): coordinates, the Delaunay graph,
//! normalisation and genes as upstream, the graph encoder over each valid cell's subgraph in
//! batches with the GPU back-off, provenance.

use std::path::Path;

use serde_json::{json, Value};

use crate::tasks::genes::{self, match_genes, GeneMatch, Kind, Resolved};
use crate::tasks::runtime::{check_weights_or_folder, weights_or_folder, Batches, TaskDevice};
use crate::tasks::shard::{work_dir, write_atomic, EmbeddingOut, TaskRows};
use crate::tasks::method::{self as method, one_step, Method, Preflight};
use serde::Deserialize;
use crate::anndata::AnnData;
use crate::error::{Error, Result};
use crate::methods::novae::{self, Config, GraphBatch, Novae, SpatialGraph};
use crate::progress::reporter;
use crate::runner::{Step, TaskResult, TaskSpec};
use crate::weights;

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

/// The genes a run uses: their rows in the model's vocabulary, and each data column's place among
/// them (`usize::MAX`: not used).
struct Genes {
    rows: Vec<u32>,
    col: Vec<usize>,
    g: usize,
    ids: Resolved,
    report: GeneMatch,
}

/// The genes: known to the vocabulary (case-insensitive), and highly variable above 100 genes.
fn genes(spec: &TaskSpec, ad: &AnnData, x: &crate::anndata::Matrix, cfg: &Config, notes: &mut Vec<String>) -> Result<Genes> {
    let vocab = cfg.gene_index();
    // symbols, found and mapped from Ensembl ids where needed (tasks::genes)
    let (ids, report) = match_genes(ad, x, &spec.params, Kind::Symbols, &|g| vocab.contains_key(g.to_lowercase().as_str()), notes)?;
    let known: Vec<Option<usize>> = ids.names.iter().map(|g| vocab.get(g.to_lowercase().as_str()).copied()).collect();
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
    Ok(Genes { rows, col, g: used.len(), ids, report })
}

/// What normalising the whole slide found: whether X held counts (then normalize_total to
/// `target` and log1p), and the notes on it. A sharded run's fit saves it beside z.
#[derive(serde::Serialize, Deserialize)]
struct Scaling {
    n_obs: usize,
    g: usize,
    counts: bool,
    target: f64,
    notes: Vec<String>,
}

/// The used genes' expression over all cells, normalised as upstream and z-scored per gene
/// (cells x genes, f32), and how it was scaled.
fn zscores(spec: &TaskSpec, ad: &AnnData, x: &crate::anndata::Matrix, genes: &Genes) -> Result<(Vec<f32>, Scaling)> {
    let rep = reporter(!spec.progress);
    let (g, col) = (genes.g, &genes.col);
    let n = ad.n_obs;
    let mut notes = Vec::new();
    // expression: totals and max over all genes, then the used genes, dense
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
    Ok((z, Scaling { n_obs: n, g, counts, target, notes }))
}

/// The fit's files in the run's work folder: z (raw little-endian f32, cells x genes) and how
/// the slide was scaled.
const Z_FILE: &str = "novae_z.f32";
const SCALING_FILE: &str = "novae_scaling.json";

/// The fit step of a sharded run: the slide normalised and z-scored once (both are over all
/// cells), saved for the shards. The graph is not saved: each shard builds it again from
/// obsm['spatial'] (cheap, deterministic).
fn fit_novae(spec: &TaskSpec) -> Result<TaskResult> {
    let dir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let (dir, manifest, _) = weights_or_folder("novae", &spec.params, &dir, &novae::ENTRIES)?;
    let (_, config_path) = novae::files(&dir, &manifest)?;
    let cfg = Config::load(&config_path)?;
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let mut notes = Vec::new();
    let genes = genes(spec, &ad, &x, &cfg, &mut notes)?;
    let (z, scaling) = zscores(spec, &ad, &x, &genes)?;
    let work = work_dir(spec)?;
    let bytes: Vec<u8> = z.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_atomic(&work.join(Z_FILE), &bytes)?;
    let text = serde_json::to_vec(&scaling).map_err(|e| Error::Model { context: "saving the scaling".into(), detail: e.to_string() })?;
    write_atomic(&work.join(SCALING_FILE), &text)?;
    Ok(TaskResult { output: Some(work.join(Z_FILE)), n_obs: ad.n_obs, dim: genes.g, notes, ..Default::default() })
}

/// Rows of z a task holds: all of them (a whole run), or those a shard read from the fit's file.
struct ZRows {
    g: usize,
    /// Row -> its place in `data`, for a shard's rows (u32::MAX: not read); None: all rows.
    slot: Option<Vec<u32>>,
    data: Vec<f32>,
}

impl ZRows {
    fn row(&self, v: usize) -> &[f32] {
        let k = match &self.slot {
            Some(s) => s[v] as usize,
            None => v,
        };
        &self.data[k * self.g..(k + 1) * self.g]
    }

    /// The rows `needed` (ascending, distinct) of the fit's z file, each contiguous run read
    /// once and noted as read (`anndata::matrix::note_rows_read`: the shard's own rows and its
    /// subgraphs' halo).
    fn read(path: &Path, n: usize, g: usize, needed: &[usize]) -> Result<ZRows> {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::open(path).map_err(|e| Error::Io { path: path.into(), source: e })?;
        let len = f.metadata().map_err(|e| Error::Io { path: path.into(), source: e })?.len();
        if len != (n * g * 4) as u64 {
            return Err(Error::BadField { path: path.into(), field: "z".into(), detail: format!("holds {len} bytes, not {n} cells x {g} genes of f32"), hint: Some("start the run again".into()) });
        }
        let mut slot = vec![u32::MAX; n];
        let mut data = vec![0f32; needed.len() * g];
        let mut i = 0;
        while i < needed.len() {
            let mut j = i + 1;
            while j < needed.len() && needed[j] == needed[j - 1] + 1 {
                j += 1;
            }
            let (a, b) = (needed[i], needed[j - 1] + 1);
            let mut bytes = vec![0u8; (b - a) * g * 4];
            f.read_exact_at(&mut bytes, (a * g * 4) as u64).map_err(|e| Error::Io { path: path.into(), source: e })?;
            for (k, c) in bytes.chunks_exact(4).enumerate() {
                data[i * g + k] = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            for (k, v) in (a..b).enumerate() {
                slot[v] = (i + k) as u32;
            }
            crate::anndata::matrix::note_rows_read(a, b);
            i = j;
        }
        Ok(ZRows { g, slot: Some(slot), data })
    }
}

pub(super) fn embed_novae(spec: &TaskSpec, task_dir: &Path) -> Result<TaskResult> {
    let rep = reporter(!spec.progress);
    let dir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let (dir, manifest, shas) = weights_or_folder("novae", &spec.params, &dir, &novae::ENTRIES)?;
    let (model_path, config_path) = novae::files(&dir, &manifest)?;
    let cfg = Config::load(&config_path)?;
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let xy = coords(&ad)?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let mut notes = Vec::new();
    let gene_set = genes(spec, &ad, &x, &cfg, &mut notes)?;
    let (g, n) = (gene_set.g, ad.n_obs);
    let p: Params = method::task_params(spec)?;
    let task_rows = TaskRows::new(spec, n, NovaeMethod.block_rows(&x, &spec.params))?;
    let sharded = matches!(spec.step, Step::Project { .. });

    // the graph and the subgraphs, over the whole slide
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

    // z: computed here over the whole slide, or a shard's rows of the fit's (its own cells and
    // the other cells in their subgraphs)
    let (z, scaling, halo) = if sharded {
        let work = work_dir(spec)?;
        let spath = work.join(SCALING_FILE);
        let bad = |detail: String| Error::BadField { path: spath.clone(), field: "scaling".into(), detail, hint: Some("the fit step of this run did not finish, or was made for other data: start the run again".into()) };
        let text = std::fs::read(&spath).map_err(|e| bad(format!("cannot be read ({e})")))?;
        let scaling: Scaling = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
        if scaling.n_obs != n || scaling.g != g {
            return Err(bad(format!("made for {} cells x {} genes; this run has {n} x {g}", scaling.n_obs, scaling.g)));
        }
        let mut needed: Vec<usize> = (task_rows.start..task_rows.end).collect();
        for &c in order.iter().filter(|&&c| c >= task_rows.start && c < task_rows.end) {
            needed.extend(&sub[c]);
        }
        needed.sort_unstable();
        needed.dedup();
        let halo = needed.len() - task_rows.len();
        (ZRows::read(&work.join(Z_FILE), n, g, &needed)?, scaling, Some(halo))
    } else {
        let (z, scaling) = zscores(spec, &ad, &x, &gene_set)?;
        (ZRows { g, slot: None, data: z }, scaling, None)
    };
    notes.extend(scaling.notes.iter().cloned());
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
    let gm = model.gene_matrix(&gene_set.rows)?;
    dev.mark_loaded();
    let mut batches = Batches::new(dev, p.batch_size, task_dir);
    let dim = model.dim();
    let key = "X_novae";
    let transfer = spec.command == "transfer";
    let out = if transfer { None } else { Some(EmbeddingOut::create(spec, &task_rows, key, n, dim)?) };
    let mut emb = if transfer { vec![0f32; n * dim] } else { Vec::new() };
    let own = order.iter().filter(|&&c| c >= task_rows.start && c < task_rows.end).count();
    let bar = rep.step("novae: embed", own as u64, "cells");
    // the valid cells batched within the blocks of the grid: a shard's batches are the whole
    // run's
    for (s, e) in task_rows.blocks() {
        let local: Vec<usize> = order.iter().filter(|&&c| c >= s && c < e).map(|&c| c - s).collect();
        let rows = batches.run(
            e - s,
            dim,
            &local,
            0.0,
            |cells| {
                let cells: Vec<usize> = cells.iter().map(|&c| c + s).collect();
                let b = GraphBatch::new(&graph, &sub, &cells, 1.0);
                let mut zb = Vec::with_capacity(b.nodes.len() * g);
                for &v in &b.nodes {
                    zb.extend_from_slice(z.row(v));
                }
                model.encode(&gm, &zb, &b)
            },
            |k| bar.inc(k as u64),
        )?;
        match &out {
            Some(o) => o.write(s, &rows)?,
            None => emb[s * dim..e * dim].copy_from_slice(&rows),
        }
    }
    bar.finish();
    batches.finish(&mut notes, true);
    if let Some(h) = halo {
        notes.push(format!("read {h} rows of the normalised matrix outside its cells: the other cells of its cells' {}-hop subgraphs", cfg.n_hops_local));
    }
    let Some(out) = out else {
        // label transfer: the rows as a raw f32 file (see task.rs)
        crate::tasks::runtime::write_f32_file(&spec.out, &emb)?;
        return Ok(TaskResult { output: Some(spec.out.clone()), obsm_key: Some(key.into()), n_obs: n, dim, notes, phases: Vec::new(), ..Default::default() });
    };
    let mut params = spec.params.clone();
    batches.record(spec, &mut params);
    params.insert("radius".into(), json!(radius));
    params.insert("graph".into(), json!("Delaunay triangulation of obsm['spatial'] (novae.spatial_neighbors, coord_type generic), edges longer than radius dropped (0: none)"));
    params.insert("edges".into(), json!(graph.n_edges()));
    params.insert("mean_neighbours".into(), json!(mean_deg));
    params.insert("n_hops_local".into(), json!(cfg.n_hops_local));
    params.insert("n_hops_view".into(), json!(cfg.n_hops_view));
    params.insert("cells_valid".into(), json!(order.len()));
    params.insert("genes_used".into(), json!(g));
    params.insert("normalised".into(), json!(scaling.counts));
    params.insert("normalize_total_target".into(), json!(if scaling.counts { scaling.target } else { 0.0 }));
    params.insert("scale_to_microns".into(), json!(1.0));
    params.insert("cell_embedding".into(), json!("upstream obsm['novae_latent']: the attention-aggregated GATv2 encoding of the cell's n_hops_local subgraph; zeros for cells without a valid neighbourhood"));
    let mut w = serde_json::Map::new();
    w.insert("model".into(), json!(model_path.display().to_string()));
    w.insert("config".into(), json!(config_path.display().to_string()));
    genes::record(&gene_set.report, &gene_set.ids, &mut params);
    let mut result = out.commit(spec, &x.field, params, w, Value::Object(shas), notes)?;
    result.gene_match = Some(gene_set.report.to_json());
    Ok(result)
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
        check_weights_or_folder(pf.method, pf.weights_dir, pf.model_dir, &novae::ENTRIES)?;
        coords(&AnnData::open(pf.data)?).map(drop)
    }

    fn block_rows(&self, x: &crate::anndata::Matrix, params: &serde_json::Map<String, Value>) -> usize {
        let batch = params.get("batch_size").and_then(Value::as_u64).unwrap_or(1) as usize;
        crate::tasks::shard::block_rows(x, 1_000_000, batch)
    }

    fn fits_before_shards(&self) -> bool {
        true
    }

    fn embed(&self, spec: &TaskSpec, task_dir: &Path, step: &Step) -> Option<Result<TaskResult>> {
        match step {
            Step::Fit => Some(fit_novae(spec)),
            _ => one_step(step, || embed_novae(spec, task_dir)),
        }
    }

    fn transfer(&self, spec: &TaskSpec, task_dir: &Path, step: &Step) -> Option<Result<TaskResult>> {
        one_step(step, || embed_novae(spec, task_dir))
    }
}
