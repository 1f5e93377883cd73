//! Orchestration: sharded runs, GPU slots, `scfoundry config`, `--executor nextflow` and
//! `--executor slurm` (against a real single-node Slurm from scripts/slurm-up.sh).
//!
//! Slurm tests run when $SCFOUNDRY_TEST_SLURM_CONF names a running cluster's slurm.conf;
//! under CI=true it must be set.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{repo, TestContext, BIN};

/// obsm/X_pca, varm/PCs, uns/pca/variance and uns/pca/variance_ratio as raw bytes.
fn pca_bytes(path: &Path) -> Vec<Vec<u8>> {
    let f = hdf5::File::open(path).unwrap();
    let f32s = |name: &str| -> Vec<u8> { f.dataset(name).unwrap().read_raw::<f32>().unwrap().iter().flat_map(|v| v.to_le_bytes()).collect() };
    let f64s = |name: &str| -> Vec<u8> { f.dataset(name).unwrap().read_raw::<f64>().unwrap().iter().flat_map(|v| v.to_le_bytes()).collect() };
    vec![f32s("obsm/X_pca"), f32s("varm/PCs"), f64s("uns/pca/variance"), f64s("uns/pca/variance_ratio")]
}

fn only_run_dir(runs: &Path) -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(runs).unwrap().filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.is_dir() && !p.ends_with(".locks")).collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    dirs.pop().unwrap()
}

#[test]
fn sharded_local_run_equals_unsharded() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    ctx.run(&["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--out", "whole.h5ad", "--runs-dir", "runs-whole"]).success();
    let r = ctx.run(&["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--out", "sharded.h5ad", "--shards", "4", "--max-forks", "2", "--runs-dir", "runs-sharded"]);
    r.success().stderr_has("(6 tasks)");
    assert_eq!(pca_bytes(&ctx.path("whole.h5ad")), pca_bytes(&ctx.path("sharded.h5ad")), "sharded output differs");
    let dir = only_run_dir(&ctx.path("runs-sharded"));
    let trace = std::fs::read_to_string(dir.join("trace.txt")).unwrap();
    let names: Vec<&str> = trace.lines().skip(1).map(|l| l.split('\t').nth(3).unwrap()).collect();
    assert_eq!(names.len(), 6, "{trace}");
    assert_eq!(names[0], "EMBED_PCA_FIT (pbmc68k_counts)");
    assert_eq!(names[5], "EMBED_PCA_MERGE (pbmc68k_counts)");
    assert_eq!(names.iter().filter(|n| n.starts_with("EMBED_PCA_PROJECT")).count(), 4);
    // the shard blocks are removed once merged; the fit stays
    let work: Vec<String> = std::fs::read_dir(dir.join("work")).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect();
    assert_eq!(work, ["pca_fit.json"]);
    // a run folder stands for its trace.txt
    let r = ctx.run(&["trace", dir.to_str().unwrap()]);
    r.success();
    assert!(r.stdout.contains("6 tasks"), "{}", r.stdout);
}

#[test]
fn more_shards_than_cells_still_covers_every_cell() {
    let ctx = TestContext::new();
    crate::common::Tiny::counts(12, 30).write(&ctx.path("t.h5ad"));
    ctx.run(&["embed", "-m", "pca", "-d", "t.h5ad", "--out", "a.h5ad", "--n-comps", "3", "--runs-dir", "r1"]).success();
    ctx.run(&["embed", "-m", "pca", "-d", "t.h5ad", "--out", "b.h5ad", "--n-comps", "3", "--shards", "50", "--runs-dir", "r2"]).success();
    assert_eq!(pca_bytes(&ctx.path("a.h5ad")), pca_bytes(&ctx.path("b.h5ad")));
}

#[test]
fn a_failing_local_shard_stops_the_run_before_the_merge() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    let out = Command::new(BIN)
        .args(["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--shards", "3"])
        .current_dir(ctx.dir.path())
        .env("SCFOUNDRY_NO_PROGRESS", "1")
        .env("SCFOUNDRY_WEIGHTS_DIR", ctx.path("w"))
        .env("SCFOUNDRY_FAIL_SHARD", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("shard 1) failed (exit 1)"), "{err}");
    assert!(!ctx.path("pbmc68k_counts.pca.h5ad").exists(), "no output from a failed run");
    let trace = std::fs::read_to_string(only_run_dir(&ctx.path("runs")).join("trace.txt")).unwrap();
    assert!(!trace.contains("MERGE"), "the merge never ran:\n{trace}");
}

// ---- scfoundry config ---------------------------------------------------------------

fn config_text(ctx: &TestContext, args: &[&str]) -> String {
    let mut a = vec!["--workspace", "ws", "config", "--out", "-"];
    a.extend_from_slice(args);
    // ctx.run sets the lock folder to [TMP]/gpu-locks, so the text names no user id
    let r = ctx.run(&a);
    r.success();
    let root = std::path::absolute(ctx.dir.path()).unwrap();
    r.stdout.replace(&root.display().to_string(), "[TMP]").replace(env!("CARGO_PKG_VERSION"), "[VERSION]")
}

