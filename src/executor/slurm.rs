//! `--executor slurm`: submit the run's tasks with `sbatch` and follow them to the end.
//!
//! An unsharded run (an embedding without --shards, integrate, benchmark, geometry) is one job. A sharded run is a fit job, a job array with one element per
//! row shard (`--dependency=afterok:<fit>`) and a merge job (`--dependency=afterok:<array>`),
//! all submitted with `--kill-on-invalid-dep=yes` so that a failed step cancels what depends
//! on it instead of leaving it pending forever. Jobs are followed with `squeue` while they
//! live and `scontrol show job` once they are gone (no `sacct`: many clusters keep no job
//! accounting). Ctrl-C cancels the jobs with `scancel`.
//!
//! Every job runs `scfoundry __task <run>/tasks/<n>/task.json`, so the run folder and this
//! binary must be on a file system the compute nodes share.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::cli::SlurmArgs;
use crate::error::{Error, Result};
use crate::runner::trace::TraceRecord;
use crate::runner::{self, Outcome, Run, Step, TaskSpec};

/// One submitted job (an array counts as one job here).
#[derive(Debug, Clone)]
pub struct Job {
    pub id: String,
    /// `fit`, `project`, `merge`, or the command of an unsharded task (`embed`, `benchmark`..).
    pub label: String,
    /// The log path with Slurm's `%a` for arrays.
    pub log: PathBuf,
    /// Task ids this job runs (an array: one per element, in element order).
    pub tasks: Vec<u64>,
}

/// The final state of one task as Slurm reports it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobState {
    /// `123` or `123_4` for an array element.
    pub native_id: String,
    pub state: String,
    pub exit: Option<i32>,
    pub reason: String,
    pub log: Option<PathBuf>,
    /// Submit, start and end as Slurm reports them (local time, whole seconds), in epoch ms.
    pub submit_ms: Option<i64>,
    pub start_ms: Option<i64>,
    pub end_ms: Option<i64>,
}

/// `2026-11-30T09:25:49` (local time) -> epoch milliseconds; `Unknown`/`None` -> None.
pub fn parse_slurm_time(s: &str) -> Option<i64> {
    use chrono::TimeZone;
    let t = chrono::NaiveDateTime::parse_from_str(s, "%Y-%m-%dT%H:%M:%S").ok()?;
    chrono::Local.from_local_datetime(&t).single().map(|t| t.timestamp_millis())
}

/// The `#SBATCH` lines for one job from the user's options.
/// `array`: (elements, at most this many running at once).
pub fn directives(job_name: &str, log: &Path, opts: &SlurmArgs, array: Option<(usize, Option<u64>)>, wants_gpu: bool) -> Vec<String> {
    let mut d = vec![format!("--job-name={job_name}"), format!("--output={}", log.display())];
    match array {
        Some((n, Some(k))) if (k as usize) < n => d.push(format!("--array=0-{}%{k}", n - 1)),
        Some((n, _)) => d.push(format!("--array=0-{}", n - 1)),
        None => {}
    }
    if let Some(p) = &opts.partition {
        d.push(format!("--partition={p}"));
    }
    if let Some(a) = &opts.account {
        d.push(format!("--account={a}"));
    }
    if let Some(t) = &opts.time {
        d.push(format!("--time={t}"));
    }
    if let Some(m) = &opts.mem {
        d.push(format!("--mem={m}"));
    }
    if let Some(c) = opts.cpus {
        d.push(format!("--cpus-per-task={c}"));
    }
    if wants_gpu {
        if let Some(g) = &opts.gpus {
            d.push(format!("--gpus={g}"));
        }
        if let Some(g) = &opts.gres {
            d.push(format!("--gres={g}"));
        }
    }
    d
}

fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// A batch script: the directives, then `scfoundry __task` on the task's spec. For an array,
/// element `i` runs task `first_task + i`.
pub fn script(directives: &[String], exe: &Path, run_dir: &Path, task: TaskRef) -> String {
    let mut s = String::from("#!/bin/bash\n");
    for d in directives {
        s.push_str(&format!("#SBATCH {d}\n"));
    }
    s.push_str("set -euo pipefail\n");
    s.push_str("echo \"scfoundry: job ${SLURM_JOB_ID} on $(hostname), CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-}\"\n");
    let tasks = sh_quote(&run_dir.join("tasks").display().to_string());
    match task {
        TaskRef::One(id) => s.push_str(&format!("exec {} __task {tasks}/{id}/task.json\n", sh_quote(&exe.display().to_string()))),
        TaskRef::Array { first } => s.push_str(&format!(
            "exec {} __task {tasks}/$((SLURM_ARRAY_TASK_ID + {first}))/task.json\n",
            sh_quote(&exe.display().to_string())
        )),
    }
    s
}

