//! scgpt_integrated against upstream's PyTorch: one training step of scGPT's integration
//! fine-tuning (tests/fixtures/scgpt_integrated/, written by scripts/scgpt_integrated_reference.py
//! with scgpt 0.2.4 and torch 2.3.0): each objective's loss and every parameter's gradient, the
//! gradient reversal of DAB, DSBN's statistics, and the command end to end.
//!
//! Bounds: each loss within 1e-4 relative; each parameter's gradient within 1e-4 relative in
//! L2 norm (|g - g_ref| / |g_ref|).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use scfoundry::methods::scgpt_integrated::{Config, Dropout, Minibatch, TrainModel, OBJECTIVES};
use serde_json::Value;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/scgpt_integrated")
}

fn load(name: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture().join(name), &Device::Cpu).unwrap()
}

fn reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap()).unwrap()
}

fn model() -> TrainModel {
    let r = reference();
    let c = &r["config"];
    let u = |k: &str| c[k].as_u64().unwrap() as usize;
    let cfg = Config {
        embsize: u("embsize"),
        nheads: u("nheads"),
        d_hid: u("d_hid"),
        nlayers: u("nlayers"),
        ntoken: u("ntoken"),
        n_batches: u("n_batches"),
        dropout: 0.0,
        ecs_threshold: c["ecs_threshold"].as_f64().unwrap(),
        dab_weight: c["dab_weight"].as_f64().unwrap(),
    };
    let (m, drawn) = TrainModel::new(cfg, &load("initial.safetensors"), 0, &Device::Cpu).unwrap();
    assert!(drawn.is_empty(), "tensors missing from the fixture: {drawn:?}");
    m
}

fn minibatch() -> Minibatch {
    let b = load("batch.safetensors");
    let ids = b["gene_ids"].to_dtype(candle_core::DType::I64).unwrap();
    let (n, l) = ids.dims2().unwrap();
    let v = |k: &str| b[k].flatten_all().unwrap().to_vec1::<f32>().unwrap();
    Minibatch {
        b: n,
        l,
        gene_ids: ids.flatten_all().unwrap().to_vec1::<i64>().unwrap().into_iter().map(|x| x as u32).collect(),
        input_values: v("input_values"),
        target_values: v("target_values"),
        batch_labels: b["batch_labels"].to_vec1::<i64>().unwrap().into_iter().map(|x| x as u32).collect(),
    }
}

fn norm(a: &Tensor) -> f64 {
    (a.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64).sqrt()
}

/// Whether `g` is within 1e-4 relative of upstream's `want` (L2 norms), with a floor of 1e-6 of
/// the whole model's gradient norm `total` for tensors whose gradient is zero but for rounding
/// (a per-channel shift before DSBN's batch statistics has none: its norm is float32 noise in
/// both implementations).
fn close(g: &Tensor, want: &Tensor, total: f64) -> (bool, f64) {
    let d = norm(&(g - want).unwrap());
    (d <= 1e-4 * norm(want) + 1e-6 * total, d / norm(want))
}

fn total_norm<'a>(ts: impl Iterator<Item = &'a Tensor>) -> f64 {
    ts.map(|t| norm(t).powi(2)).sum::<f64>().sqrt()
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a - b).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64;
    let n = b.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64;
    (d / n).sqrt()
}

fn scalar(t: &Tensor) -> f64 {
    t.to_scalar::<f32>().unwrap() as f64
}

/// The fixture minibatch's losses (dropout 0), each within `tol` relative of upstream's.
fn losses_near_upstream(m: &mut TrainModel, r: &Value, tol: f64) -> (scfoundry::methods::scgpt_integrated::Losses, Vec<f64>) {
    let l = m.losses(&minibatch(), &mut Dropout::new(0.0, 0)).unwrap();
    let vals = l.values().unwrap();
    for (i, name) in OBJECTIVES.iter().enumerate() {
        let want = r["losses"][name].as_f64().unwrap();
        let err = (vals[i] - want).abs() / want.abs();
        assert!(err < tol, "{name}: {} vs upstream {want} (relative {err:e}, mixed {})", vals[i], m.mixed);
    }
    (l, vals)
}