#[test]
fn config_snapshots() {
    let ctx = TestContext::new();
    ctx.run(&["init", "ws"]).success();
    insta::assert_snapshot!("config_gpu1_all_profiles", config_text(&ctx, &["--gpu-id", "1", "--max-forks", "2"]));
    insta::assert_snapshot!("config_gpu0_3_all_profiles", config_text(&ctx, &["--gpu", "0-3"]));
    insta::assert_snapshot!("config_unpinned_docker", config_text(&ctx, &["--profile", "docker"]));
    // the default destination is the workspace's nextflow.config
    // (without $SCFOUNDRY_WEIGHTS_DIR, so the workspace's weights folder is the one resolved)
    let out = Command::new(BIN).args(["--workspace", "ws", "config", "--gpu-id", "0"]).current_dir(ctx.dir.path()).env_remove("SCFOUNDRY_WEIGHTS_DIR").env_remove("SCFOUNDRY_GPU_LOCKS").output().unwrap();
    crate::common::Run::from(out).success().stderr_has("GPU tasks share GPUs 0, one card each, locks in /tmp/scfoundry-gpu-locks-");
    let written = std::fs::read_to_string(ctx.path("ws/nextflow.config")).unwrap();
    assert!(written.contains("export SCFOUNDRY_GPUS=0 SCFOUNDRY_GPU_LOCKS=/tmp/scfoundry-gpu-locks-"), "{written}");
    assert!(written.contains(&format!("weights_dir = '{}'", std::path::absolute(ctx.path("ws/weights")).unwrap().display())), "{written}");
}

/// The cards of `--gpu 0-3`, per profile, as the generated config's lines: maxForks 4, each
/// task locks its card in the lock folder, containers see the four cards and the folder.
#[test]
fn config_gives_four_cards_per_profile() {
    let ctx = TestContext::new();
    ctx.run(&["init", "ws"]).success();
    let text = config_text(&ctx, &["--gpu", "0-3"]);
    let block = |profile: &str| -> String {
        let start = text.find(&format!("    {profile} {{")).unwrap_or_else(|| panic!("no {profile} profile:\n{text}"));
        let end = text[start..].find("\n    }\n").unwrap() + start;
        text[start..end].to_string()
    };
    let locks = "[TMP]/gpu-locks";
    let gpu_only = |s: &str| format!("beforeScript = {{ task.ext.cpu_only ? '' : '{s}' }}");
    // no container: the task's environment
    let top = &text[..text.find("profiles {").unwrap()];
    let local = gpu_only(&format!("mkdir -p {locks}; export SCFOUNDRY_GPUS=0,1,2,3 SCFOUNDRY_GPU_LOCKS={locks}"));
    assert!(top.contains(&format!("withLabel: 'process_gpu' {{\n        maxForks = 4\n        {local}\n    }}")), "{top}");
    let docker = block("docker");
    assert!(docker.contains(&format!("containerOptions = '--gpus \\'\"device=0,1,2,3\"\\' -v {locks}:{locks}'")), "{docker}");
    assert!(docker.contains(&gpu_only(&format!("mkdir -p {locks}; unset CUDA_VISIBLE_DEVICES; export SCFOUNDRY_GPUS=0,1,2,3 SCFOUNDRY_GPU_LOCKS={locks}"))), "{docker}");
    assert!(docker.contains("docker.envWhitelist = 'SCFOUNDRY_GPUS,SCFOUNDRY_GPU_LOCKS'"), "{docker}");
    for (p, prefix) in [("apptainer", "APPTAINERENV_"), ("singularity", "SINGULARITYENV_")] {
        let b = block(p);
        assert!(b.contains(&format!("containerOptions = '--nv -B {locks}'")), "{b}");
        assert!(b.contains(&format!("export CUDA_VISIBLE_DEVICES=0,1,2,3 SCFOUNDRY_GPUS=0,1,2,3 SCFOUNDRY_GPU_LOCKS={locks} {prefix}CUDA_VISIBLE_DEVICES=0,1,2,3 {prefix}SCFOUNDRY_GPUS=0,1,2,3 {prefix}SCFOUNDRY_GPU_LOCKS={locks}")), "{b}");
        assert!(b.contains(&format!("{p}.envWhitelist = 'CUDA_VISIBLE_DEVICES,SCFOUNDRY_GPUS,SCFOUNDRY_GPU_LOCKS'")), "{b}");
    }
    let slurm = block("slurm");
    assert!(slurm.contains("clusterOptions = { task.ext.cpu_only ? '' : '--gpus=1' }") && !slurm.contains("SCFOUNDRY_GPUS"), "{slurm}");
    assert!(text.contains("cleanup = true"));
    assert!(text.contains("trace {\n    enabled   = true"));
    assert!(text.contains("report {\n    enabled   = true"));
    assert!(text.contains("workDir = '[TMP]/ws/work'"));
    // --max-forks wins; `--gpu-id` is the same option; `0,0` lets two tasks share card 0
    assert!(config_text(&ctx, &["--gpu", "0-3", "--max-forks", "2"]).contains("maxForks = 2"));
    assert!(config_text(&ctx, &["--gpu-id", "1"]).contains("export SCFOUNDRY_GPUS=1 "));
    let shared = config_text(&ctx, &["--gpu", "0,0", "--profile", "docker"]);
    assert!(shared.contains("maxForks = 2") && shared.contains("'--gpus \\'\"device=0\"\\' -v "), "{shared}");
}

// ---- --executor nextflow ------------------------------------------------------------

#[test]
fn nextflow_missing_is_a_clear_error() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    let out = Command::new(BIN)
        .args(["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--executor", "nextflow"])
        .current_dir(ctx.dir.path())
        .env("PATH", ctx.path("empty-bin"))
        .env("SCFOUNDRY_WEIGHTS_DIR", ctx.path("w"))
        .output()
        .unwrap();
    let r = crate::common::Run::from(out);
    r.user_error().stderr_has("`nextflow` is not on PATH").stderr_has("curl -s https://get.nextflow.io | bash").stderr_has("conda install -c bioconda nextflow");
    assert!(!ctx.path("runs").exists(), "no run folder when the executor is missing");
}

