//! A killed run leaves nothing running and nothing unfinished behind.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{TestContext, BIN};

/// Pids of the `__task` processes whose parent is `parent`.
fn task_children(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // the fields after the command's closing parenthesis: state, ppid, ...
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r.to_string()) else { continue };
        let ppid: u32 = rest.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if ppid == parent && String::from_utf8_lossy(&cmdline).contains("__task") {
            out.push(pid);
        }
    }
    out
}

fn alive(pid: u32) -> bool {
    // a zombie is dead for our purpose
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map(|s| !s.rsplit_once(')').map(|(_, r)| r.trim_start().starts_with('Z')).unwrap_or(true)).unwrap_or(false)
}

fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir).unwrap().flatten().map(|e| e.file_name().to_string_lossy().to_string()).filter(|n| n.ends_with(".tmp") || n.ends_with(".scvi.h5ad") || n == "out.h5ad").collect()
}

/// Start a long task (scvi_denovo training), wait for its task process, then send `signal` to
/// the parent only, as a scheduler or a closed terminal does.
fn kill_parent_mid_task(signal: i32) -> (TestContext, std::process::Output) {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    let child = Command::new(BIN)
        .args(["integrate", "-m", "scvi_denovo", "-d", "pbmc68k_counts.h5ad", "--batch-key", "phase", "--max-epochs", "100000", "-o", "out.h5ad"])
        .current_dir(ctx.dir.path())
        .env("SCFOUNDRY_NO_PROGRESS", "1")
        .env("SCFOUNDRY_CONVERTED_DIR", ctx.path("converted"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let parent = child.id();
    let t0 = Instant::now();
    let task = loop {
        if let Some(&p) = task_children(parent).first() {
            break p;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "no task process appeared");
        std::thread::sleep(Duration::from_millis(100));
    };
    std::thread::sleep(Duration::from_millis(500));
    unsafe { libc::kill(parent as i32, signal) };
    let out = child.wait_with_output().unwrap();
    let t1 = Instant::now();
    while alive(task) {
        assert!(t1.elapsed() < Duration::from_secs(10), "the task process {task} outlived its parent by 10 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    // nothing appears later either
    std::thread::sleep(Duration::from_secs(2));
    assert!(leftovers(ctx.dir.path()).is_empty(), "left behind: {:?}", leftovers(ctx.dir.path()));
    (ctx, out)
}

#[test]
fn a_task_dies_with_its_killed_parent() {
    kill_parent_mid_task(libc::SIGKILL);
}

#[test]
fn sigterm_to_the_parent_says_what_it_removed_and_stops_the_task() {
    let (ctx, out) = kill_parent_mid_task(libc::SIGTERM);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + libc::SIGTERM), "{stderr}");
    assert!(stderr.contains("interrupted by SIGTERM"), "{stderr}");
    run_folder_records_the_interruption(&ctx, "SIGTERM", 143);
}

#[test]
fn sigint_to_the_parent_is_recorded_in_the_run_folder() {
    let (ctx, out) = kill_parent_mid_task(libc::SIGINT);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + libc::SIGINT), "{stderr}");
    run_folder_records_the_interruption(&ctx, "SIGINT", 130);
}

/// The run folder of an interrupted run: trace.txt has the running task as ABORTED with exit
/// 128 + the signal (Nextflow's words), report.json says `"status": "interrupted"` and the signal.
fn run_folder_records_the_interruption(ctx: &TestContext, signal: &str, exit: i32) {
    let runs: Vec<_> = std::fs::read_dir(ctx.path("runs")).unwrap().flatten().filter(|e| e.path().is_dir() && !e.file_name().to_string_lossy().starts_with('.')).collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let dir = runs[0].path();
    let trace = std::fs::read_to_string(dir.join("trace.txt")).expect("trace.txt of the interrupted run");
    let mut lines = trace.lines();
    let header: Vec<&str> = lines.next().unwrap().split('\t').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap_or_else(|| panic!("no {name} column: {header:?}"));
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split('\t').collect()).collect();
    assert_eq!(rows.len(), 1, "{trace}");
    assert_eq!(rows[0][col("status")], "ABORTED", "{trace}");
    assert_eq!(rows[0][col("exit")], exit.to_string(), "{trace}");
    assert!(rows[0][col("name")].starts_with("INTEGRATE_"), "{trace}");
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).expect("report.json of the interrupted run")).unwrap();
    assert_eq!(report["status"], "interrupted", "{report}");
    assert_eq!(report["signal"], signal, "{report}");
    assert_eq!(report["tasks"][0]["status"], "ABORTED", "{report}");
    assert_eq!(report["tasks"][0]["exit"], exit, "{report}");
}

/// Leftover temporary outputs of dead owners on this host are swept by the next run; one whose
/// owner lives (another run writing now) is kept.
#[test]
fn leftovers_of_dead_runs_are_swept_live_ones_kept() {
    let ctx = TestContext::new();
    crate::common::Tiny::counts(20, 8).write(&ctx.path("t.h5ad"));
    let tag = scfoundry::lifecycle::owner_tag(); // host.boot.<this test's pid>: alive
    let (host_boot, _) = tag.rsplit_once('.').unwrap();
    let dead = ctx.path(&format!(".t.pca.h5ad.{host_boot}.999999999.abcdef.tmp"));
    let live = ctx.path(&format!(".t.pca.h5ad.{tag}.abcdef.tmp"));
    let other_host = ctx.path(".t.pca.h5ad.some-other-node.0123abcd.1.abcdef.tmp");
    for p in [&dead, &live, &other_host] {
        std::fs::write(p, b"partial").unwrap();
    }
    ctx.run(&["embed", "-m", "pca", "-d", "t.h5ad", "--n-comps", "3"]).success().stderr_has("the unfinished output of a run that was killed");
    assert!(!dead.exists(), "a dead owner's leftover is removed");
    assert!(live.exists(), "a live owner's file is kept");
    assert!(other_host.exists(), "another host's file is kept");
}