#[test]
fn scgpt_integrated_losses_and_gradients_match_upstream() {
    let r = reference();
    let mut m = model();
    let (l, vals) = losses_near_upstream(&mut m, &r, 1e-4);
    let want = r["total"].as_f64().unwrap();
    assert!((vals[6] - want).abs() / want < 1e-4, "total {} vs {want}", vals[6]);
    let grads = l.total.backward().unwrap();
    let refg = load("grads.safetensors");
    let mut worst = (0f64, String::new());
    let mut bad = Vec::new();
    let total = total_norm(refg.iter().filter(|(k, _)| k.starts_with("grad.")).map(|(_, v)| v));
    for (name, var) in &m.params {
        let g = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("no gradient reaches {name}"));
        let want = refg.get(&format!("grad.{name}")).unwrap_or_else(|| panic!("upstream has no gradient for {name}"));
        let (ok, e) = close(g, want, total);
        if e > worst.0 && norm(want) > 1e-3 * total {
            worst = (e, name.clone());
        }
        if !ok {
            bad.push(format!("{name}: relative {e:.2e}, |g| {:.3e}, |upstream| {:.3e}, model {total:.3e}", norm(g), norm(want)));
        }
    }
    assert!(bad.is_empty(), "gradients off by more than 1e-4 relative:\n{}", bad.join("\n"));
    // every parameter upstream trains is trained here (cls_decoder gets none upstream either)
    let n_ref = refg.keys().filter(|k| k.starts_with("grad.")).count();
    assert_eq!(n_ref, m.params.len());
    for k in r["no_gradient"].as_array().unwrap() {
        assert!(k.as_str().unwrap().starts_with("cls_decoder."), "{k}");
    }
    eprintln!("largest gradient error {:.2e} ({})", worst.0, worst.1);
}

/// Mixed precision (`--precision bf16`): the same minibatch's losses within 2% of upstream's f32
/// values and the whole gradient within 5% (relative L2 over all tensors), bf16 products having
/// 8-bit mantissas; the parameters stay f32.
#[test]
fn scgpt_integrated_bf16_stays_near_f32() {
    let r = reference();
    let mut m = model();
    m.mixed = true;
    let (l, _) = losses_near_upstream(&mut m, &r, 2e-2);
    let grads = l.total.backward().unwrap();
    let refg = load("grads.safetensors");
    let (mut diff, mut tot) = (0f64, 0f64);
    for (name, var) in &m.params {
        let g = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("no gradient reaches {name}"));
        assert_eq!(g.dtype(), candle_core::DType::F32, "{name}");
        let want = &refg[&format!("grad.{name}")];
        diff += norm(&(g - want).unwrap()).powi(2);
        tot += norm(want).powi(2);
    }
    let e = (diff / tot).sqrt();
    assert!(e < 5e-2, "bf16 gradient off by {e:.3e} relative");
    assert!(e > 1e-6, "bf16 gives f32's gradient exactly ({e:e}): the products did not run in bf16");
    eprintln!("bf16 gradient relative error {e:.2e}");
}

/// The DAB loss alone: its gradient reaches the encoder through the reversal layer, negated.
/// Upstream's gradients of the encoder are those of the discriminator's loss times -1, so a
/// reversal with the wrong sign (or none) fails here.
#[test]
fn scgpt_integrated_reversal_sign_matches_upstream() {
    let mut m = model();
    let mb = minibatch();
    let l = m.losses(&mb, &mut Dropout::new(0.0, 0)).unwrap();
    let grads = l.dab.backward().unwrap();
    let refg = load("grads.safetensors");
    let total = total_norm(refg.iter().filter(|(k, _)| k.starts_with("dab.")).map(|(_, v)| v));
    let mut encoder_checked = 0;
    for (name, var) in &m.params {
        let Some(want) = refg.get(&format!("dab.{name}")) else {
            assert!(grads.get(var.as_tensor()).is_none_or(|g| scalar(&g.abs().unwrap().max_all().unwrap()) == 0.0), "{name} has a DAB gradient upstream lacks");
            continue;
        };
        let g = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("no DAB gradient reaches {name}"));
        let (ok, e) = close(g, want, total);
        assert!(ok, "DAB gradient of {name}: relative error {e:e}, |g| {:.3e}, |upstream| {:.3e}, model {total:.3e}", norm(g), norm(want));
        if name.starts_with("transformer_encoder.") && norm(want) > 1e-3 * total {
            // the sign: the negated gradient is far from upstream's
            assert!(rel(&g.neg().unwrap(), want) > 1.0, "{name}");
            encoder_checked += 1;
        }
    }
    assert!(encoder_checked > 10, "{encoder_checked} encoder tensors checked");
}