/// A stand-in `nextflow` that records its argv and publishes what the pipeline would.
pub(crate) fn fake_nextflow(dir: &Path) -> PathBuf {
    let bin = dir.join("fake-bin");
    std::fs::create_dir_all(&bin).unwrap();
    let script = r#"#!/bin/sh
printf '%s\n' "$@" > "$FAKE_NEXTFLOW_ARGV"
pwd > "$FAKE_NEXTFLOW_ARGV.cwd"
input=""; outdir=""; method=""; task=""
while [ $# -gt 0 ]; do
  case "$1" in
    --task) task=$2; shift ;;
    --input) input=$2; shift ;;
    --outdir) outdir=$2; shift ;;
    --method) method=$2; shift ;;
  esac
  shift
done
stem=$(basename "$input" .h5ad)
reference=""; query=""
prev=""
for a in $(cat "$FAKE_NEXTFLOW_ARGV"); do
  [ "$prev" = "--reference" ] && reference=$a
  [ "$prev" = "--query" ] && query=$a
  prev=$a
done
case "$task" in
  transfer)
    id="$(basename "$query" .h5ad)_from_$(basename "$reference" .h5ad)"
    mkdir -p "$outdir/transfer/$id.transfer" && cp "$query" "$outdir/transfer/$id.transfer.h5ad"
    echo '{"published": "by the fake nextflow"}' > "$outdir/transfer/$id.transfer/transfer.json" ;;
  embed) mkdir -p "$outdir" && cp "$input" "$outdir/$stem.$method.h5ad" ;;
  integrate) mkdir -p "$outdir/integrate" && cp "$input" "$outdir/integrate/$stem.$method.h5ad" ;;
  *) mkdir -p "$outdir/$task/$stem.$task" && echo "published by the fake nextflow" > "$outdir/$task/$stem.$task/$task.tsv" ;;
esac
"#;
    let p = bin.join("nextflow");
    std::fs::write(&p, script).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    bin
}

/// Run scfoundry with the fake `nextflow` first on PATH, recording its argv in `argv_file`.
pub(crate) fn run_fake_nextflow(ctx: &TestContext, bin: &Path, argv_file: &Path, args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(args)
        .current_dir(ctx.dir.path())
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .env("FAKE_NEXTFLOW_ARGV", argv_file)
        .env("SCFOUNDRY_NO_PROGRESS", "1")
        .env("SCFOUNDRY_WEIGHTS_DIR", ctx.path("w"))
        .output()
        .unwrap()
}

