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

pub use crate::paths::default_output;

/// Warn about options the method does not honour; return the method parameters in effect.
pub fn resolve_params(s: &Settings, m: &Method, args: &EmbedArgs) -> crate::error::Result<Map<String, Value>> {
    resolve_method_params(&s.registry, m, "embed", &args.batch, &args.knobs, on_gpu(m, &args.device))
}

/// Whether `m` runs on a GPU with these device options (`--device cuda` and a CUDA method).
pub fn on_gpu(m: &Method, device: &crate::cli::DeviceArgs) -> bool {
    m.cuda && device.device == Some(crate::gpu::DeviceKind::Cuda)
}

/// As `resolve_params`, for any command (`embed`, `transfer`, `finetune`) and its batch and
/// knob options; `on_gpu`: the method's GPU batch default applies (`[batch] gpu_default`). A
/// `--model-dir` that is a Hugging Face cache entry (`models--ORG--NAME`) becomes the snapshot
/// its `refs/main` names, for every method.
pub fn resolve_method_params(reg: &crate::registry::Registry, m: &Method, command: &str, batch: &BatchArgs, knobs: &KnobArgs, on_gpu: bool) -> crate::error::Result<Map<String, Value>> {
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
        if let Some(b) = reg.default_batch_on(m, on_gpu) {
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
    // the gene ids: one pair of options for every method that reads them (tasks::genes)
    use crate::tasks::genes::{self, COLUMN_FLAG, MIN_FLAG};
    if genes::Kind::parse(&m.input_genes).is_some() {
        params.insert("gene_column".into(), json!(knobs.gene_column.clone().unwrap_or_default()));
        params.insert("min_gene_match".into(), json!(knobs.min_gene_match.unwrap_or(genes::DEFAULT_MIN_GENE_MATCH)));
    } else {
        for (flag, given) in [(COLUMN_FLAG, knobs.gene_column.is_some()), (MIN_FLAG, knobs.min_gene_match.is_some())] {
            if given {
                warn(&format!("{} does not honour {flag} (it reads no gene ids); ignored", m.name));
            }
        }
    }
    let given = knobs.given();
    let values = knobs.given_values();
    let all = given.iter().map(|(f, v)| (*f, json!(v))).chain(values);
    for (flag, v) in all {
        if flag == "--model-dir" && m.knob(flag).is_none() && m.weights.is_empty() {
            // every method that loads weights takes one: the others load none
            warn(&format!("{} loads no weights, so --model-dir has nothing to replace; ignored", m.name));
        } else if m.knob(flag).is_none() {
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
    if let Some(d) = params.get("model_dir").and_then(Value::as_str).filter(|d| !d.is_empty()) {
        let resolved = crate::weights::resolve_model_folder(Path::new(d), "--model-dir")?;
        params.insert("model_dir".into(), json!(resolved.display().to_string()));
    }
    Ok(params)
}

/// The device and allocator for the task: checked now (CUDA build, driver, device) when the
/// task runs on this machine; a method that runs on the CPU only gets a warning, never a
/// silent fallback.
pub fn resolve_device(s: &Settings, m: &Method, args: &EmbedArgs) -> anyhow::Result<crate::gpu::DeviceSpec> {
    use crate::gpu::DeviceKind;
    let d = &args.device;
    let spec = s.device_spec(d)?;
    let gpu_flags = d.memory_options_given();
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

/// `integrate`'s options for an `embed` of an integration method that embeds by fine-tuning:
/// --batch-key (required), --epochs, --integration-batch-size, --model-dir, --device,
/// --precision, --seed, --layer and the executor carry over; the rest is ignored with a warning.
fn integrate_args(args: &EmbedArgs, m: &Method, files: &[PathBuf]) -> anyhow::Result<crate::cli::IntegrateArgs> {
    if files.len() != 1 {
        return Err(Error::BadOption {
            option: "--data".into(),
            detail: format!("names {} files; {} fine-tunes on the batches of one file", files.len(), m.name),
            hint: Some("concatenate them into one file first (`anndata.concat([...], label=\"batch\")`)".into()),
        }
        .into());
    }
    let data = files[0].clone();
    let Some(key) = args.knobs.batch_key.as_deref().filter(|k| !k.is_empty()) else {
        return Err(Error::BadOption {
            option: "--batch-key".into(),
            detail: format!("none given, and it is required: {} fine-tunes the model on the batches of an obs column and embeds each batch with its own statistics, as `integrate` does", m.name),
            hint: Some(format!("pass the obs column that holds the batches: `scfoundry embed --method {} --data {} --batch-key COLUMN`", m.name, data.display())),
        }
        .into());
    };
    if args.embedding_only {
        return Err(Error::BadOption {
            option: "--embedding-only".into(),
            detail: format!("{} writes a copy of the input with the embedding, as `integrate` does", m.name),
            hint: Some("leave --embedding-only out".into()),
        }
        .into());
    }
    let k = &args.knobs;
    let mut ignored: Vec<&str> = k.given().into_iter().map(|(f, _)| f).collect();
    for (flag, given) in [
        ("--emb-layer", k.emb_layer.is_some()),
        ("--emb-mode", k.emb_mode.is_some()),
        ("--obs-features", k.obs_features.is_some()),
        ("--gene-column", k.gene_column.is_some()),
        ("--min-gene-match", k.min_gene_match.is_some()),
        ("--shards", args.exec.shards.is_some()),
        ("--gpu", args.exec.gpu.is_some()),
        ("--max-forks", args.exec.max_forks.is_some()),
        ("--allocator", args.device.allocator.is_some()),
        ("--gpu-memory-limit", args.device.gpu_memory_limit.is_some()),
    ] {
        if given {
            ignored.push(flag);
        }
    }
    if !ignored.is_empty() {
        warn(&format!("{} embeds by fine-tuning (integrate's task), which does not honour {}; ignored", m.name, ignored.join(", ")));
    }
    Ok(crate::cli::IntegrateArgs {
        method: m.name.clone(),
        data,
        embedding: "X_pca".into(),
        batch_key: key.split(',').map(String::from).collect(),
        out: args.out.clone(),
        in_place: args.in_place,
        seed: args.seed,
        theta: None,
        layer: args.layer.clone(),
        skip_counts_check: args.skip_counts_check,
        dims: None,
        k_weight: None,
        scvi: Default::default(),
        scgpt: crate::cli::ScgptIntegrationArgs {
            integration_batch_size: args.integration.integration_batch_size,
            epochs: args.integration.epochs,
            device: args.device.device,
            precision: k.precision.clone(),
            model_dir: k.model_dir.clone(),
        },
        batch: BatchArgs { batch_size: args.batch.batch_size },
        exec: args.exec.base.clone(),
    })
}

/// One input file of an embedding, checked: its cells, the block grid, the groups a sharded
/// method is cut by, and where its output goes.
struct Input {
    data: PathBuf,
    tag: String,
    n_obs: usize,
    block: usize,
    groups: Option<crate::tasks::shard::GroupOrder>,
    out: PathBuf,
}

pub fn run(s: &Settings, args: &EmbedArgs) -> anyhow::Result<ExitStatus> {
    if let Some(dir) = &args.resume {
        return resume(s, args, dir);
    }
    let Some(method) = args.method.as_deref() else { unreachable!("clap requires --method and --data without --resume") };
    let files = crate::tasks::inputs::expand(&args.data)?;
    let several = files.len() > 1;
    let m = s.registry.get(method)?.clone();
    if m.implemented && m.kind == crate::registry::Kind::Integration && crate::tasks::table::get(&m.name).is_some_and(|e| e.embeds_by_integrating()) {
        // the embedding is integrate's task: one code path, one output
        return crate::commands::integrate::run(s, &integrate_args(args, &m, &files)?);
    }
    let params = resolve_params(s, &m, args)?;
    if !m.implemented {
        return Err(Error::NotImplemented { name: m.name.clone(), version: env!("CARGO_PKG_VERSION") }.into());
    }
    if m.kind == crate::registry::Kind::Integration {
        return Err(Error::BadOption {
            option: "--method".into(),
            detail: format!("{} is an integration method: it needs a batch column", m.name),
            hint: Some(format!("run `scfoundry integrate --method {} --data {} --batch-key COLUMN`", m.name, files[0].display())),
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
    if several && pipeline.is_some() {
        return Err(Error::BadOption {
            option: "--data".into(),
            detail: format!("names {} files; with --executor nextflow scfoundry hands the pipeline one file", files.len()),
            hint: Some("run them with --executor local or slurm, or run the pipeline itself on all of them: `nextflow run <scfoundry>/main.nf --task embed --input 'folder/*.h5ad' ...` (one task a file)".into()),
        }
        .into());
    }
    let device = resolve_device(s, &m, args)?;
    // Validate what is cheap before any run folder exists: weights first (the usual miss).
    let entry = crate::tasks::table::get(&m.name).ok_or_else(|| Error::NotImplemented { name: m.name.clone(), version: env!("CARGO_PKG_VERSION") })?;
    if several && entry.fits_before_shards() {
        return Err(Error::BadOption {
            option: "--data".into(),
            detail: format!("names {} files, and {} fits a model to the whole data before it embeds a cell, so its files cannot be embedded one by one", files.len(), m.name),
            hint: Some("concatenate them into one file first (`anndata.concat([...])`), or pick a method that embeds each cell on its own (a foundation model)".into()),
        }
        .into());
    }
    let tags = crate::tasks::inputs::tags(&files);
    let out_dir = if several && !args.embedding_only && !args.in_place { args.out.clone() } else { None };
    if let Some(d) = &out_dir {
        crate::paths::check_output_dir(d, "--out")?;
    }
    let mut inputs = Vec::new();
    for (data, tag) in files.iter().zip(&tags) {
        let pf = crate::tasks::method::Preflight { method: &m.name, weights_dir: &s.weights_dir, params: &params, model_dir: params.get("model_dir").and_then(Value::as_str).filter(|d| !d.is_empty()).map(Path::new), data };
        if inputs.is_empty() {
            entry.check(&pf)?;
        }
        let ad = AnnData::open(data)?;
        ad.check_usable()?;
        entry.check_data(&pf, &ad)?;
        let x = ad.matrix(args.layer.as_deref())?;
        let block = entry.block_rows(&x, &params);
        // a method whose cells see each other in groups is cut between groups (read from obs only)
        let groups = if exec.shards.is_some() || several { entry.shard_groups(&ad, &params)? } else { None };
        if let Some(w) = crate::tasks::counts::check(&m, &ad, args.layer.as_deref(), args.skip_counts_check)? {
            warn(&if several { format!("{}: {w}", data.display()) } else { w });
        }
        let n_obs = ad.n_obs;
        drop(x);
        drop(ad);
        let out = match (&args.out, args.in_place) {
            (_, true) => data.to_path_buf(),
            // several files with --embedding-only: each file's part goes to the run's work folder
            (_, false) if several && args.embedding_only => PathBuf::new(),
            (Some(o), false) if !several => o.clone(),
            (_, false) => {
                let name = format!("{tag}.{}.h5ad", m.name);
                match &out_dir {
                    Some(d) => d.join(name),
                    None if tag == &data.file_stem().unwrap_or_default().to_string_lossy() => default_output(data, &m.name),
                    None => data.with_file_name(name),
                }
            }
        };
        if !out.as_os_str().is_empty() {
            crate::paths::check_output_file(&out, "--out")?;
            if !args.in_place && crate::paths::same_file(data, &out) {
                return Err(Error::BadOption {
                    option: "--out".into(),
                    detail: format!("{} is the input file", out.display()),
                    hint: Some("pass --in-place to replace the input on purpose, or choose another --out".into()),
                }
                .into());
            }
        }
        inputs.push(Input { data: data.clone(), tag: tag.clone(), n_obs, block, groups, out });
    }
    let table = if several && args.embedding_only {
        let Some(t) = args.out.clone() else {
            return Err(Error::BadOption {
                option: "--out".into(),
                detail: format!("is needed with --embedding-only and {} --data files: it names the one table of their embeddings", files.len()),
                hint: Some("e.g. `--out atlas.embedding.h5ad`".into()),
            }
            .into());
        };
        crate::paths::check_output_file(&t, "--out")?;
        Some(t)
    } else {
        None
    };
    if let Some(d) = &out_dir {
        std::fs::create_dir_all(d).map_err(|e| Error::Io { path: d.clone(), source: e })?;
    }

    let run_near = table.clone().or_else(|| out_dir.as_ref().map(|d| d.join("x"))).unwrap_or_else(|| inputs[0].out.clone());
    let run = executor::create_run(s, &exec.base, &run_near, &m.name)?;
    let base = |inp: &Input, out: &Path| -> anyhow::Result<TaskSpec> {
        Ok(TaskSpec {
            layer: args.layer.clone(),
            weights_dir: Some(std::path::absolute(&s.weights_dir)?),
            gpus: gpus.clone(),
            device: device.clone(),
            embedding_only: args.embedding_only,
            ..TaskSpec::new(&run, format!("EMBED_{} ({})", m.name.to_uppercase(), inp.tag), "embed", &m.name, &inp.data, out, args.seed, params.clone(), s.quiet, s.progress)?
        })
    };
    if let Some(p) = pipeline {
        let spec = base(&inputs[0], &inputs[0].out)?;
        if args.embedding_only {
            warn("--embedding-only applies to --executor local and slurm; the Nextflow pipeline writes the full output");
        }
        return run_nextflow(s, args, &spec, &run, &p);
    }
    let cards = gpus.as_ref().map(|g| g.slots_here()).unwrap_or(0);
    let mut plans = Vec::new();
    for (k, inp) in inputs.iter().enumerate() {
        let out = match &table {
            Some(_) => run.dir.join("work").join(format!("{k}-{}.h5ad", inp.tag)),
            None => inp.out.clone(),
        };
        let spec = base(inp, &out)?;
        // several files: each is at least one shard, so the files run side by side
        let shards = exec.shards.map(|c| c.count(inp.n_obs, cards)).or(several.then_some(1));
        let ranges = shards.map(|c| match &inp.groups {
            Some(g) => g.ranges(c as usize),
            None => runner::shard_ranges(inp.n_obs, c as usize, inp.block),
        });
        let tasks = executor::plan_embed(&spec, &run, ranges, entry.fits_before_shards());
        let planned = tasks.iter().filter(|t| matches!(t.step, runner::Step::Project { .. })).count() as u64;
        if let Some(c) = shards.filter(|&c| c > planned && exec.shards.is_some()) {
            let why = match &inp.groups {
                Some(g) => format!("{} embeds its cells in {} groups that see each other and a shard is whole groups", m.name, g.groups()),
                None => format!("{} reads X in blocks of {} rows and a shard is whole blocks", m.name, inp.block),
            };
            let of = if several { format!(" of {}", inp.tag) } else { String::new() };
            warn(&format!("{planned} shard(s){of}, not {c}: {why} ({} cells)", inp.n_obs));
        }
        plans.push(tasks);
    }
    if let Some(t) = &table {
        std::fs::create_dir_all(run.dir.join("work")).map_err(|e| Error::Io { path: run.dir.join("work"), source: e })?;
        let record = json!({ "table": std::path::absolute(t)?, "inputs": inputs.iter().map(|i| json!({ "input": std::path::absolute(&i.data).unwrap_or_default(), "tag": i.tag })).collect::<Vec<_>>() });
        let path = run.dir.join(TABLE_RECORD);
        std::fs::write(&path, serde_json::to_string_pretty(&record).unwrap_or_default()).map_err(|e| Error::Io { path, source: e })?;
    }
    let tasks = executor::join_plans(&run, plans);
    executor::save_plan(&run, &tasks, &exec.base)?;
    // with a GPU list, as many shards at once as it has entries (one task per card)
    let max_forks = exec.max_forks.or_else(|| gpus.as_ref().map(|g| g.slots_here() as u64));
    finish(s, &run, &tasks, &exec.base, max_forks, Vec::new())
}

/// In the run folder of several files embedded into one table: the table's path and the inputs.
const TABLE_RECORD: &str = "table.json";

/// The one table of a run of several files with --embedding-only, from each file's part.
fn write_table(s: &Settings, run: &Run, tasks: &[TaskSpec], key: &str) -> anyhow::Result<Option<PathBuf>> {
    let path = run.dir.join(TABLE_RECORD);
    let Ok(text) = std::fs::read_to_string(&path) else { return Ok(None) };
    let record: Value = serde_json::from_str(&text).map_err(|e| Error::BadField { path: path.clone(), field: "table".into(), detail: e.to_string(), hint: None })?;
    let dest = PathBuf::from(record["table"].as_str().unwrap_or_default());
    let mut parts = Vec::new();
    for i in record["inputs"].as_array().into_iter().flatten() {
        let input = PathBuf::from(i["input"].as_str().unwrap_or_default());
        let output = tasks.iter().find(|t| t.data == input && !matches!(t.step, runner::Step::Project { .. })).map(|t| t.out.clone()).unwrap_or_default();
        parts.push(crate::tasks::inputs::Part { output, input, tag: i["tag"].as_str().unwrap_or_default().to_string() });
    }
    let (n, d, renamed) = crate::tasks::inputs::write_table(&parts, key, &dest)?;
    if !s.quiet {
        eprintln!("wrote {} with obsm['{key}'] ({n} cells x {d}) from {} files; obs['{}'] names each cell's file", dest.display(), parts.len(), crate::tasks::inputs::FILE_COLUMN);
        if renamed {
            eprintln!("note: some cell names repeat across the files: every name has `-<file>` appended (as anndata.concat(..., index_unique=\"-\"))");
        }
    }
    Ok(Some(dest))
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
    // the outputs: one a file (a merge, or a whole-file task), in the plan's order
    let written: Vec<&runner::Outcome> = tasks
        .iter()
        .filter(|t| matches!(t.step, runner::Step::Merge { .. } | runner::Step::Embed))
        .filter_map(|t| outcomes.iter().find(|o| o.record.task_id == t.task_id))
        .collect();
    let key = written.first().and_then(|o| o.result.as_ref()).and_then(|r| r.obsm_key.clone()).unwrap_or_default();
    let table = write_table(s, run, tasks, &key)?;
    if !s.quiet {
        let wall: u64 = outcomes.iter().filter_map(|o| o.stats.as_ref().map(|s| s.realtime_ms)).sum();
        let peak = outcomes.iter().filter_map(|o| o.stats.as_ref().map(|s| s.peak_rss)).max().unwrap_or(0);
        let how = if tasks.len() > 1 { format!(" ({} tasks)", tasks.len()) } else { String::new() };
        let last = written.last().copied().or(outcomes.last()).expect("at least one task");
        let mut lines: Vec<String> = written
            .iter()
            .filter(|_| table.is_none())
            .map(|o| {
                let r = o.result.clone().unwrap_or_default();
                format!("wrote {} with obsm['{}'] ({} cells x {})", r.output.as_ref().map(|p| p.display().to_string()).unwrap_or_default(), r.obsm_key.unwrap_or_default(), r.n_obs, r.dim)
            })
            .collect();
        if lines.is_empty() {
            lines.push("embedded".into());
        }
        let n = lines.len();
        for (i, l) in lines.into_iter().enumerate() {
            if i + 1 == n {
                eprintln!("{l} in {}{how}, peak memory {}", runner::trace::fmt_duration(wall), runner::trace::fmt_memory(peak));
            } else {
                eprintln!("{l}");
            }
        }
        let r = last.result.clone().unwrap_or_default();
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
        // each note once (files embedded alike say the same)
        let mut notes: Vec<String> = r.notes;
        for o in &written {
            for n in o.result.as_ref().map(|r| r.notes.clone()).unwrap_or_default() {
                if !notes.contains(&n) {
                    notes.push(n);
                }
            }
        }
        for n in notes {
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
