//! The embedded local runner: each unit of work runs as one `scfoundry` task process in a
//! run folder `runs/<id>/`, which holds the task's spec and logs, a Nextflow-format
//! `trace.txt` and a cost report (`report.json`).

pub mod stats;
pub mod trace;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use stats::TaskStats;
use trace::TraceRecord;

/// What a task process is asked to do. Written to `tasks/<n>/task.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskSpec {
    pub task_id: u64,
    /// Nextflow-style process name and tag, e.g. `EMBED (pbmc)`.
    pub name: String,
    pub command: String,
    pub method: String,
    pub data: PathBuf,
    pub out: PathBuf,
    pub layer: Option<String>,
    pub seed: u64,
    /// Method parameters after defaults, as recorded in provenance.
    pub params: serde_json::Map<String, serde_json::Value>,
    pub quiet: bool,
    /// Draw progress bars.
    #[serde(default)]
    pub progress: bool,
    /// The command line the user typed, for provenance.
    pub command_line: String,
    /// The weights folder in effect (methods with weights read it).
    #[serde(default)]
    pub weights_dir: Option<PathBuf>,
    pub run_id: String,
    /// Which part of the work: all of it, or one step of a sharded run.
    #[serde(default)]
    pub step: Step,
    /// Folder shared by the steps of a sharded run (the fit and the shard files).
    #[serde(default)]
    pub work: Option<PathBuf>,
    /// The GPUs the task may take (`--gpu`): the task process locks one free card of them
    /// before its first CUDA call and sees only that card (`gpu::cards`).
    #[serde(default)]
    pub gpus: Option<crate::gpu::cards::GpuList>,
    /// The device and allocator (cpu unless --device cuda).
    #[serde(default)]
    pub device: crate::gpu::DeviceSpec,
    /// Write only the obs index, the embedding and its provenance, not a copy of the input.
    #[serde(default)]
    pub embedding_only: bool,
}

/// A task's part of the work. A sharded embedding is `Fit`, then one `Project` per row
/// range (these can run at once, on other nodes), then `Merge`; `Embed` does all three in
/// one process. Both give the same bytes in the output.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Step {
    #[default]
    Embed,
    /// Fit the model on the whole data and save it to `work/`.
    Fit,
    /// Embed rows `start..end` with the saved fit into `work/`.
    Project { shard: usize, start: usize, end: usize },
    /// Write the output from the saved fit and the shard files.
    Merge { shards: Vec<(usize, usize)> },
}

/// A command's options as a task spec's `params` (read back with `TaskSpec::options`).
pub fn options_params<T: Serialize>(opts: &T) -> serde_json::Map<String, serde_json::Value> {
    match serde_json::to_value(opts) {
        Ok(serde_json::Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    }
}

/// Row ranges of `n` rows in at most `parts` shards of whole blocks of `block` rows (the grid
/// a method reads X in, `tasks::shard`), as equal as the blocks allow; no empty shard.
pub fn shard_ranges(n: usize, parts: usize, block: usize) -> Vec<(usize, usize)> {
    let block = block.max(1);
    let n_blocks = n.div_ceil(block).max(1);
    let parts = parts.max(1).min(n_blocks);
    (0..parts).map(|p| ((p * n_blocks / parts * block).min(n), ((p + 1) * n_blocks / parts * block).min(n))).collect()
}

impl TaskSpec {
    /// The one task of a run (`tasks/1`) for `data`, writing `out`: the whole work, no layer,
    /// no weights, no GPU. The command line is this process's.
    #[allow(clippy::too_many_arguments)]
    pub fn new(run: &Run, name: String, command: &str, method: &str, data: &Path, out: &Path, seed: u64, params: serde_json::Map<String, serde_json::Value>, quiet: bool, progress: bool) -> Result<TaskSpec> {
        let abs = |p: &Path| std::path::absolute(p).map_err(|e| Error::Io { path: p.into(), source: e });
        Ok(TaskSpec {
            task_id: 1,
            name,
            command: command.into(),
            method: method.into(),
            data: abs(data)?,
            out: abs(out)?,
            layer: None,
            seed,
            params,
            quiet,
            progress,
            command_line: std::env::args().collect::<Vec<_>>().join(" "),
            weights_dir: None,
            run_id: run.id.clone(),
            step: Step::Embed,
            work: None,
            gpus: None,
            device: Default::default(),
            embedding_only: false,
        })
    }

    /// A command's options, stored as the spec's `params` by `options_params`.
    pub fn options<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_value(serde_json::Value::Object(self.params.clone())).map_err(|e| Error::BadOption {
            option: "task spec".into(),
            detail: format!("the params of {} do not fit `{}`: {e}", self.name, self.command),
            hint: Some("the spec was written by another version of scfoundry: run the command again".into()),
        })
    }

    /// Nextflow-style short hash `ab/cdef12` of what the task computes.
    pub fn hash(&self) -> String {
        let mut h = Sha256::new();
        h.update(serde_json::to_vec(&(&self.command, &self.method, &self.data, &self.layer, self.seed, &self.params)).unwrap());
        if self.step != Step::Embed {
            h.update(serde_json::to_vec(&self.step).unwrap());
        }
        if self.embedding_only {
            h.update(b"embedding-only");
        }
        let hex = hex::encode(h.finalize());
        format!("{}/{}", &hex[..2], &hex[2..8])
    }
}

