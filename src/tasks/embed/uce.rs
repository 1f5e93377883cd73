//! The `embed` task of UCE (see `methods/uce.rs`): species files, genes, seeded sentences, the
//! transformer in batches with the GPU back-off, provenance.

use std::path::Path;

use serde_json::{json, Value};

use crate::tasks::pipeline::{self, Plan, Stage, StageClock};
use crate::tasks::genes::{self, match_genes, Kind};
use crate::tasks::runtime::{check_weights_or_folder, some_cells, weights_or_folder, Batches, TaskDevice};
use crate::tasks::method::{self as method, one_step, Method, Preflight};
use serde::Deserialize;
use crate::tasks::shard::{work_dir, write_atomic, EmbeddingOut, TaskRows};
use crate::anndata::AnnData;
use crate::error::{Error, Result};
use crate::methods::uce::{self, ChromTable, Config, GeneMap, Uce};
use crate::progress::reporter;
use crate::runner::{Step, TaskResult, TaskSpec};
use crate::weights;

/// The fit's file in the run's work folder: cells expressing each gene over the whole data.
const EXPRESSING_FILE: &str = "uce_expressing.json";

/// What the fit of a sharded run saves: cells with a value > 0 per gene, over all cells.
#[derive(serde::Serialize, Deserialize)]
struct Expressing {
    n_obs: usize,
    n_vars: usize,
    cells: Vec<usize>,
}

/// The fit step of a sharded run: the cells expressing each gene over all cells (upstream's
/// filter_genes drops those under min_cells), once, so every shard keeps the same genes.
fn fit_uce(spec: &TaskSpec) -> Result<TaskResult> {
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let cells = uce::cells_expressing(&x, ad.n_vars)?;
    let path = work_dir(spec)?.join(EXPRESSING_FILE);
    let text = serde_json::to_vec(&Expressing { n_obs: ad.n_obs, n_vars: ad.n_vars, cells }).map_err(|e| Error::Model { context: format!("saving {}", path.display()), detail: e.to_string() })?;
    write_atomic(&path, &text)?;
    Ok(TaskResult { output: Some(path), n_obs: ad.n_obs, ..Default::default() })
}

/// The fit's counts, for the data this shard reads.
fn load_expressing(spec: &TaskSpec, n_obs: usize, n_vars: usize) -> Result<Vec<usize>> {
    let path = work_dir(spec)?.join(EXPRESSING_FILE);
    let bad = |detail: String| Error::BadField { path: path.clone(), field: "cells".into(), detail, hint: Some("the fit step of this run did not finish, or was made for other data: start the run again".into()) };
    let text = std::fs::read(&path).map_err(|e| bad(format!("cannot be read ({e})")))?;
    let e: Expressing = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
    if e.n_obs != n_obs || e.n_vars != n_vars || e.cells.len() != n_vars {
        return Err(bad(format!("made for {} cells x {} genes; the data has {n_obs} x {n_vars}", e.n_obs, e.n_vars)));
    }
    Ok(e.cells)
}

