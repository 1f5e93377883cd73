//! `scfoundry integrate --method scgpt_integrated`: fine-tune scGPT on the query's raw counts
//! with upstream's integration objectives (methods::scgpt_integrated) and write the fine-tuned
//! `<cls>` embedding as `obsm['X_scgpt_integrated']`.
//!
//! Reads X (or `--layer`) as raw counts and one batch column; keeps the genes in the
//! checkpoint's vocabulary (by var_names), drops genes with fewer than 3 counts, selects
//! `n_hvg` highly variable genes and bins each cell's non-zero counts into `n_bins` bins (zeros
//! kept: every cell is `<cls>` + the same genes). Writes a copy of the input with the
//! embedding and `uns['scfoundry_integrate']` (provenance, loss per epoch), and in the report
//! folder (`<out stem>/`): the fine-tuned weights (`scgpt_integrated.safetensors`, upstream's
//! state_dict names, provenance in the header's metadata), `losses.tsv` and the loss curve.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Deserialize;
use serde_json::{json, Value};

use crate::anndata::write::{write_rows, PendingOutput};
use crate::error::{Error, Hdf5Context};
use crate::methods::pca::hvg_seurat;
use crate::methods::scgpt::{self, Args, Vocab};
use crate::methods::scgpt_integrated::{train, Config, EpochLog, TrainData, TrainModel, TrainOptions, OBJECTIVES};
use crate::runner::{TaskResult, TaskSpec};
use crate::tasks::integrate::{bad_field, batch_levels, open_with_one_batch_key, IntegrateOptions};
use crate::weights::Manifest;

const TARGET_SUM: f64 = 1e4;

/// The method's defaults (methods/scgpt_integrated.toml's knobs and batch).
#[derive(Debug, Deserialize)]
struct Defaults {
    batch: u64,
    epochs: u64,
    n_hvg: usize,
    lr: f64,
    adam_eps: f64,
    schedule_ratio: f64,
    mask_ratio: f64,
    dropout: f64,
    ecs_threshold: f64,
    dab_weight: f64,
    min_gene_counts: f64,
}

fn defaults(method: &str) -> anyhow::Result<Defaults> {
    let reg = crate::registry::Registry::builtin();
    let m = reg.get(method)?;
    let k = |flag: &str| -> anyhow::Result<Value> {
        let v = m.knob(flag).ok_or_else(|| Error::Model { context: format!("methods/{method}.toml"), detail: format!("has no knob {flag}") })?;
        Ok(serde_json::to_value(&v.default)?)
    };
    let f = |flag: &str| -> anyhow::Result<f64> { k(flag)?.as_f64().ok_or_else(|| anyhow::anyhow!("methods/{method}.toml: knob {flag} is not a number")) };
    Ok(Defaults {
        batch: m.batch.as_ref().map_or(64, |b| b.default),
        epochs: f("--epochs")? as u64,
        n_hvg: f("--n-hvg")? as usize,
        lr: f("--lr")?,
        adam_eps: f("--adam-eps")?,
        schedule_ratio: f("--schedule-ratio")?,
        mask_ratio: f("--mask-ratio")?,
        dropout: f("--dropout")?,
        ecs_threshold: f("--ecs-threshold")?,
        dab_weight: f("--dab-weight")?,
        min_gene_counts: f("--min-gene-counts")?,
    })
}

/// The input, tokenised.
struct Prepared {
    data: TrainData,
    genes: Vec<String>,
    n_matched: usize,
    field: String,
    levels: Vec<String>,
}

