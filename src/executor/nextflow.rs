//! `--executor nextflow`: write the run's config, then `nextflow run <main.nf> -c <config>`
//! with the task's parameters and everything after `--` passed through unchanged.
//!
//! The pipeline is found at $SCFOUNDRY_PIPELINE, else `<prefix>/share/scfoundry/main.nf` beside
//! an installed binary (`<prefix>/bin/scfoundry`), else this source tree's `main.nf`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{Error, Result};
use crate::runner::Run;
use crate::env::EnvVars;

/// `nextflow` and the pipeline's main.nf, found before any work.
pub struct Pipeline {
    pub nextflow: PathBuf,
    pub main_nf: PathBuf,
}

/// One `nextflow run` of a run folder.
pub struct NfRun<'a> {
    pub run: &'a Run,
    pub weights_dir: &'a Path,
    /// The cards GPU tasks share (each task locks one).
    pub gpu: Option<crate::gpu::cards::GpuList>,
    pub max_forks: u64,
    /// The pipeline's parameters (names as in nextflow_schema.json), `--outdir` among them.
    pub params: Vec<(String, String)>,
    pub passthrough: &'a [String],
    pub quiet: bool,
}

/// Where the pipeline publishes a run's results: `<run>/results`.
pub fn outdir(run: &Run) -> PathBuf {
    run.dir.join("results")
}

/// The parameters every task passes first: `--task`, `--method` (when the task has one),
/// `--input`, `--outdir` and `--seed`.
pub fn task_params(task: &str, method: Option<&str>, input: &Path, run: &Run, seed: u64) -> Vec<(String, String)> {
    let mut p = vec![("task".to_string(), task.to_string())];
    if let Some(m) = method {
        p.push(("method".into(), m.to_string()));
    }
    p.push(("input".into(), input.display().to_string()));
    p.push(("outdir".into(), outdir(run).display().to_string()));
    p.push(("seed".into(), seed.to_string()));
    p
}

/// Write the run's config (`<run>/nextflow.config`) and the command line (`command.txt`), run
/// `nextflow run` in the run folder, then move what the pipeline published at `published` (a
/// file or a folder) to `dest`. Returns Nextflow's exit code; on a failure it says where to look.
pub fn run_pipeline(p: &Pipeline, nf: &NfRun, published: &Path, dest: &Path) -> Result<i32> {
    let run = nf.run;
    let cfg = crate::nfconfig::NfConfig {
        gpus: nf.gpu.clone(),
        gpu_locks: crate::gpu::cards::lock_dir(),
        max_forks: nf.max_forks,
        profiles: crate::nfconfig::all_profiles(),
        weights_dir: std::path::absolute(nf.weights_dir).map_err(|e| Error::Io { path: nf.weights_dir.into(), source: e })?,
        work_dir: run.dir.join("work"),
        outdir: outdir(run),
        scfoundry: std::env::current_exe().map_err(|e| Error::Io { path: "current executable".into(), source: e })?.display().to_string(),
        params: vec![],
        made_by: format!("Written by scfoundry {} for run {}.", env!("CARGO_PKG_VERSION"), run.id),
    };
    let cfg_path = run.dir.join("nextflow.config");
    std::fs::write(&cfg_path, cfg.render()).map_err(|e| Error::Io { path: cfg_path.clone(), source: e })?;
    let argv = command_line(&p.main_nf, &cfg_path, &nf.params, nf.passthrough);
    let line = std::iter::once(p.nextflow.display().to_string()).chain(argv.iter().cloned()).collect::<Vec<_>>().join(" ");
    let _ = std::fs::write(run.dir.join("command.txt"), format!("{line}\n"));
    if !nf.quiet {
        eprintln!("nextflow: {line}");
    }
    let code = launch(&p.nextflow, &argv, &run.dir)?;
    if code != 0 {
        eprintln!("nextflow exited with {code}; run folder: {} (.nextflow.log, work/)", run.dir.display());
        return Ok(code);
    }
    if !published.exists() {
        return Err(Error::Executor {
            what: "nextflow".into(),
            detail: format!("it finished, but {} was not published", published.display()),
            hint: Some(format!("see {}", run.dir.join(".nextflow.log").display())),
        });
    }
    move_to(published, dest)?;
    if !nf.quiet {
        eprintln!("wrote {}; run folder: {} (nextflow.config, results/pipeline_info/trace.txt)", dest.display(), run.dir.display());
    }
    Ok(0)
}

/// Move a file or a folder; across file systems, copy then remove. A folder is merged into an
/// existing `dest` (files of the same name replaced), as a local run writes into it.
pub fn move_to(from: &Path, dest: &Path) -> Result<()> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |e| Error::Io { path, source: e }
    };
    if from.is_dir() {
        if !dest.exists() && std::fs::rename(from, dest).is_ok() {
            return Ok(());
        }
        std::fs::create_dir_all(dest).map_err(io(dest))?;
        for e in std::fs::read_dir(from).map_err(io(from))? {
            let e = e.map_err(io(from))?;
            move_to(&e.path(), &dest.join(e.file_name()))?;
        }
        let _ = std::fs::remove_dir(from);
        return Ok(());
    }
    if std::fs::rename(from, dest).is_err() {
        std::fs::copy(from, dest).map_err(io(dest))?;
        let _ = std::fs::remove_file(from);
    }
    Ok(())
}

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
