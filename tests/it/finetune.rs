//! `scfoundry finetune`: the head learns real labels, the training step is right, unfrozen
//! layers are exactly the ones trained, seeds reproduce, predictions round-trip through
//! anndata, bad input is clear, and the executors are wired.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::{Device, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use serde_json::Value;

use crate::common::{python, repo, TestContext, Tiny, BIN};
use scfoundry::nn::finetune::{self as ft, Head};

fn provenance(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("finetune.json")).unwrap()).unwrap()
}

fn tensors(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// pca + head on the demo PBMCs: the validation split (held out, stratified) is classified well
/// above chance (10 types, the largest 23% of cells), and the loss falls.
#[test]
fn finetune_pca_learns_demo_cell_types() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    let r = ctx.run(&["finetune", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--label-key", "cell_type", "--epochs", "60", "--lr", "0.01", "--val-fraction", "0.2", "--patience", "10", "--seed", "1", "-o", "ft"]);
    r.success().stderr_has("trained pca head on obs['cell_type'] (10 classes");
    let dir = ctx.path("ft");
    for f in ["model.safetensors", "finetune.json", "curves.tsv", "pca_fit.json", "pca_var_names.json"] {
        assert!(dir.join(f).is_file(), "{f} missing: {}", r.stderr);
    }
    let p = provenance(&dir);
    assert_eq!(p["method"], "pca");
    assert_eq!(p["seed"], 1);
    assert_eq!(p["classes"].as_array().unwrap().len(), 10);
    assert_eq!(p["n_train"].as_u64().unwrap() + p["n_val"].as_u64().unwrap(), 700);
    assert!(p["n_val"].as_u64().unwrap() >= 130, "{}", p["n_val"]);
    let hist = p["history"].as_array().unwrap();
    let first = hist[0]["train_loss"].as_f64().unwrap();
    let best_epoch = p["best_epoch"].as_u64().unwrap() as usize;
    let best = &hist[best_epoch - 1];
    assert!(best["train_loss"].as_f64().unwrap() < 0.7 * first, "training loss did not fall: {first} -> {}", best["train_loss"]);
    assert!(best["val_loss"].as_f64().unwrap() < hist[0]["val_loss"].as_f64().unwrap(), "validation loss did not fall");
    let acc = best["val_accuracy"].as_f64().unwrap();
    assert!(acc >= 0.60, "held-out accuracy {acc}");
    let tsv = std::fs::read_to_string(dir.join("curves.tsv")).unwrap();
    assert_eq!(tsv.lines().count(), hist.len() + 1);
    assert!(tsv.starts_with("epoch\ttrain_loss\ttrain_accuracy\tval_loss\tval_accuracy\tseconds\n"));
    let m = tensors(&dir.join("model.safetensors"));
    assert_eq!(m.len(), 2, "pca saves the head only");
    assert_eq!(m["head.weight"].dims(), [10, 50]);
}

/// The training step: candle's gradient of the head's cross-entropy equals the analytic
/// (softmax - onehot)ᵀx / n and a central finite difference, and one AdamW step moves each
/// weight as torch.optim.AdamW's first step does: w(1 - lr·wd) - lr·g/(|g| + eps).
#[test]
fn finetune_training_step_matches_the_analytic_gradient_and_adamw() {
    let (n, d, k) = (6usize, 4usize, 3usize);
    let x: Vec<f32> = (0..n * d).map(|i| ((i * 37 % 11) as f32 - 5.0) / 4.0).collect();
    let y: Vec<u32> = vec![0, 1, 2, 1, 0, 2];
    let dev = Device::Cpu;
    let head = Head::init(d, k, 3, &dev).unwrap();
    let w0 = values(head.w.as_tensor());
    let b0 = values(head.b.as_tensor());
    let xt = Tensor::from_vec(x.clone(), (n, d), &dev).unwrap();
    let yt = Tensor::from_vec(y.clone(), n, &dev).unwrap();
    let loss = ft::loss(&head.logits(&xt).unwrap(), &yt).unwrap();
    let grads = loss.backward().unwrap();
    let gw = values(grads.get(head.w.as_tensor()).unwrap());
    let gb = values(grads.get(head.b.as_tensor()).unwrap());
    // analytic, in f64
    let loss_of = |w: &[f64], b: &[f64]| -> (f64, Vec<f64>, Vec<f64>) {
        let (mut l, mut dw, mut db) = (0.0, vec![0.0; k * d], vec![0.0; k]);
        for i in 0..n {
            let z: Vec<f64> = (0..k).map(|c| b[c] + (0..d).map(|j| w[c * d + j] * x[i * d + j] as f64).sum::<f64>()).collect();
            let m = z.iter().cloned().fold(f64::MIN, f64::max);
            let s: f64 = z.iter().map(|v| (v - m).exp()).sum();
            l += -(z[y[i] as usize] - m - s.ln());
            for c in 0..k {
                let p = (z[c] - m).exp() / s - if c == y[i] as usize { 1.0 } else { 0.0 };
                db[c] += p / n as f64;
                for j in 0..d {
                    dw[c * d + j] += p * x[i * d + j] as f64 / n as f64;
                }
            }
        }
        (l / n as f64, dw, db)
    };
    let w64: Vec<f64> = w0.iter().map(|&v| v as f64).collect();
    let b64: Vec<f64> = b0.iter().map(|&v| v as f64).collect();
    let (l64, dw, db) = loss_of(&w64, &b64);
    assert!((loss.to_scalar::<f32>().unwrap() as f64 - l64).abs() < 1e-5);
    for (a, b) in gw.iter().zip(&dw).chain(gb.iter().zip(&db)) {
        assert!((*a as f64 - b).abs() < 1e-5, "gradient {a} vs analytic {b}");
    }
    let h = 1e-4;
    for idx in 0..k * d {
        let (mut up, mut down) = (w64.clone(), w64.clone());
        up[idx] += h;
        down[idx] -= h;
        let num = (loss_of(&up, &b64).0 - loss_of(&down, &b64).0) / (2.0 * h);
        assert!((num - gw[idx] as f64).abs() < 1e-4, "finite difference {num} vs {}", gw[idx]);
    }
    // one AdamW step
    let (lr, wd, eps) = (0.01, 0.1, 1e-8);
    let mut opt = AdamW::new(vec![head.w.clone(), head.b.clone()], ParamsAdamW { lr, weight_decay: wd, eps, ..Default::default() }).unwrap();
    opt.step(&grads).unwrap();
    let w1 = values(head.w.as_tensor());
    for i in 0..k * d {
        let g = gw[i] as f64;
        let want = w0[i] as f64 * (1.0 - lr * wd) - lr * g / (g.abs() + eps);
        assert!((w1[i] as f64 - want).abs() < 1e-6, "AdamW step {} vs {want}", w1[i]);
    }
}

/// The head trained by `ft::train` on separable toy features reaches full accuracy, and the
/// best epoch's weights are the ones returned.
#[test]
fn finetune_train_loop_separates_toy_classes() {
    let dev = Device::Cpu;
    let n = 90;
    let labels: Vec<u32> = (0..n).map(|i| (i % 3) as u32).collect();
    let x: Vec<f32> = (0..n).flat_map(|i| { let c = i % 3; (0..4).map(move |j| if j == c { 3.0 } else { 0.1 * (i % 7) as f32 }) }).collect();
    let mut feats = ft::Cached(Tensor::from_vec(x, (n, 4), &dev).unwrap());
    let split = ft::split(&labels, 3, 0.2, 0);
    let o = ft::TrainOptions { epochs: 40, lr: 0.05, batch_size: 16, ..Default::default() };
    let t = ft::train(&mut feats, 4, &labels, 3, &split, &[], &o, &dev, |_| {}).unwrap();
    let best = &t.history[t.best_epoch - 1];
    assert_eq!(best.val_accuracy, Some(1.0));
    assert!(t.history.iter().all(|h| h.val_loss.unwrap() >= best.val_loss.unwrap()));
    let head = Head::from_tensors(&t.head_w, &t.head_b).unwrap();
    let (l, a) = ft::evaluate(&mut feats, &head, &labels, &split.val, 64).unwrap();
    assert!((l - best.val_loss.unwrap()).abs() < 1e-5 && a == 1.0, "the returned weights are the best epoch's");
}

/// Same seed: the same weights; another seed: other weights.
#[test]
fn finetune_seed_reproduces_the_weights() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    let run = |seed: &str, out: &str| {
        ctx.run(&["finetune", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--label-key", "cell_type", "--epochs", "3", "--n-comps", "10", "--seed", seed, "-o", out]).success();
        let m = tensors(&ctx.path(out).join("model.safetensors"));
        (values(&m["head.weight"]), values(&m["head.bias"]))
    };
    let a = run("5", "a");
    assert_eq!(a, run("5", "b"), "same seed, different weights");
    assert_ne!(a, run("6", "c"), "another seed gave the same weights");
    assert_eq!(provenance(&ctx.path("a"))["history"], {
        let mut h = provenance(&ctx.path("b"))["history"].clone();
        // the seconds differ between runs; the numbers must not
        for (x, y) in h.as_array_mut().unwrap().iter_mut().zip(provenance(&ctx.path("a"))["history"].as_array().unwrap()) {
            x["seconds"] = y["seconds"].clone();
        }
        h
    });
}

/// A weights folder holding the tiny scGPT fixture where weights.toml puts scgpt.
fn scgpt_weights(ctx: &TestContext) -> PathBuf {
    use scfoundry::methods::scgpt;
    let w = ctx.path("weights");
    let man = scfoundry::weights::Manifest::builtin();
    let dest = scgpt::model_dir(&w, &man);
    std::fs::create_dir_all(&dest).unwrap();
    for f in ["best_model.pt", "vocab.json", "args.json"] {
        std::fs::copy(repo().join("tests/fixtures/scgpt/tiny").join(f), dest.join(f)).unwrap();
    }
    w
}

/// `--unfreeze-layers 1` on the tiny scGPT (2 layers): model.safetensors holds the head and
/// exactly the last layer's 12 tensors, every one of them changed from the checkpoint; the
/// first layer is not saved (it was never a Var, so AdamW could not touch it). Predicting with
/// the saved folder reloads those tensors over the checkpoint.
#[test]
fn finetune_unfreezes_exactly_the_last_layers() {
    let ctx = TestContext::new();
    let w = scgpt_weights(&ctx);
    ctx.demo("pbmc68k_counts.h5ad");
    let ws = w.to_str().unwrap();
    let r = ctx.run(&["--weights-dir", ws, "finetune", "-m", "scgpt", "-d", "pbmc68k_counts.h5ad", "--label-key", "cell_type", "--epochs", "2", "--unfreeze-layers", "1", "--batch-size", "32", "--max-len", "64", "--lr", "0.001", "-o", "ft"]);
    r.success();
    let m = tensors(&ctx.path("ft/model.safetensors"));
    let base = scfoundry::methods::scgpt::read_checkpoint(&repo().join("tests/fixtures/scgpt/tiny/best_model.pt")).unwrap();
    let mut layer_keys: Vec<&String> = m.keys().filter(|k| !k.starts_with("head.")).collect();
    layer_keys.sort();
    assert_eq!(layer_keys.len(), 12, "{layer_keys:?}");
    for k in &layer_keys {
        assert!(k.starts_with("transformer_encoder.layers.1."), "{k} is not in the last layer");
        let before = values(&base[k.as_str()].to_dtype(candle_core::DType::F32).unwrap());
        assert_ne!(before, values(&m[k.as_str()]), "{k} did not change");
    }
    let p = provenance(&ctx.path("ft"));
    assert_eq!(p["unfreeze_layers"], 1);
    assert_eq!(p["unfrozen_tensors"].as_array().unwrap().len(), 12);
    assert!(p["base_weights"]["sha256"]["scgpt-whole-human-model"].as_str().unwrap().len() == 64);
    // predict with the saved folder
    ctx.run(&["--weights-dir", ws, "finetune", "--model", "ft", "--predict", "pbmc68k_counts.h5ad", "--predict-out", "pred.h5ad", "--max-len", "64"]).success();
    assert!(ctx.path("pred.h5ad").is_file());
    // more layers than the model has
    ctx.run(&["--weights-dir", ws, "finetune", "-m", "scgpt", "-d", "pbmc68k_counts.h5ad", "--label-key", "cell_type", "--epochs", "1", "--unfreeze-layers", "3", "-o", "ft3"])
        .failed()
        .stderr_has("--unfreeze-layers")
        .stderr_has("runs 2 encoder layers");
}

/// Geneformer (tiny V1): the head trains on the frozen embedding and predicts.
#[test]
fn finetune_geneformer_head_on_the_frozen_embedding() {
    let ctx = TestContext::new();
    std::fs::copy(repo().join("tests/fixtures/geneformer/pbmc68k_50.h5ad"), ctx.path("cells.h5ad")).unwrap();
    let dir = repo().join("tests/fixtures/geneformer/v1");
    let d = dir.to_str().unwrap();
    let r = ctx.run(&["finetune", "-m", "geneformer", "-d", "cells.h5ad", "--label-key", "cell_type", "--model-dir", d, "--epochs", "2", "--val-fraction", "0", "-o", "ft", "--predict", "cells.h5ad"]);
    r.success().stderr_has("obs['cell_type_pred']");
    let m = tensors(&ctx.path("ft/model.safetensors"));
    assert_eq!(m.len(), 2, "the head only");
    assert_eq!(m["head.weight"].dims()[1], 32);
}

// ---- unfrozen BERT layers (geneformer, cellama): methods/bert.rs ----------------------------

use candle_core::{DType, Var};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config, HiddenAct};
use scfoundry::nn::bert::{self, Bert, TrainableLayer};

fn bert_config(path: &Path) -> Config {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Largest |a - b| over the largest |b|.
fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();
    let m = b.abs().unwrap().max_all().unwrap().to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();
    d / m.max(1e-30)
}

/// Three sequences of different lengths (so padding and the mask matter): ids and mask.
fn padded_batch(lens: &[usize], vocab: (u32, u32), first: Option<u32>) -> (Tensor, Tensor) {
    let l = *lens.iter().max().unwrap();
    let mut ids = vec![0u32; lens.len() * l];
    let mut mask = vec![0u32; lens.len() * l];
    for (r, &n) in lens.iter().enumerate() {
        for p in 0..n {
            ids[r * l + p] = match (p, first) {
                (0, Some(f)) => f,
                _ => vocab.0 + ((r * 7919 + p * 104_729) as u32 % (vocab.1 - vocab.0)),
            };
            mask[r * l + p] = 1;
        }
    }
    (Tensor::from_vec(ids, (lens.len(), l), &Device::Cpu).unwrap(), Tensor::from_vec(mask, (lens.len(), l), &Device::Cpu).unwrap())
}

/// Our differentiable layers against candle-transformers' BertModel on the same checkpoint:
/// the hidden states with the last 1..=n layers run as TrainableLayers; returns the largest
/// relative difference.
fn compare_with_candle_bert(vb: VarBuilder<'static>, cfg: &Config, ids: &Tensor, mask: &Tensor) -> f64 {
    let types = ids.zeros_like().unwrap();
    let reference = BertModel::load(vb.clone(), cfg).unwrap().forward(ids, &types, Some(mask)).unwrap();
    let mut worst = 0f64;
    for t in 1..=cfg.num_hidden_layers {
        let ours = Bert::load(vb.clone(), cfg, t).unwrap();
        assert_eq!(ours.trainable(), t);
        let d = rel_diff(&ours.forward(ids, &types, Some(mask)).unwrap(), &reference);
        assert!(d < 1e-5, "{t} trainable layer(s): largest difference {d:e} of the largest value");
        worst = worst.max(d);
    }
    // no trainable layer: BertModel itself
    let same = Bert::load(vb, cfg, 0).unwrap().forward(ids, &types, Some(mask)).unwrap();
    assert_eq!(values(&same), values(&reference));
    worst
}

/// The tiny Geneformer V1 checkpoint (2 layers, relu): our layers equal candle's within 1e-5.
#[test]
fn finetune_bert_layer_equals_candle_bert_on_geneformer_weights() {
    let dir = repo().join("tests/fixtures/geneformer/v1");
    let cfg = bert_config(&dir.join("config.json"));
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], DType::F32, &Device::Cpu) }.unwrap().pp("bert");
    let (ids, mask) = padded_batch(&[40, 17, 3], (2, cfg.vocab_size as u32), None);
    let worst = compare_with_candle_bert(vb, &cfg, &ids, &mask);
    eprintln!("geneformer fixture: largest relative difference {worst:e}");
}

