//! `scfoundry embed`: validate, then run the embedding as a task in a run folder.

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use crate::anndata::AnnData;
use crate::cli::{EmbedArgs, ExecutorKind};
use crate::executor;
use crate::commands::ExitStatus;
use crate::error::Error;
use crate::progress::warn;
use crate::registry::Method;
use crate::runner::{self, Run, Step, TaskSpec};
use crate::settings::Settings;

/// Default output: `<input stem>.<method>.h5ad` beside the input.
pub fn default_output(data: &Path, method: &str) -> PathBuf {
    let stem = data.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "data".into());
    data.with_file_name(format!("{stem}.{method}.h5ad"))
}

/// Warn about options the method does not honour; return the method parameters in effect.
pub fn resolve_params(s: &Settings, m: &Method, args: &EmbedArgs) -> Map<String, Value> {
    let mut params = Map::new();
    let honoured = m.honoured("embed");
    if let Some(b) = args.batch.batch_size {
        if honoured.iter().any(|o| o == "--batch-size") {
            params.insert("batch_size".into(), json!(b));
        } else {
            warn(&format!("{} does not honour --batch-size when embedding; ignored", m.name));
        }
    } else if honoured.iter().any(|o| o == "--batch-size") {
        if let Some(b) = s.registry.default_batch(m) {
            params.insert("batch_size".into(), json!(b));
        }
    }
    if let Some(f) = &args.knobs.obs_features {
        if m.knob("--obs-features").is_none() {
            warn(&format!("{} does not honour --obs-features; ignored", m.name));
        } else {
            params.insert("obs_features".into(), json!(f));
        }
    }
    if let Some(c) = &args.knobs.gene_col {
        if m.knob("--gene-col").is_none() {
            warn(&format!("{} does not honour --gene-col; ignored", m.name));
        } else {
            params.insert("gene_col".into(), json!(c));
        }
    }
    let given = args.knobs.given();
    for (flag, v) in &given {
        if m.knob(flag).is_none() {
            warn(&format!("{} does not honour {flag}; ignored", m.name));
        } else {
            params.insert(flag.trim_start_matches("--").replace('-', "_"), json!(v));
        }
    }
    for k in &m.knobs {
        let key = k.flag.trim_start_matches("--").replace('-', "_");
        if !params.contains_key(&key) {
            params.insert(key, serde_json::to_value(&k.default).unwrap_or(Value::Null));
        }
    }
    params
}

