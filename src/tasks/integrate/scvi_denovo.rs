//! `scfoundry integrate --method scvi_denovo`: train scVI on the raw counts with the batch as
//! a covariate and write the latent mean as `obsm['X_scvi_denovo']`.
//!
//! Reads X (or `--layer`), checks raw counts, selects `--n-top-genes` highly variable genes
//! (scanpy's seurat flavour, as `embed --method pca`), trains (`methods::scvi`), and writes a
//! copy of the input with the embedding, `uns['scfoundry_integrate']` (provenance and the ELBO
//! per epoch), plus `elbo.tsv` and the ELBO curve (SVG, PNG) in the report folder.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::{json, Value};

use crate::tasks::integrate::{bad_field, batch_levels, open_with_one_batch_key, IntegrateOptions};
use crate::anndata::write::{write_rows, PendingOutput};
use crate::error::{Error, Hdf5Context};
use crate::methods::pca::hvg_seurat;
use crate::methods::scvi::{default_max_epochs, train, CountData, ScviError, ScviOptions, ScviResult};
use crate::runner::{TaskResult, TaskSpec};

const DEFAULT_N_TOP_GENES: usize = 2000;
const TARGET_SUM: f64 = 1e4;

/// The input, checked: counts on the selected genes and the batch codes.
struct Prepared {
    data: CountData,
    genes: Vec<String>,
    n_genes_in: usize,
    field: String,
    batches: Vec<String>,
}

fn prepare(path: &Path, o: &IntegrateOptions) -> anyhow::Result<Prepared> {
    let ad = open_with_one_batch_key(path, o, "scvi_denovo")?;
    let (codes, n_batches, mut levels) = batch_levels(&ad, &o.batch_key)?;
    let batches = levels.swap_remove(0);
    let x = ad.matrix(o.layer.as_deref())?;
    let (n, g) = (x.n_rows, x.n_cols);
    let field = x.field.clone();
    // one read: check counts, gather per-gene moments of normalised counts, keep the rows
    let mut indptr = vec![0usize];
    let mut indices: Vec<u32> = Vec::new();
    let mut values: Vec<f32> = Vec::new();
    let (mut sum, mut sq) = (vec![0f64; g], vec![0f64; g]);
    for (s, e) in x.blocks(4_000_000) {
        let b = x.read_rows(s, e)?;
        for i in 0..b.n_rows() {
            let (idx, vals) = b.row(i);
            let total: f64 = vals.iter().map(|&v| v as f64).sum();
            let size = if total == 0.0 { 1.0 } else { total / TARGET_SUM };
            for (&j, &v) in idx.iter().zip(vals) {
                if !v.is_finite() || v < 0.0 || v.fract() != 0.0 {
                    let row = s + i;
                    let what = if !v.is_finite() { "a non-finite value" } else if v < 0.0 { "a negative value" } else { "a non-integer value" };
                    let hint = if field == "X" {
                        "scVI models raw counts with a negative binomial; if raw counts are stored in a layer, pass `--layer counts` (or that layer's name)".to_string()
                    } else {
                        format!("{field} does not hold raw counts either; pick the layer with integer counts")
                    };
                    return Err(Error::NotRawCounts {
                        path: ad.path.clone(),
                        method: "scvi_denovo".into(),
                        what,
                        value: v,
                        row,
                        col: j as usize,
                        cell: ad.obs_names.get(row).cloned().unwrap_or_default(),
                        gene: ad.var_names.get(j as usize).cloned().unwrap_or_default(),
                        hint,
                    }
                    .into());
                }
                let nv = v as f64 / size;
                sum[j as usize] += nv;
                sq[j as usize] += nv * nv;
                if v != 0.0 {
                    indices.push(j);
                    values.push(v);
                }
            }
            indptr.push(indices.len());
        }
    }
    let genes_sel: Vec<usize> = {
        let n_top = o.scvi.n_top_genes.unwrap_or(DEFAULT_N_TOP_GENES);
        if n_top == 0 || n_top >= g || n < 2 {
            (0..g).collect()
        } else {
            let nf = n as f64;
            let mean: Vec<f64> = sum.iter().map(|s| s / nf).collect();
            let var: Vec<f64> = (0..g).map(|j| ((sq[j] - nf * mean[j] * mean[j]) / (nf - 1.0)).max(0.0)).collect();
            let hvg = hvg_seurat(&mean, &var, n_top);
            (0..g).filter(|&j| hvg.selected[j]).collect()
        }
    };
    if genes_sel.is_empty() {
        return Err(bad_field(&ad.path, &field, "has no gene with varying counts".into(), Some("scVI needs genes that vary between cells".into())));
    }
    // restrict to the selected genes
    let mut remap = vec![u32::MAX; g];
    for (h, &j) in genes_sel.iter().enumerate() {
        remap[j] = h as u32;
    }
    let mut data = CountData { n_cells: n, n_genes: genes_sel.len(), indptr: vec![0], indices: Vec::new(), values: Vec::new(), batch: codes[0].clone(), n_batch: n_batches[0] };
    for c in 0..n {
        let mut total = 0.0;
        for k in indptr[c]..indptr[c + 1] {
            let h = remap[indices[k] as usize];
            if h != u32::MAX {
                data.indices.push(h);
                data.values.push(values[k]);
                total += values[k] as f64;
            }
        }
        if total == 0.0 {
            return Err(bad_field(
                &ad.path,
                &field,
                format!("cell {c} ({}) has no counts on the {} training genes; its library size log(0) is undefined", ad.obs_names.get(c).cloned().unwrap_or_default(), genes_sel.len()),
                Some("remove empty cells first (e.g. sc.pp.filter_cells(adata, min_counts=1)), or raise --n-top-genes (0 keeps every gene)".into()),
            ));
        }
        data.indptr.push(data.indices.len());
    }
    let genes = genes_sel.iter().map(|&j| ad.var_names.get(j).cloned().unwrap_or_default()).collect();
    Ok(Prepared { data, genes, n_genes_in: g, field, batches })
}