/// The real all-MiniLM-L6-v2 (6 layers, gelu, cellama's encoder): our layers equal candle's
/// within 1e-5.
#[test]
fn finetune_bert_layer_equals_candle_bert_on_minilm_weights() {
    let ctx = TestContext::new();
    let Some(w) = crate::cellama::minilm_weights(&ctx) else { return };
    let dir = scfoundry::methods::cellama::model_dir(&w, &scfoundry::weights::Manifest::builtin());
    let cfg = bert_config(&dir.join("config.json"));
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], DType::F32, &Device::Cpu) }.unwrap();
    let (ids, mask) = padded_batch(&[48, 30, 9], (1000, 29_000), Some(101));
    let worst = compare_with_candle_bert(vb, &cfg, &ids, &mask);
    eprintln!("all-MiniLM-L6-v2: largest relative difference {worst:e}");
}

/// Autograd through a tiny TrainableLayer (f64, gelu, a padded batch) equals central finite
/// differences for every weight and the input.
#[test]
fn finetune_bert_layer_gradient_matches_finite_differences() {
    let dev = Device::Cpu;
    let cfg = Config { hidden_size: 4, num_attention_heads: 2, intermediate_size: 6, num_hidden_layers: 1, hidden_act: HiddenAct::Gelu, layer_norm_eps: 1e-12, ..Default::default() };
    let shapes: Vec<(&str, Vec<usize>)> = vec![
        ("attention.self.query.weight", vec![4, 4]),
        ("attention.self.query.bias", vec![4]),
        ("attention.self.key.weight", vec![4, 4]),
        ("attention.self.key.bias", vec![4]),
        ("attention.self.value.weight", vec![4, 4]),
        ("attention.self.value.bias", vec![4]),
        ("attention.output.dense.weight", vec![4, 4]),
        ("attention.output.dense.bias", vec![4]),
        ("attention.output.LayerNorm.weight", vec![4]),
        ("attention.output.LayerNorm.bias", vec![4]),
        ("intermediate.dense.weight", vec![6, 4]),
        ("intermediate.dense.bias", vec![6]),
        ("output.dense.weight", vec![4, 6]),
        ("output.dense.bias", vec![4]),
        ("output.LayerNorm.weight", vec![4]),
        ("output.LayerNorm.bias", vec![4]),
    ];
    assert_eq!(shapes.len(), bert::LAYER_TENSORS);
    let mut k = 0u64;
    let mut next = || {
        k += 1;
        // a fixed pseudo-random value in [-0.8, 0.8)
        ((k.wrapping_mul(2_654_435_761) % 1000) as f64 / 625.0) - 0.8
    };
    let mut vars = Vec::new();
    let mut map = HashMap::new();
    for (name, shape) in &shapes {
        let n: usize = shape.iter().product();
        let mut v: Vec<f64> = (0..n).map(|_| next()).collect();
        if name.ends_with("LayerNorm.weight") {
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        let var = Var::from_vec(v, shape.as_slice(), &dev).unwrap();
        map.insert(name.to_string(), var.as_tensor().clone());
        vars.push((name.to_string(), var));
    }
    let layer = TrainableLayer::load(VarBuilder::from_tensors(map, DType::F64, &dev), &cfg).unwrap();
    // batch 2 x len 3, the second sequence padded after 2 tokens
    let x = Var::from_vec((0..24).map(|_| next() * 2.0).collect::<Vec<f64>>(), (2, 3, 4), &dev).unwrap();
    let mask = bert::extended_mask(&Tensor::new(&[[1u32, 1, 1], [1, 1, 0]], &dev).unwrap(), DType::F64).unwrap();
    let r = Tensor::from_vec((0..24).map(|_| next()).collect::<Vec<f64>>(), (2, 3, 4), &dev).unwrap();
    let loss = |x: &Tensor| -> Tensor { (layer.forward(x, &mask).unwrap() * &r).unwrap().sum_all().unwrap() };
    let grads = loss(x.as_tensor()).backward().unwrap();
    let h = 1e-6;
    let mut checked = 0;
    let mut worst = 0f64;
    for (name, var) in vars.iter().chain(std::iter::once(&("input".to_string(), x.clone()))) {
        let g = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("no gradient for {name}")).flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let base = var.as_tensor().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let shape = var.as_tensor().shape().clone();
        for i in 0..base.len() {
            let at = |delta: f64| -> f64 {
                let mut v = base.clone();
                v[i] += delta;
                var.set(&Tensor::from_vec(v, shape.clone(), &dev).unwrap()).unwrap();
                let l = loss(x.as_tensor()).to_scalar::<f64>().unwrap();
                var.set(&Tensor::from_vec(base.clone(), shape.clone(), &dev).unwrap()).unwrap();
                l
            };
            let num = (at(h) - at(-h)) / (2.0 * h);
            let err = (num - g[i]).abs() / (1.0 + num.abs());
            assert!(err < 1e-6, "{name}[{i}]: autograd {} vs finite difference {num}", g[i]);
            worst = worst.max(err);
            checked += 1;
        }
    }
    assert_eq!(checked, shapes.iter().map(|(_, s)| s.iter().product::<usize>()).sum::<usize>() + 24, "every weight and input value");
    eprintln!("{checked} partial derivatives, largest error {worst:e}");
}

