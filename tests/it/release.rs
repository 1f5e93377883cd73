//! The release artifact carries the product binary alone; the GPU build still builds the
//! benchmark binary beside it.

use crate::common::{repo, BIN};

/// `scripts/release.sh` packs `scfoundry` and nothing named `scfoundry-bench`: the archive's
/// own file list (read back with tar) says so.
#[test]
fn release_archive_holds_scfoundry_alone() {
    let out = tempfile::tempdir().unwrap();
    let r = std::process::Command::new("bash").arg(repo().join("scripts/release.sh")).args(["--binary", BIN, "--out"]).arg(out.path()).output().unwrap();
    let stdout = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success(), "{stdout}{}", String::from_utf8_lossy(&r.stderr));
    let archive = std::fs::read_dir(out.path()).unwrap().map(|e| e.unwrap().path()).find(|p| p.to_string_lossy().ends_with(".tar.gz")).expect("an archive");
    let list = std::process::Command::new("tar").arg("-tzf").arg(&archive).output().unwrap();
    let list = String::from_utf8_lossy(&list.stdout);
    let bins: Vec<&str> = list.lines().filter(|l| l.contains("/bin/") && !l.ends_with('/')).collect();
    assert_eq!(bins.len(), 1, "{list}");
    assert!(bins[0].ends_with("/bin/scfoundry"), "{list}");
    assert!(!list.contains("scfoundry-bench"), "{list}");
    assert!(list.lines().any(|l| l.ends_with("/methods/pca.toml")), "{list}");
}

/// scripts/build-cuda.sh builds both binaries with the same flags (the GPU benchmarks need
/// scfoundry-bench); the release script builds only the product.
#[test]
fn gpu_build_keeps_the_bench_binary() {
    let cuda = std::fs::read_to_string(repo().join("scripts/build-cuda.sh")).unwrap();
    assert!(cuda.lines().any(|l| l.trim_start().starts_with("cargo build") && l.contains("--bin scfoundry-bench")), "build-cuda.sh no longer builds scfoundry-bench");
    let release = std::fs::read_to_string(repo().join("scripts/release.sh")).unwrap();
    let builds: Vec<&str> = release.lines().filter(|l| l.trim_start().starts_with("cargo build")).collect();
    assert!(!builds.is_empty() && builds.iter().all(|l| l.contains("--bin scfoundry") && !l.contains("scfoundry-bench")), "{builds:?}");
}