/// The input is usable (checked before a run folder exists).
pub fn check(path: &Path, o: &IntegrateOptions) -> anyhow::Result<()> {
    prepare(path, o).map(drop)
}

fn options(o: &IntegrateOptions, seed: u64) -> ScviOptions {
    let d = ScviOptions::default();
    ScviOptions {
        n_latent: o.scvi.n_latent.map_or(d.n_latent, |v| v as usize),
        n_hidden: o.scvi.n_hidden.map_or(d.n_hidden, |v| v as usize),
        n_layers: o.scvi.n_layers.map_or(d.n_layers, |v| v as usize),
        max_epochs: o.scvi.max_epochs.map(|v| v as usize),
        batch_size: o.batch_size.map_or(d.batch_size, |v| v as usize),
        seed,
        ..d
    }
}

/// `elbo.tsv`: one line per epoch.
pub fn history_tsv(r: &ScviResult) -> String {
    let mut s = String::from("epoch\tkl_weight\ttrain_loss\telbo_train\treconstruction_train\tkl_train\telbo_validation\treconstruction_validation\tkl_validation\n");
    let f = |v: Option<f64>| v.map_or("NA".to_string(), |x| format!("{x:.4}"));
    for h in &r.history {
        s.push_str(&format!(
            "{}\t{:.4}\t{:.4}\t{:.4}\t{:.4}\t{:.4}\t{}\t{}\t{}\n",
            h.epoch,
            h.kl_weight,
            h.train_loss,
            h.elbo_train,
            h.reconstruction_train,
            h.kl_train,
            f(h.elbo_validation),
            f(h.reconstruction_validation),
            f(h.kl_validation)
        ));
    }
    s
}