/// Train through a model loaded by a recording hook, then compare every tensor the model holds
/// with the checkpoint: the unfrozen layer's tensors all changed, every other tensor (earlier
/// layers, embeddings) is bit-identical.
fn check_only_unfrozen_moved(hook: &ft::LoadHook, checkpoint: &HashMap<String, Tensor>, marker: &str) {
    let loaded = hook.loaded();
    let trainable: Vec<String> = hook.vars().into_iter().map(|(n, _)| n).collect();
    assert_eq!(trainable.len(), bert::LAYER_TENSORS, "{trainable:?}");
    assert!(trainable.iter().all(|n| n.contains(marker)), "{trainable:?} not all in {marker}");
    let (mut moved, mut kept) = (0, 0);
    for (name, t) in &loaded {
        let before = values(&checkpoint[name.as_str()].to_dtype(DType::F32).unwrap());
        if trainable.contains(name) {
            assert_ne!(before, values(t), "{name} is trainable but did not change");
            moved += 1;
        } else {
            assert_eq!(before, values(t), "{name} is frozen but changed");
            kept += 1;
        }
    }
    assert_eq!(moved, bert::LAYER_TENSORS);
    assert!(kept > bert::LAYER_TENSORS, "only {kept} frozen tensors seen");
}

/// Geneformer (tiny V1, both layers run with --emb-layer 0), last layer unfrozen: one
/// training run through ft::train moves exactly that layer and the loss falls.
#[test]
fn finetune_geneformer_training_moves_only_the_unfrozen_layer() {
    use scfoundry::methods::geneformer::{Dictionaries, EmbMode, Geneformer};
    let dir = repo().join("tests/fixtures/geneformer/v1");
    let hook = ft::LoadHook::new(1, HashMap::new()).recording();
    let model = Geneformer::load_hooked(&dir, Dictionaries::find(&dir).unwrap(), 0, EmbMode::Cell, Device::Cpu, Some(&hook)).unwrap();
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(repo().join("tests/fixtures/geneformer/reference.json")).unwrap()).unwrap();
    let cells: Vec<Vec<u32>> = reference["v1"]["tokens"].as_array().unwrap().iter().map(|c| c.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()).collect();
    struct Feats<'a>(&'a Geneformer, &'a [Vec<u32>]);
    impl ft::Features for Feats<'_> {
        fn forward(&mut self, cells: &[usize]) -> scfoundry::error::Result<Tensor> {
            self.0.forward_tensor(cells.iter().map(|&i| self.1[i].as_slice()).collect())
        }
    }
    // labels: two classes by token count (learnable from the states)
    let mut lens: Vec<usize> = cells.iter().map(Vec::len).collect();
    lens.sort_unstable();
    let median = lens[lens.len() / 2];
    let labels: Vec<u32> = cells.iter().map(|c| (c.len() >= median) as u32).collect();
    let split = ft::split(&labels, 2, 0.0, 0);
    let o = ft::TrainOptions { epochs: 6, lr: 1e-3, batch_size: 10, patience: 0, ..Default::default() };
    let t = ft::train(&mut Feats(&model, &cells), 32, &labels, 2, &split, &hook.vars(), &o, &Device::Cpu, |_| {}).unwrap();
    let first = t.history[0].train_loss;
    let last = t.history.last().unwrap().train_loss;
    assert!(last < first, "training loss did not fall: {first} -> {last}");
    let checkpoint = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    check_only_unfrozen_moved(&hook, &checkpoint, "bert.encoder.layer.1.");
}

