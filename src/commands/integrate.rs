//! `scfoundry integrate --method harmony|seurat`: correct batch effects.
//!
//! harmony reads `obsm[--embedding]`; seurat reads the expression matrix (X or `--layer`, raw
//! counts log-normalised here, or log-normalised values with `--log-normalized`). Both read the
//! batch column(s), run the method, and write a copy of the input with `obsm['X_<method>']` and
//! `uns['scfoundry_integrate']` (provenance). The work is one task (`task`), run where
//! `--executor` says; the input is checked here first.

use crate::cli::IntegrateArgs;
use crate::commands::ExitStatus;
use crate::error::Error;
use crate::executor::{self, nextflow};
use crate::paths::default_output;
use crate::progress::warn;
use crate::registry::Kind;
use crate::runner::{options_params, TaskSpec};
use crate::settings::Settings;
use crate::tasks::integrate::IntegrateOptions;

pub fn run(s: &Settings, args: &IntegrateArgs) -> anyhow::Result<ExitStatus> {
    let m = s.registry.get(&args.method)?.clone();
    if m.kind != Kind::Integration {
        return Err(Error::BadOption {
            option: "--method".into(),
            detail: format!("{} is an embedding method, not an integration method", m.name),
            hint: Some(format!("run `scfoundry embed --method {}` first, then integrate its embedding with `--method harmony`", m.name)),
        }
        .into());
    }
    if args.batch.batch_size.is_some() && !m.honoured("integrate").iter().any(|o| o == "--batch-size") {
        warn(&format!("{} does not honour --batch-size when integrating; ignored", m.name));
    }
    if !m.implemented || !crate::tasks::table::get(&m.name).is_some_and(|e| e.integrates()) {
        return Err(Error::NotImplemented { name: m.name.clone(), version: env!("CARGO_PKG_VERSION") }.into());
    }
    let entry = crate::tasks::table::get(&m.name).expect("an integration method has an entry");
    entry.check_integrate_options(args)?;
    let pipeline = executor::preflight(&args.exec)?;
    let opts = IntegrateOptions {
        embedding: args.embedding.clone(),
        batch_key: args.batch_key.clone(),
        theta: args.theta,
        layer: args.layer.clone(),
        log_normalized: args.skip_counts_check,
        dims: args.dims,
        k_weight: args.k_weight,
        scvi: args.scvi.clone(),
        batch_size: args.batch.batch_size,
        scgpt: args.scgpt.clone(),
    };
    // the input is checked before any run folder exists; the task reads it again
    if m.needs_raw_counts() && !args.skip_counts_check {
        let ad = crate::anndata::AnnData::open(&args.data)?;
        ad.check_usable()?;
        if let Some(w) = crate::tasks::counts::check(&m, &ad, args.layer.as_deref(), false)? {
            warn(&w);
        }
    }
    entry.check_integrate_data(&args.data, &opts)?;
    let out_path = match (&args.out, args.in_place) {
        (_, true) => args.data.clone(),
        (Some(o), false) => o.clone(),
        (None, false) => default_output(&args.data, &m.name),
    };
    crate::paths::check_output_file(&out_path, "--out")?;
    if !args.in_place && crate::paths::same_file(&args.data, &out_path) {
        return Err(Error::BadOption { option: "--out".into(), detail: format!("{} is the input file", out_path.display()), hint: Some("pass --in-place to replace the input on purpose".into()) }.into());
    }
    let run = executor::create_run(s, &args.exec, &out_path, &m.name)?;
    let tag = args.data.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    let name = format!("INTEGRATE_{} ({tag})", m.name.to_uppercase());
    let mut spec = TaskSpec::new(&run, name, "integrate", &m.name, &args.data, &out_path, args.seed, options_params(&opts), s.quiet, s.progress)?;
    spec.weights_dir = Some(std::path::absolute(&s.weights_dir)?);
    let published = nextflow::outdir(&run).join("integrate").join(default_output(&spec.data, &m.name).file_name().unwrap_or_default());
    let params = nextflow_params(&spec, &opts, &run);
    executor::run_single(s, &args.exec, pipeline, &run, spec, params, &published)
}

/// The Nextflow parameters of an integration (names as in nextflow_schema.json).
pub fn nextflow_params(spec: &TaskSpec, o: &IntegrateOptions, run: &crate::runner::Run) -> Vec<(String, String)> {
    let mut p = nextflow::task_params("integrate", Some(&spec.method), &spec.data, run, spec.seed);
    p.push(("embedding".into(), o.embedding.clone()));
    p.push(("batch_key".into(), o.batch_key.join(",")));
    if let Some(t) = o.theta {
        p.push(("theta".into(), t.to_string()));
    }
    if let Some(l) = &o.layer {
        p.push(("layer".into(), l.clone()));
    }
    if o.log_normalized {
        p.push(("log_normalized".into(), "true".into()));
    }
    if let Some(d) = o.dims {
        p.push(("dims".into(), d.to_string()));
    }
    if let Some(k) = o.k_weight {
        p.push(("k_weight".into(), k.to_string()));
    }
    p
}