#[test]
fn nextflow_command_line_and_passthrough() {
    let ctx = TestContext::new();
    let data = ctx.demo("pbmc68k_counts.h5ad");
    let bin = fake_nextflow(ctx.dir.path());
    let argv_file = ctx.path("argv.txt");
    let out = run_fake_nextflow(
        &ctx,
        &bin,
        &argv_file,
        &["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--out", "res.h5ad", "--seed", "7", "--n-comps", "9", "--gpu", "1", "--executor", "nextflow", "--", "-with-trace", "trace.txt", "-process.maxForks", "1"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let argv: Vec<String> = std::fs::read_to_string(&argv_file).unwrap().lines().map(String::from).collect();
    let run_dir = only_run_dir(&ctx.path("runs"));
    let abs_data = std::path::absolute(&data).unwrap();
    let expect: Vec<String> = [
        "run",
        &repo().join("main.nf").display().to_string(),
        "-c",
        &run_dir.join("nextflow.config").display().to_string(),
        "--task",
        "embed",
        "--method",
        "pca",
        "--input",
        &abs_data.display().to_string(),
        "--outdir",
        &run_dir.join("results").display().to_string(),
        "--seed",
        "7",
        "--n_comps",
        "9",
        "--n_top_genes",
        "2000",
        "-with-trace",
        "trace.txt",
        "-process.maxForks",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    assert_eq!(argv, expect);
    // nextflow runs in the run folder, with the run's config, which gives GPU tasks GPU 1
    assert_eq!(std::fs::read_to_string(ctx.path("argv.txt.cwd")).unwrap().trim(), run_dir.display().to_string());
    let cfg = std::fs::read_to_string(run_dir.join("nextflow.config")).unwrap();
    assert!(cfg.contains("export SCFOUNDRY_GPUS=1 SCFOUNDRY_GPU_LOCKS="), "{cfg}");
    assert!(ctx.path("res.h5ad").is_file(), "the published result is moved to --out");
    assert!(std::fs::read_to_string(run_dir.join("command.txt")).unwrap().contains(" -with-trace trace.txt"));
}

/// The demo batches with a PCA (`pca.h5ad`, obsm['X_pca'], 20 components), made in runs-prep/.
fn pca_demo(ctx: &TestContext) {
    ctx.demo("wu2020_tcells.h5ad");
    ctx.run(&["embed", "-m", "pca", "-d", "wu2020_tcells.h5ad", "-o", "pca.h5ad", "--n-comps", "20", "--runs-dir", "runs-prep"]).success();
}

/// integrate, benchmark and geometry on `pca.h5ad`: (command, arguments, their --out).
const ONE_TASK_COMMANDS: [(&str, &[&str], &str); 3] = [
    ("integrate", &["integrate", "-m", "harmony", "-d", "pca.h5ad", "--batch-key", "batch", "--seed", "3", "--theta", "1.5", "-o", "int.h5ad"], "int.h5ad"),
    (
        "benchmark",
        &["benchmark", "-d", "pca.h5ad", "-e", "X_pca", "--label-key", "cell_type", "--batch-key", "batch", "--metrics", "bio,ilisi", "--batch-max-cells", "150", "--per-cell", "-o", "bench"],
        "bench",
    ),
    ("geometry", &["geometry", "-d", "pca.h5ad", "-e", "X_pca", "--max-cells", "120", "-o", "geo"], "geo"),
];

#[test]
fn nextflow_command_lines_of_integrate_benchmark_geometry() {
    let ctx = TestContext::new();
    pca_demo(&ctx);
    let bin = fake_nextflow(ctx.dir.path());
    let root = std::path::absolute(ctx.dir.path()).unwrap();
    for (command, args, written) in ONE_TASK_COMMANDS {
        let argv_file = ctx.path(&format!("argv-{command}.txt"));
        let runs = format!("runs-{command}");
        let out = run_fake_nextflow(&ctx, &bin, &argv_file, &[args, &["--executor", "nextflow", "--runs-dir", &runs, "--", "-resume", "-with-report", "report.html"]].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{command}: {err}");
        let run_dir = only_run_dir(&ctx.path(&runs));
        let argv = std::fs::read_to_string(&argv_file).unwrap();
        let argv = argv.replace(&run_dir.display().to_string(), "[RUN]").replace(&repo().display().to_string(), "[REPO]").replace(&root.display().to_string(), "[TMP]");
        insta::assert_snapshot!(format!("nextflow_{command}_argv"), argv);
        // in the run folder, with the run's config; the published result is moved to --out
        assert_eq!(std::fs::read_to_string(ctx.path(&format!("argv-{command}.txt.cwd"))).unwrap().trim(), run_dir.display().to_string());
        let cfg = std::fs::read_to_string(run_dir.join("nextflow.config")).unwrap();
        assert!(cfg.contains(&format!("outdir      = '{}'", run_dir.join("results").display())), "{cfg}");
        // what the (fake) pipeline published is moved to --out
        let moved = if command == "integrate" { ctx.path(written) } else { ctx.path(written).join(format!("{command}.tsv")) };
        assert!(moved.is_file(), "{command}: {} was not moved into place: {err}", moved.display());
        assert!(err.contains(&format!("wrote {};", root.join(written).display())), "{err}");
        assert!(std::fs::read_to_string(run_dir.join("command.txt")).unwrap().ends_with(" -resume -with-report report.html\n"));
    }
}

#[test]
fn executors_missing_are_clear_errors_for_every_task_command() {
    let ctx = TestContext::new();
    pca_demo(&ctx);
    for (command, args, _) in ONE_TASK_COMMANDS {
        for (executor, tool, hint) in [("nextflow", "nextflow", "curl -s https://get.nextflow.io | bash"), ("slurm", "sbatch", "Slurm's client")] {
            let out = Command::new(BIN)
                .args(args)
                .args(["--executor", executor])
                .current_dir(ctx.dir.path())
                .env("PATH", ctx.path("empty-bin"))
                .env("SCFOUNDRY_WEIGHTS_DIR", ctx.path("w"))
                .output()
                .unwrap();
            crate::common::Run::from(out).user_error().stderr_has(&format!("`{tool}` is not on PATH")).stderr_has(hint);
        }
        assert!(!ctx.path("runs").exists(), "{command}: no run folder when the executor is missing");
    }
}

/// The three commands run as one `scfoundry __task` process of a run folder, recorded in its
/// trace.txt and report.json as embed's tasks are; `--shards` is embed's only.
#[test]
fn integrate_benchmark_geometry_run_as_traced_tasks() {
    let ctx = TestContext::new();
    pca_demo(&ctx);
    for ((command, args, written), name) in ONE_TASK_COMMANDS.into_iter().zip(["INTEGRATE_HARMONY (pca)", "BENCHMARK (pca)", "GEOMETRY (pca)"]) {
        let runs = format!("runs-{command}");
        let mut a = args.to_vec();
        a.extend(["--runs-dir", &runs]);
        let r = ctx.run(&a);
        r.success().stderr_has("run folder: ");
        assert!(ctx.path(written).exists(), "{command}: no output");
        let dir = only_run_dir(&ctx.path(&runs));
        let trace = std::fs::read_to_string(dir.join("trace.txt")).unwrap();
        let rows: Vec<Vec<&str>> = trace.lines().skip(1).map(|l| l.split('\t').collect()).collect();
        assert_eq!(rows.len(), 1, "{trace}");
        assert_eq!(rows[0][3], name, "{trace}");
        assert_eq!((rows[0][4], rows[0][5]), ("COMPLETED", "0"), "{trace}");
        assert!(rows[0][2].chars().all(|c| c.is_ascii_digit()), "native_id is the task process's pid: {trace}");
        assert!(rows[0][10] != "-", "peak_rss measured by the task process: {trace}");
        let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap();
        assert_eq!(report["command"], command);
        assert_eq!(report["tasks"][0]["status"], "COMPLETED");
        let spec: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("tasks/1/task.json")).unwrap()).unwrap();
        assert_eq!(spec["command"], command);
    }
    let r = ctx.run(&["benchmark", "-d", "pca.h5ad", "-e", "X_pca", "--label-key", "cell_type", "--batch-key", "batch", "--shards", "2"]);
    r.user_error().stderr_has("unexpected argument '--shards'");
    let help = ctx.run(&["geometry", "--help"]);
    assert!(help.stdout.contains("--executor") && help.stdout.contains("--shards is embed's") && !help.stdout.contains("--shards <N>"), "{}", help.stdout);
}

// ---- scfoundry trace ----------------------------------------------------------------

#[test]
fn trace_reads_nextflows_own_trace() {
    let ctx = TestContext::new();
    let f = repo().join("tests/fixtures/trace/nextflow-docs-trace.txt");
    let r = ctx.run(&["trace", f.to_str().unwrap(), "--gpu-memory", "80GB"]);
    r.success();
    insta::assert_snapshot!("trace_nextflow_docs", r.stdout);
}

#[test]
fn trace_reads_ours_and_raw_units_alike() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    ctx.run(&["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--shards", "2"]).success();
    let trace = only_run_dir(&ctx.path("runs")).join("trace.txt");
    let r = ctx.run(&["trace", trace.to_str().unwrap()]);
    r.success();
    assert!(r.stdout.contains("EMBED_PCA_MERGE (pbmc68k_counts)") && r.stdout.contains("COMPLETED"), "{}", r.stdout);
    assert!(r.stdout.contains("4 tasks"), "{}", r.stdout);
    assert!(r.stdout.contains("EMBED_PCA_FIT: peak memory "), "{}", r.stdout);
    // the committed pair: the same records formatted and raw read the same
    let fx = repo().join("tests/fixtures/trace");
    let a = ctx.run(&["trace", fx.join("scfoundry-trace.txt").to_str().unwrap(), "--gpu-memory", "24 GB"]);
    let b = ctx.run(&["trace", fx.join("scfoundry-raw-trace.txt").to_str().unwrap(), "--gpu-memory", "24 GB"]);
    a.success();
    b.success();
    assert_eq!(a.stdout, b.stdout);
    insta::assert_snapshot!("trace_scfoundry", a.stdout);
}

#[test]
fn trace_suggests_a_batch_size_for_a_gpu() {
    let ctx = TestContext::new();
    let f = repo().join("tests/fixtures/trace/gpu-sizing-trace.txt");
    let r = ctx.run(&["trace", f.to_str().unwrap(), "--gpu-memory", "80GB"]);
    r.success();
    // scGPT: 32 cells 9.5 GB, 64 cells 14.9 GB -> 5.4 GB per 32 cells plus 4.1 GB fixed
    assert!(r.stdout.contains("--batch-size 402 fits 80 GB"), "{}", r.stdout);
    insta::assert_snapshot!("trace_gpu_sizing", r.stdout);
    let r = ctx.run(&["trace", f.to_str().unwrap()]);
    assert!(r.stdout.contains("pass --gpu-memory"), "{}", r.stdout);
}

#[test]
fn trace_errors_are_clear() {
    let ctx = TestContext::new();
    std::fs::write(ctx.path("bad.txt"), "task_id\tname\tstatus\n1\tX\n").unwrap();
    ctx.run(&["trace", "bad.txt"]).user_error().stderr_has("bad.txt:2: 2 fields, but the header has 3").has_hint();
    ctx.run(&["trace", "missing.txt"]).user_error();
    let f = repo().join("tests/fixtures/trace/nextflow-docs-trace.txt");
    ctx.run(&["trace", f.to_str().unwrap(), "--gpu-memory", "lots"]).user_error().stderr_has("--gpu-memory");
}

// ---- --executor slurm ---------------------------------------------------------------

/// The slurm.conf of a running test cluster, or None (allowed only outside CI).
pub(crate) fn slurm_conf() -> Option<PathBuf> {
    match std::env::var_os("SCFOUNDRY_TEST_SLURM_CONF") {
        Some(p) => Some(PathBuf::from(p)),
        None => {
            if std::env::var_os("CI").is_some() {
                panic!("CI=true but SCFOUNDRY_TEST_SLURM_CONF is not set: .ci/run must start Slurm with scripts/slurm-up.sh");
            }
            eprintln!("SCFOUNDRY_TEST_SLURM_CONF not set: skipping the Slurm test (start one with scripts/slurm-up.sh)");
            None
        }
    }
}

fn slurm_embed(ctx: &TestContext, conf: &Path, extra: &[&str], env: &[(&str, &str)]) -> (std::process::Output, Duration) {
    let started = Instant::now();
    let mut cmd = Command::new(BIN);
    cmd.args(["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--executor", "slurm"])
        .args(extra)
        .current_dir(ctx.dir.path())
        .env("SLURM_CONF", conf)
        .env("SCFOUNDRY_NO_PROGRESS", "1")
        .env("SCFOUNDRY_WEIGHTS_DIR", ctx.path("w"));
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (out, started.elapsed())
}

#[test]
fn slurm_sharded_embedding_equals_the_local_run() {
    let Some(conf) = slurm_conf() else { return };
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    ctx.run(&["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--out", "local.h5ad", "--runs-dir", "runs-local"]).success();
    let (out, took) = slurm_embed(&ctx, &conf, &["--out", "slurm.h5ad", "--shards", "3", "--gpus", "1", "--time", "10", "--mem", "500M"], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    eprintln!("slurm: fit + 3-shard array + merge took {:.1}s", took.as_secs_f64());
    assert_eq!(pca_bytes(&ctx.path("local.h5ad")), pca_bytes(&ctx.path("slurm.h5ad")), "Slurm's merged output differs from the local run");
    let dir = only_run_dir(&ctx.path("runs"));
    let trace = std::fs::read_to_string(dir.join("trace.txt")).unwrap();
    let rows: Vec<Vec<&str>> = trace.lines().skip(1).map(|l| l.split('\t').collect()).collect();
    assert_eq!(rows.len(), 5, "{trace}");
    assert!(rows.iter().all(|r| r[4] == "COMPLETED" && r[5] == "0"), "{trace}");
    assert!(rows[1][2].contains('_'), "array tasks have ids like 12_0: {trace}");
    // the GPU request reached the jobs: Slurm set CUDA_VISIBLE_DEVICES for a --gpus=1 job
    let log = std::fs::read_to_string(dir.join("logs/project-0.out")).unwrap();
    assert!(log.contains("CUDA_VISIBLE_DEVICES=0") || log.contains("CUDA_VISIBLE_DEVICES=1"), "{log}");
    let script = std::fs::read_to_string(dir.join("slurm/project.sh")).unwrap();
    assert!(script.contains("#SBATCH --array=0-2\n") && script.contains("#SBATCH --gpus=1\n") && script.contains("#SBATCH --mem=500M\n"), "{script}");
    assert!(!std::fs::read_to_string(dir.join("slurm/merge.sh")).unwrap().contains("--gpus"), "the merge asks for no GPU");
}

#[test]
fn slurm_failing_shard_cancels_the_merge_and_names_the_log() {
    let Some(conf) = slurm_conf() else { return };
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    let (out, took) = slurm_embed(&ctx, &conf, &["--shards", "3"], &[("SCFOUNDRY_FAIL_SHARD", "1")]);
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!("slurm: failing run reported in {:.1}s", took.as_secs_f64());
    assert_eq!(out.status.code(), Some(1), "{err}");
    let dir = only_run_dir(&ctx.path("runs"));
    let log = dir.join("logs/project-1.out");
    assert!(err.contains("shard 1) job ") && err.contains(&format!("FAILED exit 1, log {}", log.display())), "{err}");
    assert!(err.contains("shard 1 fails on purpose"), "the log's end is shown:\n{err}");
    assert!(err.contains("EMBED_PCA_MERGE (pbmc68k_counts) job ") && err.contains("CANCELLED (DependencyNeverSatisfied)"), "{err}");
    assert!(std::fs::read_to_string(&log).unwrap().contains("shard 1 fails on purpose"));
    assert!(!ctx.path("pbmc68k_counts.pca.h5ad").exists());
    let trace = std::fs::read_to_string(dir.join("trace.txt")).unwrap();
    let merge = trace.lines().find(|l| l.contains("MERGE")).unwrap();
    assert!(merge.contains("\tABORTED\t"), "{trace}");
}

#[test]
fn slurm_missing_is_a_clear_error() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    let out = Command::new(BIN)
        .args(["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--executor", "slurm"])
        .current_dir(ctx.dir.path())
        .env("PATH", ctx.path("empty-bin"))
        .env("SCFOUNDRY_WEIGHTS_DIR", ctx.path("w"))
        .output()
        .unwrap();
    crate::common::Run::from(out).user_error().stderr_has("`sbatch` is not on PATH").has_hint();
}

/// integrate, then benchmark and geometry of the integrated file, locally and as Slurm jobs:
/// the same bytes, the same tables on stdout, one job each with its log named.
#[test]
fn slurm_integrate_benchmark_geometry_equal_the_local_runs() {
    let Some(conf) = slurm_conf() else { return };
    let ctx = TestContext::new();
    pca_demo(&ctx);
    let slurm = |args: &[&str]| -> (crate::common::Run, Duration) {
        let started = Instant::now();
        let out = Command::new(BIN)
            .args(args)
            .args(["--executor", "slurm", "--runs-dir", "runs-slurm", "--time", "10", "--mem", "500M", "--cpus", "1"])
            .current_dir(ctx.dir.path())
            .env("SLURM_CONF", &conf)
            .env("SCFOUNDRY_NO_PROGRESS", "1")
            .env("SCFOUNDRY_WEIGHTS_DIR", ctx.path("w"))
            .output()
            .unwrap();
        (crate::common::Run::from(out), started.elapsed())
    };
    let local = |args: &[&str]| {
        let mut a = args.to_vec();
        a.extend(["--runs-dir", "runs-local"]);
        let r = ctx.run(&a);
        r.success();
        r
    };
    let integrate = ["integrate", "-m", "harmony", "-d", "pca.h5ad", "--batch-key", "batch", "--seed", "3"];
    local(&[&integrate[..], &["-o", "int-local.h5ad"]].concat());
    let (r, took) = slurm(&[&integrate[..], &["-o", "int-slurm.h5ad"]].concat());
    r.success().stderr_has("obsm['X_harmony'] (200 cells x 20)");
    eprintln!("slurm: integrate took {:.1}s", took.as_secs_f64());
    let harmony = |p: &str| hdf5::File::open(ctx.path(p)).unwrap().dataset("obsm/X_harmony").unwrap().read_raw::<f32>().unwrap().iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
    assert_eq!(harmony("int-local.h5ad"), harmony("int-slurm.h5ad"), "Slurm's X_harmony differs from the local run");

    let bench = ["benchmark", "-d", "int-local.h5ad", "-e", "X_pca,X_harmony", "--label-key", "cell_type", "--batch-key", "batch", "--per-cell"];
    let lb = local(&[&bench[..], &["-o", "bench-local"]].concat());
    let (sb, took) = slurm(&[&bench[..], &["-o", "bench-slurm"]].concat());
    sb.success();
    eprintln!("slurm: benchmark took {:.1}s", took.as_secs_f64());
    assert_eq!(lb.stdout, sb.stdout, "the ranked table on stdout");
    assert!(sb.stdout.starts_with("rank embedding"), "{}", sb.stdout);
    for f in ["results.tsv", "lisi_per_cell.tsv"] {
        let a = std::fs::read_to_string(ctx.path("bench-local").join(f)).unwrap();
        assert_eq!(a, std::fs::read_to_string(ctx.path("bench-slurm").join(f)).unwrap(), "{f} differs");
        assert!(a.lines().count() > 2);
    }

    let geo = ["geometry", "-d", "int-local.h5ad", "-e", "X_harmony"];
    let lg = local(&[&geo[..], &["-o", "geo-local"]].concat());
    let (sg, _) = slurm(&[&geo[..], &["-o", "geo-slurm"]].concat());
    sg.success();
    assert_eq!(lg.stdout, sg.stdout);
    assert_eq!(std::fs::read_to_string(ctx.path("geo-local/geometry.tsv")).unwrap(), std::fs::read_to_string(ctx.path("geo-slurm/geometry.tsv")).unwrap());

    // one job per command: its trace row, its batch script and its log
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(ctx.path("runs-slurm")).unwrap().map(|e| e.unwrap().path()).collect();
    dirs.sort();
    assert_eq!(dirs.len(), 3, "{dirs:?}");
    for (command, r) in [("integrate", &r), ("benchmark", &sb), ("geometry", &sg)] {
        let dir = dirs.iter().find(|d| d.file_name().unwrap().to_string_lossy().contains(if command == "integrate" { "-harmony-" } else { command })).unwrap();
        let trace = std::fs::read_to_string(dir.join("trace.txt")).unwrap();
        let rows: Vec<Vec<&str>> = trace.lines().skip(1).map(|l| l.split('\t').collect()).collect();
        assert_eq!(rows.len(), 1, "{trace}");
        assert!(rows[0][4] == "COMPLETED" && rows[0][5] == "0" && rows[0][2].chars().all(|c| c.is_ascii_digit()), "{trace}");
        let log = dir.join(format!("logs/{command}.out"));
        r.stderr_has(&format!("job {} COMPLETED exit 0, log {}", rows[0][2], log.display()));
        assert!(std::fs::read_to_string(&log).unwrap().contains("scfoundry: job "), "the job's log");
        let script = std::fs::read_to_string(dir.join(format!("slurm/{command}.sh"))).unwrap();
        for d in ["--time=10", "--mem=500M", "--cpus-per-task=1"] {
            assert!(script.contains(&format!("#SBATCH {d}\n")), "{script}");
        }
        assert!(script.contains("__task"), "{script}");
    }
}

// ---- Nextflow files: the real parsers, and rules of our own ----------------------------

#[test]
fn nextflow_files_pass_the_parsers() {
    let ctx = TestContext::new();
    ctx.run(&["init", "ws"]).success();
    // generated configs: every profile pinned, unpinned per profile, and a run's config
    let mut generated = vec![];
    for (name, args) in [
        ("all-gpu1.config", vec!["--gpu-id", "1", "--max-forks", "2"]),
        ("docker.config", vec!["--profile", "docker"]),
        ("apptainer-slurm.config", vec!["--profile", "apptainer", "--profile", "slurm", "--gpu-id", "0"]),
        ("all-gpu0-3.config", vec!["--gpu", "0-3"]),
        ("unpinned.config", vec![]),
    ] {
        let out = ctx.path(name);
        let mut a = vec!["--workspace", "ws", "config", "--out", out.to_str().unwrap()];
        a.extend(args);
        ctx.run(&a).success();
        generated.push(out);
    }
    let cfg = scfoundry::nfconfig::NfConfig {
        gpus: Some("3".parse().unwrap()),
        gpu_locks: "/tmp/gpu locks/it's".into(),
        max_forks: 1,
        profiles: scfoundry::nfconfig::all_profiles(),
        weights_dir: "/w eights/it's".into(),
        work_dir: ctx.path("run/work"),
        outdir: ctx.path("run/results"),
        scfoundry: "/opt/scfoundry/bin/scfoundry".into(),
        params: vec![],
        made_by: "test".into(),
    };
    std::fs::write(ctx.path("run.config"), cfg.render()).unwrap();
    generated.push(ctx.path("run.config"));
    // the config a `benchmark --executor nextflow` run writes
    pca_demo(&ctx);
    let bin = fake_nextflow(ctx.dir.path());
    let args = ["benchmark", "-d", "pca.h5ad", "-e", "X_pca", "--label-key", "cell_type", "--batch-key", "batch", "--executor", "nextflow", "--runs-dir", "runs-nf"];
    let out = run_fake_nextflow(&ctx, &bin, &ctx.path("argv.txt"), &args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    generated.push(only_run_dir(&ctx.path("runs-nf")).join("nextflow.config"));
    // reftrace lives in $REFTRACE_PYTHON, else in the test venv ($SCFOUNDRY_TEST_PYTHON)
    let mut cmd = Command::new(repo().join("scripts/validate-nextflow.sh"));
    if std::env::var_os("REFTRACE_PYTHON").is_none() {
        if let Some(py) = std::env::var_os("SCFOUNDRY_TEST_PYTHON") {
            cmd.env("REFTRACE_PYTHON", py);
        }
    }
    let out = cmd.args(&generated).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if out.status.code() == Some(3) {
        if std::env::var_os("CI").is_some() {
            panic!("CI=true but the Nextflow parsers are missing (apt-get install -y groovy; pip install -r ci/requirements-nextflow.txt):\n{text}");
        }
        eprintln!("skipping: {text}");
        return;
    }
    assert!(out.status.success(), "{text}");
    for g in &generated {
        assert!(text.contains(&format!("ok   {}", g.display())), "{} not validated:\n{text}", g.display());
    }
    for f in [
        "nextflow.config",
        "conf/base.config",
        "conf/modules.config",
        "conf/test.config",
        "main.nf",
        "workflows/scfoundry.nf",
        "modules/local/embed/main.nf",
        "modules/local/integrate/main.nf",
        "modules/local/benchmark/main.nf",
        "modules/local/geometry/main.nf",
    ] {
        assert!(text.contains(&format!("ok   {f}")), "{f} not validated:\n{text}");
    }
}

/// Every `params.x` the pipeline reads is declared in nextflow.config and documented in
/// nextflow_schema.json, and the schema documents nothing that does not exist.
#[test]
fn every_pipeline_parameter_is_declared_and_documented() {
    let root = repo();
    let mut files = vec![root.join("main.nf"), root.join("nextflow.config")];
    for dir in ["workflows", "conf"] {
        for e in std::fs::read_dir(root.join(dir)).unwrap() {
            files.push(e.unwrap().path());
        }
    }
    for e in std::fs::read_dir(root.join("modules/local")).unwrap() {
        files.push(e.unwrap().path().join("main.nf"));
    }
    let mut used = std::collections::BTreeSet::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let mut rest = text.as_str();
        while let Some(i) = rest.find("params.") {
            let tail = &rest[i + 7..];
            let name: String = tail.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            if !name.is_empty() {
                used.insert(name);
            }
            rest = tail;
        }
    }
    // params[name] lookups in the workflow name these
    for p in ["input", "reference", "query"] {
        used.insert(p.to_string());
    }
    let config = std::fs::read_to_string(root.join("nextflow.config")).unwrap();
    let block = &config[config.find("params {").unwrap()..];
    let block = &block[..block.find("\n}\n").unwrap()];
    let declared: std::collections::BTreeSet<String> = block
        .lines()
        .skip(1)
        .filter_map(|l| l.trim().split_once(" = ").or_else(|| l.trim().split_once(" ")).map(|(k, _)| k.trim().to_string()))
        .filter(|k| !k.is_empty() && !k.starts_with("//"))
        .collect();
    let schema: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(root.join("nextflow_schema.json")).unwrap()).unwrap();
    let mut documented = std::collections::BTreeSet::new();
    for (_, group) in schema["$defs"].as_object().unwrap() {
        for (name, p) in group["properties"].as_object().unwrap() {
            assert!(p["description"].as_str().is_some_and(|d| !d.is_empty()), "{name} has no description");
            documented.insert(name.clone());
        }
    }
    let missing: Vec<_> = used.difference(&declared).collect();
    assert!(missing.is_empty(), "used but not declared in nextflow.config: {missing:?}");
    assert_eq!(declared, documented, "nextflow.config params vs nextflow_schema.json");
    // what `scfoundry config` and the nextflow executor pass are parameters too
    for p in [
        "weights_dir", "outdir", "scfoundry", "gpu_id", "max_forks", "task", "method", "input", "seed", "n_comps", "n_top_genes", "layer", "batch_size", "embedding", "batch_key",
        "label_key", "theta", "metrics", "batch_max_cells", "per_cell", "min_max_scale", "max_cells",
    ] {
        assert!(documented.contains(p), "{p} is not in the schema");
    }
}