/// cellama (real all-MiniLM-L6-v2, 6 layers), last layer unfrozen: the same check.
#[test]
fn finetune_cellama_training_moves_only_the_unfrozen_layer() {
    let ctx = TestContext::new();
    let Some(w) = crate::cellama::minilm_weights(&ctx) else { return };
    let dir = scfoundry::methods::cellama::model_dir(&w, &scfoundry::weights::Manifest::builtin());
    let hook = ft::LoadHook::new(1, HashMap::new()).recording();
    let enc = scfoundry::methods::cellama::Encoder::load_hooked(&dir, Device::Cpu, Some(&hook)).unwrap();
    let fx: Value = serde_json::from_str(&std::fs::read_to_string(repo().join("tests/fixtures/cellama/pbmc68k_first64.json")).unwrap()).unwrap();
    let sentences: Vec<String> = fx["sentences"].as_array().unwrap().iter().take(24).map(|s| s.as_str().unwrap().to_string()).collect();
    struct Feats<'a>(&'a scfoundry::methods::cellama::Encoder, &'a [String]);
    impl ft::Features for Feats<'_> {
        fn forward(&mut self, cells: &[usize]) -> scfoundry::error::Result<Tensor> {
            self.0.encode_tensor(&cells.iter().map(|&i| self.1[i].clone()).collect::<Vec<_>>())
        }
    }
    let labels: Vec<u32> = (0..sentences.len()).map(|i| (i % 2) as u32).collect();
    let split = ft::split(&labels, 2, 0.0, 0);
    let o = ft::TrainOptions { epochs: 3, lr: 1e-3, batch_size: 8, patience: 0, ..Default::default() };
    let t = ft::train(&mut Feats(&enc, &sentences), enc.hidden, &labels, 2, &split, &hook.vars(), &o, &Device::Cpu, |_| {}).unwrap();
    assert!(t.history.last().unwrap().train_loss < t.history[0].train_loss, "training loss did not fall: {:?}", t.history);
    let checkpoint = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    check_only_unfrozen_moved(&hook, &checkpoint, "encoder.layer.5.");
}