pub(super) fn embed_uce(spec: &TaskSpec, task_dir: &Path) -> Result<TaskResult> {
    let clock = StageClock::new();
    let rep = reporter(!spec.progress);
    let dir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let p: Params = method::task_params(spec)?;
    let nlayers = p.nlayers;
    let (dir, manifest, shas) = weights_or_folder("uce", &spec.params, &dir, &uce::required_entries(nlayers)?)?;
    let (model_path, pe_path, chrom_path, offsets_path) = uce::files(&dir, &manifest, nlayers)?;
    let mut cfg = Config::default();
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let mut notes = Vec::new();

    // species files, then the genes
    let pe_genes = uce::protein_embedding_genes(&pe_path)?;
    let offset = uce::species_offset(&offsets_path, &cfg.species)?;
    let chroms = ChromTable::load(&chrom_path, &cfg.species)?;
    // over all cells: computed here for a whole run, by the fit step for a shard's
    let expressing = match spec.step {
        Step::Project { .. } => load_expressing(spec, ad.n_obs, ad.n_vars)?,
        _ => uce::cells_expressing(&x, ad.n_vars)?,
    };
    // symbols, found and mapped from Ensembl ids where needed (tasks::genes); the protein
    // embeddings are matched upper-cased, as upstream
    let vocab: std::collections::HashSet<&str> = pe_genes.iter().map(String::as_str).collect();
    let (gids, gmatch) = match_genes(&ad, &x, &spec.params, Kind::Symbols, &|g| vocab.contains(g.to_uppercase().as_str()), &mut notes)?;
    let map = GeneMap::new(&gids.names, &expressing, cfg.min_cells, &pe_genes, offset, &chroms);
    if map.n_kept() == 0 {
        let example = ad.var_names.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
        return Err(Error::BadField {
            path: spec.data.clone(),
            field: "var_names".into(),
            detail: format!(
                "no gene is left to embed: of {} genes, {} are expressed in fewer than {} cells and {} of the rest have no protein embedding in {} (e.g. {example})",
                ad.n_vars,
                map.filtered,
                cfg.min_cells,
                map.no_embedding,
                pe_path.display()
            ),
            hint: Some("UCE matches gene symbols (e.g. CD3E) in var_names, as upstream; data with Ensembl ids in var_names needs the symbols there".into()),
        });
    }
    notes.push(format!(
        "{} of {} genes are embedded: {} are expressed in fewer than {} cells (upstream's filter_genes), {} have no ESM2 protein embedding{}",
        map.n_kept(),
        ad.n_vars,
        map.filtered,
        cfg.min_cells,
        map.no_embedding,
        if map.no_chromosome > 0 { format!(", {} have no row in species_chrom.csv (upstream fails on them)", map.no_chromosome) } else { String::new() }
    ));

    let dev = TaskDevice::start(spec)?;
    let dtype = crate::tasks::runtime::precision(spec, &dev.device, &mut notes);
    let mut model = Uce::load_on(&model_path, cfg.clone(), dtype, dev.device.clone()).map_err(|e| dev.load_error(e, "loading the model's weights", task_dir))?;
    dev.mark_loaded();
    cfg.chrom_token_offset = model.chrom_offset(chroms.categories.len());
    model.cfg.chrom_token_offset = cfg.chrom_token_offset;
    if cfg.chrom_token_offset != Config::default().chrom_token_offset {
        notes.push(format!(
            "{} has {} token rows, not the released {}: chromosome tokens start at row {} (its last {} rows, one per species_chrom.csv chromosome)",
            model_path.display(),
            model.dims.tokens,
            uce::RELEASED_TOKENS,
            cfg.chrom_token_offset,
            chroms.categories.len()
        ));
    }
    let max_token = map.token.iter().copied().chain(chroms.categories.iter().enumerate().map(|(i, _)| (i as i64 + cfg.chrom_token_offset) as u32)).max().unwrap_or(0);
    model.check_tokens(max_token)?;
    if model.dims.nlayers as u64 != nlayers {
        notes.push(format!("{} has {} layers, not --nlayers {nlayers}: its layers were run", model_path.display(), model.dims.nlayers));
    }
    let batch = p.batch_size;
    let mut batches = Batches::new(dev, batch, task_dir);
    let dim = model.dim();
    let key = "X_uce";
    let task_rows = TaskRows::new(spec, ad.n_obs, UceMethod.block_rows(&x, &spec.params))?;
    let out = EmbeddingOut::create(spec, &task_rows, key, ad.n_obs, dim)?;
    let p = rep.step("uce: embed", task_rows.len() as u64, "cells");
    let (mut empty, mut few) = (Vec::new(), 0usize);
    // blocks of rows, read and turned into sentences ahead on all cores while the device runs
    // the block before
    let blocks = task_rows.blocks();
    let (map, cfg_ref, expressing, x, ad_ref) = (&map, &cfg, &expressing, &x, &ad);
    let blocks_started = std::time::Instant::now();
    let setup = clock.elapsed();
    pipeline::run(
        blocks.len(),
        Plan::from_env(),
        |k| {
            // each cell: whether it has few genes, and its sentence (None: no count); the first
            // error in row order is the block's
            let cells: Vec<Result<(bool, Option<Vec<u32>>)>> = pipeline::read_and_map(&clock, x, blocks[k], 8, |row, idx, vals| {
                let n_genes = idx.iter().zip(vals).filter(|(&j, &v)| v > 0.0 && expressing[j as usize] >= cfg_ref.min_cells).count();
                let (g, c) = uce::cell_counts(idx, vals, map).map_err(|v| Error::BadField {
                    path: spec.data.clone(),
                    field: x.field.clone(),
                    detail: format!("cell {row} ({}) has the negative value {v}", ad_ref.obs_names[row]),
                    hint: Some("UCE reads raw counts; pass the counts layer with --layer".into()),
                })?;
                Ok((n_genes < cfg_ref.min_genes, uce::sentence(&g, &c, map, cfg_ref, spec.seed, row)?))
            })?;
            cells.into_iter().collect::<Result<Vec<_>>>()
        },
        |k, cells| {
            let (s, _) = blocks[k];
            let mut sentences: Vec<Vec<u32>> = Vec::with_capacity(cells.len());
            for (i, (few_genes, sentence)) in cells.into_iter().enumerate() {
                few += few_genes as usize;
                match sentence {
                    Some(t) => sentences.push(t),
                    None => {
                        empty.push(s + i);
                        sentences.push(vec![cfg_ref.cls_token_idx]);
                    }
                }
            }
            let order: Vec<usize> = (0..sentences.len()).collect();
            let rows = clock.time(Stage::Device, || batches.run_lagged(sentences.len(), dim, &order, None, 0.0, |idx| model.embed_tensor(&idx.iter().map(|&i| sentences[i].as_slice()).collect::<Vec<_>>()), |k| p.inc(k as u64)))?;
            clock.time(Stage::Write, || out.write(s, &rows))
        },
    )?;
    let blocks_wall = blocks_started.elapsed().as_secs_f64();
    p.finish();
    if few > 0 {
        notes.push(format!("{few} cell(s) express fewer than {} of the filtered genes: upstream's filter_cells drops them; they are embedded here", cfg.min_genes));
    }
    if !empty.is_empty() {
        notes.push(format!("{} cell(s) have no count in any embedded gene ({}): embedded from CLS alone, so they share one embedding (upstream cannot sample them)", empty.len(), some_cells(&ad.obs_names, &empty)));
    }
    let mut params = spec.params.clone();
    batches.finish(&mut notes, true);
    batches.record(spec, &mut params);
    params.insert("nlayers".into(), json!(model.dims.nlayers));
    params.insert("precision".into(), json!(crate::tasks::runtime::precision_name(dtype)));
    params.insert("species".into(), json!(cfg.species));
    params.insert("sample_size".into(), json!(cfg.sample_size));
    params.insert("pad_length".into(), json!(cfg.pad_length));
    params.insert("min_cells".into(), json!(cfg.min_cells));
    params.insert("chrom_token_offset".into(), json!(cfg.chrom_token_offset));
    params.insert("genes_embedded".into(), json!(map.n_kept()));
    params.insert("genes_without_embedding".into(), json!(map.no_embedding));
    params.insert("genes_filtered".into(), json!(map.filtered));
    params.insert("cell_embedding".into(), json!("CLS output through the decoder, L2-normalised; padding masked (each cell as in a batch of one)"));
    params.insert("rng".into(), json!("numpy MT19937 per cell, seeded with (seed + cell row) mod 2^32: np.random.choice of the genes, then the chromosome shuffle"));
    params.insert("cells_without_counts".into(), json!(empty.len()));
    let mut w = serde_json::Map::new();
    w.insert("model".into(), json!(model_path.display().to_string()));
    w.insert("protein_embeddings".into(), json!(pe_path.display().to_string()));
    genes::record(&gmatch, &gids, &mut params);
    let mut result = out.commit(spec, &x.field, params, w, Value::Object(shas), notes)?;
    result.gene_match = Some(gmatch.to_json());
    result.phases = clock.phases(setup, blocks_wall);
    Ok(result)
}