/// What the task process reports back besides its exit code (`tasks/<n>/result.json`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TaskResult {
    pub output: Option<PathBuf>,
    pub obsm_key: Option<String>,
    pub n_obs: usize,
    pub dim: usize,
    #[serde(default)]
    pub notes: Vec<String>,
    /// Seconds per phase of the task.
    #[serde(default)]
    pub phases: Vec<(String, f64)>,
    /// What the command prints on stdout (e.g. benchmark's ranked table); the command prints it
    /// once the task is done, wherever the task ran.
    #[serde(default)]
    pub stdout: Option<String>,
    /// Lines for stderr once the task is done (unless --quiet), e.g. what was written where.
    #[serde(default)]
    pub summary: Vec<String>,
    /// Rows of X the task read (an embedding task; a shard reads its own rows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows_read: Option<u64>,
    /// Of those, rows outside the task's own (a shard's neighbours).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows_read_outside: Option<u64>,
    /// The GPU card the task held (`--gpu`), so that the run's summary names each task's card.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub card: Option<crate::gpu::cards::CardRecord>,
    /// How the data's genes matched the model's vocabulary (`tasks::genes::GeneMatch`), for
    /// report.json.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gene_match: Option<serde_json::Value>,
}

/// A run folder.
pub struct Run {
    pub id: String,
    pub dir: PathBuf,
}

impl Run {
    /// Create `base/<id>/` with a fresh id `YYYYmmdd-HHMMSS-<method>-<4 hex>`.
    pub fn create(base: &Path, label: &str) -> Result<Run> {
        let now = chrono::Local::now();
        let rand: u16 = rand::random();
        let id = format!("{}-{label}-{rand:04x}", now.format("%Y%m%d-%H%M%S"));
        let dir = base.join(&id);
        std::fs::create_dir_all(&dir).map_err(|e| Error::Io { path: dir.clone(), source: e })?;
        Ok(Run { id, dir })
    }

    pub fn task_dir(&self, task_id: u64) -> PathBuf {
        self.dir.join("tasks").join(task_id.to_string())
    }
}

/// The outcome of one task as seen by the runner.
#[derive(Clone)]
pub struct Outcome {
    pub exit: i32,
    pub record: TraceRecord,
    pub stats: Option<TaskStats>,
    pub result: Option<TaskResult>,
}

/// Write a task's spec to `tasks/<n>/task.json`; any executor then runs `scfoundry __task` on it.
pub fn write_spec(run: &Run, spec: &TaskSpec) -> Result<PathBuf> {
    let tdir = run.task_dir(spec.task_id);
    std::fs::create_dir_all(&tdir).map_err(|e| Error::Io { path: tdir.clone(), source: e })?;
    let spec_path = tdir.join("task.json");
    std::fs::write(&spec_path, serde_json::to_string_pretty(spec).unwrap()).map_err(|e| Error::Io { path: spec_path.clone(), source: e })?;
    Ok(spec_path)
}

/// What a finished task left in its folder: its measured cost and its result.
pub fn task_files(run: &Run, spec: &TaskSpec) -> (Option<TaskStats>, Option<TaskResult>) {
    let tdir = run.task_dir(spec.task_id);
    let stats = std::fs::read_to_string(tdir.join("stats.json")).ok().and_then(|t| serde_json::from_str(&t).ok());
    let result = std::fs::read_to_string(tdir.join("result.json")).ok().and_then(|t| serde_json::from_str(&t).ok());
    (stats, result)
}