fn prepare(path: &Path, o: &IntegrateOptions, vocab: &Vocab, n_bins: usize, d: &Defaults, seed: u64) -> anyhow::Result<Prepared> {
    let ad = open_with_one_batch_key(path, o, "scgpt_integrated")?;
    let (codes, _, levels) = batch_levels(&ad, &o.batch_key)?;
    let names: Vec<Option<String>> = ad.var_names.iter().map(|s| Some(s.clone())).collect();
    let ids = scgpt::match_genes(&names, vocab);
    let n_matched = ids.iter().filter(|i| i.is_some()).count();
    if n_matched == 0 {
        return Err(bad_field(&ad.path, "var_names", format!("none of the {} genes is in the scGPT vocabulary", ad.n_vars), Some("scGPT matches genes by symbol (e.g. CD3E): give var_names as gene symbols".into())));
    }
    let x = ad.matrix(o.layer.as_deref())?;
    let (n, g) = (x.n_rows, x.n_cols);
    let field = x.field.clone();
    let mut rows: Vec<(Vec<u32>, Vec<f32>)> = Vec::with_capacity(n);
    let (mut sum, mut sq, mut counts) = (vec![0f64; g], vec![0f64; g], vec![0f64; g]);
    for (s, e) in x.blocks(4_000_000) {
        let b = x.read_rows(s, e)?;
        for i in 0..b.n_rows() {
            let (idx, vals) = b.row(i);
            let total: f64 = vals.iter().map(|&v| v as f64).sum();
            let size = if total == 0.0 { 1.0 } else { total / TARGET_SUM };
            let mut keep = (Vec::new(), Vec::new());
            for (&j, &v) in idx.iter().zip(vals) {
                if !v.is_finite() || v < 0.0 || v.fract() != 0.0 {
                    return Err(bad_field(&ad.path, &field, format!("holds {v} at cell {} gene {j}: scgpt_integrated bins raw counts", s + i), Some("pass the layer with raw integer counts with --layer".into())));
                }
                if v != 0.0 && ids[j as usize].is_some() {
                    let nv = v as f64 / size;
                    sum[j as usize] += nv;
                    sq[j as usize] += nv * nv;
                    counts[j as usize] += v as f64;
                    keep.0.push(j);
                    keep.1.push(v);
                }
            }
            rows.push(keep);
        }
    }
    // filter_gene_by_counts, then highly variable genes among the vocabulary's
    let cand: Vec<usize> = (0..g).filter(|&j| ids[j].is_some() && counts[j] >= d.min_gene_counts).collect();
    if cand.is_empty() {
        return Err(bad_field(&ad.path, &field, format!("no gene of the vocabulary has {} or more counts", d.min_gene_counts), None));
    }
    let selected: Vec<usize> = if cand.len() <= d.n_hvg || n < 2 {
        cand
    } else {
        let nf = n as f64;
        let mean: Vec<f64> = cand.iter().map(|&j| sum[j] / nf).collect();
        let var: Vec<f64> = cand.iter().enumerate().map(|(h, &j)| ((sq[j] - nf * mean[h] * mean[h]) / (nf - 1.0)).max(0.0)).collect();
        let hvg = hvg_seurat(&mean, &var, d.n_hvg);
        cand.iter().enumerate().filter(|(h, _)| hvg.selected[*h]).map(|(_, &j)| j).collect()
    };
    let mut col = vec![usize::MAX; g];
    for (h, &j) in selected.iter().enumerate() {
        col[j] = h;
    }
    let gs = selected.len();
    let mut binned = vec![0f32; n * gs];
    for (c, (idx, vals)) in rows.iter().enumerate() {
        let pairs: Vec<(usize, f32)> = idx.iter().zip(vals).filter(|(j, _)| col[**j as usize] != usize::MAX).map(|(j, v)| (col[*j as usize], *v)).collect();
        if pairs.is_empty() {
            continue;
        }
        let mut rng = scgpt::cell_rng(seed, c);
        let raw: Vec<f32> = pairs.iter().map(|p| p.1).collect();
        for ((h, _), b) in pairs.iter().zip(scgpt::bin_values(&raw, n_bins, &mut rng)) {
            binned[c * gs + h] = b;
        }
    }
    let cls_id = vocab.get("<cls>").expect("the vocabulary has <cls> (appended when absent)");
    let data = TrainData { n, g: gs, cls_id, gene_ids: selected.iter().map(|&j| ids[j].unwrap()).collect(), binned, batch: codes[0].clone() };
    let genes = selected.iter().map(|&j| ad.var_names[j].clone()).collect();
    Ok(Prepared { data, genes, n_matched, field, levels: levels[0].clone() })
}