/// DSBN: the minibatch's batch (label 1) normalises with its own statistics, and only its
/// running statistics move; eval mode reads them (the `<cls>` embeddings after the update).
#[test]
fn scgpt_integrated_dsbn_statistics_match_upstream() {
    let mut m = model();
    let mb = minibatch();
    let before = m.dsbn.clone();
    m.losses(&mb, &mut Dropout::new(0.0, 0)).unwrap();
    let refg = load("grads.safetensors");
    let vec = |k: &str| refg[k].to_vec1::<f32>().unwrap();
    for i in 0..3 {
        for (key, ours, was) in [("running_mean", &m.dsbn.running_mean[i], &before.running_mean[i]), ("running_var", &m.dsbn.running_var[i], &before.running_var[i])] {
            let want = vec(&format!("after.dsbn.bns.{i}.{key}"));
            let err = ours.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < 1e-5, "bns.{i}.{key}: {err}");
            let moved = ours.iter().zip(was).any(|(a, b)| a != b);
            assert_eq!(moved, i == 1, "bns.{i}.{key} moved: {moved}");
        }
    }
    assert_eq!(m.dsbn.tracked, vec![0, 1, 0]);
    let emb = m.embed(&mb).unwrap();
    let want = refg["eval_cell_emb"].flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let err = emb.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(err < 1e-5, "eval embeddings: {err}");
}

/// A safetensors file's header (its `__metadata__` among the entries).
fn safetensors_header(path: &Path) -> Value {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    serde_json::from_slice(&bytes[8..8 + n]).unwrap()
}