/// The outcome of a task that finished in an earlier attempt of the run (`embed --resume`):
/// its recorded cost and result, status CACHED.
pub fn cached_outcome(run: &Run, spec: &TaskSpec) -> Outcome {
    let (stats, result) = task_files(run, spec);
    let record = TraceRecord {
        task_id: spec.task_id,
        hash: spec.hash(),
        name: spec.name.clone(),
        status: "CACHED".into(),
        exit: Some(0),
        submit_ms: chrono::Utc::now().timestamp_millis(),
        realtime_ms: stats.as_ref().map(|s| s.realtime_ms),
        peak_rss: stats.as_ref().map(|s| s.peak_rss),
        ..Default::default()
    };
    Outcome { exit: 0, record, stats, result }
}

/// Where task `task_id` of a sharded run counts its cells (see `progress::ShardBar`).
pub fn progress_file(run: &Run, task_id: u64) -> PathBuf {
    run.task_dir(task_id).join("cells_done")
}

/// Run one task as a child process of this binary and wait for it.
pub fn run_task(run: &Run, spec: &TaskSpec) -> Result<Outcome> {
    let spec_path = write_spec(run, spec)?;
    let exe = std::env::current_exe().map_err(|e| Error::Io { path: "current executable".into(), source: e })?;
    let submit_ms = chrono::Utc::now().timestamp_millis();
    let started = Instant::now();
    let mut cmd = Command::new(exe);
    // stdin is a pipe the task watches: if this process dies, the pipe closes and the task
    // removes its unfinished output and exits (lifecycle.rs)
    cmd.arg("__task").arg(&spec_path).stdin(std::process::Stdio::piped()).env(crate::env::EnvVars::PARENT_PIPE, "1");
    if matches!(spec.step, Step::Project { .. }) {
        // a shard counts its cells for the run's one bar (progress::ShardBar)
        cmd.env(crate::env::EnvVars::PROGRESS_FILE, progress_file(run, spec.task_id));
    }
    // A task given GPUs takes its card itself (tasks::run, gpu::cards): no lock is held here,
    // so a runner never waits on a card that one of its own tasks holds.
    let mut child = cmd.spawn().map_err(|e| Error::Io { path: spec_path.clone(), source: e })?;
    let pid = child.id();
    ledger::started(run, spec, pid, submit_ms, started);
    // held open until the task ends (`wait` would close a stdin it still owns)
    let _parent_pipe = child.stdin.take();
    let status = child.wait().map_err(|e| Error::Io { path: spec_path.clone(), source: e })?;
    let duration_ms = started.elapsed().as_millis() as u64;
    let exit = status.code().unwrap_or(128 + 9);
    let (stats, result) = task_files(run, spec);
    let record = TraceRecord {
        task_id: spec.task_id,
        hash: spec.hash(),
        native_id: Some(pid.to_string()),
        name: spec.name.clone(),
        status: if exit == 0 { "COMPLETED".into() } else { "FAILED".into() },
        exit: Some(exit),
        submit_ms,
        duration_ms: Some(duration_ms),
        realtime_ms: stats.as_ref().map(|s| s.realtime_ms),
        cpu_percent: stats.as_ref().map(|s| s.cpu_percent()),
        peak_rss: stats.as_ref().map(|s| s.peak_rss),
        peak_vmem: stats.as_ref().map(|s| s.peak_vmem),
        rchar: stats.as_ref().map(|s| s.rchar),
        wchar: stats.as_ref().map(|s| s.wchar),
        ..Default::default()
    };
    let outcome = Outcome { exit, record, stats, result };
    ledger::finished(run, &outcome);
    Ok(outcome)
}

/// Write `trace.txt` and `report.json` for a finished run; report.json's `status` is
/// `completed` when every task exited 0, `failed` otherwise.
pub fn write_reports(run: &Run, spec: &TaskSpec, outcomes: &[&Outcome]) -> Result<()> {
    let status = if outcomes.iter().all(|o| o.exit == 0 && o.record.status == "COMPLETED") { "completed" } else { "failed" };
    write_reports_as(run, spec, outcomes, serde_json::json!(status), None)
}

