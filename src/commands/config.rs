//! `scfoundry config`: write the workspace's nextflow.config (the GPUs tasks share, maxForks, cleanup,
//! trace and report, the weights and work folders). The text comes from `nfconfig`.

use std::path::PathBuf;

use crate::cli::ConfigArgs;
use crate::commands::ExitStatus;
use crate::error::Error;
use crate::nfconfig::{all_profiles, NfConfig};
use crate::settings::Settings;

/// --max-forks, else one GPU task per entry of --gpu (`all`: the cards of this machine), else 1.
fn max_forks(args: &ConfigArgs) -> u64 {
    args.max_forks.unwrap_or_else(|| args.gpu.as_ref().map_or(1, |g| g.slots_here() as u64))
}

pub fn build(s: &Settings, args: &ConfigArgs) -> anyhow::Result<NfConfig> {
    let root: PathBuf = match &s.workspace {
        Some(ws) => std::path::absolute(&ws.root)?,
        None => std::env::current_dir()?,
    };
    let mut profiles = if args.profile.is_empty() { all_profiles() } else { args.profile.clone() };
    profiles.sort();
    profiles.dedup();
    Ok(NfConfig {
        gpus: args.gpu.clone(),
        gpu_locks: crate::gpu::cards::lock_dir(),
        max_forks: max_forks(args),
        profiles,
        weights_dir: std::path::absolute(&s.weights_dir)?,
        work_dir: root.join("work"),
        outdir: root.join("results"),
        scfoundry: "scfoundry".into(),
        params: vec![],
        made_by: format!("Written by scfoundry {}.", env!("CARGO_PKG_VERSION")),
    })
}

pub fn run(s: &Settings, args: &ConfigArgs) -> anyhow::Result<ExitStatus> {
    let text = build(s, args)?.render();
    let dest = match &args.out {
        Some(p) if p.as_os_str() == "-" => {
            print!("{text}");
            return Ok(ExitStatus::Success);
        }
        Some(p) => p.clone(),
        None => match &s.workspace {
            Some(ws) => ws.root.join("nextflow.config"),
            None => PathBuf::from("nextflow.config"),
        },
    };
    let tmp = dest.with_extension("config.tmp");
    std::fs::write(&tmp, &text).map_err(|e| Error::Io { path: tmp.clone(), source: e })?;
    std::fs::rename(&tmp, &dest).map_err(|e| Error::Io { path: dest.clone(), source: e })?;
    if !s.quiet {
        let pin = match &args.gpu {
            Some(g) => format!("GPU tasks share GPUs {g}, one card each, locks in {}", crate::gpu::cards::lock_dir().display()),
            None => "GPU tasks not pinned".into(),
        };
        eprintln!("wrote {} ({pin}, maxForks {})", dest.display(), max_forks(args));
    }
    Ok(ExitStatus::Success)
}
