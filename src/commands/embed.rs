//! `scfoundry embed`: validate, then run the embedding as a task in a run folder.

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use crate::anndata::AnnData;
use crate::cli::EmbedArgs;
use crate::commands::ExitStatus;
use crate::error::Error;
use crate::progress::warn;
use crate::registry::Method;
use crate::runner::{self, Run, TaskSpec};
use crate::settings::Settings;

/// Default output: `<input stem>.<method>.h5ad` beside the input.
pub fn default_output(data: &Path, method: &str) -> PathBuf {
    let stem = data.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "data".into());
    data.with_file_name(format!("{stem}.{method}.h5ad"))
}

/// Warn about options the method does not honour; return the method parameters in effect.
pub fn resolve_params(s: &Settings, m: &Method, args: &EmbedArgs) -> Map<String, Value> {
    let mut params = Map::new();
    let honoured = m.honoured("embed");
    if let Some(b) = args.batch.batch_size {
        if honoured.iter().any(|o| o == "--batch-size") {
            params.insert("batch_size".into(), json!(b));
        } else {
            warn(&format!("{} does not honour --batch-size when embedding; ignored", m.name));
        }
    } else if honoured.iter().any(|o| o == "--batch-size") {
        if let Some(b) = s.registry.default_batch(m) {
            params.insert("batch_size".into(), json!(b));
        }
    }
    if let Some(f) = &args.knobs.obs_features {
        if m.knob("--obs-features").is_none() {
            warn(&format!("{} does not honour --obs-features; ignored", m.name));
        } else {
            params.insert("obs_features".into(), json!(f));
        }
    }
    let given = args.knobs.given();
    for (flag, v) in &given {
        if m.knob(flag).is_none() {
            warn(&format!("{} does not honour {flag}; ignored", m.name));
        } else {
            params.insert(flag.trim_start_matches("--").replace('-', "_"), json!(v));
        }
    }
    for k in &m.knobs {
        let key = k.flag.trim_start_matches("--").replace('-', "_");
        if !params.contains_key(&key) {
            params.insert(key, serde_json::to_value(&k.default).unwrap_or(Value::Null));
        }
    }
    params
}

pub fn run(s: &Settings, args: &EmbedArgs) -> anyhow::Result<ExitStatus> {
    let m = s.registry.get(&args.method)?.clone();
    let params = resolve_params(s, &m, args);
    if !m.implemented {
        return Err(Error::NotImplemented { name: m.name.clone(), version: env!("CARGO_PKG_VERSION") }.into());
    }
    // Validate what is cheap before any run folder exists: weights first (the usual miss).
    if m.name == "cellama" {
        crate::commands::task::verified_weights(&m.name, &s.weights_dir, crate::methods::cellama::REQUIRED_ENTRIES)?;
    }
    let ad = AnnData::open(&args.data)?;
    ad.check_usable()?;
    ad.matrix(args.layer.as_deref())?;
    drop(ad);

    let out = match (&args.out, args.in_place) {
        (_, true) => args.data.clone(),
        (Some(o), false) => o.clone(),
        (None, false) => default_output(&args.data, &m.name),
    };
    let same = |a: &Path, b: &Path| match (std::fs::canonicalize(a), std::path::absolute(b)) {
        (Ok(x), Ok(y)) => x == y || std::fs::canonicalize(b).map(|z| z == x).unwrap_or(false),
        _ => false,
    };
    if !args.in_place && same(&args.data, &out) {
        return Err(Error::BadOption {
            option: "--out".into(),
            detail: format!("{} is the input file", out.display()),
            hint: Some("pass --in-place to replace the input on purpose, or choose another --out".into()),
        }
        .into());
    }
    let runs_base = match (&args.runs_dir, &s.workspace) {
        (Some(d), _) => d.clone(),
        (None, Some(ws)) => ws.runs_dir(),
        (None, None) => out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).join("runs"),
    };
    let run = Run::create(&runs_base, &m.name)?;
    let tag = args.data.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    let spec = TaskSpec {
        task_id: 1,
        name: format!("EMBED_{} ({tag})", m.name.to_uppercase()),
        command: "embed".into(),
        method: m.name.clone(),
        data: std::path::absolute(&args.data)?,
        out: std::path::absolute(&out)?,
        layer: args.layer.clone(),
        seed: args.seed,
        params,
        quiet: s.quiet,
        progress: s.progress,
        command_line: std::env::args().collect::<Vec<_>>().join(" "),
        run_id: run.id.clone(),
        weights_dir: Some(std::path::absolute(&s.weights_dir)?),
    };
    let outcome = runner::run_task(&run, &spec)?;
    runner::write_reports(&run, &spec, &[&outcome])?;
    if outcome.exit != 0 {
        eprintln!("run folder: {} (task logs, trace.txt)", run.dir.display());
        return Ok(ExitStatus::Code(outcome.exit));
    }
    if !s.quiet {
        let r = outcome.result.unwrap_or_default();
        let st = outcome.stats.unwrap_or_default();
        eprintln!(
            "wrote {} with obsm['{}'] ({} cells x {}) in {}, peak memory {}",
            out.display(),
            r.obsm_key.unwrap_or_default(),
            r.n_obs,
            r.dim,
            runner::trace::fmt_duration(st.realtime_ms),
            runner::trace::fmt_memory(st.peak_rss)
        );
        for n in r.notes {
            eprintln!("note: {n}");
        }
        eprintln!("run folder: {} (trace.txt, report.json)", run.dir.display());
    }
    Ok(ExitStatus::Success)
}