/// [`write_reports`] with the run's `status` (and the `signal` that interrupted it) given.
fn write_reports_as(run: &Run, spec: &TaskSpec, outcomes: &[&Outcome], status: serde_json::Value, signal: Option<&str>) -> Result<()> {
    // GPU tasks leave gpu.json (peak device memory, allocator, batch size): a table beside
    // trace.txt, and trace.txt's batch_size and peak_gpu_mem columns
    let gpu: Vec<(&Outcome, crate::gpu::GpuReport)> = outcomes.iter().filter_map(|o| crate::gpu::GpuReport::read(&run.task_dir(o.record.task_id)).map(|g| (*o, g.with_wall_ms(o.record.realtime_ms)))).collect();
    let records: Vec<TraceRecord> = outcomes
        .iter()
        .map(|o| {
            let mut r = o.record.clone();
            if let Some((_, g)) = gpu.iter().find(|(g, _)| g.record.task_id == r.task_id) {
                r.peak_gpu_mem = Some(g.stats.peak_bytes);
                r.batch_size = g.batch_size;
            }
            r
        })
        .collect();
    let trace_path = run.dir.join("trace.txt");
    std::fs::write(&trace_path, trace::render(&records)).map_err(|e| Error::Io { path: trace_path, source: e })?;
    if !gpu.is_empty() {
        let path = run.dir.join("gpu.tsv");
        std::fs::write(&path, render_gpu_table(&gpu)).map_err(|e| Error::Io { path, source: e })?;
    }
    let tasks: Vec<serde_json::Value> = outcomes
        .iter()
        .map(|o| {
            serde_json::json!({
                "task_id": o.record.task_id,
                "name": o.record.name,
                "status": o.record.status,
                "exit": o.exit,
                "duration_ms": o.record.duration_ms,
                "stats": o.stats,
                "result": o.result,
            })
        })
        .collect();
    let report = serde_json::json!({
        "run_id": run.id,
        "status": status,
        "signal": signal,
        "tool": "scfoundry",
        "version": env!("CARGO_PKG_VERSION"),
        "command": spec.command,
        "method": spec.method,
        "params": spec.params,
        "seed": spec.seed,
        "data": spec.data,
        "tasks": tasks,
        "total_cpu_ms": outcomes.iter().filter_map(|o| o.stats.as_ref().map(|s| s.cpu_ms)).sum::<u64>(),
        "max_peak_rss": outcomes.iter().filter_map(|o| o.stats.as_ref().map(|s| s.peak_rss)).max(),
        "gpu": gpu.iter().map(|(_, g)| g).collect::<Vec<_>>(),
    });
    let path = run.dir.join("report.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report).unwrap()).map_err(|e| Error::Io { path, source: e })?;
    Ok(())
}

/// `gpu.tsv`: one row per GPU task, the cost report's device-memory columns.
fn render_gpu_table(rows: &[(&Outcome, crate::gpu::GpuReport)]) -> String {
    let mut t = String::from("task_id\tname\tdevice\tallocator\tpeak_gpu_bytes\tpeak_gpu\tallocations\tfailed_allocations\talloc_ms\talloc_share\tpool_reserved_high\tbatch_backoff\n");
    for (o, g) in rows {
        t.push_str(&format!(
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\n",
            o.record.task_id,
            o.record.name,
            g.device,
            g.allocator,
            g.stats.peak_bytes,
            trace::fmt_memory(g.stats.peak_bytes),
            g.stats.allocations,
            g.stats.failed,
            g.alloc_ms.map(|ms| format!("{ms:.1}")).unwrap_or_else(|| "-".into()),
            g.alloc_share.map(|x| format!("{x:.4}")).unwrap_or_else(|| "-".into()),
            g.pool_reserved_high.map(|b| b.to_string()).unwrap_or_else(|| "-".into()),
            g.backoff.as_ref().map(|b| format!("{} -> {}", b.requested, b.final_batch)).unwrap_or_else(|| "-".into()),
        ));
    }
    t
}

/// The runs of this process and their tasks, running and finished, so that an interrupted
/// parent (SIGINT, SIGTERM, SIGHUP; see `lifecycle.rs`) still writes `trace.txt` (its running
/// tasks as `ABORTED`, exit 128 + the signal, as Nextflow writes them) and `report.json`
/// (`"status": "interrupted"`, `"signal"`) before it exits.
mod ledger {
    use std::path::PathBuf;
    use std::sync::Mutex;
    use std::time::Instant;

    use super::{Outcome, Run, TaskSpec, TraceRecord};

    struct Entry {
        id: String,
        dir: PathBuf,
        spec: TaskSpec,
        finished: Vec<Outcome>,
        running: Vec<(TraceRecord, Instant)>,
    }

    static RUNS: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

    fn with_entry(run: &Run, spec: &TaskSpec, f: impl FnOnce(&mut Entry)) {
        let Ok(mut runs) = RUNS.lock() else { return };
        let i = match runs.iter().position(|e| e.dir == run.dir) {
            Some(i) => i,
            None => {
                runs.push(Entry { id: run.id.clone(), dir: run.dir.clone(), spec: spec.clone(), finished: Vec::new(), running: Vec::new() });
                runs.len() - 1
            }
        };
        f(&mut runs[i]);
    }

    /// A task process `pid` started for `spec`.
    pub(super) fn started(run: &Run, spec: &TaskSpec, pid: u32, submit_ms: i64, at: Instant) {
        crate::lifecycle::on_interrupt(interrupted);
        let record = TraceRecord { task_id: spec.task_id, hash: spec.hash(), native_id: Some(pid.to_string()), name: spec.name.clone(), submit_ms, ..Default::default() };
        with_entry(run, spec, |e| e.running.push((record, at)));
    }

    /// A task ended (its trace row is in `outcome`).
    pub(super) fn finished(run: &Run, outcome: &Outcome) {
        let Ok(mut runs) = RUNS.lock() else { return };
        if let Some(e) = runs.iter_mut().find(|e| e.dir == run.dir) {
            e.running.retain(|(r, _)| r.task_id != outcome.record.task_id);
            e.finished.push(outcome.clone());
        }
    }

    /// The interrupt hook: each run's trace.txt and report.json, the running tasks aborted.
    fn interrupted(sig: i32) {
        let Ok(runs) = RUNS.lock() else { return };
        let signal = crate::lifecycle::signal_short_name(sig);
        for e in runs.iter().filter(|e| !e.running.is_empty()) {
            let mut outcomes = e.finished.clone();
            for (r, at) in &e.running {
                let ms = at.elapsed().as_millis() as u64;
                let record = TraceRecord { status: "ABORTED".into(), exit: Some(128 + sig), duration_ms: Some(ms), ..r.clone() };
                outcomes.push(Outcome { exit: 128 + sig, record, stats: None, result: None });
            }
            let run = Run { id: e.id.clone(), dir: e.dir.clone() };
            let refs: Vec<&Outcome> = outcomes.iter().collect();
            let status = serde_json::json!("interrupted");
            if let Err(err) = super::write_reports_as(&run, &e.spec, &refs, status, Some(signal)) {
                eprintln!("scfoundry: could not record the interrupted run in {}: {err}", e.dir.display());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gpu.tsv's allocation columns: the time inside allocation and free calls, and its share
    /// of the task's wall time (`-` where the wall time is unknown).
    #[test]
    fn gpu_table_has_the_allocation_time_and_its_share() {
        let o = Outcome { exit: 0, record: TraceRecord { task_id: 1, name: "embed".into(), realtime_ms: Some(2_000), ..Default::default() }, stats: None, result: None };
        let mut g = crate::gpu::GpuReport { device: "card".into(), ..Default::default() };
        g.stats.allocations = 7;
        g.stats.alloc_ns = 80_000_000;
        g.stats.free_ns = 20_000_000;
        let known = g.clone().with_wall_ms(o.record.realtime_ms);
        assert_eq!((known.alloc_ms, known.alloc_share), (Some(100.0), Some(0.05)));
        let unknown = g.with_wall_ms(None);
        let t = render_gpu_table(&[(&o, known), (&o, unknown)]);
        let rows: Vec<Vec<&str>> = t.lines().map(|l| l.split('\t').collect()).collect();
        let col = |name: &str| rows[0].iter().position(|c| *c == name).unwrap_or_else(|| panic!("no {name} in {:?}", rows[0]));
        assert!(rows.iter().all(|r| r.len() == rows[0].len()), "{t}");
        assert_eq!((rows[1][col("allocations")], rows[1][col("alloc_ms")], rows[1][col("alloc_share")]), ("7", "100.0", "0.0500"));
        assert_eq!((rows[2][col("alloc_ms")], rows[2][col("alloc_share")]), ("100.0", "-"));
    }
}