/// Where the checkpoint is (`--model-dir`, else the weights folder's whole-human model) and
/// the sha256 of its files.
fn checkpoint(spec: &TaskSpec, o: &IntegrateOptions) -> anyhow::Result<(PathBuf, serde_json::Map<String, Value>)> {
    if let Some(dir) = &o.scgpt.model_dir {
        let mut shas = serde_json::Map::new();
        for f in scgpt::folder_files(dir) {
            if !f.is_file() {
                return Err(Error::MissingFile { path: f }.into());
            }
            let name = f.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
            shas.insert(name, json!(crate::weights::sha256_file(&f, |_| {})?));
        }
        return Ok((dir.clone(), shas));
    }
    let dir = spec.weights_dir.clone().unwrap_or_else(crate::weights::default_dir);
    let shas = crate::tasks::runtime::verified_weights(&spec.method, &dir, scgpt::REQUIRED_ENTRIES)?;
    Ok((scgpt::model_dir(&dir, &Manifest::load()?), shas))
}

/// The safetensors format with a `__metadata__` entry (string values), f32 tensors.
fn write_safetensors(path: &Path, tensors: &[(String, candle_core::Tensor)], metadata: &[(&str, String)]) -> anyhow::Result<()> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), Value::Object(metadata.iter().map(|(k, v)| (k.to_string(), json!(v))).collect()));
    let mut blob: Vec<u8> = Vec::new();
    for (name, t) in tensors {
        let (dtype, bytes): (&str, Vec<u8>) = match t.dtype() {
            candle_core::DType::I64 => ("I64", t.flatten_all()?.to_vec1::<i64>()?.iter().flat_map(|v| v.to_le_bytes()).collect()),
            _ => ("F32", t.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().flat_map(|v| v.to_le_bytes()).collect()),
        };
        header.insert(name.clone(), json!({"dtype": dtype, "shape": t.dims(), "data_offsets": [blob.len(), blob.len() + bytes.len()]}));
        blob.extend(bytes);
    }
    let mut h = serde_json::to_vec(&Value::Object(header))?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + blob.len());
    out.extend((h.len() as u64).to_le_bytes());
    out.extend(h);
    out.extend(blob);
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, out).map_err(|e| Error::Io { path: tmp.clone(), source: e })?;
    std::fs::rename(&tmp, path).map_err(|e| Error::Io { path: path.to_path_buf(), source: e })?;
    Ok(())
}

/// `losses.tsv`: one line per epoch.
fn history_tsv(h: &[EpochLog]) -> String {
    let mut s = format!("epoch\tlr\t{}\ttotal\tvalid_gep_mse\tseconds\tsteps\ttrain_cells_per_s\tbatches_s\tforward_s\tbackward_s\toptimizer_s\tvalidation_s\n", OBJECTIVES.join("\t"));
    for e in h {
        let t: Vec<String> = e.train.iter().map(|v| format!("{v:.5}")).collect();
        let p = &e.phases;
        let train_s = p.batches + p.forward + p.backward + p.optimizer;
        s.push_str(&format!(
            "{}\t{:.3e}\t{}\t{}\t{:.1}\t{}\t{:.1}\t{:.2}\t{:.2}\t{:.2}\t{:.2}\t{:.2}\n",
            e.epoch,
            e.lr,
            t.join("\t"),
            e.valid_mse.map_or("NA".into(), |v| format!("{v:.5}")),
            e.seconds,
            e.steps,
            e.cells as f64 / train_s.max(1e-9),
            p.batches,
            p.forward,
            p.backward,
            p.optimizer,
            p.validation
        ));
    }
    s
}

