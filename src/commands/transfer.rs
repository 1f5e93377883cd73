//! `scfoundry transfer`: label a query from a labelled reference.
//!
//! 1. Both files are embedded with one method, as tasks of the local runner in a run folder
//!    (trace.txt, report.json): for pca a fit on the reference (HVGs, means, loadings), then
//!    the reference and the query projected with that fit at once (query genes aligned by var
//!    name, missing ones zero); for cellama the two embeddings at once (nothing is fitted).
//! 2. The labels move by the weighted kNN vote of `methods::knn_transfer` (scArches), with a
//!    confidence per cell.
//! 3. A copy of the query gets `obs['<label>_pred']` (categorical), `obs['<label>_pred_confidence']`
//!    (float32), the query's embedding in obsm and `uns['scfoundry']`; the report folder gets
//!    transfer.json and, when the query has the label column, the scores (accuracy, macro-F1,
//!    per-label table, confusion matrix as TSV and figure).

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::{json, Value};

use crate::anndata::write::{write_rows, PendingOutput};
use crate::anndata::AnnData;
use crate::cli::{ExecutorKind, TransferArgs};
use crate::commands::benchmark::write_file;
use crate::commands::embed::resolve_method_params;
use crate::commands::ExitStatus;
use crate::error::{Error, Hdf5Context};
use crate::executor::{self, nextflow};
use crate::nn::knn_transfer;
use crate::metrics::classification::{accuracy, confusion_matrix, macro_f1, per_label};
use crate::progress::warn;
use crate::registry::Kind;
use crate::runner::{self, Run, Step, TaskSpec};
use crate::settings::Settings;

/// Methods whose embeddings `transfer` can compute today.
/// The methods `transfer` embeds with (the table's entries that say so).
fn transfer_methods() -> Vec<&'static str> {
    crate::tasks::table::names(|m| m.transfers())
}

/// Whether `method`'s transfer fits a model to the reference first (`Step::Fit`).
fn fits_reference(method: &str) -> bool {
    crate::tasks::table::get(method).is_some_and(|m| m.fits_reference())
}

/// Default output: `<query stem>.transfer.h5ad` beside the query.
pub fn default_output(query: &Path) -> PathBuf {
    let stem = query.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "query".into());
    query.with_file_name(format!("{stem}.transfer.h5ad"))
}

/// Labels of an obs column: the values (None = missing) and the sorted distinct labels.
struct Labels {
    values: Vec<Option<String>>,
    categories: Vec<String>,
}

fn read_labels(ad: &AnnData, key: &str, role: &str) -> Result<Option<Labels>, Error> {
    let obs = ad.obs_columns(&[key])?;
    let Some(col) = obs.column(key) else {
        if role == "query" {
            return Ok(None);
        }
        let have = ad.obs_column_names()?;
        return Err(Error::BadField {
            path: ad.path.clone(),
            field: format!("obs/{key}"),
            detail: format!("is missing: the {role} has no label column `{key}`"),
            hint: Some(if have.is_empty() {
                "the reference has no obs columns at all: add the labels first (`adata.obs['cell_type'] = ...`)".into()
            } else {
                format!("pass --label-key with one of the obs columns of this file: {}", have.join(", "))
            }),
        });
    };
    let values = col.as_labels().ok_or_else(|| Error::BadField {
        path: ad.path.clone(),
        field: format!("obs/{key}"),
        detail: format!("is a {} column; labels must be categorical, string or integer", col.kind()),
        hint: Some(format!("convert it first, e.g. `adata.obs['{key}'] = adata.obs['{key}'].astype(str).astype('category')`")),
    })?;
    let mut categories: Vec<String> = values.iter().flatten().cloned().collect();
    categories.sort();
    categories.dedup();
    Ok(Some(Labels { values, categories }))
}

