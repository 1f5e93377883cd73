//! Sharded embeddings beyond equality (each method's test file checks that its sharded output
//! equals its unsharded one): resuming a run whose shard was killed mid-write, the
//! embedding-only output read by Python's anndata, `--shards auto`, Slurm job arrays for a
//! transformer and a non-transformer, and deterministic Nextflow inputs for `-resume`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{python, read_obsm, repo, TestContext, BIN, SHARD_BLOCK_ROWS};

fn genept_dir() -> PathBuf {
    repo().join("tests/fixtures/genept")
}

/// The 50-cell file of the genept fixture, copied into the test folder as `pbmc.h5ad`.
fn pbmc(ctx: &TestContext) {
    let f: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(genept_dir().join("reference.json")).unwrap()).unwrap();
    std::fs::copy(repo().join(f["data"].as_str().unwrap()), ctx.path("pbmc.h5ad")).unwrap();
}

fn only_dir(runs: &Path) -> PathBuf {
    let dirs: Vec<PathBuf> = std::fs::read_dir(runs).unwrap().flatten().map(|e| e.path()).filter(|p| p.is_dir() && !p.ends_with(".locks")).collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    dirs[0].clone()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn a_killed_shard_resumes_to_the_uninterrupted_output() {
    let ctx = TestContext::new();
    pbmc(&ctx);
    let model = genept_dir();
    let block = [("SCFOUNDRY_BLOCK_ROWS", Path::new(SHARD_BLOCK_ROWS))];
    let base = ["embed", "-m", "genept", "-d", "pbmc.h5ad", "--model-dir", model.to_str().unwrap()];
    ctx.run_env(&[&base[..], &["-o", "whole.h5ad", "--runs-dir", "runs-whole"]].concat(), &block).success();
    // shard 1 of 3 is killed (SIGKILL) after writing its first block, as a scheduler kills a job
    let mut env = block.to_vec();
    env.push(("SCFOUNDRY_KILL_SHARD", Path::new("1")));
    let r = ctx.run_env(&[&base[..], &["-o", "split.h5ad", "--shards", "3", "--runs-dir", "runs"]].concat(), &env);
    assert_ne!(r.code, 0, "{}", r.stderr);
    r.stderr_has("--resume");
    assert!(!ctx.path("split.h5ad").exists(), "no output while a shard is missing");
    let run = only_dir(&ctx.path("runs"));
    let work = run.join("work");
    assert!(!work.join("shard1.json").exists(), "the killed shard left no record");
    let leftovers: Vec<String> = std::fs::read_dir(&work).unwrap().flatten().map(|e| e.file_name().to_string_lossy().to_string()).filter(|n| n.starts_with("shard1")).collect();
    assert!(leftovers.iter().all(|n| n.ends_with(".tmp")), "only a partial temporary file: {leftovers:?}");
    // a shard whose rows were tampered with is run again too
    let r = ctx.run_env(&["embed", "--resume", run.to_str().unwrap()], &block);
    r.success().stderr_has("of 3 shards finished and checked");
    let (whole, _) = read_obsm(&ctx.path("whole.h5ad"), "X_genept");
    let (split, _) = read_obsm(&ctx.path("split.h5ad"), "X_genept");
    assert_eq!(bits(&whole), bits(&split), "the resumed output differs from the uninterrupted run");
    let trace = std::fs::read_to_string(run.join("trace.txt")).unwrap();
    let status = |name: &str| trace.lines().find(|l| l.contains(name)).map(|l| l.split('\t').nth(4).unwrap().to_string()).unwrap_or_default();
    assert_eq!(status("shard 0)"), "CACHED", "{trace}");
    assert_eq!(status("shard 1)"), "COMPLETED", "{trace}");
    assert_eq!(status("_MERGE"), "COMPLETED", "{trace}");

    // resuming again after corrupting a finished shard re-runs that shard only
    let rows = work.join("shard2.f32");
    let mut bytes = std::fs::read(&rows).unwrap();
    bytes[0] ^= 0xff;
    std::fs::write(&rows, bytes).unwrap();
    std::fs::remove_file(ctx.path("split.h5ad")).unwrap();
    ctx.run_env(&["embed", "--resume", run.to_str().unwrap()], &block).success().stderr_has("2 of 3 shards finished and checked");
    let (again, _) = read_obsm(&ctx.path("split.h5ad"), "X_genept");
    assert_eq!(bits(&whole), bits(&again));
    // --resume takes no other input options, and a folder without a plan is refused
    ctx.run(&["embed", "--resume", run.to_str().unwrap(), "-m", "genept"]).user_error();
    ctx.run(&["embed", "--resume", ctx.path("runs").to_str().unwrap()]).user_error().stderr_has("plan.json");
}

#[test]
fn embedding_only_holds_the_index_and_the_embedding_and_joins_back() {
    let ctx = TestContext::new();
    pbmc(&ctx);
    let model = genept_dir();
    let base = ["embed", "-m", "genept", "-d", "pbmc.h5ad", "--model-dir", model.to_str().unwrap()];
    ctx.run(&[&base[..], &["-o", "full.h5ad"]].concat()).success();
    ctx.run_env(&[&base[..], &["-o", "small.h5ad", "--embedding-only", "--shards", "2"]].concat(), &[("SCFOUNDRY_BLOCK_ROWS", Path::new(SHARD_BLOCK_ROWS))]).success();
    let (a, _) = read_obsm(&ctx.path("full.h5ad"), "X_genept");
    let (b, _) = read_obsm(&ctx.path("small.h5ad"), "X_genept");
    assert_eq!(bits(&a), bits(&b));
    let full = std::fs::metadata(ctx.path("full.h5ad")).unwrap().len();
    let small = std::fs::metadata(ctx.path("small.h5ad")).unwrap().len();
    assert!(small * 3 < full, "the embedding-only file ({small} bytes) should be far smaller than the full copy ({full})");
    let f = hdf5::File::open(ctx.path("small.h5ad")).unwrap();
    assert!(!f.link_exists("X") && !f.link_exists("layers/counts"), "no copy of the matrix");
    let Some(py) = python() else { return };
    // anndata reads it, and the documented join puts the embedding back on the full data
    let out = crate::common::python_json(&py, "embedding_only_join.py", &[&ctx.path("full.h5ad"), &ctx.path("small.h5ad")]);
    assert_eq!(out["shape"], serde_json::json!([50, 0]));
    assert_eq!(out["joined"], true);
    assert_eq!(out["method"], "genept");
}

#[test]
fn shards_auto_and_bad_counts() {
    let ctx = TestContext::new();
    pbmc(&ctx);
    let model = genept_dir();
    let base = ["embed", "-m", "genept", "-d", "pbmc.h5ad", "--model-dir", model.to_str().unwrap()];
    // 50 cells and no card: one shard (at most 200,000 cells a shard)
    ctx.run(&[&base[..], &["-o", "a.h5ad", "--shards", "auto", "--runs-dir", "r"]].concat()).success().stderr_has("(2 tasks)");
    ctx.run(&[&base[..], &["-o", "b.h5ad", "--shards", "0"]].concat()).user_error().stderr_has("not a shard count");
    ctx.run(&[&base[..], &["-o", "b.h5ad", "--shards", "many"]].concat()).user_error().stderr_has("`auto`");
}

/// `embed ... --executor slurm --shards 3` through the real Slurm equals the local run, for the
/// non-transformer genept and the transformer geneformer (its tiny fixture model).
#[test]
fn slurm_shards_of_a_transformer_and_a_non_transformer_equal_the_local_run() {
    let Some(conf) = crate::orchestration::slurm_conf() else { return };
    let ctx = TestContext::new();
    pbmc(&ctx);
    std::fs::copy(repo().join("tests/fixtures/geneformer/pbmc68k_50.h5ad"), ctx.path("cells.h5ad")).unwrap();
    let gf = repo().join("tests/fixtures/geneformer/v1");
    let gp = genept_dir();
    let cases: [(&str, Vec<&str>, &str); 2] = [
        ("genept", vec!["-d", "pbmc.h5ad", "--model-dir", gp.to_str().unwrap()], "X_genept"),
        ("geneformer", vec!["-d", "cells.h5ad", "--model-dir", gf.to_str().unwrap(), "--batch-size", "1"], "X_geneformer"),
    ];
    for (method, args, key) in cases {
        let local = format!("{method}-local.h5ad");
        let slurm = format!("{method}-slurm.h5ad");
        let runs = format!("runs-{method}");
        let mut cmd = Command::new(BIN);
        cmd.args(["embed", "-m", method]).args(&args).args(["-o", &local, "--runs-dir", "runs-local"]);
        let run = |cmd: &mut Command| {
            let out = cmd.current_dir(ctx.dir.path()).env("SLURM_CONF", &conf).env("SCFOUNDRY_NO_PROGRESS", "1").env("SCFOUNDRY_BLOCK_ROWS", SHARD_BLOCK_ROWS).env("SCFOUNDRY_WEIGHTS_DIR", ctx.path("w")).env("HDF5_USE_FILE_LOCKING", "FALSE").output().unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        };
        run(&mut cmd);
        let mut cmd = Command::new(BIN);
        cmd.args(["embed", "-m", method]).args(&args).args(["-o", &slurm, "--executor", "slurm", "--shards", "3", "--time", "10", "--mem", "1G", "--runs-dir", &runs]);
        run(&mut cmd);
        let (a, _) = read_obsm(&ctx.path(&local), key);
        let (b, _) = read_obsm(&ctx.path(&slurm), key);
        assert_eq!(bits(&a), bits(&b), "{method}: Slurm's merged output differs from the local run");
        let dir = only_dir(&ctx.path(&runs));
        let script = std::fs::read_to_string(dir.join("slurm/project.sh")).unwrap();
        assert!(script.contains("#SBATCH --array=0-2\n"), "{script}");
        assert!(!dir.join("slurm/fit.sh").exists(), "{method} needs no fit job");
        let trace = std::fs::read_to_string(dir.join("trace.txt")).unwrap();
        assert_eq!(trace.lines().count(), 1 + 4, "3 shards and a merge: {trace}");
    }
    // several files: one job array over every file's shards, then a merge job a file
    std::fs::copy(ctx.path("pbmc.h5ad"), ctx.path("a.h5ad")).unwrap();
    std::fs::copy(ctx.path("pbmc.h5ad"), ctx.path("b.h5ad")).unwrap();
    let out = Command::new(BIN)
        .args(["embed", "-m", "genept", "-d", "a.h5ad", "b.h5ad", "--model-dir", gp.to_str().unwrap(), "-o", "files", "--executor", "slurm", "--shards", "2", "--time", "10", "--mem", "1G", "--runs-dir", "runs-files"])
        .current_dir(ctx.dir.path())
        .env("SLURM_CONF", &conf)
        .env("SCFOUNDRY_NO_PROGRESS", "1")
        .env("SCFOUNDRY_BLOCK_ROWS", SHARD_BLOCK_ROWS)
        .env("SCFOUNDRY_WEIGHTS_DIR", ctx.path("w"))
        .env("HDF5_USE_FILE_LOCKING", "FALSE")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("merge-5 job") && stderr.contains("merge-6 job"), "{stderr}");
    let (a, _) = read_obsm(&ctx.path("genept-local.h5ad"), "X_genept");
    for f in ["files/a.genept.h5ad", "files/b.genept.h5ad"] {
        let (b, _) = read_obsm(&ctx.path(f), "X_genept");
        assert_eq!(bits(&a), bits(&b), "{f}: Slurm's output differs from the local run");
    }
    let script = std::fs::read_to_string(only_dir(&ctx.path("runs-files")).join("slurm/project.sh")).unwrap();
    assert!(script.contains("#SBATCH --array=0-3\n"), "{script}");
}

