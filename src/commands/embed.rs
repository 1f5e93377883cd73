//! `scfoundry embed`: validate, then run the embedding as a task in a run folder.

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use crate::anndata::AnnData;
use crate::cli::{BatchArgs, EmbedArgs, ExecutorKind, KnobArgs};
use crate::executor::{self, nextflow::{NfRun, Pipeline}, Finished};
use crate::commands::ExitStatus;
use crate::error::Error;
use crate::progress::warn;
use crate::registry::Method;
use crate::runner::{self, Run, TaskSpec};
use crate::settings::Settings;

/// Default output: `<input stem>.<method>.h5ad` beside the input.
pub fn default_output(data: &Path, method: &str) -> PathBuf {
    let stem = data.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "data".into());
    data.with_file_name(format!("{stem}.{method}.h5ad"))
}

/// Warn about options the method does not honour; return the method parameters in effect.
pub fn resolve_params(s: &Settings, m: &Method, args: &EmbedArgs) -> Map<String, Value> {
    resolve_method_params(&s.registry, m, "embed", &args.batch, &args.knobs)
}

/// As `resolve_params`, for any command (`embed`, `transfer`) and its batch and knob options.
pub fn resolve_method_params(reg: &crate::registry::Registry, m: &Method, command: &str, batch: &BatchArgs, knobs: &KnobArgs) -> Map<String, Value> {
    let mut params = Map::new();
    let honoured = m.honoured(command);
    let verb = match command { "embed" => "embedding", "transfer" => "transferring labels", other => other };
    if let Some(b) = batch.batch_size {
        if honoured.iter().any(|o| o == "--batch-size") {
            params.insert("batch_size".into(), json!(b));
        } else {
            warn(&format!("{} does not honour --batch-size when {verb}; ignored", m.name));
        }
    } else if honoured.iter().any(|o| o == "--batch-size") {
        if let Some(b) = reg.default_batch(m) {
            params.insert("batch_size".into(), json!(b));
        }
    }
    if let Some(f) = &knobs.obs_features {
        if m.knob("--obs-features").is_none() {
            warn(&format!("{} does not honour --obs-features; ignored", m.name));
        } else {
            params.insert("obs_features".into(), json!(f));
        }
    }
    if let Some(c) = &knobs.gene_col {
        if m.knob("--gene-col").is_none() {
            warn(&format!("{} does not honour --gene-col; ignored", m.name));
        } else {
            params.insert("gene_col".into(), json!(c));
        }
    }
    let given = knobs.given();
    let values = knobs.given_values();
    let all = given.iter().map(|(f, v)| (*f, json!(v))).chain(values);
    for (flag, v) in all {
        if m.knob(flag).is_none() {
            warn(&format!("{} does not honour {flag}; ignored", m.name));
        } else {
            params.insert(flag.trim_start_matches("--").replace('-', "_"), v);
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

/// The device and allocator for the task: checked now (CUDA build, driver, device) when the
/// task runs on this machine; a method that runs on the CPU only gets a warning, never a
/// silent fallback.
pub fn resolve_device(s: &Settings, m: &Method, args: &EmbedArgs) -> anyhow::Result<crate::gpu::DeviceSpec> {
    use crate::gpu::DeviceKind;
    let d = &args.device;
    let spec = s.device_spec(d)?;
    let gpu_flags = d.allocator.is_some()
        || d.release_threshold.is_some()
        || d.initial_pool_size.is_some()
        || d.maximum_pool_size.is_some()
        || d.gpu_memory_limit.is_some()
        || d.device_budget.is_some()
        || d.allocation_log.is_some();
    if !m.cuda {
        if spec.kind == DeviceKind::Cuda || gpu_flags {
            warn(&format!("{} runs on the CPU only; --device cuda and the GPU memory options are ignored", m.name));
        }
        return Ok(crate::gpu::DeviceSpec::default());
    }
    if spec.kind == DeviceKind::Cpu && gpu_flags {
        warn("the GPU memory options (--allocator, pool sizes, --gpu-memory-limit, ...) apply with --device cuda; ignored on the CPU");
    }
    if spec.kind == DeviceKind::Cuda && args.exec.base.executor == ExecutorKind::Local {
        // each task sees only the card it takes (CUDA_VISIBLE_DEVICES): check one of the list here
        let first = match &args.exec.gpu {
            Some(crate::gpu::cards::GpuList::Cards(c)) => c.iter().copied().min().unwrap_or(0),
            _ => 0,
        };
        let here = crate::gpu::DeviceSpec { ordinal: first as usize, ..spec.clone() };
        crate::gpu::preflight(&here).map_err(Error::Gpu)?;
    }
    Ok(spec)
}

pub fn run(s: &Settings, args: &EmbedArgs) -> anyhow::Result<ExitStatus> {
    if let Some(dir) = &args.resume {
        return resume(s, args, dir);
    }
    let (Some(method), Some(data)) = (args.method.as_deref(), args.data.as_deref()) else {
        unreachable!("clap requires --method and --data without --resume")
    };
    let m = s.registry.get(method)?.clone();
    let params = resolve_params(s, &m, args);
    if !m.implemented {
        return Err(Error::NotImplemented { name: m.name.clone(), version: env!("CARGO_PKG_VERSION") }.into());
    }
    if m.kind == crate::registry::Kind::Integration {
        return Err(Error::BadOption {
            option: "--method".into(),
            detail: format!("{} is an integration method: it needs a batch column", m.name),
            hint: Some(format!("run `scfoundry integrate --method {} --data {} --batch-key COLUMN`", m.name, data.display())),
        }
        .into());
    }
    let exec = &args.exec;
    // The executor's tools before any work.
    let pipeline = executor::preflight(&exec.base)?;
    let gpus = crate::commands::task_gpus(exec.base.executor, &exec.gpu);
    if exec.base.executor == ExecutorKind::Nextflow && exec.shards.is_some() {
        warn("--shards applies to --executor local and slurm; the Nextflow pipeline embeds each file in one task");
    }
    let device = resolve_device(s, &m, args)?;
    // Validate what is cheap before any run folder exists: weights first (the usual miss).
    let entry = crate::tasks::table::get(&m.name).ok_or_else(|| Error::NotImplemented { name: m.name.clone(), version: env!("CARGO_PKG_VERSION") })?;
    let pf = crate::tasks::method::Preflight { method: &m.name, weights_dir: &s.weights_dir, params: &params, model_dir: args.knobs.model_dir.as_deref(), data };
    entry.check(&pf)?;
    let ad = AnnData::open(data)?;
    ad.check_usable()?;
    entry.check_data(&pf, &ad)?;
    let x = ad.matrix(args.layer.as_deref())?;
    let block = entry.block_rows(&x, &params);
    // a method whose cells see each other in groups is cut between groups (read from obs only)
    let groups = if exec.shards.is_some() { entry.shard_groups(&ad, &params)? } else { None };
    if let Some(w) = crate::tasks::counts::check(&m, &ad, args.layer.as_deref(), args.skip_counts_check)? {
        warn(&w);
    }
    let n_obs = ad.n_obs;
    drop(x);
    drop(ad);

    let out = match (&args.out, args.in_place) {
        (_, true) => data.to_path_buf(),
        (Some(o), false) => o.clone(),
        (None, false) => default_output(data, &m.name),
    };
    crate::paths::check_output_file(&out, "--out")?;
    if !args.in_place && crate::paths::same_file(data, &out) {
        return Err(Error::BadOption {
            option: "--out".into(),
            detail: format!("{} is the input file", out.display()),
            hint: Some("pass --in-place to replace the input on purpose, or choose another --out".into()),
        }
        .into());
    }
    let run = executor::create_run(s, &exec.base, &out, &m.name)?;
    let tag = data.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    let spec = TaskSpec {
        layer: args.layer.clone(),
        weights_dir: Some(std::path::absolute(&s.weights_dir)?),
        gpus,
        device,
        embedding_only: args.embedding_only,
        ..TaskSpec::new(&run, format!("EMBED_{} ({tag})", m.name.to_uppercase()), "embed", &m.name, data, &out, args.seed, params, s.quiet, s.progress)?
    };
    if let Some(p) = pipeline {
        if args.embedding_only {
            warn("--embedding-only applies to --executor local and slurm; the Nextflow pipeline writes the full output");
        }
        return run_nextflow(s, args, &spec, &run, &p);
    }
    let cards = spec.gpus.as_ref().map(|g| g.slots_here()).unwrap_or(0);
    let shards = exec.shards.map(|k| k.count(n_obs, cards));
    let ranges = shards.map(|k| match &groups {
        Some(g) => g.ranges(k as usize),
        None => runner::shard_ranges(n_obs, k as usize, block),
    });
    let tasks = executor::plan_embed(&spec, &run, ranges, entry.fits_before_shards());
    let planned = tasks.iter().filter(|t| matches!(t.step, runner::Step::Project { .. })).count() as u64;
    if let Some(k) = shards.filter(|&k| k > planned) {
        let why = match &groups {
            Some(g) => format!("{} embeds its cells in {} groups that see each other and a shard is whole groups", m.name, g.groups()),
            None => format!("{} reads X in blocks of {block} rows and a shard is whole blocks", m.name),
        };
        warn(&format!("{planned} shard(s), not {k}: {why} ({n_obs} cells)"));
    }
    executor::save_plan(&run, &tasks, &exec.base)?;
    // with a GPU list, as many shards at once as it has entries (one task per card)
    let max_forks = exec.max_forks.or_else(|| spec.gpus.as_ref().map(|g| g.slots_here() as u64));
    finish(s, &run, &tasks, &exec.base, max_forks, Vec::new())
}

/// Run `tasks` (those of `cached` already done) and print what was written.
fn finish(s: &Settings, run: &Run, tasks: &[TaskSpec], exec: &crate::cli::ExecutorArgs, max_forks: Option<u64>, cached: Vec<runner::Outcome>) -> anyhow::Result<ExitStatus> {
    let todo: Vec<TaskSpec> = tasks.iter().filter(|t| !cached.iter().any(|c| c.record.task_id == t.task_id)).cloned().collect();
    let outcomes = match executor::run_plan_cached(run, &todo, exec, max_forks, s.quiet, cached)? {
        Finished::Completed(o) => o,
        Finished::Failed(code) => {
            if tasks.len() > 1 {
                eprintln!("finished shards are kept: `scfoundry embed --resume {}` runs only what is left", run.dir.display());
            }
            return Ok(ExitStatus::Code(code));
        }
    };
    if !s.quiet {
        let last = outcomes.iter().find(|o| matches!(tasks.iter().find(|t| t.task_id == o.record.task_id).map(|t| &t.step), Some(runner::Step::Merge { .. } | runner::Step::Embed))).or(outcomes.last()).expect("at least one task");
        let r = last.result.clone().unwrap_or_default();
        let wall: u64 = outcomes.iter().filter_map(|o| o.stats.as_ref().map(|s| s.realtime_ms)).sum();
        let peak = outcomes.iter().filter_map(|o| o.stats.as_ref().map(|s| s.peak_rss)).max().unwrap_or(0);
        let how = if tasks.len() > 1 { format!(" ({} tasks)", tasks.len()) } else { String::new() };
        eprintln!(
            "wrote {} with obsm['{}'] ({} cells x {}) in {}{how}, peak memory {}",
            r.output.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
            r.obsm_key.unwrap_or_default(),
            r.n_obs,
            r.dim,
            runner::trace::fmt_duration(wall),
            runner::trace::fmt_memory(peak)
        );
        if tasks.len() > 1 {
            for o in &outcomes {
                let (time, mem) = o.stats.as_ref().map(|s| (runner::trace::fmt_duration(s.realtime_ms), runner::trace::fmt_memory(s.peak_rss))).unwrap_or_default();
                eprintln!("  {}: {} in {time}, peak memory {mem}", o.record.name, o.record.status.to_lowercase());
            }
        }
        for o in &outcomes {
            let card = o.result.as_ref().and_then(|r| r.card.as_ref());
            if let Some(g) = crate::gpu::GpuReport::read(&run.task_dir(o.record.task_id)) {
                let which = match card {
                    Some(c) => format!("{}: GPU {} {}", o.record.name, c.ordinal, c.uuid),
                    None => format!("GPU {}", g.ordinal),
                };
                eprintln!("{which} ({}): peak {} in {} allocations, allocator {}", g.device, runner::trace::fmt_memory(g.stats.peak_bytes), g.stats.allocations, g.allocator);
            } else if let Some(c) = card {
                eprintln!("{}: GPU {} {}", o.record.name, c.ordinal, c.uuid);
            }
        }
        for n in r.notes {
            eprintln!("note: {n}");
        }
        eprintln!("run folder: {} (trace.txt, report.json)", run.dir.display());
    }
    Ok(ExitStatus::Success)
}

/// `embed --resume RUN_DIR`: the run's plan again, without the shards (and fit) that finished
/// and whose rows pass their checksum.
fn resume(s: &Settings, args: &EmbedArgs, dir: &Path) -> anyhow::Result<ExitStatus> {
    let (run, tasks, saved_exec) = executor::load_plan(dir)?;
    if tasks.first().map(|t| t.command.as_str()) != Some("embed") {
        return Err(Error::BadOption { option: "--resume".into(), detail: format!("{} is not the run folder of an embedding", dir.display()), hint: None }.into());
    }
    let mut exec = saved_exec;
    if args.exec.base.executor != ExecutorKind::Local {
        exec.executor = args.exec.base.executor;
    }
    let mut cached = Vec::new();
    for t in &tasks {
        let done = match &t.step {
            runner::Step::Project { shard, start, end } => t.work.as_deref().and_then(|w| crate::tasks::shard::shard_done(w, *shard, *start, *end)).is_some(),
            runner::Step::Fit => runner::task_files(&run, t).1.is_some(),
            _ => false,
        };
        if done {
            cached.push(runner::cached_outcome(&run, t));
        }
    }
    if !s.quiet {
        let projects = tasks.iter().filter(|t| matches!(t.step, runner::Step::Project { .. })).count();
        let kept = cached.iter().filter(|o| o.record.name.contains("_PROJECT")).count();
        eprintln!("resuming {}: {kept} of {projects} shards finished and checked; running the rest", run.dir.display());
    }
    let max_forks = args.exec.max_forks.or_else(|| tasks.first().and_then(|t| t.gpus.as_ref()).map(|g| g.slots_here() as u64));
    finish(s, &run, &tasks, &exec, max_forks, cached)
}

/// The Nextflow parameters of an embedding (names as in nextflow_schema.json).
pub fn nextflow_params(spec: &TaskSpec, run: &Run) -> Vec<(String, String)> {
    let mut p = executor::nextflow::task_params("embed", Some(&spec.method), &spec.data, run, spec.seed);
    if let Some(l) = &spec.layer {
        p.push(("layer".into(), l.clone()));
    }
    for (k, v) in &spec.params {
        p.push((k.clone(), v.as_str().map(str::to_string).unwrap_or_else(|| v.to_string())));
    }
    p
}

fn run_nextflow(s: &Settings, args: &EmbedArgs, spec: &TaskSpec, run: &Run, p: &Pipeline) -> anyhow::Result<ExitStatus> {
    let nf = NfRun {
        run,
        weights_dir: &s.weights_dir,
        gpu: args.exec.gpu.clone(),
        max_forks: args.exec.max_forks.unwrap_or_else(|| args.exec.gpu.as_ref().map_or(1, |g| g.slots_here() as u64)),
        params: nextflow_params(spec, run),
        passthrough: &args.exec.base.passthrough,
        quiet: s.quiet,
    };
    // The pipeline publishes <stem>.<method>.h5ad into outdir; it is moved where the user asked.
    let published = executor::nextflow::outdir(run).join(default_output(&spec.data, &spec.method).file_name().unwrap_or_default());
    Ok(ExitStatus::from_code(executor::nextflow::run_pipeline(p, &nf, &published, &spec.out)?))
}