pub fn task(spec: &TaskSpec, o: &IntegrateOptions) -> anyhow::Result<TaskResult> {
    let clock = Instant::now();
    let d = defaults(&spec.method)?;
    let (model_dir, shas) = checkpoint(spec, o)?;
    let [pt, vocab_path, args_path] = scgpt::folder_files(&model_dir);
    let args = Args::load(&args_path)?;
    let vocab = Vocab::load(&vocab_path)?;
    let p = prepare(&spec.data, o, &vocab, args.n_bins, &d, spec.seed)?;
    let tensors = scgpt::read_checkpoint(&pt)?;
    let read_s = clock.elapsed().as_secs_f64();
    let so = &o.scgpt;
    let mut dspec = spec.clone();
    dspec.device.kind = so.device.unwrap_or_default();
    let asked = so.precision.as_deref().unwrap_or("auto");
    if !matches!(asked, "auto" | "f32") && dspec.device.kind != crate::gpu::DeviceKind::Cuda {
        return Err(Error::BadOption { option: "--precision".into(), detail: format!("{asked} training is for NVIDIA GPUs (tensor cores): it needs --device cuda"), hint: Some("add --device cuda, or leave --precision out (f32 on the CPU)".into()) }.into());
    }
    // TF32 products for every f32 matrix product of this process (candle's cuBLAS switch)
    candle_core::cuda::set_gemm_reduced_precision_f32(asked == "tf32");
    let dev = crate::tasks::runtime::TaskDevice::start(&dspec)?;
    // auto: the method's GPU default (methods/scgpt_integrated.toml [precision]) on a card with
    // bf16, f32 on the CPU; tf32 is this method's own extra
    let mut precision_note = None;
    let precision = match asked {
        "tf32" => "tf32",
        other => {
            use crate::tasks::precision::{decide, Requested};
            let gpu_default = crate::registry::Registry::builtin().methods.get(&spec.method).and_then(|m| m.precision.as_ref()).map(|p| p.gpu_default);
            let d = decide(gpu_default, Requested::parse(other).unwrap_or(Requested::Auto), dev.device.is_cuda(), crate::tasks::runtime::compute_capability(&dev.device));
            precision_note = d.note;
            d.dtype.name()
        }
    };
    let cfg = Config {
        embsize: args.embsize,
        nheads: args.nheads,
        d_hid: args.d_hid,
        nlayers: args.nlayers,
        ntoken: vocab.len,
        n_batches: p.levels.len(),
        dropout: d.dropout,
        ecs_threshold: d.ecs_threshold,
        dab_weight: d.dab_weight,
    };
    let (mut model, drawn) = TrainModel::new(cfg, &tensors, spec.seed, &dev.device)?;
    model.mixed = precision == "bf16";
    model.profile = crate::nn::step_profile::StepProfile::from_env(&dev.device);
    model.fused_attention = std::env::var(crate::env::EnvVars::TRAIN_ATTENTION).map_or(true, |v| v != "materialized");
    let opts = TrainOptions {
        epochs: so.epochs.unwrap_or(d.epochs) as usize,
        batch_size: so.integration_batch_size.unwrap_or(d.batch) as usize,
        lr: d.lr,
        adam_eps: d.adam_eps,
        schedule_ratio: d.schedule_ratio,
        mask_ratio: d.mask_ratio,
        valid_fraction: 0.1,
        max_grad_norm: 1.0,
        seed: spec.seed,
    };
    let rep = crate::progress::for_settings(spec.quiet, spec.progress);
    if let Some(n) = &precision_note {
        rep.note(n);
    }
    let started = Instant::now();
    let n_epochs = opts.epochs;
    let res = train(&mut model, &p.data, &opts, |e| {
        let p = &e.phases;
        rep.note(&format!(
            "epoch {}/{n_epochs}: loss {:.4}{} ({:.1}s: forward {:.1}, backward {:.1}, optimiser {:.1}, validation {:.1})",
            e.epoch,
            e.train[OBJECTIVES.len()],
            e.valid_mse.map_or(String::new(), |v| format!(", validation GEP MSE {v:.4}")),
            e.seconds,
            p.forward,
            p.backward,
            p.optimizer,
            p.validation
        ));
    })?;
    let train_s = started.elapsed().as_secs_f64();
    let (n, dim) = (p.data.n, args.embsize);
    // the output file
    let out = PendingOutput::create(&spec.data, &spec.out)?;
    let key = format!("X_{}", spec.method);
    let ds = out.create_obsm(&key, n, dim)?;
    write_rows(&ds, 0, &res.embedding, dim)?;
    drop(ds);
    let mut prov = serde_json::Map::new();
    prov.insert("tool".into(), json!("scfoundry"));
    prov.insert("version".into(), json!(env!("CARGO_PKG_VERSION")));
    prov.insert("method".into(), json!(spec.method));
    prov.insert("matrix".into(), json!(p.field));
    prov.insert("obsm_key".into(), json!(key));
    prov.insert("batch_key".into(), json!(o.batch_key.join(",")));
    prov.insert("batches".into(), json!(p.levels));
    prov.insert("seed".into(), json!(spec.seed));
    prov.insert("base_weights".into(), json!(model_dir.display().to_string()));
    prov.insert("base_weights_sha256".into(), Value::Object(shas.clone()));
    prov.insert("genes_in_vocab".into(), json!(p.n_matched));
    prov.insert("n_hvg".into(), json!(p.genes.len()));
    prov.insert("tokens_per_cell".into(), json!(p.genes.len() + 1));
    prov.insert("n_bins".into(), json!(args.n_bins));
    prov.insert("objectives".into(), json!({"gep": 1.0, "gep_zero": 1.0, "gepc": 1.0, "gepc_zero": 1.0, "ecs": crate::methods::scgpt_integrated::ECS_WEIGHT, "ecs_threshold": d.ecs_threshold, "dab": d.dab_weight, "dsbn": true}));
    prov.insert("epochs".into(), json!(opts.epochs));
    prov.insert("best_epoch".into(), json!(res.best_epoch));
    prov.insert("batch_size".into(), json!(opts.batch_size));
    prov.insert("final_batch_size".into(), json!(res.final_batch));
    prov.insert("oom_retries".into(), json!(res.oom_retries));
    prov.insert("optimizer".into(), json!(format!("Adam(lr={}, eps={}), clip_grad_norm 1.0, StepLR(1, gamma={})", opts.lr, opts.adam_eps, opts.schedule_ratio)));
    prov.insert("mask_ratio".into(), json!(opts.mask_ratio));
    prov.insert("dropout".into(), json!(d.dropout));
    prov.insert("precision".into(), json!(precision));
    prov.insert("device".into(), json!(dspec.device.kind.to_string()));
    prov.insert("n_train".into(), json!(res.n_train));
    prov.insert("n_validation".into(), json!(res.n_valid));
    prov.insert("initialised_not_loaded".into(), json!(drawn));
    prov.insert("loss_train".into(), json!(res.history.iter().map(|e| e.train.clone()).collect::<Vec<_>>()));
    prov.insert("loss_validation_gep".into(), json!(res.history.iter().map(|e| e.valid_mse).collect::<Vec<_>>()));
    prov.insert("train_seconds".into(), json!(train_s));
    prov.insert("date".into(), json!(chrono::Local::now().to_rfc3339()));
    prov.insert("run_id".into(), json!(spec.run_id));
    prov.insert("command_line".into(), Value::String(spec.command_line.clone()));
    let uns = crate::anndata::h5util::require_dict(out.file(), "uns").h5ctx(|| "creating uns".into())?;
    crate::tasks::runtime::write_json_dict(&uns, "scfoundry_integrate", &prov).h5ctx(|| "writing uns/scfoundry_integrate".into())?;
    drop(uns);
    out.commit()?;
    // the report folder: weights, losses, curve
    let report_dir: PathBuf = spec.out.with_extension("");
    std::fs::create_dir_all(&report_dir).map_err(|e| Error::Io { path: report_dir.clone(), source: e })?;
    let weights = report_dir.join("scgpt_integrated.safetensors");
    let sd = model.state_dict().map_err(|e| Error::Model { context: "saving the fine-tuned weights".into(), detail: e.to_string() })?;
    let mut meta = vec![("provenance", serde_json::to_string(&prov)?), ("format", "pt".to_string())];
    meta.push(("genes", serde_json::to_string(&p.genes)?));
    write_safetensors(&weights, &sd, &meta)?;
    std::fs::write(report_dir.join("losses.tsv"), history_tsv(&res.history)).map_err(|e| Error::Io { path: report_dir.join("losses.tsv"), source: e })?;
    if let Some(tsv) = &res.profile {
        let path = report_dir.join("step_profile.tsv");
        std::fs::write(&path, tsv).map_err(|e| Error::Io { path: path.clone(), source: e })?;
    }
    let curve = crate::plots::ElboCurve {
        title: format!("scgpt_integrated: training loss (all objectives) and validation GEP MSE per epoch ({n} cells, {} genes, {} batches, seed {})", p.genes.len(), p.levels.len(), spec.seed),
        train: res.history.iter().map(|h| h.train[OBJECTIVES.len()]).collect(),
        validation: res.history.iter().map(|h| h.valid_mse).collect::<Option<Vec<f64>>>(),
    };
    crate::plots::elbo_curve(&curve, &report_dir.join("losses.svg"), &report_dir.join("losses.png"))?;
    let last = res.history.last();
    let mut summary = vec![format!(
        "wrote {} with obsm['{key}'] ({n} cells x {dim}): scGPT fine-tuned {} epochs (best {}) on {} genes, {} batches in obs['{}'], in {train_s:.1}s",
        spec.out.display(),
        opts.epochs,
        res.best_epoch,
        p.genes.len(),
        p.levels.len(),
        o.batch_key[0]
    )];
    summary.push(format!("fine-tuned weights {}; losses and curve in {}", weights.display(), report_dir.display()));
    if res.profile.is_some() {
        summary.push(format!("time by region of the training steps (SCFOUNDRY_STEP_PROFILE): {}", report_dir.join("step_profile.tsv").display()));
    }
    if res.oom_retries > 0 {
        summary.push(format!("CUDA ran out of memory at --integration-batch-size {}; the minibatch was halved {} time(s) and training finished at {}: pass --integration-batch-size {} next time", opts.batch_size, res.oom_retries, res.final_batch, res.final_batch));
    }
    Ok(TaskResult {
        output: Some(spec.out.clone()),
        obsm_key: Some(key),
        n_obs: n,
        dim,
        phases: vec![("read, select genes and bin".into(), read_s), ("fine-tune and embed".into(), train_s)],
        notes: vec![format!("loss {:.4}", last.map_or(f64::NAN, |l| l.train[OBJECTIVES.len()]))],
        summary,
        ..Default::default()
    })
}

/// scgpt_integrated: the table's entry.
pub struct ScgptIntegrated;

impl crate::tasks::method::Method for ScgptIntegrated {
    fn integrates(&self) -> bool {
        true
    }

    fn embeds_by_integrating(&self) -> bool {
        true
    }

    fn check_integrate_options(&self, args: &crate::cli::IntegrateArgs) -> anyhow::Result<()> {
        super::warn_classic_options(args, "scgpt_integrated");
        Ok(())
    }

    fn integrate(&self, spec: &TaskSpec) -> Option<anyhow::Result<TaskResult>> {
        Some(spec.options().map_err(Into::into).and_then(|o: IntegrateOptions| task(spec, &o)))
    }
}
