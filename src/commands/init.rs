//! `scfoundry init DIR`: a workspace with scfoundry.toml, runs/ and a weights folder.

use std::path::Path;

use anyhow::Context;

use crate::commands::ExitStatus;
use crate::settings::CONFIG_FILE;

pub fn init(dir: &Path, shared_weights: Option<&Path>, quiet: bool) -> anyhow::Result<ExitStatus> {
    std::fs::create_dir_all(dir.join("runs")).with_context(|| format!("creating {}", dir.join("runs").display()))?;
    let config = dir.join(CONFIG_FILE);
    let weights_line = match shared_weights {
        Some(w) => {
            let abs = std::path::absolute(w).unwrap_or_else(|_| w.to_path_buf());
            std::fs::create_dir_all(&abs).with_context(|| format!("creating the shared weights folder {}", abs.display()))?;
            format!("dir = {:?}  # shared with other workspaces", abs.display().to_string())
        }
        None => {
            std::fs::create_dir_all(dir.join("weights")).with_context(|| format!("creating {}", dir.join("weights").display()))?;
            "dir = \"weights\"  # relative to this file; point several workspaces at one folder to share weights".to_string()
        }
    };
    if config.exists() {
        if !quiet {
            eprintln!("{} exists; kept as it is", config.display());
        }
        return Ok(ExitStatus::Success);
    }
    let text = format!(
        "# scfoundry workspace. Runs go to runs/<id>/ (trace.txt, report.json, task logs).\n\
         [workspace]\nversion = 1\n\n\
         [weights]\n{weights_line}\n\n\
         # Per-method overrides of the default batch size, e.g.\n\
         # [methods.uce]\n# batch_size = 8\n"
    );
    let tmp = dir.join(format!(".{CONFIG_FILE}.tmp"));
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &config).with_context(|| format!("writing {}", config.display()))?;
    if !quiet {
        eprintln!("created workspace {} ({CONFIG_FILE}, runs/, weights)", dir.display());
    }
    Ok(ExitStatus::Success)
}
