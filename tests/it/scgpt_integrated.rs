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

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a - b).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64;
    let n = b.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64;
    (d / n).sqrt()
}

fn scalar(t: &Tensor) -> f64 {
    t.to_scalar::<f32>().unwrap() as f64
}

#[test]
fn scgpt_integrated_losses_and_gradients_match_upstream() {
    let r = reference();
    let mut m = model();
    let mb = minibatch();
    let l = m.losses(&mb, &mut Dropout::new(0.0, 0)).unwrap();
    let vals = l.values().unwrap();
    for (i, name) in OBJECTIVES.iter().enumerate() {
        let want = r["losses"][name].as_f64().unwrap();
        let err = (vals[i] - want).abs() / want.abs();
        assert!(err < 1e-4, "{name}: {} vs upstream {want} (relative {err:e})", vals[i]);
    }
    let want = r["total"].as_f64().unwrap();
    assert!((vals[6] - want).abs() / want < 1e-4, "total {} vs {want}", vals[6]);
    let grads = l.total.backward().unwrap();
    let refg = load("grads.safetensors");
    let mut worst = (0f64, String::new());
    for (name, var) in &m.params {
        let g = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("no gradient reaches {name}"));
        let want = refg.get(&format!("grad.{name}")).unwrap_or_else(|| panic!("upstream has no gradient for {name}"));
        let e = rel(g, want);
        if e > worst.0 {
            worst = (e, name.clone());
        }
        assert!(e < 1e-4, "gradient of {name}: relative error {e:e}");
    }
    // every parameter upstream trains is trained here (cls_decoder gets none upstream either)
    let n_ref = refg.keys().filter(|k| k.starts_with("grad.")).count();
    assert_eq!(n_ref, m.params.len());
    for k in r["no_gradient"].as_array().unwrap() {
        assert!(k.as_str().unwrap().starts_with("cls_decoder."), "{k}");
    }
    eprintln!("largest gradient error {:.2e} ({})", worst.0, worst.1);
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
    let mut encoder_checked = 0;
    for (name, var) in &m.params {
        let Some(want) = refg.get(&format!("dab.{name}")) else {
            assert!(grads.get(var.as_tensor()).is_none_or(|g| scalar(&g.abs().unwrap().max_all().unwrap()) == 0.0), "{name} has a DAB gradient upstream lacks");
            continue;
        };
        let g = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("no DAB gradient reaches {name}"));
        let e = rel(g, want);
        assert!(e < 1e-4, "DAB gradient of {name}: relative error {e:e}");
        if name.starts_with("transformer_encoder.") && scalar(&want.abs().unwrap().max_all().unwrap()) > 0.0 {
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
