//! The integration task of harmony (see `methods/harmony.rs`): obsm[--embedding] corrected over
//! the batch columns, written as `obsm['X_harmony']`.

use std::path::Path;
use std::time::Instant;

use serde_json::{json, Value};

use crate::anndata::write::{write_rows, PendingOutput};
use crate::anndata::AnnData;
use crate::cli::IntegrateArgs;
use crate::error::{Error, Hdf5Context};
use crate::methods::harmony::{harmonize, HarmonyError, HarmonyOptions};
use crate::progress::warn;
use crate::runner::{TaskResult, TaskSpec};
use crate::tasks::integrate::{batch_codes, IntegrateOptions};
use crate::tasks::method::Method;

/// The embedding and the batch codes, checked.
struct Loaded {
    ad: AnnData,
    z: Vec<f32>,
    n: usize,
    d: usize,
    codes: Vec<Vec<u32>>,
    n_batches: Vec<usize>,
}

fn load(data: &Path, o: &IntegrateOptions) -> anyhow::Result<Loaded> {
    let ad = AnnData::open(data)?;
    if ad.n_obs == 0 {
        return Err(Error::ZeroCells { path: ad.path.clone(), n_vars: ad.n_vars }.into());
    }
    let (codes, n_batches) = batch_codes(&ad, &o.batch_key)?;
    let (z, n, d) = ad.dense_entry("obsm", &o.embedding)?;
    if n != ad.n_obs {
        return Err(Error::BadField { path: ad.path.clone(), field: format!("obsm/{}", o.embedding), detail: format!("has {n} rows but the data has {} cells", ad.n_obs), hint: None }.into());
    }
    if let Some(i) = z.iter().position(|v| !v.is_finite()) {
        return Err(Error::BadField {
            path: ad.path.clone(),
            field: format!("obsm/{}", o.embedding),
            detail: format!("holds a non-finite value at cell {} ({})", i / d, ad.obs_names[i / d]),
            hint: Some("recompute the embedding; Harmony needs finite coordinates".into()),
        }
        .into());
    }
    Ok(Loaded { ad, z, n, d, codes, n_batches })
}

/// The task: run harmony and write the output.
fn task(spec: &TaskSpec) -> anyhow::Result<TaskResult> {
    let o: IntegrateOptions = spec.options()?;
    let Loaded { ad, z, n, d, codes, n_batches } = load(&spec.data, &o)?;
    let mut opts = HarmonyOptions { seed: spec.seed, ..HarmonyOptions::default() };
    if let Some(t) = o.theta {
        opts.theta = vec![t];
    }
    let started = Instant::now();
    let res = harmonize(&z, n, d, &codes, &opts, None).map_err(|e| match e {
        HarmonyError::Input(msg) => anyhow::Error::from(Error::BadOption { option: "--batch-key / --theta".into(), detail: msg, hint: None }),
        other => anyhow::Error::from(other),
    })?;
    let secs = started.elapsed().as_secs_f64();
    drop(ad);
    let out = PendingOutput::create(&spec.data, &spec.out)?;
    let key = format!("X_{}", spec.method);
    let ds = out.create_obsm(&key, n, d)?;
    write_rows(&ds, 0, &res.z_corr, d)?;
    drop(ds);
    let uns = crate::anndata::h5util::require_dict(out.file(), "uns").h5ctx(|| "creating uns".into())?;
    let mut prov = serde_json::Map::new();
    prov.insert("tool".into(), json!("scfoundry"));
    prov.insert("version".into(), json!(env!("CARGO_PKG_VERSION")));
    prov.insert("method".into(), json!(spec.method));
    prov.insert("embedding".into(), json!(o.embedding));
    prov.insert("obsm_key".into(), json!(key));
    prov.insert("batch_key".into(), json!(o.batch_key.join(",")));
    prov.insert("seed".into(), json!(spec.seed));
    prov.insert("theta".into(), json!(opts.theta.first().copied().unwrap_or(2.0) as f64));
    prov.insert("iterations".into(), json!(res.iterations));
    prov.insert("converged".into(), json!(res.converged));
    prov.insert("clusters".into(), json!(res.n_clusters));
    prov.insert("date".into(), json!(chrono::Local::now().to_rfc3339()));
    prov.insert("run_id".into(), json!(spec.run_id));
    prov.insert("command_line".into(), Value::String(spec.command_line.clone()));
    crate::tasks::runtime::write_json_dict(&uns, "scfoundry_integrate", &prov).h5ctx(|| "writing uns/scfoundry_integrate".into())?;
    drop(uns);
    out.commit()?;
    let summary = format!(
        "wrote {} with obsm['{key}'] ({n} cells x {d}): harmony on obsm['{}'] over {} ({} batches), {} iterations{} in {secs:.1}s",
        spec.out.display(),
        o.embedding,
        o.batch_key.join(", "),
        n_batches.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(" x "),
        res.iterations,
        if res.converged { "" } else { " (not converged: the iteration limit was reached)" },
    );
    Ok(TaskResult { output: Some(spec.out.clone()), obsm_key: Some(key), n_obs: n, dim: d, summary: vec![summary], ..Default::default() })
}

/// harmony: the table's entry.
pub struct Harmony;

impl Method for Harmony {
    fn integrates(&self) -> bool {
        true
    }

    fn check_integrate_options(&self, args: &IntegrateArgs) -> anyhow::Result<()> {
        if args.layer.is_some() || args.skip_counts_check || args.dims.is_some() || args.k_weight.is_some() {
            warn("--layer, --skip-counts-check (--log-normalized), --dims and --k-weight are seurat options; harmony ignores them");
        }
        Ok(())
    }

    fn check_integrate_data(&self, data: &Path, opts: &IntegrateOptions) -> anyhow::Result<()> {
        load(data, opts).map(drop)
    }

    fn integrate(&self, spec: &TaskSpec) -> Option<anyhow::Result<TaskResult>> {
        Some(task(spec))
    }
}
