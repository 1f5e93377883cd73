//! The release archives: the product binary alone, a checksum that matches, the licences and
//! third-party notices, and a GPU flavour named apart; the GPU build still builds the benchmark
//! binary beside it.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{repo, sha256, BIN};

fn version() -> String {
    let toml = std::fs::read_to_string(repo().join("Cargo.toml")).unwrap();
    toml.lines().find_map(|l| l.strip_prefix("version = \"")).unwrap().trim_end_matches('"').to_string()
}

/// Run scripts/release.sh with `args` into a fresh folder; the folder and the archive's path.
fn release(args: &[&str]) -> (tempfile::TempDir, PathBuf) {
    let out = tempfile::tempdir().unwrap();
    let r = Command::new("bash").arg(repo().join("scripts/release.sh")).args(["--binary", BIN]).args(args).arg("--out").arg(out.path()).output().unwrap();
    assert!(r.status.success(), "{}{}", String::from_utf8_lossy(&r.stdout), String::from_utf8_lossy(&r.stderr));
    let archive = std::fs::read_dir(out.path()).unwrap().map(|e| e.unwrap().path()).find(|p| p.to_string_lossy().ends_with(".tar.gz")).expect("an archive");
    (out, archive)
}

/// The archive's `.sha256` holds `<hash>  <file name>` and the hash is the archive's.
fn checksum_matches(archive: &Path) {
    let sum = std::fs::read_to_string(format!("{}.sha256", archive.display())).expect("a .sha256 beside the archive");
    let name = archive.file_name().unwrap().to_string_lossy();
    assert_eq!(sum, format!("{}  {name}\n", sha256(archive)), "the .sha256 does not match the archive");
}

fn unpack(archive: &Path, into: &Path) {
    let st = Command::new("tar").arg("-xzf").arg(archive).arg("-C").arg(into).status().unwrap();
    assert!(st.success());
}

