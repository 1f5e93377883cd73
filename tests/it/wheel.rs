//! The pip wheel (scripts/build_wheel.py) around the binary the tests run: its name and files,
//! and, with Python, `pip install` of it into a fresh folder and `scfoundry.embed` equal to
//! the CLI's own output on the demo cells.

use std::io::Read;
use std::process::Command;

use crate::common::{python, python_json, repo, TestContext, BIN};

/// The glibc the binary needs, as scripts/check-glibc.sh reads it ("2.28").
fn glibc_of(bin: &str) -> String {
    let out = Command::new(repo().join("scripts/check-glibc.sh")).arg(bin).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().trim_start_matches("GLIBC_").to_string()
}

#[test]
fn wheel_carries_the_binary_and_embeds_as_the_cli() {
    let ctx = TestContext::new();
    // built with the interpreter that runs the Python half when there is one (standard library only)
    let builder = python().unwrap_or_else(|| "python3".into());
    let out = Command::new(&builder).arg(repo().join("scripts/build_wheel.py")).args(["--binary", BIN, "--out"]).arg(ctx.path("dist")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let wheel = std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let glibc = glibc_of(BIN).replace('.', "_");
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(wheel.file_name().unwrap().to_string_lossy(), format!("scfoundry-{version}-py3-none-manylinux_{glibc}_x86_64.whl"));
    // the binary inside is byte-for-byte the one given, marked executable
    let mut z = zip::ZipArchive::new(std::fs::File::open(&wheel).unwrap()).unwrap();
    let mut inner = Vec::new();
    let mode = {
        let mut f = z.by_name("scfoundry/bin/scfoundry").unwrap();
        f.read_to_end(&mut inner).unwrap();
        f.unix_mode().unwrap()
    };
    assert!(inner == std::fs::read(BIN).unwrap(), "the wheel's binary is not the one given");
    assert_eq!(mode & 0o111, 0o111, "not executable: {mode:o}");
    for name in ["scfoundry/__init__.py", "scfoundry/__main__.py", &format!("scfoundry-{version}.dist-info/licenses/THIRD-PARTY-NOTICES"), &format!("scfoundry-{version}.dist-info/entry_points.txt")] {
        assert!(z.by_name(name).is_ok(), "{name} missing from the wheel");
    }

    let Some(py) = python() else { return };
    let site = ctx.path("site");
    let pip = Command::new(&py).args(["-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps", "--target"]).arg(&site).arg(&wheel).output().unwrap();
    assert!(pip.status.success(), "pip install: {}", String::from_utf8_lossy(&pip.stderr));
    // the console script runs the packaged binary
    let cmd = Command::new(site.join("bin/scfoundry")).arg("--version").env("PYTHONPATH", &site).env_remove("SCFOUNDRY_BINARY").output().unwrap();
    // (--version names the commit and the GPU contents after the first line: the same as the binary's own)
    let own = Command::new(env!("CARGO_BIN_EXE_scfoundry")).arg("--version").output().unwrap();
    assert!(String::from_utf8_lossy(&cmd.stdout).starts_with(&format!("scfoundry {version}\n")), "{}", String::from_utf8_lossy(&cmd.stderr));
    assert_eq!(cmd.stdout, own.stdout, "{}", String::from_utf8_lossy(&cmd.stderr));
    // the CLI's own run, then the same through Python
    std::fs::copy(repo().join("demo/pbmc68k_counts.h5ad"), ctx.path("pbmc.h5ad")).unwrap();
    ctx.run(&["embed", "--method", "pca", "--data", "pbmc.h5ad", "--out", "cli.h5ad", "--n-comps", "20"]).success();
    let args = [wheel.as_path(), site.as_path(), &ctx.path("pbmc.h5ad"), &ctx.path("cli.h5ad"), std::path::Path::new("X_pca"), std::path::Path::new("20")];
    let r = python_json(&py, "wheel_embed.py", &args);
    assert!(r["module"].as_str().unwrap().starts_with(site.to_str().unwrap()), "{r}");
    assert!(r["binary"].as_str().unwrap().starts_with(site.to_str().unwrap()), "{r}");
    assert_eq!(r["record_bad"], serde_json::json!([]), "{r}");
    assert_eq!(r["record_complete"], true, "{r}");
    assert_eq!(r["key"], "X_pca");
    assert_eq!(r["shape"], serde_json::json!([700, 20]));
    assert_eq!(r["equal"], true, "scfoundry.embed differs from the CLI: {r}");
    // a refused option surfaces as ScfoundryError with the binary's message
    assert!(r["error"]["message"].as_str().unwrap().contains("--n-comps"), "{r}");
    assert_ne!(r["error"]["returncode"], 0, "{r}");
}