pub fn task(spec: &TaskSpec, o: &IntegrateOptions) -> anyhow::Result<TaskResult> {
    let clock = Instant::now();
    let p = prepare(&spec.data, o)?;
    let read_s = clock.elapsed().as_secs_f64();
    let opts = options(o, spec.seed);
    let rep = crate::progress::for_settings(spec.quiet, spec.progress);
    let started = Instant::now();
    let res = train(&p.data, &opts, rep.as_ref()).map_err(|e| match e {
        ScviError::Input(msg) => anyhow::Error::from(Error::BadOption { option: "scvi_denovo options".into(), detail: msg, hint: None }),
        ScviError::Diverged { .. } => {
            let hint = e.hint();
            anyhow::Error::from(Error::BadField { path: spec.data.clone(), field: p.field.clone(), detail: e.to_string(), hint })
        }
        other => anyhow::Error::from(other),
    })?;
    let train_s = started.elapsed().as_secs_f64();
    let (n, d) = (p.data.n_cells, opts.n_latent);
    let out = PendingOutput::create(&spec.data, &spec.out)?;
    let key = format!("X_{}", spec.method);
    let ds = out.create_obsm(&key, n, d)?;
    write_rows(&ds, 0, &res.latent, d)?;
    drop(ds);
    let uns = crate::anndata::h5util::require_dict(out.file(), "uns").h5ctx(|| "creating uns".into())?;
    let last = res.history.last();
    let mut prov = serde_json::Map::new();
    prov.insert("tool".into(), json!("scfoundry"));
    prov.insert("version".into(), json!(env!("CARGO_PKG_VERSION")));
    prov.insert("method".into(), json!(spec.method));
    prov.insert("matrix".into(), json!(p.field));
    prov.insert("obsm_key".into(), json!(key));
    prov.insert("batch_key".into(), json!(o.batch_key.join(",")));
    prov.insert("n_batches".into(), json!(p.batches.len()));
    prov.insert("seed".into(), json!(spec.seed));
    prov.insert("n_genes".into(), json!(p.genes.len()));
    prov.insert("gene_selection".into(), json!(if p.genes.len() == p.n_genes_in { "all genes".to_string() } else { format!("seurat-flavour highly variable genes, n_top_genes={}", o.scvi.n_top_genes.unwrap_or(DEFAULT_N_TOP_GENES)) }));
    prov.insert("n_latent".into(), json!(opts.n_latent));
    prov.insert("n_hidden".into(), json!(opts.n_hidden));
    prov.insert("n_layers".into(), json!(opts.n_layers));
    prov.insert("dropout_rate".into(), json!(opts.dropout_rate as f64));
    prov.insert("gene_likelihood".into(), json!("nb"));
    prov.insert("dispersion".into(), json!("gene"));
    prov.insert("max_epochs".into(), json!(res.epochs));
    prov.insert("batch_size".into(), json!(opts.batch_size));
    prov.insert("lr".into(), json!(opts.lr));
    prov.insert("weight_decay".into(), json!(opts.weight_decay));
    prov.insert("adam_eps".into(), json!(opts.eps));
    prov.insert("n_epochs_kl_warmup".into(), json!(opts.n_epochs_kl_warmup));
    prov.insert("n_train".into(), json!(res.n_train));
    prov.insert("n_validation".into(), json!(res.n_validation));
    prov.insert("n_params".into(), json!(res.n_params));
    if let Some(l) = last {
        prov.insert("elbo_train".into(), json!(l.elbo_train));
        if let Some(v) = l.elbo_validation {
            prov.insert("elbo_validation".into(), json!(v));
        }
    }
    prov.insert("train_seconds".into(), json!(train_s));
    prov.insert("date".into(), json!(chrono::Local::now().to_rfc3339()));
    prov.insert("run_id".into(), json!(spec.run_id));
    prov.insert("command_line".into(), Value::String(spec.command_line.clone()));
    crate::tasks::runtime::write_json_dict(&uns, "scfoundry_integrate", &prov).h5ctx(|| "writing uns/scfoundry_integrate".into())?;
    {
        let g = uns.group("scfoundry_integrate").h5ctx(|| "opening uns/scfoundry_integrate".into())?;
        let h = crate::anndata::h5util::require_dict(&g, "history").h5ctx(|| "creating uns/scfoundry_integrate/history".into())?;
        let col = |f: &dyn Fn(&crate::methods::scvi::EpochLog) -> f64| res.history.iter().map(f).collect::<Vec<f64>>();
        use crate::anndata::h5util::write_array_f64 as w;
        w(&h, "elbo_train", &col(&|e| e.elbo_train)).h5ctx(|| "writing the ELBO history".into())?;
        w(&h, "train_loss", &col(&|e| e.train_loss)).h5ctx(|| "writing the ELBO history".into())?;
        w(&h, "kl_weight", &col(&|e| e.kl_weight)).h5ctx(|| "writing the ELBO history".into())?;
        if res.n_validation > 0 {
            w(&h, "elbo_validation", &col(&|e| e.elbo_validation.unwrap_or(f64::NAN))).h5ctx(|| "writing the ELBO history".into())?;
        }
    }
    drop(uns);
    out.commit()?;
    // the report: elbo.tsv and the curve
    let report_dir: PathBuf = o.scvi.report_dir.clone().unwrap_or_else(|| spec.out.with_extension(""));
    std::fs::create_dir_all(&report_dir).map_err(|e| Error::Io { path: report_dir.clone(), source: e })?;
    crate::tasks::shard::write_atomic(&report_dir.join("elbo.tsv"), history_tsv(&res).as_bytes())?;
    let curve = crate::plots::ElboCurve {
        title: format!("scvi_denovo: ELBO per epoch ({n} cells, {} genes, {} batches, seed {})", p.genes.len(), p.batches.len(), spec.seed),
        train: res.history.iter().map(|h| h.elbo_train).collect(),
        validation: res.history.iter().map(|h| h.elbo_validation).collect::<Option<Vec<f64>>>(),
    };
    crate::plots::elbo_curve(&curve, &report_dir.join("elbo.svg"), &report_dir.join("elbo.png"))?;
    let default_epochs = default_max_epochs(n);
    let summary = vec![
        format!(
            "wrote {} with obsm['{key}'] ({n} cells x {d}): scVI (NB, {} genes of {}, {} batches in obs['{}']) trained {} epochs{} in {train_s:.1}s",
            spec.out.display(),
            p.genes.len(),
            p.field,
            p.batches.len(),
            o.batch_key[0],
            res.epochs,
            if res.epochs == default_epochs { " (scvi-tools' default)" } else { "" },
        ),
        match last {
            Some(l) => format!(
                "ELBO per cell: train {:.1}{}; curve in {}",
                l.elbo_train,
                l.elbo_validation.map_or(String::new(), |v| format!(", validation {v:.1}")),
                report_dir.display()
            ),
            None => String::new(),
        },
    ];
    Ok(TaskResult {
        output: Some(spec.out.clone()),
        obsm_key: Some(key),
        n_obs: n,
        dim: d,
        phases: vec![("read and select genes".into(), read_s), ("train".into(), train_s)],
        notes: vec![format!("elbo_train {:.3}", last.map_or(f64::NAN, |l| l.elbo_train))],
        summary,
        ..Default::default()
    })
}

/// scvi_denovo: the table's entry.
pub struct ScviDenovo;

impl crate::tasks::method::Method for ScviDenovo {
    fn integrates(&self) -> bool {
        true
    }

    fn check_integrate_options(&self, args: &crate::cli::IntegrateArgs) -> anyhow::Result<()> {
        super::warn_classic_options(args, "scvi_denovo");
        if args.skip_counts_check {
            crate::progress::warn("--skip-counts-check skips the sampled counts check only: scvi_denovo trains on raw counts and still checks every value as it reads them");
        }
        Ok(())
    }

    fn check_integrate_data(&self, data: &Path, opts: &IntegrateOptions) -> anyhow::Result<()> {
        check(data, opts)
    }

    fn integrate(&self, spec: &TaskSpec) -> Option<anyhow::Result<TaskResult>> {
        Some(spec.options().map_err(Into::into).and_then(|o: IntegrateOptions| task(spec, &o)))
    }
}