/// `scripts/release.sh` packs `scfoundry` and nothing named `scfoundry-bench`: the archive's
/// own file list (read back with tar) says so; the checksum matches; the licences, the notices
/// (the bundled C libraries and every Rust crate, no CUDA) and the archive's README are there.
#[test]
fn release_archive_holds_scfoundry_alone() {
    let (out, archive) = release(&[]);
    let name = format!("scfoundry-{}-x86_64-linux", version());
    assert_eq!(archive.file_name().unwrap().to_string_lossy(), format!("{name}.tar.gz"));
    let list = Command::new("tar").arg("-tzf").arg(&archive).output().unwrap();
    let list = String::from_utf8_lossy(&list.stdout);
    let bins: Vec<&str> = list.lines().filter(|l| l.contains("/bin/") && !l.ends_with('/')).collect();
    assert_eq!(bins.len(), 1, "{list}");
    assert!(bins[0].ends_with("/bin/scfoundry"), "{list}");
    assert!(!list.contains("scfoundry-bench"), "{list}");
    assert!(list.lines().any(|l| l.ends_with("/methods/pca.toml")), "{list}");
    checksum_matches(&archive);
    unpack(&archive, out.path());
    let root = out.path().join(&name);
    for (file, want) in [("LICENSE-MIT", "Copyright (c) the scfoundry developers"), ("LICENSE-APACHE", "Apache License"), ("LICENSE-APACHE", "Version 2.0, January 2004")] {
        let text = std::fs::read_to_string(root.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(text.contains(want), "{file} lacks {want:?}");
        assert_eq!(text, std::fs::read_to_string(repo().join(file)).unwrap(), "{file} differs from the repository's");
    }
    let notices = std::fs::read_to_string(root.join("THIRD-PARTY-NOTICES")).unwrap();
    for want in ["The HDF Group", "Jean-loup Gailly", "K.Kosako", "Marc Alexander Lehmann", "Daisuke Okanohara", "candle-core 0.11.1: MIT OR Apache-2.0", "hdf5-metno 0.15.1", "GENCODE release 44", "Copyright (c) 2020 Teichmann Lab", "mouse_to_human.csv", "Copyright (c) 2022 Stefan Peidli"] {
        assert!(notices.contains(want), "THIRD-PARTY-NOTICES lacks {want:?}");
    }
    assert!(!notices.contains("CUDA Runtime") && !notices.contains("cudarc "), "the CPU archive names no CUDA parts");
    // the crate list (from its heading to the first blank line): each entry is a locked package
    let start = notices.find("Rust crates (").expect("a Rust crates section");
    let listed: Vec<&str> = notices[start..].lines().skip(3).take_while(|l| !l.is_empty()).collect();
    let count: usize = notices[start + "Rust crates (".len()..].split(' ').next().unwrap().parse().unwrap();
    assert_eq!(listed.len(), count, "the heading's count and the list differ");
    let lock = std::fs::read_to_string(repo().join("Cargo.lock")).unwrap();
    assert!(listed.len() > 100, "{} crates listed", listed.len());
    for l in &listed {
        let mut it = l.split(' ');
        let (n, v) = (it.next().unwrap(), it.next().unwrap().trim_end_matches(':'));
        assert!(lock.contains(&format!("name = \"{n}\"\nversion = \"{v}\"")), "{n} {v} is not in Cargo.lock");
    }
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    assert!(readme.contains(&format!("tar -xzf {name}.tar.gz")) && readme.contains("scfoundry embed --method pca"), "{readme}");
    assert!(!readme.contains('@'), "a placeholder left in the archive's README:\n{readme}");
}

/// `--flavour cuda12` names the archive apart and adds the CUDA runtime's terms (the text given
/// by `--cuda-license`) to the notices; an unknown flavour is refused.
#[test]
fn release_gpu_flavour_carries_the_cuda_terms() {
    let eula = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(eula.path(), "NVIDIA CUDA Toolkit EULA (the text under test)\n").unwrap();
    let (out, archive) = release(&["--flavour", "cuda12", "--cuda-license", eula.path().to_str().unwrap()]);
    let name = format!("scfoundry-{}-cuda12-x86_64-linux", version());
    assert_eq!(archive.file_name().unwrap().to_string_lossy(), format!("{name}.tar.gz"));
    checksum_matches(&archive);
    unpack(&archive, out.path());
    let notices = std::fs::read_to_string(out.path().join(&name).join("THIRD-PARTY-NOTICES")).unwrap();
    for want in ["libcudart_static.a", "NVIDIA CUDA Toolkit EULA (the text under test)", "cudarc 0.19.10", "The HDF Group"] {
        assert!(notices.contains(want), "the cuda12 notices lack {want:?}");
    }
    let readme = std::fs::read_to_string(out.path().join(&name).join("README.md")).unwrap();
    assert!(readme.contains("CUDA 12") && readme.contains("scfoundry doctor"), "{readme}");
    let r = Command::new("bash").arg(repo().join("scripts/release.sh")).args(["--binary", BIN, "--flavour", "rocm", "--out"]).arg(out.path()).output().unwrap();
    assert_eq!(r.status.code(), Some(2), "{}", String::from_utf8_lossy(&r.stderr));
}

/// scripts/build-cuda.sh builds both binaries with the same flags (the GPU benchmarks need
/// scfoundry-bench); the release script builds only the product.
#[test]
fn gpu_build_keeps_the_bench_binary() {
    let cuda = std::fs::read_to_string(repo().join("scripts/build-cuda.sh")).unwrap();
    assert!(cuda.lines().any(|l| l.trim_start().starts_with("cargo build") && l.contains("--bin scfoundry-bench")), "build-cuda.sh no longer builds scfoundry-bench");
    let release = std::fs::read_to_string(repo().join("scripts/release.sh")).unwrap();
    let builds: Vec<&str> = release.lines().filter(|l| l.trim_start().starts_with("cargo build") || l.trim_start().starts_with("cargo zigbuild")).collect();
    assert!(!builds.is_empty() && builds.iter().all(|l| l.contains("--bin scfoundry") && !l.contains("scfoundry-bench")), "{builds:?}");
}
