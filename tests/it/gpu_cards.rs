//! `--gpu` lists: each task process locks one card of its list (by UUID, in the lock folder)
//! and waits while all are held. The cards are fake (`SCFOUNDRY_FAKE_GPUS`), so these run
//! without a GPU; `__hold-gpu` takes a card exactly as a task does.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{TestContext, BIN};

const FAKE: &str = "0:GPU-aaaa,1:GPU-bbbb";

/// One line of `__hold-gpu`'s record: (ordinal, uuid, slot, start_ms, end_ms, CUDA_VISIBLE_DEVICES).
type Hold = (u32, String, usize, i64, i64, String);

fn hold_cmd(ctx: &TestContext, gpus: &str, record: &Path, ms: u64) -> Command {
    let mut c = Command::new(BIN);
    c.args(["__hold-gpu", gpus, record.to_str().unwrap(), &ms.to_string()])
        .current_dir(ctx.dir.path())
        .env("SCFOUNDRY_FAKE_GPUS", FAKE)
        .env("SCFOUNDRY_GPU_LOCKS", ctx.path("locks"))
        .env_remove("CUDA_VISIBLE_DEVICES")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

/// Start `n` holders at once; their records and stderr once all are done.
fn hold_at_once(ctx: &TestContext, gpus: &str, n: usize, ms: u64) -> (Vec<Hold>, Vec<String>) {
    let record = ctx.path(&format!("record-{gpus}.txt"));
    let children: Vec<_> = (0..n).map(|_| hold_cmd(ctx, gpus, &record, ms).spawn().unwrap()).collect();
    let mut errs = vec![];
    for c in children {
        let out = c.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "a holder failed: {err}");
        errs.push(err);
    }
    let text = std::fs::read_to_string(&record).unwrap();
    let holds = text
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f[0].parse().unwrap(), f[1].to_string(), f[2].parse().unwrap(), f[3].parse().unwrap(), f[4].parse().unwrap(), f.get(5).unwrap_or(&"").to_string())
        })
        .collect();
    (holds, errs)
}

#[test]
fn four_tasks_on_two_cards_never_share_one() {
    let ctx = TestContext::new();
    let started = Instant::now();
    let (holds, errs) = hold_at_once(&ctx, "0,1", 4, 300);
    assert_eq!(holds.len(), 4, "all four finish: {holds:?}");
    // two at a time: at least two rounds of 300 ms
    assert!(started.elapsed() >= Duration::from_millis(600), "{:?}", started.elapsed());
    for card in [0u32, 1] {
        let mut on: Vec<&Hold> = holds.iter().filter(|h| h.0 == card).collect();
        on.sort_by_key(|h| h.3);
        for w in on.windows(2) {
            assert!(w[1].3 >= w[0].4, "card {card} held by two tasks at once: {:?} and {:?}", w[0], w[1]);
        }
    }
    for h in &holds {
        let uuid = if h.0 == 0 { "GPU-aaaa" } else { "GPU-bbbb" };
        assert_eq!((h.1.as_str(), h.2, h.5.as_str()), (uuid, 0, uuid), "the task sees only its card, by UUID: {h:?}");
    }
    // a task that waits says so once
    let waited: Vec<&String> = errs.iter().filter(|e| e.contains("waiting for a free GPU among 0,1")).collect();
    assert!(!waited.is_empty(), "{errs:?}");
    assert!(errs.iter().all(|e| e.matches("waiting for").count() <= 1), "{errs:?}");
}

#[test]
fn a_card_listed_twice_is_shared_by_two_tasks() {
    let ctx = TestContext::new();
    let (holds, _) = hold_at_once(&ctx, "0,0", 2, 600);
    assert_eq!(holds.len(), 2);
    assert!(holds.iter().all(|h| h.0 == 0), "{holds:?}");
    let mut slots: Vec<usize> = holds.iter().map(|h| h.2).collect();
    slots.sort();
    assert_eq!(slots, vec![0, 1]);
    let (s, e) = (holds.iter().map(|h| h.3).max().unwrap(), holds.iter().map(|h| h.4).min().unwrap());
    assert!(s < e, "both ran on card 0 at once: {holds:?}");
    // listed once, the card is not shared
    let (holds, _) = hold_at_once(&ctx, "1", 2, 300);
    let mut h: Vec<&Hold> = holds.iter().collect();
    h.sort_by_key(|h| h.3);
    assert!(h[1].3 >= h[0].4, "{holds:?}");
}

