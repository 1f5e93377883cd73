//! Where a command's tasks run: `local` (task processes on this machine, the built-in runner),
//! `nextflow` (`nextflow run` on our main.nf with a generated config) or `slurm` (sbatch).
//!
//! Every executor runs the same tasks: one `TaskSpec` per task, written to
//! `runs/<id>/tasks/<n>/task.json` and run by `scfoundry __task`. A sharded embedding is a fit
//! task, one project task per row shard and a merge task (see `runner::Step`); integrate,
//! benchmark and geometry are one task each.
//!
//! A command uses this module in four steps: `preflight` (the executor's tools, before any
//! work), `create_run` (the run folder), then `nextflow::run_pipeline` or `run_plan` (local or
//! Slurm, which writes trace.txt and report.json); `run_single` does the last two for a
//! command of one task.

pub mod nextflow;
pub mod slurm;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::cli::{ExecutorArgs, ExecutorKind};
use crate::commands::ExitStatus;
use crate::error::{Error, Result};
use crate::progress::warn;
use crate::runner::{self, Outcome, Run, Step, TaskSpec};
use crate::settings::Settings;

/// Check the executor's tools before any work: `nextflow` and the pipeline (returned), or
/// Slurm's clients. Warns about `--` arguments that the local runner has no use for.
pub fn preflight(exec: &ExecutorArgs) -> Result<Option<nextflow::Pipeline>> {
    match exec.executor {
        ExecutorKind::Nextflow => Ok(Some(nextflow::Pipeline { nextflow: nextflow::find_nextflow()?, main_nf: nextflow::pipeline()? })),
        ExecutorKind::Slurm => slurm::check_tools().map(|_| None),
        ExecutorKind::Local => {
            if !exec.passthrough.is_empty() {
                warn(&format!("arguments after `--` are for --executor nextflow or slurm; ignored: {}", exec.passthrough.join(" ")));
            }
            Ok(None)
        }
    }
}

/// A new run folder under `--runs-dir`, else the workspace's runs/, else runs/ beside `out`;
/// its path is absolute, so that jobs on other nodes and their logs name the same folder.
pub fn create_run(s: &Settings, exec: &ExecutorArgs, out: &Path, label: &str) -> Result<Run> {
    let base = match (&exec.runs_dir, &s.workspace) {
        (Some(d), _) => d.clone(),
        (None, Some(ws)) => ws.runs_dir(),
        (None, None) => out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).join("runs"),
    };
    let base = std::path::absolute(&base).map_err(|e| Error::Io { path: base.clone(), source: e })?;
    Run::create(&base, label)
}

/// How a plan ended.
pub enum Finished {
    /// Every task completed; outcomes in completion order.
    Completed(Vec<Outcome>),
    /// A task failed or never ran: exit with this code (what went wrong is printed).
    Failed(i32),
}

/// Run a plan with the local runner (at most `max_forks` shards at once) or with Slurm, write
/// the run's trace.txt and report.json, and on a failure name the task and the run folder.
pub fn run_plan(run: &Run, tasks: &[TaskSpec], exec: &ExecutorArgs, max_forks: Option<u64>, quiet: bool) -> Result<Finished> {
    run_plan_cached(run, tasks, exec, max_forks, quiet, Vec::new())
}

/// [`run_plan`] for the tasks left of a resumed run; `cached` are the outcomes of those that
/// finished before (trace.txt lists them as CACHED, as Nextflow's `-resume` does).
pub fn run_plan_cached(run: &Run, tasks: &[TaskSpec], exec: &ExecutorArgs, max_forks: Option<u64>, quiet: bool, cached: Vec<Outcome>) -> Result<Finished> {
    let mut outcomes = cached;
    if !tasks.is_empty() {
        outcomes.extend(match exec.executor {
            ExecutorKind::Slurm => slurm::run(run, tasks, &exec.slurm, max_forks, &exec.passthrough, quiet)?,
            _ => run_local(run, tasks, max_forks.unwrap_or(1) as usize)?,
        });
    }
    let Some(first) = tasks.first() else {
        return Ok(Finished::Completed(outcomes));
    };
    let refs: Vec<&Outcome> = outcomes.iter().collect();
    runner::write_reports(run, first, &refs)?;
    let failed = outcomes.iter().find(|o| o.record.status == "FAILED").or_else(|| outcomes.iter().find(|o| o.exit != 0));
    if let Some(f) = failed {
        if tasks.len() > 1 {
            eprintln!("{} {} (exit {})", f.record.name, f.record.status.to_lowercase(), f.exit);
        }
        eprintln!("run folder: {} (task logs, trace.txt)", run.dir.display());
        return Ok(Finished::Failed(f.exit));
    }
    Ok(Finished::Completed(outcomes))
}