#[test]
fn slurm_ctrl_c_cancels_the_jobs() {
    let Some(conf) = slurm_conf() else { return };
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    // `--begin` after `--` (passed to sbatch) keeps the jobs pending until we interrupt
    let child = Command::new(BIN)
        .args(["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--executor", "slurm", "--shards", "2", "--max-forks", "1", "--", "--begin=now+600"])
        .current_dir(ctx.dir.path())
        .env("SLURM_CONF", &conf)
        .env("SCFOUNDRY_WEIGHTS_DIR", ctx.path("w"))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // wait until the jobs are submitted (the scripts are written before sbatch runs)
    let merge = |dir: &Path| dir.join("slurm/merge.sh");
    let started = Instant::now();
    let dir = loop {
        if let Ok(rd) = std::fs::read_dir(ctx.path("runs")) {
            if let Some(d) = rd.filter_map(|e| e.ok()).map(|e| e.path()).find(|p| merge(p).exists()) {
                break d;
            }
        }
        assert!(started.elapsed() < Duration::from_secs(30), "no jobs submitted");
        std::thread::sleep(Duration::from_millis(100));
    };
    std::thread::sleep(Duration::from_millis(1500));
    let array = std::fs::read_to_string(dir.join("slurm/project.sh")).unwrap();
    assert!(array.contains("#SBATCH --array=0-1%1\n"), "--max-forks throttles the array: {array}");
    unsafe {
        libc::kill(child.id() as i32, libc::SIGINT);
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted: cancelled Slurm jobs"), "{err}");
    let ids: Vec<String> = err.lines().find(|l| l.contains("cancelled Slurm jobs")).unwrap().rsplit("jobs ").next().unwrap().split_whitespace().map(String::from).collect();
    assert_eq!(ids.len(), 3, "fit, array, merge: {err}");
    for id in ids {
        let o = Command::new("scontrol").args(["-o", "show", "job", &id]).env("SLURM_CONF", &conf).output().unwrap();
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(text.lines().all(|l| l.contains("JobState=CANCELLED")), "job {id} not cancelled: {text}");
    }
}