pub fn run(s: &Settings, args: &EmbedArgs) -> anyhow::Result<ExitStatus> {
    let m = s.registry.get(&args.method)?.clone();
    let params = resolve_params(s, &m, args);
    if !m.implemented {
        return Err(Error::NotImplemented { name: m.name.clone(), version: env!("CARGO_PKG_VERSION") }.into());
    }
    let exec = &args.exec;
    // The executor's tools before any work.
    let nextflow = match exec.executor {
        ExecutorKind::Nextflow => Some((executor::nextflow::find_nextflow()?, executor::nextflow::pipeline()?)),
        ExecutorKind::Slurm => {
            executor::slurm::check_tools()?;
            None
        }
        ExecutorKind::Local => None,
    };
    if exec.executor == ExecutorKind::Local && !args.passthrough.is_empty() {
        warn(&format!("arguments after `--` are for --executor nextflow or slurm; ignored: {}", args.passthrough.join(" ")));
    }
    if exec.executor == ExecutorKind::Slurm && exec.gpu.is_some() {
        warn("--gpu pins a device on this machine; with --executor slurm ask for GPUs with --gpus or --gres and Slurm chooses them");
    }
    if exec.executor == ExecutorKind::Nextflow && exec.shards.is_some() {
        warn("--shards applies to --executor local and slurm; the Nextflow pipeline embeds each file in one task");
    }
    // Validate what is cheap before any run folder exists: weights first (the usual miss).
    if m.name == "cellama" {
        crate::commands::task::verified_weights(&m.name, &s.weights_dir, crate::methods::cellama::REQUIRED_ENTRIES)?;
    }
    if m.name == "scgpt" {
        crate::commands::task::verified_weights(&m.name, &s.weights_dir, crate::methods::scgpt::REQUIRED_ENTRIES)?;
    }
    let ad = AnnData::open(&args.data)?;
    ad.check_usable()?;
    ad.matrix(args.layer.as_deref())?;
    let n_obs = ad.n_obs;
    drop(ad);

    let out = match (&args.out, args.in_place) {
        (_, true) => args.data.clone(),
        (Some(o), false) => o.clone(),
        (None, false) => default_output(&args.data, &m.name),
    };
    let same = |a: &Path, b: &Path| match (std::fs::canonicalize(a), std::path::absolute(b)) {
        (Ok(x), Ok(y)) => x == y || std::fs::canonicalize(b).map(|z| z == x).unwrap_or(false),
        _ => false,
    };
    if !args.in_place && same(&args.data, &out) {
        return Err(Error::BadOption {
            option: "--out".into(),
            detail: format!("{} is the input file", out.display()),
            hint: Some("pass --in-place to replace the input on purpose, or choose another --out".into()),
        }
        .into());
    }
    let runs_base = match (&args.runs_dir, &s.workspace) {
        (Some(d), _) => d.clone(),
        (None, Some(ws)) => ws.runs_dir(),
        (None, None) => out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).join("runs"),
    };
    // absolute, so that jobs on other nodes and their logs name the same folder
    let runs_base = std::path::absolute(&runs_base)?;
    let mut run = Run::create(&runs_base, &m.name)?;
    if let Some(ws) = &s.workspace {
        run.locks = ws.root.join(".locks");
    }
    let tag = args.data.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    let spec = TaskSpec {
        task_id: 1,
        name: format!("EMBED_{} ({tag})", m.name.to_uppercase()),
        command: "embed".into(),
        method: m.name.clone(),
        data: std::path::absolute(&args.data)?,
        out: std::path::absolute(&out)?,
        layer: args.layer.clone(),
        seed: args.seed,
        params,
        quiet: s.quiet,
        progress: s.progress,
        command_line: std::env::args().collect::<Vec<_>>().join(" "),
        run_id: run.id.clone(),
        weights_dir: Some(std::path::absolute(&s.weights_dir)?),
        step: Step::Embed,
        work: None,
        gpu: exec.gpu,
    };
    if let Some((nf, main_nf)) = nextflow {
        return run_nextflow(s, args, &spec, &run, &nf, &main_nf);
    }
    let tasks = executor::plan_embed(&spec, &run, n_obs, exec.shards);
    let outcomes = match exec.executor {
        ExecutorKind::Slurm => executor::slurm::run(&run, &tasks, &exec.slurm, exec.max_forks, &args.passthrough, s.quiet)?,
        _ => executor::run_local(&run, &tasks, exec.max_forks.unwrap_or(1) as usize)?,
    };
    let refs: Vec<&runner::Outcome> = outcomes.iter().collect();
    runner::write_reports(&run, &spec, &refs)?;
    let failed = outcomes.iter().find(|o| o.record.status == "FAILED").or_else(|| outcomes.iter().find(|o| o.exit != 0));
    if let Some(f) = failed {
        if tasks.len() > 1 {
            eprintln!("{} {} (exit {})", f.record.name, f.record.status.to_lowercase(), f.exit);
        }
        eprintln!("run folder: {} (task logs, trace.txt)", run.dir.display());
        return Ok(ExitStatus::Code(f.exit));
    }
    if !s.quiet {
        let last = outcomes.last().expect("at least one task");
        let r = last.result.clone().unwrap_or_default();
        let wall: u64 = outcomes.iter().filter_map(|o| o.stats.as_ref().map(|s| s.realtime_ms)).sum();
        let peak = outcomes.iter().filter_map(|o| o.stats.as_ref().map(|s| s.peak_rss)).max().unwrap_or(0);
        let how = if tasks.len() > 1 { format!(" ({} tasks)", tasks.len()) } else { String::new() };
        eprintln!(
            "wrote {} with obsm['{}'] ({} cells x {}) in {}{how}, peak memory {}",
            out.display(),
            r.obsm_key.unwrap_or_default(),
            r.n_obs,
            r.dim,
            runner::trace::fmt_duration(wall),
            runner::trace::fmt_memory(peak)
        );
        for n in r.notes {
            eprintln!("note: {n}");
        }
        eprintln!("run folder: {} (trace.txt, report.json)", run.dir.display());
    }
    Ok(ExitStatus::Success)
}