/// `integrate --method scgpt_integrated` on a small file with the tiny checkpoint of the scgpt
/// fixture (`--model-dir`): obsm, the fine-tuned weights with provenance, the losses and curve.
#[test]
fn scgpt_integrated_command_writes_embedding_and_weights() {
    let ctx = crate::common::TestContext::new();
    let vocab: serde_json::Map<String, Value> = serde_json::from_str(&std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/scgpt/tiny/vocab.json")).unwrap()).unwrap();
    let mut genes: Vec<String> = vocab.keys().filter(|k| !k.starts_with('<') && !k.starts_with("NOTINDATA")).cloned().collect();
    genes.sort();
    let (n, g) = (60, 24);
    let mut t = crate::common::Tiny::counts(n, g);
    t.var_names = genes[..g].to_vec();
    let t = t.with_obs("batch", (0..n).map(|i| format!("b{}", i % 3)).collect());
    t.write(&ctx.path("t.h5ad"));
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/scgpt/tiny");
    let r = ctx.run(&["integrate", "-m", "scgpt_integrated", "-d", "t.h5ad", "--batch-key", "batch", "--epochs", "2", "--integration-batch-size", "8", "--model-dir", model.to_str().unwrap(), "--seed", "3"]);
    r.success();
    let out = ctx.path("t.scgpt_integrated.h5ad");
    let (emb, dim) = crate::common::read_obsm(&out, "X_scgpt_integrated");
    assert_eq!((emb.len(), dim), (n * 32, 32));
    for row in emb.chunks(dim) {
        let norm: f32 = row.iter().map(|v| v * v).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "{norm}");
    }
    // cells differ
    assert!(emb[..dim].iter().zip(&emb[dim..2 * dim]).any(|(a, b)| (a - b).abs() > 1e-4));
    let report = ctx.path("t.scgpt_integrated");
    let h = safetensors_header(&report.join("scgpt_integrated.safetensors"));
    let prov: Value = serde_json::from_str(h["__metadata__"]["provenance"].as_str().unwrap()).unwrap();
    assert_eq!(prov["seed"], 3);
    assert_eq!(prov["epochs"], 2);
    assert_eq!(prov["batch_size"], 8);
    assert_eq!(prov["batches"], serde_json::json!(["b0", "b1", "b2"]));
    let sha = prov["base_weights_sha256"]["best_model.pt"].as_str().unwrap();
    assert_eq!(sha, crate::common::sha256(&model.join("best_model.pt")));
    assert_eq!(prov["loss_train"].as_array().unwrap().len(), 2);
    assert_eq!(prov["objectives"]["ecs"], 10.0);
    // the integration heads are new (the pretrained checkpoint has none): drawn, and said so
    let drawn: Vec<&str> = prov["initialised_not_loaded"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert!(drawn.contains(&"grad_reverse_discriminator.out_layer.weight") && drawn.contains(&"decoder.fc.0.weight"), "{drawn:?}");
    assert!(!drawn.contains(&"transformer_encoder.layers.0.linear1.weight"), "{drawn:?}");
    // upstream's state_dict names, the three batches' statistics
    assert_eq!(h["dsbn.bns.2.running_var"]["shape"], serde_json::json!([32]));
    assert_eq!(h["encoder.embedding.weight"]["dtype"], "F32");
    let tsv = std::fs::read_to_string(report.join("losses.tsv")).unwrap();
    assert_eq!(tsv.lines().count(), 3, "{tsv}");
    assert!(tsv.starts_with("epoch\tlr\tgep\tgep_zero\tgepc\tgepc_zero\tecs\tdab\ttotal"));
    // where each epoch's time went: steps, training speed, phases
    let head: Vec<&str> = tsv.lines().next().unwrap().split('\t').collect();
    let col = |name: &str| head.iter().position(|h| *h == name).unwrap_or_else(|| panic!("no {name} in {head:?}"));
    for row in tsv.lines().skip(1) {
        let f: Vec<f64> = row.split('\t').map(|v| v.parse().unwrap_or(f64::NAN)).collect();
        assert_eq!(f.len(), head.len(), "{row}");
        // 54 training cells in minibatches of at most 8 cells of one batch (3 batches)
        assert!((7.0..=9.0).contains(&f[col("steps")]), "{row}");
        assert!(f[col("train_cells_per_s")] > 0.0 && f[col("forward_s")] > 0.0 && f[col("backward_s")] > 0.0, "{row}");
        let phases: f64 = ["batches_s", "forward_s", "backward_s", "optimizer_s", "validation_s"].iter().map(|c| f[col(c)]).sum();
        assert!(phases <= f[col("seconds")] + 0.1, "{row}");
    }
    assert!(report.join("losses.svg").is_file());
    // the same seed gives the same embedding
    let r = ctx.run(&["integrate", "-m", "scgpt_integrated", "-d", "t.h5ad", "--batch-key", "batch", "--epochs", "2", "--integration-batch-size", "8", "--model-dir", model.to_str().unwrap(), "--seed", "3", "-o", "again.h5ad"]);
    r.success();
    assert_eq!(crate::common::read_obsm(&ctx.path("again.h5ad"), "X_scgpt_integrated").0, emb);
}

/// `embed --method scgpt_integrated` runs integrate's task: the same options give the same
/// embedding as `integrate`, and without --batch-key it stops naming the option.
#[test]
fn scgpt_integrated_embed_matches_integrate() {
    let ctx = crate::common::TestContext::new();
    let vocab: serde_json::Map<String, Value> = serde_json::from_str(&std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/scgpt/tiny/vocab.json")).unwrap()).unwrap();
    let mut genes: Vec<String> = vocab.keys().filter(|k| !k.starts_with('<') && !k.starts_with("NOTINDATA")).cloned().collect();
    genes.sort();
    let (n, g) = (45, 24);
    let mut t = crate::common::Tiny::counts(n, g);
    t.var_names = genes[..g].to_vec();
    let t = t.with_obs("batch", (0..n).map(|i| format!("b{}", i % 3)).collect());
    t.write(&ctx.path("t.h5ad"));
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/scgpt/tiny");
    let common = ["-d", "t.h5ad", "--epochs", "2", "--integration-batch-size", "8", "--model-dir", model.to_str().unwrap(), "--seed", "5"];
    let r = ctx.run(&[&["embed", "-m", "scgpt_integrated"][..], &common].concat());
    r.failed().stderr_has("--batch-key").stderr_has("is required").has_hint();
    assert!(!ctx.path("t.scgpt_integrated.h5ad").exists());
    let r = ctx.run(&[&["embed", "-m", "scgpt_integrated", "--batch-key", "batch", "-o", "e.h5ad"][..], &common].concat());
    r.success();
    let r = ctx.run(&[&["integrate", "-m", "scgpt_integrated", "--batch-key", "batch", "-o", "i.h5ad"][..], &common].concat());
    r.success();
    let (e, dim) = crate::common::read_obsm(&ctx.path("e.h5ad"), "X_scgpt_integrated");
    let (i, _) = crate::common::read_obsm(&ctx.path("i.h5ad"), "X_scgpt_integrated");
    assert_eq!((e.len(), dim), (n * 32, 32));
    assert_eq!(e, i, "embed and integrate differ");
    // the options reached the task: the provenance of embed's output says so
    let h = safetensors_header(&ctx.path("e").join("scgpt_integrated.safetensors"));
    let prov: Value = serde_json::from_str(h["__metadata__"]["provenance"].as_str().unwrap()).unwrap();
    assert_eq!((prov["seed"].as_u64(), prov["epochs"].as_u64(), prov["batch_size"].as_u64()), (Some(5), Some(2), Some(8)));
    assert_eq!(prov["batch_key"], "batch");
    // another seed gives another embedding (the comparison above could not pass by accident)
    let r = ctx.run(&[&["embed", "-m", "scgpt_integrated", "--batch-key", "batch", "-o", "e6.h5ad"][..], &common[..common.len() - 1], &["6"]].concat());
    r.success();
    assert_ne!(crate::common::read_obsm(&ctx.path("e6.h5ad"), "X_scgpt_integrated").0, e);
}
