//! Compile every `methods/*.toml` into the binary so the registry works from any folder, and,
//! with the `cuda` feature, our CUDA kernels (src/gpu/kernels/*.cu) to PTX with nvcc (on PATH, as
//! scripts/build-cuda.sh sets it up) for CUDA_COMPUTE_CAP (default 90; the Hopper kernels, *_sm90.cu,
//! are built for 90 only).
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
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        cuda_kernels();
    }
}

fn cuda_kernels() {
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap());
    // (kernel file, architecture): the Hopper kernels (_sm90) use wgmma, which only sm_90a has;
    // built for other capabilities they are empty files and the portable paths run instead
    let hopper = cap == "90";
    for (name, arch) in [
        ("varlen_attention", format!("sm_{cap}")),
        ("encoder_ops", format!("sm_{cap}")),
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
