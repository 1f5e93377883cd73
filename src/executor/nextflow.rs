//! `--executor nextflow`: write the run's config, then `nextflow run <main.nf> -c <config>`
//! with the task's parameters and everything after `--` passed through unchanged.
//!
//! The pipeline is found at $SCFOUNDRY_PIPELINE, else `<prefix>/share/scfoundry/main.nf` beside
//! an installed binary (`<prefix>/bin/scfoundry`), else this source tree's `main.nf`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{Error, Result};
use crate::settings::EnvVars;

pub const INSTALL_HINT: &str = "install Nextflow (it needs Java 17 or later): `curl -s https://get.nextflow.io | bash`, then move `nextflow` to a folder on your PATH (e.g. ~/.local/bin); or `conda install -c bioconda nextflow` (or mamba). Or run with `--executor local` (the default) or `--executor slurm`";

/// `nextflow` on PATH, or a clear error saying how to install it.
pub fn find_nextflow() -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("nextflow"))
        .find(|p| p.is_file())
        .ok_or_else(|| Error::ToolMissing { tool: "nextflow".into(), hint: INSTALL_HINT.into() })
}

/// The pipeline's main.nf.
pub fn pipeline() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(EnvVars::PIPELINE) {
        let p = PathBuf::from(p);
        let main = if p.is_dir() { p.join("main.nf") } else { p };
        return if main.is_file() {
            Ok(main)
        } else {
            Err(Error::MissingFile { path: main })
        };
    }
    let exe = std::env::current_exe().ok();
    let installed = exe.as_ref().and_then(|e| e.parent()).and_then(|b| b.parent()).map(|prefix| prefix.join("share/scfoundry/main.nf"));
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("main.nf");
    installed.into_iter().chain([source]).find(|p| p.is_file()).ok_or_else(|| Error::Config {
        path: "main.nf".into(),
        detail: "the scfoundry Nextflow pipeline was not found".into(),
        hint: Some(format!("set {} to the folder with scfoundry's main.nf (the repository root)", EnvVars::PIPELINE)),
    })
}

/// The argument vector after `nextflow`: `run <main.nf> -c <config> --<param> <value>.. <passthrough>..`.
pub fn command_line(pipeline: &Path, config: &Path, params: &[(String, String)], passthrough: &[String]) -> Vec<String> {
    let mut v = vec!["run".to_string(), pipeline.display().to_string(), "-c".into(), config.display().to_string()];
    for (k, val) in params {
        v.push(format!("--{k}"));
        v.push(val.clone());
    }
    v.extend(passthrough.iter().cloned());
    v
}

/// Run `nextflow` in `dir` (its .nextflow.log and cache go there); its output goes to the terminal.
pub fn launch(nextflow: &Path, args: &[String], dir: &Path) -> Result<i32> {
    let status = Command::new(nextflow)
        .args(args)
        .current_dir(dir)
        .stdin(std::process::Stdio::null())
        .status()
        .map_err(|e| Error::Io { path: nextflow.into(), source: e })?;
    Ok(status.code().unwrap_or(128 + 9))
}