/// `finetune -m geneformer --unfreeze-layers 1` end to end: model.safetensors holds the head
/// and exactly the last run layer's 16 tensors, all changed; the training loss falls; the
/// same seed gives bit-identical weights and another seed other weights; prediction with the
/// saved folder works; more layers than the model runs is a clear user error.
#[test]
fn finetune_geneformer_unfreezes_the_last_layer() {
    let ctx = TestContext::new();
    std::fs::copy(repo().join("tests/fixtures/geneformer/pbmc68k_50.h5ad"), ctx.path("cells.h5ad")).unwrap();
    let dir = repo().join("tests/fixtures/geneformer/v1");
    let d = dir.to_str().unwrap();
    let train = |seed: &str, out: &str| {
        ctx.run(&["finetune", "-m", "geneformer", "-d", "cells.h5ad", "--label-key", "cell_type", "--model-dir", d, "--emb-layer", "0", "--unfreeze-layers", "1", "--epochs", "6", "--lr", "0.003", "--batch-size", "10", "--val-fraction", "0", "--patience", "0", "--seed", seed, "-o", out]).success();
        tensors(&ctx.path(out).join("model.safetensors"))
    };
    let a = train("1", "a");
    let base = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut keys: Vec<&String> = a.keys().filter(|k| !k.starts_with("head.")).collect();
    keys.sort();
    assert_eq!(keys.len(), bert::LAYER_TENSORS, "{keys:?}");
    for k in &keys {
        assert!(k.starts_with("bert.encoder.layer.1."), "{k} is not in the last layer");
        assert_ne!(values(&base[k.as_str()]), values(&a[k.as_str()]), "{k} did not change");
    }
    let p = provenance(&ctx.path("a"));
    assert_eq!(p["unfrozen_tensors"].as_array().unwrap().len(), bert::LAYER_TENSORS);
    let hist = p["history"].as_array().unwrap();
    let (first, last) = (hist[0]["train_loss"].as_f64().unwrap(), hist.last().unwrap()["train_loss"].as_f64().unwrap());
    assert!(last < first, "training loss did not fall: {first} -> {last}");
    // seeds
    let b = train("1", "b");
    for (k, t) in &a {
        assert_eq!(values(t), values(&b[k]), "{k}: same seed, different weights");
    }
    let c = train("2", "c");
    assert_ne!(values(&a["bert.encoder.layer.1.output.dense.weight"]), values(&c["bert.encoder.layer.1.output.dense.weight"]), "another seed gave the same weights");
    // predict with the saved folder: the fine-tuned layer replaces the checkpoint's
    ctx.run(&["finetune", "--model", "a", "--predict", "cells.h5ad", "--predict-out", "pred.h5ad"]).success().stderr_has("accuracy against its obs['cell_type']");
    // more layers than run: with --emb-layer -1 (default) the model runs 1 of its 2 layers
    ctx.run(&["finetune", "-m", "geneformer", "-d", "cells.h5ad", "--label-key", "cell_type", "--model-dir", d, "--unfreeze-layers", "2", "-o", "ft2"])
        .user_error()
        .stderr_has("--unfreeze-layers")
        .stderr_has("runs 1 encoder layers")
        .has_hint();
    ctx.run(&["finetune", "-m", "geneformer", "-d", "cells.h5ad", "--label-key", "cell_type", "--model-dir", d, "--emb-layer", "0", "--unfreeze-layers", "3", "-o", "ft3"])
        .user_error()
        .stderr_has("runs 2 encoder layers")
        .has_hint();
    assert!(!ctx.path("ft2").exists() && !ctx.path("ft3").exists());
}