/// A command of one task (integrate, benchmark, geometry) on any executor. `spec` is the task;
/// with Nextflow, `nf_params` are the pipeline's parameters and `published` is where the
/// pipeline publishes the output (moved to `spec.out`). The task's stdout and summary lines
/// are printed here, so that they read the same whether the task ran here or on a node.
pub fn run_single(s: &Settings, exec: &ExecutorArgs, pipeline: Option<nextflow::Pipeline>, run: &Run, spec: TaskSpec, nf_params: Vec<(String, String)>, published: &Path) -> anyhow::Result<ExitStatus> {
    if let Some(p) = pipeline {
        let nf = nextflow::NfRun { run, weights_dir: &s.weights_dir, gpu: spec.gpus.clone(), max_forks: 1, params: nf_params, passthrough: &exec.passthrough, quiet: s.quiet };
        return Ok(ExitStatus::from_code(nextflow::run_pipeline(&p, &nf, published, &spec.out)?));
    }
    let outcomes = match run_plan(run, std::slice::from_ref(&spec), exec, None, s.quiet)? {
        Finished::Completed(o) => o,
        Finished::Failed(code) => return Ok(ExitStatus::Code(code)),
    };
    let r = outcomes.into_iter().next().and_then(|o| o.result).unwrap_or_default();
    if let Some(out) = &r.stdout {
        print!("{out}");
    }
    if !s.quiet {
        for line in &r.summary {
            eprintln!("{line}");
        }
        for n in &r.notes {
            eprintln!("note: {n}");
        }
        eprintln!("run folder: {} (trace.txt, report.json)", run.dir.display());
    }
    Ok(ExitStatus::Success)
}

/// The tasks of one embedding, in dependency order: `[embed]`, or `[fit?, project.., merge]`
/// with one project task for each of the shards' `start..end` (whole blocks of rows, or whole
/// groups of a method cut by groups: `tasks::shard`) and a fit step first when the method
/// computes something over the whole data (`fit`).
pub fn plan_embed(base: &TaskSpec, run: &Run, shards: Option<Vec<(usize, usize)>>, fit: bool) -> Vec<TaskSpec> {
    let Some(ranges) = shards else {
        return vec![TaskSpec { task_id: 1, ..base.clone() }];
    };
    let work: PathBuf = run.dir.join("work");
    let (process, tag) = split_name(&base.name);
    let mut tasks = Vec::new();
    if fit {
        tasks.push(TaskSpec { task_id: 1, name: format!("{process}_FIT ({tag})"), step: Step::Fit, work: Some(work.clone()), ..base.clone() });
    }
    let first = tasks.len() as u64 + 1;
    for (i, &(start, end)) in ranges.iter().enumerate() {
        tasks.push(TaskSpec {
            task_id: first + i as u64,
            name: format!("{process}_PROJECT ({tag}, shard {i})"),
            step: Step::Project { shard: i, start, end },
            work: Some(work.clone()),
            ..base.clone()
        });
    }
    tasks.push(TaskSpec {
        task_id: first + ranges.len() as u64,
        name: format!("{process}_MERGE ({tag})"),
        step: Step::Merge { shards: ranges },
        work: Some(work),
        // the merge only copies rows: it takes no card
        gpus: None,
        ..base.clone()
    });
    tasks
}

/// One plan of several files' plans ([`plan_embed`] each, sharded): each file's shards in a
/// work folder of its own (`work/<k>`), every shard before every merge, tasks numbered anew in
/// that order (a Slurm job array takes the shards as one range of task ids). One plan is
/// returned as it is.
pub fn join_plans(run: &Run, mut plans: Vec<Vec<TaskSpec>>) -> Vec<TaskSpec> {
    if plans.len() == 1 {
        return plans.pop().unwrap_or_default();
    }
    let mut ordered: Vec<TaskSpec> = Vec::new();
    for rank in 0..3 {
        for (k, plan) in plans.iter().enumerate() {
            for t in plan {
                let r = match t.step {
                    Step::Fit => 0,
                    Step::Project { .. } => 1,
                    _ => 2,
                };
                if r == rank {
                    let work = t.work.as_ref().map(|_| run.dir.join("work").join(k.to_string()));
                    ordered.push(TaskSpec { work, ..t.clone() });
                }
            }
        }
    }
    for (i, t) in ordered.iter_mut().enumerate() {
        t.task_id = i as u64 + 1;
    }
    ordered
}

/// What `plan.json` in a run folder holds: every task of the run and its executor;
/// `embed --resume` reads it back.
#[derive(serde::Serialize, serde::Deserialize)]
struct Plan {
    tasks: Vec<TaskSpec>,
    executor: ExecutorArgs,
}

/// Save a run's plan in its folder (`plan.json`) before any task runs.
pub fn save_plan(run: &Run, tasks: &[TaskSpec], exec: &ExecutorArgs) -> Result<()> {
    let path = run.dir.join("plan.json");
    let plan = Plan { tasks: tasks.to_vec(), executor: exec.clone() };
    std::fs::write(&path, serde_json::to_string_pretty(&plan).unwrap_or_default()).map_err(|e| Error::Io { path, source: e })
}

