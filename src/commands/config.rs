//! `scfoundry config`: write the workspace's nextflow.config (GPU pinning, maxForks, cleanup,
//! trace and report, the weights and work folders). The text comes from `nfconfig`.

use std::path::PathBuf;

use crate::cli::ConfigArgs;
use crate::commands::ExitStatus;
use crate::error::Error;
use crate::nfconfig::{all_profiles, NfConfig};
use crate::settings::Settings;

pub fn build(s: &Settings, args: &ConfigArgs) -> anyhow::Result<NfConfig> {
    let root: PathBuf = match &s.workspace {
        Some(ws) => std::path::absolute(&ws.root)?,
        None => std::env::current_dir()?,
    };
    let mut profiles = if args.profile.is_empty() { all_profiles() } else { args.profile.clone() };
    profiles.sort();
    profiles.dedup();
    Ok(NfConfig {
        gpu_id: args.gpu_id,
        max_forks: args.max_forks.unwrap_or(1),
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
        let pin = match args.gpu_id {
            Some(g) => format!("GPU tasks pinned to GPU {g}"),
            None => "GPU tasks not pinned".into(),
        };
        eprintln!("wrote {} ({pin}, maxForks {})", dest.display(), args.max_forks.unwrap_or(1));
    }
    Ok(ExitStatus::Success)
}
