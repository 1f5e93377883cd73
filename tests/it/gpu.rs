//! The GPU runtime as CI sees it (no GPU, CPU build): `doctor`, device and allocator options,
//! the workspace's [allocator], and the errors that must never turn into a silent CPU run.
//! The GPU half runs on a GPU machine with bench/gpu_runtime.sh (BENCHMARKS.md, "GPU runtime").

use crate::common::{repo, TestContext};

fn cuda_build() -> bool {
    scfoundry::gpu::CUDA_COMPILED
}

#[test]
fn doctor_on_the_cpu_build_says_how_to_get_cuda() {
    if cuda_build() {
        return;
    }
    let ctx = TestContext::new();
    let r = ctx.run(&["doctor"]);
    r.success();
    let text = r.stdout.replace(env!("CARGO_PKG_VERSION"), "[VERSION]");
    insta::assert_snapshot!("doctor_cpu_build", text);
    let j = ctx.run(&["doctor", "--json"]);
    j.success();
    let v: serde_json::Value = serde_json::from_str(&j.stdout).unwrap();
    assert_eq!(v["cuda_compiled"], false);
    assert_eq!(v["allocator"]["options"]["kind"], "async");
    assert_eq!(v["allocator"]["from"], "default");
    // the benchmark needs CUDA: a clear refusal, exit 1
    let b = ctx.run(&["doctor", "--bench-alloc"]);
    assert_eq!(b.code, 1, "{}", b.stderr);
    assert!(b.stderr.contains("needs the CUDA build"), "{}", b.stderr);
}

#[test]
fn device_cuda_without_the_cuda_build_fails_before_any_work() {
    if cuda_build() {
        return;
    }
    let ctx = TestContext::new();
    let data = ctx.demo("pbmc68k_counts.h5ad");
    let before = std::fs::read(&data).unwrap();
    let w = ctx.path("weights");
    // cellama has a CUDA path: the request is refused, never run on the CPU instead
    let r = ctx.run(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "cellama", "-d", "pbmc68k_counts.h5ad", "--device", "cuda"]);
    r.user_error().has_hint().stderr_has("built without CUDA").stderr_has("scripts/build-cuda.sh");
    assert!(!ctx.path("pbmc68k_counts.cellama.h5ad").exists());
    assert!(!ctx.path("runs").exists(), "no run folder for a refused run");
    assert_eq!(std::fs::read(&data).unwrap(), before);
}

#[test]
fn a_cpu_method_asked_for_cuda_warns_and_runs_on_the_cpu() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    let r = ctx.run(&["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--n-comps", "5", "--device", "cuda", "--allocator", "pool"]);
    r.success().stderr_has("pca runs on the CPU only; --device cuda and the GPU memory options are ignored");
    assert!(ctx.path("pbmc68k_counts.pca.h5ad").is_file());
    // no GPU report for a CPU task
    let runs: Vec<_> = std::fs::read_dir(ctx.path("runs")).unwrap().flatten().filter(|e| e.path().is_dir() && !e.file_name().to_string_lossy().starts_with('.')).collect();
    assert_eq!(runs.len(), 1);
    assert!(!runs[0].path().join("gpu.tsv").exists());
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(runs[0].path().join("report.json")).unwrap()).unwrap();
    assert_eq!(report["gpu"], serde_json::json!([]));
}

#[test]
fn allocator_options_are_checked_with_hints() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    let cases: &[(&[&str], &str)] = &[
        (&["--allocator", "async", "--initial-pool-size", "1GiB"], "invalid --initial-pool-size"),
        (&["--allocator", "pool", "--initial-pool-size", "8GiB", "--maximum-pool-size", "1GiB"], "8GiB > --maximum-pool-size 1GiB"),
        (&["--allocator", "managed-pool"], "--allocator managed-pool needs an explicit --maximum-pool-size"),
        (&["--allocator", "pool", "--device-budget", "1GiB"], "invalid --device-budget"),
    ];
    for (extra, want) in cases {
        let mut args = vec!["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad"];
        args.extend_from_slice(extra);
        let r = ctx.run(&args);
        r.user_error().has_hint();
        assert!(r.stderr.contains(want), "{extra:?}: {}", r.stderr);
    }
    let r = ctx.run(&["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--gpu-memory-limit", "8 parsecs"]);
    assert_ne!(r.code, 0, "a bad size is refused: {}", r.stderr);
    assert!(r.stderr.contains("512MiB"), "the size format is explained: {}", r.stderr);
}

#[test]
fn the_workspace_sets_the_allocator_and_flags_win() {
    let ctx = TestContext::new();
    let ws = ctx.path("ws");
    ctx.run(&["init", ws.to_str().unwrap()]).success();
    let cfg = ws.join("scfoundry.toml");
    let mut text = std::fs::read_to_string(&cfg).unwrap();
    text.push_str("\n[allocator]\nkind = \"pool\"\ninitial_pool_size = \"1GiB\"\nmaximum_pool_size = \"2GiB\"\nlimit = \"1536MiB\"\n");
    std::fs::write(&cfg, &text).unwrap();
    let r = ctx.run(&["--workspace", ws.to_str().unwrap(), "doctor"]);
    r.success();
    assert!(r.stdout.contains("allocator in effect: pool (initial 1GiB, maximum 2GiB, limit 1536MiB) (from workspace scfoundry.toml)"), "{}", r.stdout);
    // a flag of another kind drops the workspace's pool sizes but keeps its limit
    let r = ctx.run(&["--workspace", ws.to_str().unwrap(), "doctor", "--allocator", "managed"]);
    r.success();
    assert!(r.stdout.contains("allocator in effect: managed (limit 1536MiB) (from --allocator)"), "{}", r.stdout);
    // a wrong workspace setting names the file and the table
    std::fs::write(&cfg, text.replace("initial_pool_size = \"1GiB\"", "initial_pool_size = \"4GiB\"")).unwrap();
    let r = ctx.run(&["--workspace", ws.to_str().unwrap(), "doctor"]);
    r.user_error().stderr_has("scfoundry.toml: [allocator]").stderr_has("4GiB > --maximum-pool-size 2GiB");
    std::fs::write(&cfg, text.replace("kind = \"pool\"", "kind = \"arena\"")).unwrap();
    let r = ctx.run(&["--workspace", ws.to_str().unwrap(), "doctor"]);
    r.user_error().stderr_has("scfoundry.toml");
}

#[test]
fn the_cuda_build_recipe_is_in_the_repository() {
    // scripts/build-cuda.sh applies our patches to the registry sources: they must apply cleanly
    // to the versions Cargo.lock pins (the patches name their crate versions).
    let lock = std::fs::read_to_string(repo().join("Cargo.lock")).unwrap();
    for (krate, version) in [("cudarc", "0.19.10"), ("candle-core", "0.11.1")] {
        assert!(lock.contains(&format!("name = \"{krate}\"\nversion = \"{version}\"")), "Cargo.lock no longer pins {krate} {version}: update cuda/patches/");
        let patch = repo().join(format!("cuda/patches/{krate}-{version}.patch"));
        let text = std::fs::read_to_string(&patch).unwrap();
        assert!(text.contains(&format!("--- a/{krate}-{version}/")), "{} does not patch {krate} {version}", patch.display());
    }
    let reqs = std::fs::read_to_string(repo().join("ci/requirements-cuda.txt")).unwrap();
    assert!(reqs.contains("nvidia-cuda-nvcc==13.0.*"), "the CUDA compiler must stay pinned to 13.0");
}