/// The Nextflow parameters of an embedding (names as in nextflow_schema.json).
pub fn nextflow_params(spec: &TaskSpec, outdir: &Path) -> Vec<(String, String)> {
    let mut p = vec![
        ("task".to_string(), "embed".to_string()),
        ("method".into(), spec.method.clone()),
        ("input".into(), spec.data.display().to_string()),
        ("outdir".into(), outdir.display().to_string()),
        ("seed".into(), spec.seed.to_string()),
    ];
    if let Some(l) = &spec.layer {
        p.push(("layer".into(), l.clone()));
    }
    for (k, v) in &spec.params {
        p.push((k.clone(), v.as_str().map(str::to_string).unwrap_or_else(|| v.to_string())));
    }
    p
}

fn run_nextflow(s: &Settings, args: &EmbedArgs, spec: &TaskSpec, run: &Run, nf: &Path, main_nf: &Path) -> anyhow::Result<ExitStatus> {
    let outdir = run.dir.join("results");
    let cfg = crate::nfconfig::NfConfig {
        gpu_id: args.exec.gpu,
        max_forks: args.exec.max_forks.unwrap_or(1),
        profiles: crate::nfconfig::all_profiles(),
        weights_dir: std::path::absolute(&s.weights_dir)?,
        work_dir: run.dir.join("work"),
        outdir: outdir.clone(),
        scfoundry: std::env::current_exe()?.display().to_string(),
        params: vec![],
        made_by: format!("Written by scfoundry {} for run {}.", env!("CARGO_PKG_VERSION"), run.id),
    };
    let cfg_path = run.dir.join("nextflow.config");
    std::fs::write(&cfg_path, cfg.render()).map_err(|e| Error::Io { path: cfg_path.clone(), source: e })?;
    let argv = executor::nextflow::command_line(main_nf, &cfg_path, &nextflow_params(spec, &outdir), &args.passthrough);
    let line = std::iter::once(nf.display().to_string()).chain(argv.iter().cloned()).collect::<Vec<_>>().join(" ");
    let _ = std::fs::write(run.dir.join("command.txt"), format!("{line}\n"));
    if !s.quiet {
        eprintln!("nextflow: {line}");
    }
    let code = executor::nextflow::launch(nf, &argv, &run.dir)?;
    if code != 0 {
        eprintln!("nextflow exited with {code}; run folder: {} (.nextflow.log, work/)", run.dir.display());
        return Ok(ExitStatus::Code(code));
    }
    // The pipeline publishes <stem>.<method>.h5ad into outdir; move it where the user asked.
    let published = outdir.join(default_output(&spec.data, &spec.method).file_name().unwrap_or_default());
    if !published.is_file() {
        return Err(Error::Executor {
            what: "nextflow".into(),
            detail: format!("it finished, but {} was not published", published.display()),
            hint: Some(format!("see {}", run.dir.join(".nextflow.log").display())),
        }
        .into());
    }
    if std::fs::rename(&published, &spec.out).is_err() {
        std::fs::copy(&published, &spec.out).map_err(|e| Error::Io { path: spec.out.clone(), source: e })?;
        let _ = std::fs::remove_file(&published);
    }
    if !s.quiet {
        eprintln!("wrote {}; run folder: {} (nextflow.config, pipeline_info/trace.txt)", spec.out.display(), run.dir.display());
    }
    Ok(ExitStatus::Success)
}
