//! Compile every `methods/*.toml` into the binary so the registry works from any folder, and,
//! with the `cuda` feature, our CUDA kernels (src/gpu/kernels/*.cu) to PTX with nvcc (on PATH, as
//! scripts/build-cuda.sh sets it up) for CUDA_COMPUTE_CAP (default 90; the Hopper kernels, *_sm90.cu,
//! are built for 90 only); with `cuda12`, to fatbins with NVRTC (scripts/build-cuda12.sh).
use std::fmt::Write;

fn main() {
    println!("cargo:rerun-if-changed=methods");
    let mut entries: Vec<_> = std::fs::read_dir("methods")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "toml")).collect())
        .unwrap_or_default();
    entries.sort();
    let mut out = String::from("/// (file stem, TOML text) of every method in methods/.\npub static BUILTIN: &[(&str, &str)] = &[\n");
    for p in entries {
        println!("cargo:rerun-if-changed={}", p.display());
        let stem = p.file_stem().unwrap().to_string_lossy().to_string();
        // relative to the manifest, so that a build folder shared between checkouts (worktrees,
        // CI's cached target) never includes another checkout's files
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        writeln!(out, "    ({stem:?}, include_str!(concat!(env!(\"CARGO_MANIFEST_DIR\"), \"/methods/{name}\"))),").unwrap();
    }
    out.push_str("];\n");
    let dest = std::path::Path::new(&std::env::var("OUT_DIR").unwrap()).join("methods_builtin.rs");
    std::fs::write(dest, out).unwrap();
    println!("cargo:rerun-if-changed=weights.toml");
    git_commit();
    if std::env::var_os("CARGO_FEATURE_CUDA12").is_some() {
        cuda12_kernels();
    } else if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        cuda_kernels();
    } else {
        println!("cargo:rustc-env=SCFOUNDRY_BUILD_CUDA=");
        println!("cargo:rustc-env=SCFOUNDRY_BUILD_SASS=");
        println!("cargo:rustc-env=SCFOUNDRY_BUILD_PTX=");
    }
}

/// The CUDA 12 build (scripts/build-cuda12.sh): every kernel as a fatbin made by `nvrtc-fatbin`
/// (cuda/nvrtc_fatbin.py, on PATH): machine code for SCFOUNDRY_CUDA_SASS (default 80,90) and PTX
/// for SCFOUNDRY_CUDA_PTX (default 90); the Hopper kernels (*_sm90.cu) as sm_90a machine code alone.
/// Records the CUDA version and the architectures for `--version` and the preflight (gpu::build).
fn cuda12_kernels() {
    for var in ["SCFOUNDRY_CUDA_SASS", "SCFOUNDRY_CUDA_PTX", "SCFOUNDRY_CUDA_VERSION"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let sass = std::env::var("SCFOUNDRY_CUDA_SASS").unwrap_or_else(|_| "80,90".into());
    let ptx = std::env::var("SCFOUNDRY_CUDA_PTX").unwrap_or_else(|_| "90".into());
    let version = std::env::var("SCFOUNDRY_CUDA_VERSION").unwrap_or_else(|_| "12.8".into());
    println!("cargo:rustc-env=SCFOUNDRY_BUILD_CUDA={version}");
    println!("cargo:rustc-env=SCFOUNDRY_BUILD_SASS={sass},90a");
    println!("cargo:rustc-env=SCFOUNDRY_BUILD_PTX={ptx}");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap());
    println!("cargo:rerun-if-changed=cuda/nvrtc_fatbin.py");
    println!("cargo:rerun-if-changed=cuda/nvrtc-include");
    println!("cargo:rerun-if-changed=src/gpu/kernels/attention_common.cuh");
    println!("cargo:rerun-if-changed=src/gpu/kernels/sm90_common.cuh");
    for (names, args) in [
        (&["varlen_attention", "encoder_ops", "pairwise", "optim"][..], vec!["--sass", sass.as_str(), "--ptx", ptx.as_str()]),
        (&["varlen_attention_sm90", "gemm_layer_norm_sm90"][..], vec!["--sass", "90a"]),
    ] {
        let srcs: Vec<String> = names.iter().map(|n| format!("src/gpu/kernels/{n}.cu")).collect();
        for s in &srcs {
            println!("cargo:rerun-if-changed={s}");
        }
        let status = std::process::Command::new("nvrtc-fatbin")
            .args(&args)
            .arg("--out-dir")
            .arg(&out)
            .args(&srcs)
            .status()
            .unwrap_or_else(|e| panic!("nvrtc-fatbin: {e} (scripts/build-cuda12.sh puts it on PATH)"));
        assert!(status.success(), "nvrtc-fatbin failed on {srcs:?}");
    }
}

fn cuda_kernels() {
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap());
    // (kernel file, architecture): the Hopper kernels (_sm90) use wgmma, which only sm_90a has;
    // built for other capabilities they are empty files and the portable paths run instead
    let hopper = cap == "90";
    // what `--version` and the preflight report (gpu::build): PTX only, JIT-compiled at load
    let release = std::process::Command::new("nvcc")
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            let text = String::from_utf8_lossy(&o.stdout).to_string();
            text.split("release ").nth(1).and_then(|r| r.split(',').next()).map(str::to_string)
        })
        .unwrap_or_default();
    println!("cargo:rustc-env=SCFOUNDRY_BUILD_CUDA={release}");
    println!("cargo:rustc-env=SCFOUNDRY_BUILD_SASS=");
    println!("cargo:rustc-env=SCFOUNDRY_BUILD_PTX={cap}{}", if hopper { ",90a" } else { "" });
    for (name, arch) in [
        ("varlen_attention", format!("sm_{cap}")),
        ("encoder_ops", format!("sm_{cap}")),
        ("pairwise", format!("sm_{cap}")),
        ("optim", format!("sm_{cap}")),
        ("varlen_attention_sm90", "sm_90a".into()),
        ("gemm_layer_norm_sm90", "sm_90a".into()),
    ] {
        let src = format!("src/gpu/kernels/{name}.cu");
        println!("cargo:rerun-if-changed={src}");
        println!("cargo:rerun-if-changed=src/gpu/kernels/attention_common.cuh");
        println!("cargo:rerun-if-changed=src/gpu/kernels/sm90_common.cuh");
        let ptx = out.join(format!("{name}.ptx"));
        if name.ends_with("_sm90") && !hopper {
            std::fs::write(&ptx, "").unwrap();
            continue;
        }
        let status = std::process::Command::new("nvcc")
            .args(["--ptx", "-O3", &format!("-arch={arch}"), "-o"])
            .arg(&ptx)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("nvcc for {src}: {e} (scripts/build-cuda.sh puts the CUDA compiler on PATH)"));
        assert!(status.success(), "nvcc failed on {src}");
    }
}

/// The commit for `--version` (SCFOUNDRY_GIT_COMMIT, empty outside a git checkout), rebuilt when HEAD moves.
fn git_commit() {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_default();
    println!("cargo:rustc-env=SCFOUNDRY_GIT_COMMIT={commit}");
    // (not the index: it changes with every `git status`, and each change would rebuild the crate)
    if let Some(p) = git(&["rev-parse", "--git-path", "HEAD"]) {
        println!("cargo:rerun-if-changed={p}");
    }
    if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]).and_then(|r| git(&["rev-parse", "--git-path", &r])) {
        println!("cargo:rerun-if-changed={r}");
    }
}