#[derive(Debug, Clone, Copy)]
pub enum TaskRef {
    One(u64),
    Array { first: u64 },
}

fn tool_missing(tool: &str) -> Error {
    Error::ToolMissing {
        tool: tool.into(),
        hint: format!(
            "`{tool}` is Slurm's client: run on a cluster login node, load its module (e.g. `module load slurm`), or set SLURM_CONF; or use `--executor local`"
        ),
    }
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

/// `sbatch --parsable [dependency] [passthrough] script` -> the job id.
fn sbatch(script_path: &Path, after: Option<&str>, passthrough: &[String]) -> Result<String> {
    let mut cmd = Command::new("sbatch");
    cmd.arg("--parsable");
    if let Some(dep) = after {
        cmd.arg(format!("--dependency=afterok:{dep}")).arg("--kill-on-invalid-dep=yes");
    }
    cmd.args(passthrough).arg(script_path);
    let out = cmd.output().map_err(|_| tool_missing("sbatch"))?;
    if !out.status.success() {
        return Err(Error::Executor {
            what: format!("sbatch {}", script_path.display()),
            detail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            hint: Some("check --partition, --account, --time, --mem and --gpus against `sinfo` and your site's limits".into()),
        });
    }
    let text = String::from_utf8_lossy(&out.stdout);
    // `--parsable` prints `id` or `id;cluster`
    let id = text.trim().split(';').next().unwrap_or("").to_string();
    if id.is_empty() || !id.chars().all(|c| c.is_ascii_digit()) {
        return Err(Error::Executor { what: "sbatch".into(), detail: format!("unexpected output {text:?}"), hint: None });
    }
    Ok(id)
}

/// Parse `scontrol -o show job` output: one record a line, `Key=Value` tokens.
pub fn parse_scontrol(text: &str) -> Vec<BTreeMap<String, String>> {
    text.lines()
        .filter(|l| l.contains("JobId="))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|tok| tok.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .collect()
}

/// The final states of a job's tasks, keyed by task id.
pub fn job_states(job: &Job, records: &[BTreeMap<String, String>]) -> BTreeMap<u64, JobState> {
    let mut out = BTreeMap::new();
    for r in records {
        let state = r.get("JobState").cloned().unwrap_or_else(|| "UNKNOWN".into());
        let exit = r.get("ExitCode").and_then(|e| e.split(':').next()).and_then(|e| e.parse().ok());
        let reason = r.get("Reason").cloned().unwrap_or_default();
        let log = r.get("StdOut").map(PathBuf::from);
        let time = |k: &str| r.get(k).and_then(|v| parse_slurm_time(v));
        let (submit_ms, start_ms, end_ms) = (time("SubmitTime"), time("StartTime"), time("EndTime"));
        match r.get("ArrayTaskId") {
            Some(a) if job.tasks.len() > 1 || job.label == "project" => {
                // an element `4`, or a range of elements that never ran (`0-2`, `1,3`)
                let mut elems = Vec::new();
                for part in a.split(',') {
                    let part = part.split('%').next().unwrap_or(part);
                    match part.split_once('-') {
                        Some((x, y)) => {
                            if let (Ok(x), Ok(y)) = (x.parse::<usize>(), y.parse::<usize>()) {
                                elems.extend(x..=y)
                            }
                        }
                        None => elems.extend(part.parse::<usize>().ok()),
                    }
                }
                for i in elems {
                    if let Some(&t) = job.tasks.get(i) {
                        let native_id = format!("{}_{i}", job.id);
                        let log = log.clone().filter(|_| a.parse::<usize>().is_ok());
                        out.insert(t, JobState { native_id, state: state.clone(), exit, reason: reason.clone(), log, submit_ms, start_ms, end_ms });
                    }
                }
            }
            _ => {
                if let Some(&t) = job.tasks.first() {
                    out.insert(t, JobState { native_id: job.id.clone(), state, exit, reason, log, submit_ms, start_ms, end_ms });
                }
            }
        }
    }
    out
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Catch Ctrl-C (and SIGTERM) while following jobs; restored on drop.
struct CatchInterrupt {
    old_int: libc::sighandler_t,
    old_term: libc::sighandler_t,
}

impl CatchInterrupt {
    fn install() -> CatchInterrupt {
        INTERRUPTED.store(false, Ordering::SeqCst);
        let h = on_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t;
        unsafe { CatchInterrupt { old_int: libc::signal(libc::SIGINT, h), old_term: libc::signal(libc::SIGTERM, h) } }
    }
}

impl Drop for CatchInterrupt {
    fn drop(&mut self) {
        unsafe {
            libc::signal(libc::SIGINT, self.old_int);
            libc::signal(libc::SIGTERM, self.old_term);
        }
    }
}

/// Job ids still known to `squeue` (pending, running, completing), with their states.
fn squeue(ids: &[String]) -> Option<Vec<(String, String)>> {
    let out = Command::new("squeue").args(["-h", "-o", "%i|%T", "-j", &ids.join(",")]).output().ok()?;
    if !out.status.success() {
        // ids that Slurm has purged make squeue fail: none of ours is alive then
        return Some(Vec::new());
    }
    Some(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once('|'))
            .map(|(i, s)| (i.trim().to_string(), s.trim().to_string()))
            .collect(),
    )
}

/// Whether a job in this state will not change any more.
pub fn is_terminal(state: &str) -> bool {
    !matches!(state, "PENDING" | "RUNNING" | "CONFIGURING" | "COMPLETING" | "SUSPENDED" | "REQUEUED" | "RESIZING" | "SIGNALING" | "STAGE_OUT" | "STOPPED" | "REQUEUE_HOLD" | "REQUEUE_FED" | "RESV_DEL_HOLD")
}

fn scontrol(id: &str) -> Vec<BTreeMap<String, String>> {
    match Command::new("scontrol").args(["-o", "show", "job", id]).output() {
        Ok(o) if o.status.success() => parse_scontrol(&String::from_utf8_lossy(&o.stdout)),
        _ => Vec::new(),
    }
}

fn scancel(ids: &[String]) {
    let _ = Command::new("scancel").args(ids).status();
}

/// Submit the plan's tasks and wait for them. Outcomes in task order; a task that never ran
/// (cancelled because what it depends on failed) is `ABORTED`.
/// Slurm's clients on PATH, or a clear error.
pub fn check_tools() -> Result<()> {
    for tool in ["sbatch", "squeue", "scontrol", "scancel"] {
        if !on_path(tool) {
            return Err(tool_missing(tool));
        }
    }
    Ok(())
}

/// `max_forks` throttles the shard array (`--array=0-N%K`).
pub fn run(run: &Run, tasks: &[TaskSpec], opts: &SlurmArgs, max_forks: Option<u64>, passthrough: &[String], quiet: bool) -> Result<Vec<Outcome>> {
    check_tools()?;
    let exe = std::env::current_exe().map_err(|e| Error::Io { path: "current executable".into(), source: e })?;
    for t in tasks {
        runner::write_spec(run, t)?;
    }
    let logs = run.dir.join("logs");
    let sdir = run.dir.join("slurm");
    for d in [&logs, &sdir] {
        std::fs::create_dir_all(d).map_err(|e| Error::Io { path: d.clone(), source: e })?;
    }
    // Ctrl-C from here on cancels whatever was submitted
    let guard = CatchInterrupt::install();
    let short = run.id.rsplit('-').next().unwrap_or(&run.id).to_string();
    let mut jobs: Vec<Job> = Vec::new();
    let submit_ms = chrono::Utc::now().timestamp_millis();
    let submit = |label: &str, log: PathBuf, array: Option<(usize, Option<u64>)>, task: TaskRef, ids: Vec<u64>, after: Option<&str>, gpu: bool| -> Result<Job> {
        let method = &tasks[0].method;
        let name = if method == label { format!("scf-{label}-{short}") } else { format!("scf-{method}-{label}-{short}") };
        let text = script(&directives(&name, &log, opts, array, gpu), &exe, &run.dir, task);
        let path = sdir.join(format!("{label}.sh"));
        std::fs::write(&path, text).map_err(|e| Error::Io { path: path.clone(), source: e })?;
        let id = sbatch(&path, after, passthrough)?;
        Ok(Job { id, label: label.into(), log, tasks: ids })
    };
    let result = (|| -> Result<()> {
        let projects: Vec<&TaskSpec> = tasks.iter().filter(|t| matches!(t.step, Step::Project { .. })).collect();
        if projects.is_empty() {
            // Fits run first, one after the other; every other task waits for all of them and
            // runs alongside the rest (transfer's reference and query embeddings).
            let labels = job_labels(tasks);
            let mut fits: Vec<String> = Vec::new();
            for (t, label) in tasks.iter().zip(&labels).filter(|(t, _)| t.step == Step::Fit) {
                let after = fits.last().cloned();
                let j = submit(label, logs.join(format!("{label}.out")), None, TaskRef::One(t.task_id), vec![t.task_id], after.as_deref(), true)?;
                fits.push(j.id.clone());
                jobs.push(j);
            }
            let after = (!fits.is_empty()).then(|| fits.join(":"));
            for (t, label) in tasks.iter().zip(&labels).filter(|(t, _)| t.step != Step::Fit) {
                jobs.push(submit(label, logs.join(format!("{label}.out")), None, TaskRef::One(t.task_id), vec![t.task_id], after.as_deref(), true)?);
            }
            return Ok(());
        }
        // a fit over the whole data first when the method has one, then the shards as a job
        // array, then the merge once every element has finished
        let merges: Vec<&TaskSpec> = tasks.iter().filter(|t| matches!(t.step, Step::Merge { .. })).collect();
        let mut fit_id = None;
        if let Some(fit) = tasks.iter().find(|t| t.step == Step::Fit) {
            let j = submit("fit", logs.join("fit.out"), None, TaskRef::One(fit.task_id), vec![fit.task_id], None, true)?;
            fit_id = Some(j.id.clone());
            jobs.push(j);
        }
        let first = projects[0].task_id;
        let ids = projects.iter().map(|t| t.task_id).collect();
        let j = submit("project", logs.join("project-%a.out"), Some((projects.len(), max_forks)), TaskRef::Array { first }, ids, fit_id.as_deref(), true)?;
        let array_id = j.id.clone();
        jobs.push(j);
        // one merge a file (several --data files: one each)
        for merge in &merges {
            let label = if merges.len() == 1 { "merge".to_string() } else { format!("merge-{}", merge.task_id) };
            jobs.push(submit(&label, logs.join(format!("{label}.out")), None, TaskRef::One(merge.task_id), vec![merge.task_id], Some(&array_id), false)?);
        }
        Ok(())
    })();
    let ids: Vec<String> = jobs.iter().map(|j| j.id.clone()).collect();
    if let Err(e) = result {
        scancel(&ids);
        return Err(e);
    }
    let rep = crate::progress::reporter(quiet);
    rep.note(&format!(
        "slurm: submitted {} (scfoundry follows them; Ctrl-C cancels them)",
        jobs.iter().map(|j| format!("{} job {}", j.label, j.id)).collect::<Vec<_>>().join(", ")
    ));

    // Follow the jobs until none is left in the queue.
    let started = Instant::now();
    let mut last: Vec<(String, String)> = Vec::new();
    let mut interrupted = false;
    loop {
        if INTERRUPTED.load(Ordering::SeqCst) {
            scancel(&ids);
            interrupted = true;
            crate::progress::warn(&format!("interrupted: cancelled Slurm jobs {}", ids.join(" ")));
            break;
        }
        let live = squeue(&ids).unwrap_or_default();
        if live.is_empty() {
            // gone from the queue: done, unless scontrol still knows one as live (squeue can
            // fail while the controller restarts)
            let unfinished = jobs.iter().flat_map(|j| scontrol(&j.id)).any(|r| r.get("JobState").is_some_and(|s| !is_terminal(s)));
            if !unfinished {
                break;
            }
        }
        if live != last {
            let summary: Vec<String> = live.iter().map(|(i, s)| format!("{i} {s}")).collect();
            rep.note(&format!("slurm: {} ({})", summary.join(", "), runner::trace::fmt_duration(started.elapsed().as_millis() as u64)));
            last = live;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    drop(guard);

    // Final states from scontrol; a purged job is UNKNOWN.
    let mut states: BTreeMap<u64, JobState> = BTreeMap::new();
    for j in &jobs {
        let mut recs = scontrol(&j.id);
        // an array's records: each element's; scontrol may also list the array job itself
        recs.retain(|r| r.get("JobState").is_some());
        states.extend(job_states(j, &recs));
    }
    let mut outcomes = Vec::new();
    for t in tasks {
        let job = jobs.iter().find(|j| j.tasks.contains(&t.task_id));
        let st = states.get(&t.task_id).cloned().unwrap_or_else(|| JobState {
            native_id: job.map(|j| j.id.clone()).unwrap_or_default(),
            state: if interrupted { "CANCELLED".into() } else { "UNKNOWN".into() },
            ..Default::default()
        });
        let (stats, result) = runner::task_files(run, t);
        let ran = st.state == "COMPLETED" || st.state == "FAILED" || st.state == "TIMEOUT" || st.state == "OUT_OF_MEMORY";
        let status = match st.state.as_str() {
            "COMPLETED" => "COMPLETED",
            "CANCELLED" | "DEADLINE" | "UNKNOWN" => "ABORTED",
            _ => "FAILED",
        };
        let exit = match (status, st.exit) {
            ("COMPLETED", Some(e)) => e,
            ("COMPLETED", None) => 0,
            (_, Some(e)) if e != 0 => e,
            _ if interrupted => 130,
            _ => 1,
        };
        let record = TraceRecord {
            task_id: t.task_id,
            hash: t.hash(),
            native_id: Some(st.native_id.clone()),
            name: t.name.clone(),
            status: status.into(),
            exit: if ran { Some(exit) } else { None },
            submit_ms: st.submit_ms.unwrap_or(submit_ms),
            duration_ms: match (st.submit_ms, st.end_ms) {
                (Some(a), Some(b)) if ran && b >= a => Some((b - a) as u64),
                _ => None,
            },
            realtime_ms: stats.as_ref().map(|s| s.realtime_ms).or(match (st.start_ms, st.end_ms) {
                (Some(a), Some(b)) if ran && b >= a => Some((b - a) as u64),
                _ => None,
            }),
            cpu_percent: stats.as_ref().map(|s| s.cpu_percent()),
            peak_rss: stats.as_ref().map(|s| s.peak_rss),
            peak_vmem: stats.as_ref().map(|s| s.peak_vmem),
            rchar: stats.as_ref().map(|s| s.rchar),
            wchar: stats.as_ref().map(|s| s.wchar),
            ..Default::default()
        };
        let log = st.log.clone().or_else(|| job.map(|j| log_path(j, &st.native_id)));
        let line = format!(
            "slurm: {} job {} {}{}{}",
            t.name,
            st.native_id,
            st.state,
            if ran { format!(" exit {exit}") } else { String::new() },
            log.as_ref().filter(|_| ran).map(|l| format!(", log {}", l.display())).unwrap_or_default()
        );
        if status == "COMPLETED" {
            rep.note(&line);
        } else if !ran {
            eprintln!("{line}{}", if st.reason.is_empty() || st.reason == "None" { String::new() } else { format!(" ({})", st.reason) });
        } else {
            eprintln!("{line}");
            // the end of the failed task's log says why
            if let Some(text) = log.as_ref().and_then(|l| std::fs::read_to_string(l).ok()) {
                let lines: Vec<&str> = text.lines().collect();
                for l in &lines[lines.len().saturating_sub(6)..] {
                    eprintln!("    | {l}");
                }
            }
        }
        outcomes.push(Outcome { exit: if status == "COMPLETED" { 0 } else { exit }, record, stats, result });
    }
    Ok(outcomes)
}

/// Job labels of an unsharded plan (they name the batch script, the log and the job): `fit`
/// for a fit, else the command, numbered by task when several tasks share it
/// (`transfer-2`, `transfer-3`).
pub fn job_labels(tasks: &[TaskSpec]) -> Vec<String> {
    let base = |t: &TaskSpec| if t.step == Step::Fit { "fit".to_string() } else { t.command.clone() };
    tasks
        .iter()
        .map(|t| {
            let b = base(t);
            if tasks.iter().filter(|u| base(u) == b).count() > 1 {
                format!("{b}-{}", t.task_id)
            } else {
                b
            }
        })
        .collect()
}

/// The log of one task: the job's `--output` with `%a` replaced by the element.
pub fn log_path(job: &Job, native_id: &str) -> PathBuf {
    let elem = native_id.split_once('_').map(|(_, e)| e).unwrap_or("");
    PathBuf::from(job.log.display().to_string().replace("%a", elem))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn array_elements_and_never_run_ranges() {
        let job = Job { id: "40".into(), label: "project".into(), log: "/r/logs/project-%a.out".into(), tasks: vec![2, 3, 4] };
        let text = "JobId=41 ArrayJobId=40 ArrayTaskId=1 JobName=x JobState=FAILED Reason=NonZeroExitCode ExitCode=1:0 StdOut=/r/logs/project-1.out\n\
                    JobId=40 ArrayJobId=40 ArrayTaskId=0 JobName=x JobState=COMPLETED Reason=None ExitCode=0:0 StdOut=/r/logs/project-0.out\n\
                    JobId=42 ArrayJobId=40 ArrayTaskId=2 JobName=x JobState=CANCELLED Reason=DependencyNeverSatisfied ExitCode=0:0\n";
        let st = job_states(&job, &parse_scontrol(text));
        assert_eq!(st[&2].state, "COMPLETED");
        assert_eq!(st[&3].exit, Some(1));
        assert_eq!(st[&3].native_id, "40_1");
        assert_eq!(st[&3].log.as_deref(), Some(Path::new("/r/logs/project-1.out")));
        assert_eq!(st[&4].state, "CANCELLED");
        let pending = "JobId=40 ArrayJobId=40 ArrayTaskId=0-2 JobState=CANCELLED Reason=DependencyNeverSatisfied ExitCode=0:0";
        let st = job_states(&job, &parse_scontrol(pending));
        assert_eq!(st.len(), 3);
        assert!(st.values().all(|s| s.state == "CANCELLED" && s.log.is_none()));
        assert_eq!(log_path(&job, "40_2"), PathBuf::from("/r/logs/project-2.out"));
        let one = Job { id: "7".into(), label: "merge".into(), log: "/r/logs/merge.out".into(), tasks: vec![5] };
        let t = "JobId=7 JobName=m JobState=COMPLETED Reason=None ExitCode=0:0 SubmitTime=2026-11-30T09:25:49 StartTime=2026-11-30T09:25:50 EndTime=2026-11-30T09:25:53";
        let st = job_states(&one, &parse_scontrol(t));
        assert_eq!(st[&5].end_ms.unwrap() - st[&5].submit_ms.unwrap(), 4000);
        assert_eq!(parse_slurm_time("Unknown"), None);
    }

    #[test]
    fn directives_follow_the_options() {
        let opts = SlurmArgs { partition: Some("gpu".into()), account: Some("lab".into()), time: Some("1:00:00".into()), mem: Some("16G".into()), gpus: Some("1".into()), gres: None, cpus: Some(4) };
        let d = directives("scf-pca-project-ab12", Path::new("/r/logs/project-%a.out"), &opts, Some((3, None)), true);
        let throttled = directives("x", Path::new("/r/x"), &opts, Some((8, Some(2))), true);
        assert!(throttled.contains(&"--array=0-7%2".to_string()));
        assert_eq!(
            d,
            [
                "--job-name=scf-pca-project-ab12",
                "--output=/r/logs/project-%a.out",
                "--array=0-2",
                "--partition=gpu",
                "--account=lab",
                "--time=1:00:00",
                "--mem=16G",
                "--cpus-per-task=4",
                "--gpus=1"
            ]
        );
        let merge = directives("m", Path::new("/r/logs/merge.out"), &opts, None, false);
        assert!(!merge.iter().any(|l| l.starts_with("--gpus")), "the merge job asks for no GPU");
        let s = script(&d, Path::new("/opt/bin/scfoundry"), Path::new("/r"), TaskRef::Array { first: 2 });
        assert!(s.contains("#SBATCH --array=0-2\n"));
        assert!(s.ends_with("exec '/opt/bin/scfoundry' __task '/r/tasks'/$((SLURM_ARRAY_TASK_ID + 2))/task.json\n"), "{s}");
    }
}