/// UCE's options, from `methods/uce.toml`.
#[derive(Debug, Deserialize)]
pub struct Params {
    pub batch_size: usize,
    pub nlayers: u64,
}

/// UCE: the table's entry.
pub struct UceMethod;

impl Method for UceMethod {
    fn check(&self, pf: &Preflight) -> Result<()> {
        let p: Params = method::params(pf.method, pf.params)?;
        check_weights_or_folder(pf.method, pf.weights_dir, pf.model_dir, &uce::required_entries(p.nlayers)?)?;
        // a folder stands in for the archive with what it extracts beside it: the human table
        // must be there before a run starts (model_files/protein_embeddings/ as upstream's)
        if let Some(d) = pf.model_dir {
            let (found, _) = weights::Manifest::load()?.find_in_folder(&[uce::COMMON_ENTRIES[0]], d);
            let beside = found.first().and_then(|(_, tail)| Path::new(tail).parent().map(Path::to_path_buf)).unwrap_or_default();
            let pe = beside.join(uce::HUMAN_PE_FILE).to_string_lossy().to_string();
            let upstream = "the ESM2 embeddings of human genes, extracted from protein_embeddings.tar.gz";
            weights::require_files(pf.method, "--model-dir", d, &[weights::Needed { file: &pe, upstream }])?;
        }
        Ok(())
    }

    fn fits_before_shards(&self) -> bool {
        true
    }

    fn embed(&self, spec: &TaskSpec, task_dir: &Path, step: &Step) -> Option<Result<TaskResult>> {
        match step {
            Step::Fit => Some(fit_uce(spec)),
            _ => one_step(step, || embed_uce(spec, task_dir)),
        }
    }
}