/// A run folder's plan: the run, its tasks and its executor.
pub fn load_plan(dir: &Path) -> Result<(Run, Vec<TaskSpec>, ExecutorArgs)> {
    let path = dir.join("plan.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::BadOption {
        option: "--resume".into(),
        detail: format!("{} cannot be read ({e})", path.display()),
        hint: Some("give the run folder a sharded `scfoundry embed` printed (it holds plan.json)".into()),
    })?;
    let plan: Plan = serde_json::from_str(&text).map_err(|e| Error::BadField { path: path.clone(), field: "plan".into(), detail: e.to_string(), hint: Some("the run was planned by another version of scfoundry: start it again".into()) })?;
    let dir = std::path::absolute(dir).map_err(|e| Error::Io { path: dir.into(), source: e })?;
    let id = plan.tasks.first().map(|t| t.run_id.clone()).unwrap_or_default();
    Ok((Run { id, dir }, plan.tasks, plan.executor))
}

/// `EMBED_PCA (pbmc)` -> (`EMBED_PCA`, `pbmc`).
fn split_name(name: &str) -> (String, String) {
    match name.split_once(" (") {
        Some((p, t)) => (p.to_string(), t.trim_end_matches(')').to_string()),
        None => (name.to_string(), String::new()),
    }
}

/// Run a plan with the local runner: the fit, then the shards (at most `max_forks` at once),
/// then the merge. Stops after the first failed step; outcomes in completion order.
pub fn run_local(run: &Run, tasks: &[TaskSpec], max_forks: usize) -> Result<Vec<Outcome>> {
    let mut outcomes = Vec::new();
    let projects: Vec<&TaskSpec> = tasks.iter().filter(|t| matches!(t.step, Step::Project { .. })).collect();
    for t in tasks.iter().filter(|t| !matches!(t.step, Step::Project { .. } | Step::Merge { .. })) {
        let o = runner::run_task(run, t)?;
        let failed = o.exit != 0;
        outcomes.push(o);
        if failed {
            return Ok(outcomes);
        }
    }
    if !projects.is_empty() {
        // one bar for all shards, fed by the cells each shard's task counts
        let total: u64 = projects.iter().map(|t| match t.step { Step::Project { start, end, .. } => (end - start) as u64, _ => 0 }).sum();
        let files = projects.iter().map(|t| runner::progress_file(run, t.task_id)).collect();
        let _bar = crate::progress::ShardBar::start(&format!("{}: {} shards", projects[0].method, projects.len()), total, files, projects[0].progress && !projects[0].quiet);
        let next = AtomicUsize::new(0);
        let done: Mutex<Vec<Result<Outcome>>> = Mutex::new(Vec::new());
        let failed = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|sc| {
            for _ in 0..max_forks.max(1).min(projects.len()) {
                sc.spawn(|| loop {
                    if failed.load(Ordering::SeqCst) {
                        return;
                    }
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(t) = projects.get(i) else { return };
                    let o = runner::run_task(run, t);
                    if o.as_ref().map(|o| o.exit != 0).unwrap_or(true) {
                        failed.store(true, Ordering::SeqCst);
                    }
                    done.lock().unwrap().push(o);
                });
            }
        });
        for o in done.into_inner().unwrap() {
            outcomes.push(o?);
        }
        if outcomes.iter().any(|o| o.exit != 0) {
            return Ok(outcomes);
        }
    }
    for t in tasks.iter().filter(|t| matches!(t.step, Step::Merge { .. })) {
        outcomes.push(runner::run_task(run, t)?);
    }
    Ok(outcomes)
}

/// Run stages of independent tasks with the local runner: the stages one after the other, the
/// tasks of a stage at once (at most `max_forks`). Stops after a stage in which a task failed;
/// outcomes in task order.
pub fn run_stages(run: &Run, stages: &[Vec<TaskSpec>], max_forks: usize) -> Result<Vec<Outcome>> {
    let mut outcomes = Vec::new();
    for stage in stages {
        let next = AtomicUsize::new(0);
        let done: Mutex<Vec<(usize, Result<Outcome>)>> = Mutex::new(Vec::new());
        std::thread::scope(|sc| {
            for _ in 0..max_forks.max(1).min(stage.len()) {
                sc.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(t) = stage.get(i) else { return };
                    let o = runner::run_task(run, t);
                    done.lock().unwrap().push((i, o));
                });
            }
        });
        let mut done = done.into_inner().unwrap();
        done.sort_by_key(|d| d.0);
        for (_, o) in done {
            outcomes.push(o?);
        }
        if outcomes.iter().any(|o| o.exit != 0) {
            break;
        }
    }
    Ok(outcomes)
}
