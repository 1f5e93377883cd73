//! The `embed` task of Cell2Sentence (see `methods/c2s.rs`): cell sentences and prompts in data
//! order (upstream's two seeded RNG streams), the model's tokenizer, the GPT-NeoX model in
//! batches with the GPU back-off, provenance.

use std::path::Path;

use serde_json::{json, Value};

use crate::tasks::genes::{self, is_symbol, match_genes, Kind};
use crate::tasks::runtime::{check_weights_or_folder, obs_strings, weights_or_folder, Batches, TaskDevice};
use crate::tasks::method::{self as method, one_step, Method, Preflight};
use serde::Deserialize;
use crate::tasks::shard::{load_block_state, save_block_states, BlockStates, EmbeddingOut, TaskRows};
use crate::anndata::AnnData;
use crate::error::{Error, Result};
use crate::methods::c2s::{self, C2sTokenizer, GptNeoX, Prompter, PrompterState};
use crate::progress::reporter;
use crate::runner::{Step, TaskResult, TaskSpec};
use crate::weights::{self, Manifest};

/// The files of the default model under a weights folder: (config.json, weights, tokenizer.json).
pub fn files(dir: &Path, m: &Manifest) -> Result<(std::path::PathBuf, std::path::PathBuf, std::path::PathBuf)> {
    let f = |id: &str| {
        m.weights.get(id).map(|e| dir.join(&e.file)).ok_or_else(|| Error::Config { path: "weights.toml".into(), detail: format!("has no entry {id}"), hint: None })
    };
    Ok((f(c2s::REQUIRED_ENTRIES[0])?, f(c2s::REQUIRED_ENTRIES[1])?, f(c2s::REQUIRED_ENTRIES[2])?))
}

/// The fit's file in the run's work folder: both prompt streams at the start of every block.
const RNG_FILE: &str = "c2s_rng.json";

/// The fit step of a sharded run: every cell's sentence and prompt drawn in data order (no
/// model, no tokenizer: the draws depend on the stored entries alone), both streams' states
/// saved at the start of every block, so a shard's prompts are the whole run's.
fn fit_c2s(spec: &TaskSpec) -> Result<TaskResult> {
    let rep = reporter(!spec.progress);
    let p: Params = method::task_params(spec)?;
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let (gids, _) = match_genes(&ad, &x, &spec.params, Kind::Symbols, &is_symbol, &mut Vec::new())?;
    let mut prompter = Prompter::new(&gids.names, p.top_genes, spec.seed)?;
    let rows = TaskRows::new(spec, ad.n_obs, C2s.block_rows(&x, &spec.params))?;
    let mut states = Vec::new();
    let bar = rep.step("c2s: draw the cells' prompts", rows.len() as u64, "cells");
    for (s, e) in rows.blocks() {
        states.push(prompter.rng_state());
        let b = x.read_rows(s, e)?;
        for i in 0..b.n_rows() {
            let (idx, vals) = b.row(i);
            let sentence = prompter.sentence(idx, vals);
            prompter.prompt(&sentence, c2s::DEFAULT_ORGANISM);
        }
        bar.inc((e - s) as u64);
    }
    bar.finish();
    let path = save_block_states(spec, RNG_FILE, &BlockStates { n_obs: ad.n_obs, block: rows.block, states })?;
    Ok(TaskResult { output: Some(path), n_obs: ad.n_obs, ..Default::default() })
}

