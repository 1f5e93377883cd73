//! Where a command's tasks run: `local` (task processes on this machine, the built-in runner),
//! `nextflow` (`nextflow run` on our main.nf with a generated config) or `slurm` (sbatch).
//!
//! Every executor runs the same tasks: one `TaskSpec` per task, written to
//! `runs/<id>/tasks/<n>/task.json` and run by `scfoundry __task`. A sharded embedding is a fit
//! task, one project task per row shard and a merge task (see `runner::Step`).

pub mod nextflow;
pub mod slurm;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::error::Result;
use crate::runner::{self, shard_ranges, Outcome, Run, Step, TaskSpec};

/// The tasks of one embedding, in dependency order: `[embed]`, or `[fit, project.., merge]`.
pub fn plan_embed(base: &TaskSpec, run: &Run, n_obs: usize, shards: Option<u64>) -> Vec<TaskSpec> {
    let Some(k) = shards else {
        return vec![TaskSpec { task_id: 1, ..base.clone() }];
    };
    let ranges = shard_ranges(n_obs, k as usize);
    let work: PathBuf = run.dir.join("work");
    let (process, tag) = split_name(&base.name);
    let mut tasks = vec![TaskSpec { task_id: 1, name: format!("{process}_FIT ({tag})"), step: Step::Fit, work: Some(work.clone()), ..base.clone() }];
    for (i, &(start, end)) in ranges.iter().enumerate() {
        tasks.push(TaskSpec {
            task_id: 2 + i as u64,
            name: format!("{process}_PROJECT ({tag}, shard {i})"),
            step: Step::Project { shard: i, start, end },
            work: Some(work.clone()),
            ..base.clone()
        });
    }
    tasks.push(TaskSpec {
        task_id: 2 + ranges.len() as u64,
        name: format!("{process}_MERGE ({tag})"),
        step: Step::Merge { shards: ranges },
        work: Some(work),
        ..base.clone()
    });
    tasks
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