/// `finetune -m cellama --unfreeze-layers 1` end to end on the real all-MiniLM-L6-v2: the last
/// layer's 16 tensors saved and changed, the loss falls, seeds reproduce, 7 layers refused.
#[test]
fn finetune_cellama_unfreezes_the_last_layer() {
    let ctx = TestContext::new();
    let Some(w) = crate::cellama::minilm_weights(&ctx) else { return };
    std::fs::copy(repo().join("tests/fixtures/geneformer/pbmc68k_50.h5ad"), ctx.path("cells.h5ad")).unwrap();
    let ws = w.to_str().unwrap();
    let train = |seed: &str, out: &str| {
        ctx.run(&["--weights-dir", ws, "finetune", "-m", "cellama", "-d", "cells.h5ad", "--label-key", "cell_type", "--unfreeze-layers", "1", "--epochs", "3", "--lr", "0.003", "--batch-size", "16", "--val-fraction", "0", "--patience", "0", "--seed", seed, "-o", out]).success();
        tensors(&ctx.path(out).join("model.safetensors"))
    };
    let a = train("1", "a");
    let dir = scfoundry::methods::cellama::model_dir(&w, &scfoundry::weights::Manifest::builtin());
    let base = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut keys: Vec<&String> = a.keys().filter(|k| !k.starts_with("head.")).collect();
    keys.sort();
    assert_eq!(keys.len(), bert::LAYER_TENSORS, "{keys:?}");
    for k in &keys {
        assert!(k.starts_with("encoder.layer.5."), "{k} is not in the last layer");
        assert_ne!(values(&base[k.as_str()]), values(&a[k.as_str()]), "{k} did not change");
    }
    let p = provenance(&ctx.path("a"));
    let hist = p["history"].as_array().unwrap();
    let (first, last) = (hist[0]["train_loss"].as_f64().unwrap(), hist.last().unwrap()["train_loss"].as_f64().unwrap());
    assert!(last < first, "training loss did not fall: {first} -> {last}");
    let b = train("1", "b");
    for (k, t) in &a {
        assert_eq!(values(t), values(&b[k]), "{k}: same seed, different weights");
    }
    ctx.run(&["--weights-dir", ws, "finetune", "-m", "cellama", "-d", "cells.h5ad", "--label-key", "cell_type", "--unfreeze-layers", "7", "-o", "ft7"])
        .user_error()
        .stderr_has("runs 6 encoder layers")
        .has_hint();
}