/// Nextflow's `-resume` finds cached tasks when their scripts are byte-identical: the same
/// embedding asked twice gives the same pipeline parameters and config, but for the run folder.
/// (Nextflow itself cannot be installed here; a fake `nextflow` records what it is given.)
#[test]
fn nextflow_inputs_are_identical_for_the_same_run() {
    let ctx = TestContext::new();
    pbmc(&ctx);
    let bin = crate::orchestration::fake_nextflow(ctx.dir.path());
    let model = genept_dir();
    let mut seen = Vec::new();
    for i in 0..2 {
        let argv = ctx.path(&format!("argv{i}"));
        let runs = ctx.path(&format!("runs{i}"));
        let out = crate::orchestration::run_fake_nextflow(&ctx, &bin, &argv, &["embed", "-m", "genept", "-d", "pbmc.h5ad", "--model-dir", model.to_str().unwrap(), "--executor", "nextflow", "--runs-dir", runs.to_str().unwrap(), "-o", &format!("o{i}.h5ad")]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let dir = only_dir(&runs);
        let id = dir.file_name().unwrap().to_string_lossy().to_string();
        let clean = |t: String| t.replace(dir.to_str().unwrap(), "RUN").replace(&id, "ID");
        let args = clean(std::fs::read_to_string(&argv).unwrap());
        let config = clean(std::fs::read_to_string(dir.join("nextflow.config")).unwrap());
        seen.push((args, config));
    }
    assert_eq!(seen[0].0, seen[1].0, "the pipeline's parameters differ");
    assert_eq!(seen[0].1, seen[1].1, "the generated nextflow.config differs");
}

/// Several files as one run: `--data a.h5ad b.h5ad` (each file its own shard(s), its own
/// output, each equal to that file embedded alone), a .txt list with --embedding-only (one
/// table, read by anndata), and the refusals: a method that fits the whole data, and a table
/// without --out.
#[test]
fn several_files_embed_as_one_run() {
    let ctx = TestContext::new();
    pbmc(&ctx);
    let model = genept_dir();
    let m = model.to_str().unwrap();
    std::fs::copy(ctx.path("pbmc.h5ad"), ctx.path("a.h5ad")).unwrap();
    std::fs::copy(ctx.path("pbmc.h5ad"), ctx.path("b.h5ad")).unwrap();
    ctx.run(&["embed", "-m", "genept", "-d", "pbmc.h5ad", "--model-dir", m, "-o", "alone.h5ad"]).success();
    let (alone, _) = read_obsm(&ctx.path("alone.h5ad"), "X_genept");
    let r = ctx.run(&["embed", "-m", "genept", "-d", "a.h5ad", "b.h5ad", "--model-dir", m, "-o", "outs", "--runs-dir", "runs-files"]);
    r.success().stderr_has("outs/a.genept.h5ad").stderr_has("outs/b.genept.h5ad");
    for f in ["outs/a.genept.h5ad", "outs/b.genept.h5ad"] {
        let (v, _) = read_obsm(&ctx.path(f), "X_genept");
        assert_eq!(bits(&v), bits(&alone), "{f}");
    }
    let trace = std::fs::read_to_string(only_dir(&ctx.path("runs-files")).join("trace.txt")).unwrap();
    assert!(trace.contains("(a, shard 0)") && trace.contains("(b, shard 0)") && trace.contains("MERGE (b)"), "{trace}");
    // shards within files
    let block = [("SCFOUNDRY_BLOCK_ROWS", Path::new(SHARD_BLOCK_ROWS))];
    ctx.run_env(&["embed", "-m", "genept", "-d", "a.h5ad", "b.h5ad", "--model-dir", m, "-o", "split", "--shards", "2", "--runs-dir", "runs-split"], &block).success();
    let (v, _) = read_obsm(&ctx.path("split/b.genept.h5ad"), "X_genept");
    assert_eq!(bits(&v), bits(&alone));
    // a list file and one table
    std::fs::write(ctx.path("files.txt"), "# two parts\na.h5ad\nb.h5ad\n").unwrap();
    let r = ctx.run(&["embed", "-m", "genept", "-d", "files.txt", "--model-dir", m, "--embedding-only", "-o", "table.h5ad"]);
    r.success().stderr_has("(100 cells x").stderr_has("index_unique");
    let (t, _) = read_obsm(&ctx.path("table.h5ad"), "X_genept");
    assert_eq!(bits(&t), bits(&[alone.clone(), alone.clone()].concat()));
    if let Some(py) = python() {
        let out = crate::common::python_json(&py, "table_of_files.py", &[&ctx.path("table.h5ad"), Path::new("X_genept"), &ctx.path("outs/a.genept.h5ad"), &ctx.path("outs/b.genept.h5ad")]);
        assert_eq!(out["shape"], serde_json::json!([100, 0]));
        assert_eq!(out["files"], serde_json::json!(["a", "b"]));
        assert_eq!(out["counts"], serde_json::json!([50, 50]));
        assert_eq!(out["names_unique"], true);
        assert!(out["first_name"].as_str().unwrap().ends_with("-a"), "{out}");
        assert_eq!(out["equal"], serde_json::json!([true, true]));
    }
    // refusals, before any work
    ctx.run(&["embed", "-m", "genept", "-d", "a.h5ad", "b.h5ad", "--model-dir", m, "--embedding-only"]).user_error().stderr_has("--out");
    ctx.run(&["embed", "-m", "pca", "-d", "a.h5ad", "b.h5ad"]).user_error().stderr_has("anndata.concat");
    ctx.run(&["embed", "-m", "genept", "-d", "a.h5ad", "a.h5ad", "--model-dir", m]).user_error().stderr_has("named twice");
}