#[test]
fn a_card_that_is_not_there_is_a_clear_error() {
    let ctx = TestContext::new();
    let out = hold_cmd(&ctx, "0,5", &ctx.path("r.txt"), 10).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("this machine has no GPU 5 (it has 0, 1)") && err.contains("hint: "), "{err}");
    ctx.run(&["embed", "-m", "pca", "-d", "x.h5ad", "--gpu", "3-1"]).user_error().stderr_has("write `1-3`");
}

/// A task waits while another process holds its only card, then runs on it; the run's report
/// names the card.
#[test]
fn an_embedding_waits_for_its_card_and_reports_it() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    let locks = ctx.path("locks");
    std::fs::create_dir_all(&locks).unwrap();
    // this test process holds card 1, as a task of another run would
    let held = std::fs::File::create(locks.join("GPU-bbbb.0.lock")).unwrap();
    assert_eq!(unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
    let mut child = Command::new(BIN)
        .args(["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--gpu", "1", "--n-comps", "5"])
        .current_dir(ctx.dir.path())
        .env("SCFOUNDRY_NO_PROGRESS", "1")
        .env("SCFOUNDRY_WEIGHTS_DIR", ctx.path("w"))
        .env("SCFOUNDRY_FAKE_GPUS", FAKE)
        .env("SCFOUNDRY_GPU_LOCKS", &locks)
        .env_remove("SCFOUNDRY_WORKSPACE")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        let mut all = String::new();
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line.clone());
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let waiting = loop {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(l) if l.contains("waiting for a free GPU among 1") => break true,
            Ok(_) => continue,
            Err(_) => break false,
        }
    };
    assert!(waiting, "the task never said it waits for GPU 1");
    std::thread::sleep(Duration::from_millis(500));
    assert!(child.try_wait().unwrap().is_none(), "the task must wait while GPU 1 is held");
    assert!(!ctx.path("pbmc68k_counts.pca.h5ad").exists());
    drop(held);
    let status = child.wait().unwrap();
    let err = reader.join().unwrap();
    assert!(status.success(), "{err}");
    assert!(ctx.path("pbmc68k_counts.pca.h5ad").exists());
    assert!(err.contains("EMBED_PCA (pbmc68k_counts): GPU 1 GPU-bbbb"), "{err}");
    let run = std::fs::read_dir(ctx.path("runs")).unwrap().next().unwrap().unwrap().path();
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(run.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["tasks"][0]["result"]["card"]["uuid"], "GPU-bbbb", "{report}");
    assert_eq!(report["tasks"][0]["result"]["card"]["ordinal"], 1);
}

/// Shards with `--gpu 0,1` run two at a time (no --max-forks), each on a card it locked: with
/// card 1 held elsewhere, a shard that starts beside another waits for card 0; one shard at a
/// time never would.
#[test]
fn sharded_embedding_on_two_cards_runs_two_shards_at_once() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    let locks = ctx.path("gpu-locks");
    std::fs::create_dir_all(&locks).unwrap();
    let held = std::fs::File::create(locks.join("GPU-bbbb.0.lock")).unwrap();
    assert_eq!(unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
    // blocks of one row keep each shard busy long enough (175 reads) that the runner's second
    // shard starts while the first holds card 0, whatever the machine's load
    let r = ctx.run_env(&["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--n-comps", "5", "--shards", "4", "--gpu", "0,1"], &[("SCFOUNDRY_FAKE_GPUS", Path::new(FAKE)), ("SCFOUNDRY_BLOCK_ROWS", Path::new("1"))]);
    r.success().stderr_has("waiting for a free GPU among 0,1");
    let run = std::fs::read_dir(ctx.path("runs")).unwrap().next().unwrap().unwrap().path();
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(run.join("report.json")).unwrap()).unwrap();
    let tasks = report["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 6, "fit, 4 shards, merge");
    // the merge only copies rows and takes no card; the fit and the shards take card 0
    let (merge, carded): (Vec<&serde_json::Value>, Vec<&serde_json::Value>) = tasks.iter().partition(|t| t["name"].as_str().unwrap().contains("_MERGE"));
    assert!(merge.len() == 1 && merge[0]["result"]["card"].is_null(), "{report}");
    for t in &carded {
        assert_eq!(t["result"]["card"]["uuid"], "GPU-aaaa", "card 1 is held elsewhere: {t}");
        r.stderr_has(&format!("{}: GPU 0 GPU-aaaa", t["name"].as_str().unwrap()));
    }
    let waited: f64 = carded.iter().map(|t| t["result"]["card"]["waited_s"].as_f64().unwrap()).sum();
    assert!(waited > 0.0, "{report}");
    drop(held);
}