/// Read a task's embedding file (rows x dim little-endian f32).
fn read_f32_file(path: &Path, rows: usize, dim: usize) -> Result<Vec<f32>, Error> {
    let bytes = std::fs::read(path).map_err(|e| Error::Io { path: path.into(), source: e })?;
    if bytes.len() != rows * dim * 4 {
        return Err(Error::BadField {
            path: path.into(),
            field: "embedding".into(),
            detail: format!("holds {} bytes, expected {rows} x {dim} x 4", bytes.len()),
            hint: Some("the embedding task did not finish; run the transfer again".into()),
        });
    }
    Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

pub fn run(s: &Settings, a: &TransferArgs) -> anyhow::Result<ExitStatus> {
    let t0 = Instant::now();
    let m = match &a.method {
        Some(name) => Some(s.registry.get(name)?.clone()),
        None => None,
    };
    if let Some(m) = &m {
        if m.kind != Kind::Embedding {
            return Err(Error::BadOption {
                option: "--method".into(),
                detail: format!("{} is an integration method: it corrects an existing embedding and cannot embed a new query, so it cannot transfer labels", m.name),
                hint: Some(format!("pass an embedding method ({}); `scfoundry methods` lists them", transfer_methods().join(", "))),
            }
            .into());
        }
    }
    let mut params = match &m {
        Some(m) => resolve_method_params(&s.registry, m, "transfer", &a.batch, &a.knobs, false)?,
        None => serde_json::Map::new(),
    };
    // With --embedding nothing is embedded: the vote runs here, on what both files hold.
    let precomputed = a.embedding.clone();
    let pipeline = if precomputed.is_some() {
        if a.exec.executor != ExecutorKind::Local {
            warn(&format!("--embedding: nothing is embedded, so there is no task for --executor {}; the vote runs here", if a.exec.executor == ExecutorKind::Slurm { "slurm" } else { "nextflow" }));
        }
        for (given, flag) in [(a.layer.is_some(), "--layer"), (a.min_gene_overlap != 0.5, "--min-gene-overlap"), (a.max_forks.is_some(), "--max-forks")] {
            if given {
                warn(&format!("{flag} applies when transfer embeds the files; with --embedding it is ignored"));
            }
        }
        None
    } else {
        let m = m.as_ref().expect("clap requires --method without --embedding");
        if !m.implemented || !transfer_methods().contains(&m.name.as_str()) {
            return Err(Error::NotImplemented { name: m.name.clone(), version: env!("CARGO_PKG_VERSION") }.into());
        }
        if !fits_reference(&m.name) && a.min_gene_overlap != 0.5 {
            warn(&format!("{} embeds each cell on its own and fits nothing to the reference; --min-gene-overlap applies to pca and is ignored", m.name));
        }
        let pipeline = executor::preflight(&a.exec)?;
        if let Some(entry) = crate::tasks::table::get(&m.name) {
            let model_dir = params.get("model_dir").and_then(serde_json::Value::as_str).filter(|d| !d.is_empty()).map(std::path::Path::new);
            entry.check_transfer(&crate::tasks::method::Preflight { method: &m.name, weights_dir: &s.weights_dir, params: &params, model_dir, data: &a.reference })?;
        }
        pipeline
    };
    let method_name = m.as_ref().map(|m| m.name.clone()).unwrap_or_else(|| "precomputed".into());
    let pred_key = a.pred_key.clone().unwrap_or_else(|| format!("{}_pred", a.label_key));
    let conf_key = format!("{pred_key}_confidence");
    if pred_key == a.label_key {
        return Err(Error::BadOption {
            option: "--pred-key".into(),
            detail: format!("`{pred_key}` is the label column itself; the predictions would overwrite the query's labels"),
            hint: Some("choose another column name, or leave --pred-key out for `<label-key>_pred`".into()),
        }
        .into());
    }

    // Everything cheap is checked before a run folder exists.
    let rad = AnnData::open(&a.reference)?;
    rad.check_usable()?;
    if let (None, Some(m)) = (&precomputed, &m) {
        rad.matrix(a.layer.as_deref())?;
        if let Some(w) = crate::tasks::counts::check(m, &rad, a.layer.as_deref(), a.skip_counts_check)? {
            warn(&w);
        }
    }
    let ref_labels = read_labels(&rad, &a.label_key, "reference")?.expect("the reference's labels are required");
    let labelled: Vec<usize> = (0..rad.n_obs).filter(|&i| ref_labels.values[i].is_some()).collect();
    if labelled.is_empty() {
        return Err(Error::BadField {
            path: rad.path.clone(),
            field: format!("obs/{}", a.label_key),
            detail: "has no value in any cell".into(),
            hint: Some("label the reference first, or pass --label-key with another column".into()),
        }
        .into());
    }
    if labelled.len() < rad.n_obs {
        warn(&format!(
            "{} of the {} reference cells have no `{}` and are left out of the vote",
            rad.n_obs - labelled.len(),
            rad.n_obs,
            a.label_key
        ));
    }
    if a.k as usize > labelled.len() {
        return Err(Error::BadOption {
            option: "-k".into(),
            detail: format!("k = {} but the reference {} has {} labelled cell(s)", a.k, a.reference.display(), labelled.len()),
            hint: Some(format!("pass `-k {}` or fewer (15 is usual), or use a larger reference", labelled.len())),
        }
        .into());
    }
    let qad = AnnData::open(&a.query)?;
    qad.check_usable()?;
    if let (None, Some(m)) = (&precomputed, &m) {
        qad.matrix(a.layer.as_deref())?;
        if let Some(w) = crate::tasks::counts::check(m, &qad, a.layer.as_deref(), a.skip_counts_check)? {
            warn(&w);
        }
    }
    let query_labels = match read_labels(&qad, &a.label_key, "query") {
        Ok(l) => l,
        Err(e) => {
            warn(&format!("the query's `{}` cannot be used as truth, so the transfer is not scored: {e}", a.label_key));
            None
        }
    };
    let query_labels = query_labels.filter(|l| {
        let any = l.values.iter().any(Option::is_some);
        if !any {
            warn(&format!("the query's `{}` has no value in any cell, so the transfer is not scored", a.label_key));
        }
        any
    });
    let qobs = qad.obs_column_names()?;
    if qobs.contains(&pred_key) || qobs.contains(&conf_key) {
        warn(&format!("the query already has obs `{pred_key}` or `{conf_key}`; the output replaces them (the input is not touched)"));
    }
    let obsm_key = precomputed.clone().unwrap_or_else(|| format!("X_{method_name}"));
    let given = match &precomputed {
        Some(key) => Some((embedding_of(&rad, key)?, embedding_of(&qad, key)?)),
        None => {
            if qad.group_keys("obsm").contains(&obsm_key) {
                warn(&format!("the query already has obsm['{obsm_key}']; the output replaces it with the query's {method_name} embedding of this transfer"));
            }
            None
        }
    };
    if let Some(((_, dr), (_, dq))) = &given {
        if dr != dq {
            return Err(Error::BadField {
                path: qad.path.clone(),
                field: format!("obsm/{obsm_key}"),
                detail: format!("is {dq} wide but the reference's is {dr} wide"),
                hint: Some("embed both files with the same method and settings".into()),
            }
            .into());
        }
    }
    let (n_ref, n_query) = (rad.n_obs, qad.n_obs);
    drop((rad, qad, qobs));

    let out = a.out.clone().unwrap_or_else(|| default_output(&a.query));
    crate::paths::check_output_file(&out, "--out")?;
    for (input, what) in [(&a.query, "query"), (&a.reference, "reference")] {
        if crate::paths::same_file(input, &out) {
            return Err(Error::BadOption {
                option: "--out".into(),
                detail: format!("{} is the {what} file; transfer never modifies its inputs", out.display()),
                hint: Some("choose another --out".into()),
            }
            .into());
        }
    }
    let report_dir = a.report_dir.clone().unwrap_or_else(|| out.with_extension(""));
    let reference = std::path::absolute(&a.reference)?;
    let query = std::path::absolute(&a.query)?;
    if let Some(p) = pipeline {
        return run_nextflow(s, a, p, &method_name, &reference, &query, &out, &report_dir);
    }
    let mut run_info: Option<Run> = None;
    let mut outcomes: Vec<runner::Outcome> = Vec::new();
    let (ref_emb, q_emb, dim) = match given {
        Some(((r, dim), (q, _))) => (r, q, dim),
        None => {
            let run = executor::create_run(s, &a.exec, &out, &format!("transfer-{method_name}"))?;
            let work = run.dir.join("work");
            params.insert("reference".into(), json!(reference.display().to_string()));
            if fits_reference(&method_name) {
                params.insert("fit".into(), json!(work.join("pca_fit.json").display().to_string()));
                params.insert("min_gene_overlap".into(), json!(a.min_gene_overlap));
            }
            let slurm = a.exec.executor == ExecutorKind::Slurm;
            // both embeddings at once, or as many tasks as --gpu has entries (one per card)
            let max_forks = a.max_forks.or_else(|| a.gpu.as_ref().map(|g| g.slots_here() as u64)).unwrap_or(2) as usize;
            let stages = plan(&run, s, a, &method_name, params.clone(), &reference, &query, max_forks == 1 && !slurm)?;
            outcomes = if slurm {
                let tasks: Vec<TaskSpec> = stages.concat();
                executor::slurm::run(&run, &tasks, &a.exec.slurm, None, &a.exec.passthrough, s.quiet)?
            } else {
                executor::run_stages(&run, &stages, max_forks)?
            };
            let report_spec = TaskSpec { data: query.clone(), ..stages[0][0].clone() };
            let refs: Vec<&runner::Outcome> = outcomes.iter().collect();
            runner::write_reports(&run, &report_spec, &refs)?;
            if let Some(f) = outcomes.iter().find(|o| o.exit != 0) {
                eprintln!("{} {} (exit {})", f.record.name, f.record.status.to_lowercase(), f.exit);
                eprintln!("run folder: {} (task logs, trace.txt)", run.dir.display());
                return Ok(ExitStatus::Code(f.exit));
            }
            let n_embed = outcomes.len();
            let (ref_res, q_res) = (outcomes[n_embed - 2].result.clone().unwrap_or_default(), outcomes[n_embed - 1].result.clone().unwrap_or_default());
            let dim = ref_res.dim;
            if q_res.dim != dim || ref_res.n_obs != n_ref || q_res.n_obs != n_query {
                return Err(Error::Executor {
                    what: "the embedding tasks".into(),
                    detail: format!("reported {} x {} and {} x {}, expected {n_ref} and {n_query} cells of one width", ref_res.n_obs, ref_res.dim, q_res.n_obs, q_res.dim),
                    hint: Some(format!("see {}", run.dir.display())),
                }
                .into());
            }
            let r = read_f32_file(&work.join("reference.f32"), n_ref, dim)?;
            let q = read_f32_file(&work.join("query.f32"), n_query, dim)?;
            run_info = Some(run);
            (r, q, dim)
        }
    };
    let command_line = std::env::args().collect::<Vec<_>>().join(" ");

    // The vote, on the labelled reference cells.
    let t_vote = Instant::now();
    let cats = &ref_labels.categories;
    let ref_codes: Vec<u32> = labelled.iter().map(|&i| cats.binary_search(ref_labels.values[i].as_ref().unwrap()).unwrap() as u32).collect();
    let ref_sub: Vec<f32> = labelled.iter().flat_map(|&i| ref_emb[i * dim..(i + 1) * dim].iter().copied()).collect();
    let t = knn_transfer::transfer(&ref_sub, labelled.len(), &q_emb, n_query, dim, &ref_codes, cats.len(), a.k as usize);
    let vote_s = t_vote.elapsed().as_secs_f64();

    // Scores, when the query has labels.
    let scores = query_labels.as_ref().map(|ql| Scores::new(cats, &t.predicted, ql));

    // The output: a copy of the query with the predictions and the embedding.
    let pending = PendingOutput::create(&a.query, &out)?;
    let codes: Vec<i32> = t.predicted.iter().map(|&c| c as i32).collect();
    pending.add_obs_categorical(&pred_key, &codes, cats)?;
    pending.add_obs_f32(&conf_key, &t.confidence)?;
    let ds = pending.create_obsm(&obsm_key, n_query, dim)?;
    write_rows(&ds, 0, &q_emb, dim)?;
    drop(ds);
    let mut prov = serde_json::Map::new();
    prov.insert("tool".into(), json!("scfoundry"));
    prov.insert("version".into(), json!(env!("CARGO_PKG_VERSION")));
    prov.insert("command".into(), json!("transfer"));
    prov.insert("command_line".into(), json!(command_line));
    prov.insert("method".into(), json!(method_name));
    prov.insert("obsm_key".into(), json!(obsm_key));
    prov.insert("seed".into(), json!(a.seed));
    prov.insert("date".into(), json!(chrono::Local::now().to_rfc3339()));
    if let Some(run) = &run_info {
        prov.insert("run_id".into(), json!(run.id));
    }
    if precomputed.is_some() {
        prov.insert("embedding".into(), json!("precomputed: obsm of both input files"));
    }
    prov.insert("input".into(), json!(query.display().to_string()));
    prov.insert("reference".into(), json!(reference.display().to_string()));
    prov.insert("label_key".into(), json!(a.label_key));
    prov.insert("pred_key".into(), json!(pred_key));
    prov.insert("confidence_key".into(), json!(conf_key));
    prov.insert("k".into(), json!(a.k));
    prov.insert("vote".into(), json!("scArches weighted_knn_transfer: exact Euclidean kNN, weights exp(-d / (2 / std(d))^2)"));
    let mut p = params.clone();
    p.remove("fit");
    prov.insert("parameters".into(), Value::Object(p));
    if let Some(sc) = &scores {
        prov.insert("accuracy".into(), json!(sc.accuracy));
        prov.insert("macro_f1".into(), json!(sc.macro_f1));
    }
    {
        let f = pending.file();
        let uns = crate::anndata::h5util::require_dict(f, "uns").h5ctx(|| "creating uns".into())?;
        crate::tasks::runtime::write_json_dict(&uns, "scfoundry", &prov).h5ctx(|| "writing uns/scfoundry".into())?;
    }
    pending.commit()?;

    // The report.
    std::fs::create_dir_all(&report_dir).map_err(|e| Error::Io { path: report_dir.clone(), source: e })?;
    let mut predicted_counts = serde_json::Map::new();
    for (l, name) in cats.iter().enumerate() {
        let n = t.predicted.iter().filter(|&&p| p as usize == l).count();
        predicted_counts.insert(name.clone(), json!(n));
    }
    let mean_conf = t.confidence.iter().map(|&c| c as f64).sum::<f64>() / n_query.max(1) as f64;
    let mut notes: Vec<String> = outcomes.iter().filter_map(|o| o.result.as_ref()).flat_map(|r| r.notes.clone()).collect();
    notes.dedup();
    let mut doc = json!({
        "tool": "scfoundry",
        "version": env!("CARGO_PKG_VERSION"),
        "method": method_name,
        "reference": reference,
        "query": query,
        "output": std::path::absolute(&out)?,
        "label_key": a.label_key,
        "pred_key": pred_key,
        "confidence_key": conf_key,
        "k": a.k,
        "embedding": { "obsm_key": obsm_key, "dim": dim },
        "n_reference": n_ref,
        "n_reference_labelled": labelled.len(),
        "n_query": n_query,
        "reference_labels": cats,
        "predicted_counts": predicted_counts,
        "mean_confidence": mean_conf,
        "run_id": run_info.as_ref().map(|r| r.id.clone()),
        "run_folder": run_info.as_ref().map(|r| r.dir.clone()),
        "vote_seconds": vote_s,
        "notes": notes,
        "scored": scores.is_some(),
    });
    if let Some(sc) = &scores {
        sc.write(&report_dir, &mut doc, &method_name, a.k, &a.label_key)?;
    }
    write_file(&report_dir.join("transfer.json"), serde_json::to_string_pretty(&doc)?.as_bytes())?;

    if !s.quiet {
        let wall = t0.elapsed().as_secs_f64();
        eprintln!(
            "labelled {n_query} query cells from {} reference cells ({} labels) with {} and k = {} in {wall:.1}s; mean confidence {mean_conf:.3}",
            labelled.len(),
            cats.len(),
            if precomputed.is_some() { format!("obsm['{obsm_key}']") } else { method_name.clone() },
            a.k
        );
        if let Some(sc) = &scores {
            eprintln!(
                "against the query's `{}` ({} cells): accuracy {:.4}, macro-F1 {:.4}{}",
                a.label_key,
                sc.truth.len(),
                sc.accuracy,
                sc.macro_f1,
                if sc.unseen.is_empty() { String::new() } else { format!("; {} query label(s) are not in the reference: {}", sc.unseen.len(), sc.unseen.join(", ")) }
            );
        }
        eprintln!("wrote {} (obs['{pred_key}'], obs['{conf_key}'], obsm['{obsm_key}'])", out.display());
        let files = if scores.is_some() { "transfer.json, per_label.tsv, confusion.tsv, confusion.svg, confusion.png" } else { "transfer.json" };
        eprintln!("report: {} ({files})", report_dir.display());
        if let Some(run) = &run_info {
            eprintln!("run folder: {} (trace.txt, report.json)", run.dir.display());
        }
    }
    Ok(ExitStatus::Success)
}

/// obsm[key] of a file given with --embedding: one finite row per cell.
fn embedding_of(ad: &AnnData, key: &str) -> Result<(Vec<f32>, usize), Error> {
    let (z, n, d) = ad.dense_entry("obsm", key)?;
    let field = format!("obsm/{key}");
    if n != ad.n_obs {
        return Err(Error::BadField { path: ad.path.clone(), field, detail: format!("has {n} rows but the file has {} cells", ad.n_obs), hint: None });
    }
    if let Some(i) = z.iter().position(|v| !v.is_finite()) {
        return Err(Error::BadField {
            path: ad.path.clone(),
            field,
            detail: format!("holds a non-finite value at cell {} ({})", i / d.max(1), ad.obs_names[i / d.max(1)]),
            hint: Some("recompute the embedding; the vote needs finite coordinates".into()),
        });
    }
    Ok((z, d))
}

/// The embedding tasks, in stages: for pca a fit on the reference, then the reference and the
/// query embedded at once (both projected with the fit for pca).
#[allow(clippy::too_many_arguments)]
fn plan(run: &Run, s: &Settings, a: &TransferArgs, method: &str, params: serde_json::Map<String, Value>, reference: &Path, query: &Path, bars: bool) -> anyhow::Result<Vec<Vec<TaskSpec>>> {
    let work = run.dir.join("work");
    let tag = |p: &Path| p.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    let base = TaskSpec {
        task_id: 0,
        name: String::new(),
        command: "transfer".into(),
        method: method.to_string(),
        data: reference.to_path_buf(),
        out: PathBuf::new(),
        layer: a.layer.clone(),
        seed: a.seed,
        params,
        quiet: s.quiet,
        progress: s.progress,
        command_line: std::env::args().collect::<Vec<_>>().join(" "),
        run_id: run.id.clone(),
        weights_dir: Some(std::path::absolute(&s.weights_dir)?),
        step: Step::Embed,
        work: Some(work.clone()),
        gpus: crate::commands::task_gpus(a.exec.executor, &a.gpu),
        device: Default::default(),
        embedding_only: false,
    };
    let process = method.to_uppercase();
    let mut stages: Vec<Vec<TaskSpec>> = Vec::new();
    if fits_reference(method) {
        stages.push(vec![TaskSpec {
            task_id: 1,
            name: format!("TRANSFER_FIT_{process} ({}, reference)", tag(reference)),
            out: work.join("pca_fit.json"),
            step: Step::Fit,
            ..base.clone()
        }]);
    }
    let first = stages.len() as u64 + 1;
    // two tasks drawing bars at once would garble the terminal
    let bars = s.progress && bars;
    stages.push(vec![
        TaskSpec {
            task_id: first,
            name: format!("TRANSFER_EMBED_{process} ({}, reference)", tag(reference)),
            data: reference.to_path_buf(),
            out: work.join("reference.f32"),
            progress: bars,
            ..base.clone()
        },
        TaskSpec {
            task_id: first + 1,
            name: format!("TRANSFER_EMBED_{process} ({}, query)", tag(query)),
            data: query.to_path_buf(),
            out: work.join("query.f32"),
            progress: bars,
            ..base
        },
    ]);
    Ok(stages)
}

/// `--executor nextflow`: the pipeline's transfer branch (pca: one TRANSFER task that fits and
/// projects; a per-cell model: EMBED_REFERENCE and EMBED_QUERY at once, then TRANSFER on their
/// obsm), then the published .h5ad and report folder moved to --out and --report-dir.
#[allow(clippy::too_many_arguments)]
fn run_nextflow(s: &Settings, a: &TransferArgs, p: nextflow::Pipeline, method: &str, reference: &Path, query: &Path, out: &Path, report_dir: &Path) -> anyhow::Result<ExitStatus> {
    let (out, report_dir) = (&std::path::absolute(out)?, &std::path::absolute(report_dir)?);
    let run = executor::create_run(s, &a.exec, out, &format!("transfer-{method}"))?;
    let mut params = vec![
        ("task".to_string(), "transfer".to_string()),
        ("method".into(), method.to_string()),
        ("reference".into(), reference.display().to_string()),
        ("query".into(), query.display().to_string()),
        ("label_key".into(), a.label_key.clone()),
        ("outdir".into(), nextflow::outdir(&run).display().to_string()),
        ("seed".into(), a.seed.to_string()),
        ("k".into(), a.k.to_string()),
    ];
    if let Some(l) = &a.layer {
        params.push(("layer".into(), l.clone()));
    }
    for (given, flag) in [(a.pred_key.is_some(), "--pred-key"), (a.min_gene_overlap != 0.5, "--min-gene-overlap")] {
        if given {
            warn(&format!("{flag} is not a pipeline parameter; the Nextflow run uses its default"));
        }
    }
    let stem = |p: &Path| p.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    let id = format!("{}_from_{}", stem(query), stem(reference));
    let published = nextflow::outdir(&run).join("transfer").join(format!("{id}.transfer.h5ad"));
    let nf = nextflow::NfRun { run: &run, weights_dir: &s.weights_dir, gpu: a.gpu.clone(), max_forks: a.max_forks.or_else(|| a.gpu.as_ref().map(|g| g.slots_here() as u64)).unwrap_or(2), params, passthrough: &a.exec.passthrough, quiet: s.quiet };
    let code = nextflow::run_pipeline(&p, &nf, &published, out)?;
    if code == 0 {
        let report = nextflow::outdir(&run).join("transfer").join(format!("{id}.transfer"));
        if report.is_dir() {
            nextflow::move_to(&report, report_dir)?;
            if !s.quiet {
                eprintln!("report: {}", report_dir.display());
            }
        }
    }
    Ok(ExitStatus::from_code(code))
}

/// The scores of a transfer against the query's own labels.
struct Scores {
    /// Sorted union of the reference's labels and the query's.
    labels: Vec<String>,
    /// Codes into `labels` of the query cells that have a label, and their predictions.
    truth: Vec<u32>,
    predicted: Vec<u32>,
    accuracy: f64,
    macro_f1: f64,
    /// Query labels the reference does not have (never predictable).
    unseen: Vec<String>,
    /// Query cells without a label (left out of the scores).
    unlabelled: usize,
}

impl Scores {
    fn new(ref_cats: &[String], predicted: &[u32], ql: &Labels) -> Scores {
        let mut labels: Vec<String> = ref_cats.iter().chain(&ql.categories).cloned().collect();
        labels.sort();
        labels.dedup();
        let code = |l: &str| labels.binary_search_by(|x| x.as_str().cmp(l)).unwrap() as u32;
        let (mut truth, mut pred) = (Vec::new(), Vec::new());
        for (i, v) in ql.values.iter().enumerate() {
            if let Some(l) = v {
                truth.push(code(l));
                pred.push(code(&ref_cats[predicted[i] as usize]));
            }
        }
        let unseen = ql.categories.iter().filter(|c| ref_cats.binary_search(c).is_err()).cloned().collect();
        let unlabelled = ql.values.len() - truth.len();
        Scores { accuracy: accuracy(&truth, &pred), macro_f1: macro_f1(&truth, &pred), labels, truth, predicted: pred, unseen, unlabelled }
    }

    /// per_label.tsv, confusion.tsv, the figure; the scores into `doc`.
    fn write(&self, dir: &Path, doc: &mut Value, method: &str, k: u64, label_key: &str) -> anyhow::Result<()> {
        let per = per_label(&self.truth, &self.predicted);
        let mut tsv = String::from("label\tprecision\trecall\tf1\tsupport\tpredicted\tin_reference\n");
        let mut rows = Vec::new();
        for sc in &per {
            let name = &self.labels[sc.label as usize];
            let in_ref = !self.unseen.contains(name);
            tsv.push_str(&format!("{name}\t{:.6}\t{:.6}\t{:.6}\t{}\t{}\t{in_ref}\n", sc.precision, sc.recall, sc.f1, sc.support, sc.predicted));
            rows.push(json!({ "label": name, "precision": sc.precision, "recall": sc.recall, "f1": sc.f1, "support": sc.support, "predicted": sc.predicted, "in_reference": in_ref }));
        }
        write_file(&dir.join("per_label.tsv"), tsv.as_bytes())?;
        // the confusion matrix over the labels present in the truth or the prediction (as sklearn)
        let present: Vec<u32> = per.iter().map(|s| s.label).collect();
        let full = confusion_matrix(&self.truth, &self.predicted, self.labels.len());
        let n = present.len();
        let nl = self.labels.len();
        let counts: Vec<u64> = present.iter().flat_map(|&t| present.iter().map(move |&p| (t, p))).map(|(t, p)| full[t as usize * nl + p as usize]).collect();
        let names: Vec<String> = present.iter().map(|&l| self.labels[l as usize].clone()).collect();
        let mut ctsv = String::from("true\\predicted");
        for l in &names {
            ctsv.push_str(&format!("\t{l}"));
        }
        ctsv.push('\n');
        for (i, l) in names.iter().enumerate() {
            ctsv.push_str(l);
            for j in 0..n {
                ctsv.push_str(&format!("\t{}", counts[i * n + j]));
            }
            ctsv.push('\n');
        }
        write_file(&dir.join("confusion.tsv"), ctsv.as_bytes())?;
        let fig = crate::plots::ConfusionFigure {
            title: format!("Label transfer with {method}: {label_key}"),
            subtitle: format!(
                "{} query cells, k = {k}: accuracy {:.3}, macro-F1 {:.3}{}",
                self.truth.len(),
                self.accuracy,
                self.macro_f1,
                if self.unseen.is_empty() { String::new() } else { format!(" ({} label(s) not in the reference)", self.unseen.len()) }
            ),
            labels: names.clone(),
            counts: counts.clone(),
        };
        crate::plots::confusion_figure(&fig, &dir.join("confusion.svg"), &dir.join("confusion.png"))?;
        doc["accuracy"] = json!(self.accuracy);
        doc["macro_f1"] = json!(self.macro_f1);
        doc["n_scored"] = json!(self.truth.len());
        doc["n_query_unlabelled"] = json!(self.unlabelled);
        doc["labels_not_in_reference"] = json!(self.unseen);
        doc["per_label"] = json!(rows);
        doc["confusion"] = json!({ "labels": names, "rows": "true label", "columns": "predicted label", "counts": counts.chunks(n.max(1)).map(|r| r.to_vec()).collect::<Vec<_>>() });
        doc["implementation"] = json!("scikit-learn definitions: accuracy_score, f1_score(average='macro'), precision_recall_fscore_support(zero_division=0), confusion_matrix");
        Ok(())
    }
}