pub(super) fn embed_c2s(spec: &TaskSpec, task_dir: &Path) -> Result<TaskResult> {
    let rep = reporter(!spec.progress);
    let dir = spec.weights_dir.clone().unwrap_or_else(weights::default_dir);
    let (dir, manifest, shas) = weights_or_folder("c2s", &spec.params, &dir, c2s::REQUIRED_ENTRIES)?;
    let (config_path, model_path, tokenizer_path) = files(&dir, &manifest)?;
    let p: Params = method::task_params(spec)?;
    let top = p.top_genes;
    if top == 0 {
        return Err(Error::BadOption { option: "--top-genes".into(), detail: "must be at least 1".into(), hint: Some("upstream asserts top_k_genes > 0; its default is 100".into()) });
    }
    let ad = AnnData::open(&spec.data)?;
    ad.check_usable()?;
    let x = ad.matrix(spec.layer.as_deref())?;
    let mut notes = Vec::new();
    // Cell2Sentence writes gene names into its sentences and its models read symbols: Ensembl
    // ids are mapped to symbols (tasks::genes)
    let (gids, gmatch) = match_genes(&ad, &x, &spec.params, Kind::Symbols, &is_symbol, &mut notes)?;
    let collisions = c2s::upper_case_collisions(&gids.names);
    if !collisions.is_empty() {
        notes.push(format!(
            "{} gene name(s) are shared by several var names once upper-cased (e.g. {}): each gene keeps its own name here; upstream's vocabulary merges them and shifts the names after them",
            collisions.len(),
            collisions[0]
        ));
    }
    let organisms: Vec<String> = {
        let has = ad.obs()?.column("organism").is_some();
        if has {
            obs_strings(&ad, &["organism".to_string()], &mut notes)?.pop().map(|(_, v)| v).unwrap_or_default()
        } else {
            notes.push(format!("obs has no `organism` column: the prompts say \"{}\" (upstream reads the column)", c2s::DEFAULT_ORGANISM));
            vec![c2s::DEFAULT_ORGANISM.to_string(); ad.n_obs]
        }
    };
    let tokenizer = C2sTokenizer::load(&tokenizer_path)?;
    let dev = TaskDevice::start(spec)?;
    let mut precision_notes = Vec::new();
    let dtype = crate::tasks::runtime::precision(spec, &dev.device, &mut precision_notes);
    notes.extend(precision_notes);
    let model = GptNeoX::load(&config_path, &model_path, dtype, dev.device.clone()).map_err(|e| dev.load_error(e, "loading the model's weights", task_dir))?;
    dev.mark_loaded();
    let dim = model.hidden();
    let batch = p.batch_size;
    let mut batches = Batches::new(dev, batch, task_dir);
    let mut prompter = Prompter::new(&gids.names, top, spec.seed)?;

    let key = "X_c2s";
    let task_rows = TaskRows::new(spec, ad.n_obs, C2s.block_rows(&x, &spec.params))?;
    // a shard starts both streams where the fit found them at its first row
    if let Step::Project { .. } = spec.step {
        let state: PrompterState = load_block_state(spec, RNG_FILE, &task_rows, ad.n_obs)?;
        if !prompter.restore(&state) {
            return Err(Error::BadOption { option: "task spec".into(), detail: format!("{RNG_FILE} in the run's work folder holds no generator states"), hint: Some("start the run again".into()) });
        }
    }
    let out = EmbeddingOut::create(spec, &task_rows, key, ad.n_obs, dim)?;
    let p = rep.step("c2s: embed", task_rows.len() as u64, "cells");
    let (mut tokens_total, mut longest, mut too_long, mut short) = (0usize, 0usize, 0usize, 0usize);
    for (s, e) in task_rows.blocks() {
        let b = x.read_rows(s, e)?;
        let mut seqs: Vec<Vec<u32>> = Vec::with_capacity(b.n_rows());
        for i in 0..b.n_rows() {
            let (idx, vals) = b.row(i);
            if idx.len() < top {
                short += 1;
            }
            let sentence = prompter.sentence(idx, vals);
            let prompt = prompter.prompt(&sentence, &organisms[s + i]);
            let ids = tokenizer.encode(&prompt)?;
            tokens_total += ids.len();
            longest = longest.max(ids.len());
            if model.cfg.max_position_embeddings > 0 && ids.len() > model.cfg.max_position_embeddings {
                too_long += 1;
            }
            seqs.push(ids);
        }
        // longest first, so a batch's cells have similar lengths (each cell's embedding does not
        // depend on its batch: see methods/c2s.rs)
        let rows = batches.run_longest_first(&seqs, dim, Vec::len, |b| model.embed(&b.iter().map(|s| s.as_slice()).collect::<Vec<_>>()), |k| p.inc(k as u64))?;
        out.write(s, &rows)?;
    }
    p.finish();
    if short > 0 {
        notes.push(format!("{short} cell(s) express fewer than --top-genes {top} genes: their sentences are shorter (the prompt still says {top}, as upstream's)"));
    }
    if too_long > 0 {
        notes.push(format!(
            "{too_long} prompt(s) are longer than the model's max_position_embeddings {} (longest {longest} tokens): run whole, as upstream runs them; lower --top-genes to stay within the model's training length",
            model.cfg.max_position_embeddings
        ));
    }
    let mut params = spec.params.clone();
    batches.finish(&mut notes, true);
    batches.record(spec, &mut params);
    params.insert("top_genes".into(), json!(top));
    params.insert("seed".into(), json!(spec.seed));
    params.insert("rng".into(), json!("numpy legacy MT19937 seeded once with --seed (np.random.seed), sklearn.utils.shuffle per cell in data order (ties); CPython random seeded once with --seed, random.choice of the prompt template per cell in data order; upstream's seed is 42"));
    params.insert("prompt_task".into(), json!("cell_type_prediction"));
    params.insert("layers".into(), json!(model.cfg.num_hidden_layers));
    params.insert("precision".into(), json!(crate::tasks::runtime::precision_name(model.dtype)));
    params.insert("mean_tokens".into(), json!(tokens_total as f64 / task_rows.len().max(1) as f64));
    params.insert("longest_prompt_tokens".into(), json!(longest));
    params.insert("cell_embedding".into(), json!("mean over the prompt's tokens of the last hidden state (after final_layer_norm); each cell as in a batch of one"));
    let mut w = serde_json::Map::new();
    w.insert("config".into(), json!(config_path.display().to_string()));
    w.insert("model".into(), json!(model_path.display().to_string()));
    w.insert("tokenizer".into(), json!(tokenizer_path.display().to_string()));
    genes::record(&gmatch, &gids, &mut params);
    let mut result = out.commit(spec, &x.field, params, w, Value::Object(shas), notes)?;
    result.gene_match = Some(gmatch.to_json());
    Ok(result)
}

/// C2S's options, from `methods/c2s.toml`.
#[derive(Debug, Deserialize)]
pub struct Params {
    pub batch_size: usize,
    pub top_genes: usize,
}

/// C2S: the table's entry.
pub struct C2s;

impl Method for C2s {
    fn block_rows(&self, x: &crate::anndata::Matrix, params: &serde_json::Map<String, serde_json::Value>) -> usize {
        let _ = params;
        crate::tasks::shard::block_rows(x, 200_000, 1)
    }

    fn check(&self, pf: &Preflight) -> Result<()> {
        check_weights_or_folder(pf.method, pf.weights_dir, pf.model_dir, c2s::REQUIRED_ENTRIES)
    }

    fn fits_before_shards(&self) -> bool {
        true
    }

    fn embed(&self, spec: &TaskSpec, task_dir: &Path, step: &Step) -> Option<Result<TaskResult>> {
        match step {
            Step::Fit => Some(fit_c2s(spec)),
            _ => one_step(step, || embed_c2s(spec, task_dir)),
        }
    }
}