/// `--predict` right after training writes a copy with the predictions, which anndata reads.
#[test]
fn finetune_predict_round_trip_through_anndata() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    let r = ctx.run(&["finetune", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--label-key", "cell_type", "--epochs", "20", "--lr", "0.01", "-o", "ft", "--predict", "pbmc68k_counts.h5ad", "--predict-out", "pred.h5ad"]);
    r.success().stderr_has("with obs['cell_type_pred'] and obs['cell_type_pred_confidence'] (700 cells); accuracy against its obs['cell_type']: ");
    let f = hdf5::File::open(ctx.path("pred.h5ad")).unwrap();
    let conf = f.dataset("obs/cell_type_pred_confidence").unwrap().read_raw::<f32>().unwrap();
    assert!(conf.iter().all(|&c| (0.1..=1.0).contains(&c)), "softmax maxima of 10 classes");
    drop(f);
    // and again from the saved folder: the same predictions
    ctx.run(&["finetune", "--model", "ft", "--predict", "pbmc68k_counts.h5ad", "--predict-out", "pred2.h5ad"]).success();
    let codes = |p: &str| hdf5::File::open(ctx.path(p)).unwrap().dataset("obs/cell_type_pred/codes").unwrap().read_raw::<i64>().unwrap();
    assert_eq!(codes("pred.h5ad"), codes("pred2.h5ad"));
    let Some(py) = python() else { return };
    let script = r#"
import sys, json, anndata
a = anndata.read_h5ad(sys.argv[1])
c = a.obs["cell_type_pred"]
print(json.dumps({"cats": list(map(str, c.cat.categories)), "acc": float((c.astype(str) == a.obs["cell_type"].astype(str)).mean()),
                  "conf": float(a.obs["cell_type_pred_confidence"].mean()), "n": a.n_obs, "prov": a.uns["scfoundry_finetune"]["method"]}))
"#;
    let out = Command::new(py).arg("-c").arg(script).arg(ctx.path("pred.h5ad")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let classes = provenance(&ctx.path("ft"))["classes"].clone();
    assert_eq!(v["cats"], classes);
    assert_eq!(v["n"], 700);
    assert_eq!(v["prov"], "pca");
    assert!(v["acc"].as_f64().unwrap() > 0.6, "{v}");
}

/// Bad input: a clear error naming the file and the field, with a hint, and no panic.
#[test]
fn finetune_bad_input_is_clear() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    let base = ["finetune", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--epochs", "1"];
    ctx.run(&[&base[..], &["--label-key", "celltype"]].concat())
        .user_error()
        .stderr_has("obs/celltype")
        .stderr_has("is missing")
        .stderr_has("cell_type")
        .has_hint();
    // one class only
    let one = Tiny::counts(30, 20).with_obs("cell_type", vec!["T".to_string(); 30]);
    one.write(&ctx.path("one.h5ad"));
    ctx.run(&["finetune", "-m", "pca", "-d", "one.h5ad", "--label-key", "cell_type"]).user_error().stderr_has("one.h5ad").stderr_has("holds one label only").has_hint();
    // fewer cells than classes: 4 labelled cells, 6 categories
    let few = Tiny::counts(4, 20).with_obs("cell_type", vec!["A".into(), "B".into(), "A".into(), "B".into()]);
    let path = ctx.path("few.h5ad");
    few.write(&path);
    {
        let f = hdf5::File::open_rw(&path).unwrap();
        let g = f.group("obs/cell_type").unwrap();
        g.unlink("categories").unwrap();
        let cats: Vec<hdf5::types::VarLenUnicode> = ["A", "B", "C", "D", "E", "F"].iter().map(|s| s.parse().unwrap()).collect();
        let ds = g.new_dataset::<hdf5::types::VarLenUnicode>().shape([6]).create("categories").unwrap();
        ds.write_raw(&cats).unwrap();
        crate::common::enc(&ds, "string-array", "0.2.0");
    }
    ctx.run(&["finetune", "-m", "pca", "-d", "few.h5ad", "--label-key", "cell_type"]).user_error().stderr_has("fewer cells than classes").stderr_has("remove_unused_categories").has_hint();
    // a method that cannot be fine-tuned, and a numeric label column
    ctx.run(&[&base[..], &["--label-key", "cell_type"]].concat().iter().map(|s| if *s == "pca" { "harmony" } else { *s }).collect::<Vec<_>>()).user_error().stderr_has("cannot be fine-tuned").has_hint();
    ctx.run(&[&base[..], &["--label-key", "percent_mito"]].concat()).user_error().stderr_has("labels must be categorical").has_hint();
    // --model without a fine-tuning record
    std::fs::create_dir_all(ctx.path("empty")).unwrap();
    ctx.run(&["finetune", "--model", "empty", "--predict", "pbmc68k_counts.h5ad"]).user_error().stderr_has("finetune.json");
    assert!(!ctx.path("pbmc68k_counts.finetune.h5ad").exists());
}

/// pca accepts --unfreeze-layers and says it is not honoured.
#[test]
fn finetune_pca_warns_about_unfreeze_layers() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    ctx.run(&["finetune", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--label-key", "cell_type", "--epochs", "1", "--unfreeze-layers", "2"])
        .success()
        .stderr_has("warning: pca has no encoder layers to unfreeze: --unfreeze-layers is not honoured");
    assert!(ctx.path("pbmc68k_counts.pca.finetune/model.safetensors").is_file(), "the default --out");
    assert_eq!(provenance(&ctx.path("pbmc68k_counts.pca.finetune"))["unfreeze_layers"], 0);
}

/// --executor slurm / nextflow without their tools: clear errors, no run folder; with a stand-in
/// nextflow, the pipeline's finetune parameters and the published folder moved to --out.
#[test]
fn finetune_executors_are_wired() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    let args = ["finetune", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--label-key", "cell_type", "--epochs", "7", "--seed", "2", "-o", "ft"];
    for (executor, tool) in [("nextflow", "nextflow"), ("slurm", "sbatch")] {
        let out = Command::new(BIN).args(args).args(["--executor", executor]).current_dir(ctx.dir.path()).env("PATH", ctx.path("empty-bin")).env("SCFOUNDRY_WEIGHTS_DIR", ctx.path("w")).output().unwrap();
        crate::common::Run::from(out).user_error().stderr_has(&format!("`{tool}` is not on PATH")).has_hint();
    }
    assert!(!ctx.path("runs").exists(), "no run folder when the executor is missing");
    // a stand-in nextflow that records its argv and publishes the folder
    let bin = ctx.path("fake-bin");
    std::fs::create_dir_all(&bin).unwrap();
    let script = r#"#!/bin/sh
printf '%s\n' "$@" > "$FAKE_NEXTFLOW_ARGV"
input=""; outdir=""; method=""
while [ $# -gt 0 ]; do
  case "$1" in
    --input) input=$2; shift ;;
    --outdir) outdir=$2; shift ;;
    --method) method=$2; shift ;;
  esac
  shift
done
stem=$(basename "$input" .h5ad)
mkdir -p "$outdir/finetune/$stem.$method.finetune" && echo '{}' > "$outdir/finetune/$stem.$method.finetune/finetune.json"
"#;
    std::fs::write(bin.join("nextflow"), script).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(bin.join("nextflow"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = Command::new(BIN)
        .args(args)
        .args(["--executor", "nextflow"])
        .current_dir(ctx.dir.path())
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .env("FAKE_NEXTFLOW_ARGV", ctx.path("argv.txt"))
        .env("SCFOUNDRY_NO_PROGRESS", "1")
        .env("SCFOUNDRY_WEIGHTS_DIR", ctx.path("w"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let argv = std::fs::read_to_string(ctx.path("argv.txt")).unwrap();
    let lines: Vec<&str> = argv.lines().collect();
    for pair in [["--task", "finetune"], ["--method", "pca"], ["--label_key", "cell_type"], ["--epochs", "7"], ["--seed", "2"], ["--val_fraction", "0.1"]] {
        assert!(lines.windows(2).any(|w| w == pair), "{pair:?} not in {argv}");
    }
    assert!(ctx.path("ft/finetune.json").is_file(), "the published folder is moved to --out");
    // every pipeline parameter finetune passes is declared and used by the FINETUNE module's ext.args
    let config = std::fs::read_to_string(repo().join("conf/modules.config")).unwrap();
    for p in ["epochs", "unfreeze_layers", "lr", "weight_decay", "patience", "val_fraction", "predict_batch_size"] {
        assert!(config.contains(&format!("params.{p}")), "{p} is not passed to FINETUNE");
    }
}
