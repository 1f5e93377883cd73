//! `scfoundry-bench __bench-train-attention`: training attention in bf16 on a GPU, the fused
//! kernels (`nn::flash_attention`) against the materialised path (`nn::recompute_attention`,
//! the (l x l) scores in bf16), each against f32 (the materialised path on the same bf16 inputs
//! upcast) with and without dropout: relative (Frobenius) error of the output and of the
//! gradient of qkv; then seconds of a forward and backward pass of each at scgpt_integrated's
//! shape, and of the fused forward pass alone. One JSON line.

use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use serde_json::json;

use crate::args::BenchTrainAttentionArgs;
use scfoundry::commands::ExitStatus;
use scfoundry::nn::dropout::{Dropout, Mask};

#[derive(Clone, Copy)]
enum Path {
    Fused,
    Materialised,
}

/// The output (f32) and the gradient of qkv (f32) of `loss = sum(out * w)`.
fn run_path(path: Path, qkv: &Tensor, w: &Tensor, heads: usize, mask: Option<Mask>) -> candle_core::Result<(Tensor, Tensor)> {
    let (b, l, width) = qkv.dims3()?;
    let d = width / 3;
    let v = Var::from_tensor(qkv)?;
    let out = match path {
        Path::Fused => scfoundry::nn::flash_attention::attention(v.as_tensor(), heads, mask)?,
        Path::Materialised => {
            let h = v.as_tensor().reshape((b, l, 3, heads, 64))?.permute((2, 0, 3, 1, 4))?.contiguous()?;
            scfoundry::nn::recompute_attention::attention(&h, 0.125, mask, None)?.transpose(1, 2)?.reshape((b, l, d))?
        }
    };
    let out = out.to_dtype(DType::F32)?;
    let grads = (&out * w)?.sum_all()?.backward()?;
    let g = grads.get(v.as_tensor()).ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?.to_dtype(DType::F32)?;
    Ok((out, g))
}

fn rel(a: &Tensor, b: &Tensor) -> candle_core::Result<f64> {
    let num = (a - b)?.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
    let den = b.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
    Ok((num / den.max(f64::MIN_POSITIVE)).sqrt())
}

fn inputs(dev: &Device, b: usize, l: usize, heads: usize, seed: u64) -> candle_core::Result<(Tensor, Tensor)> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let unit = Normal::new(0f32, 1.0).expect("a normal distribution");
    let d = heads * 64;
    let qkv: Vec<f32> = (0..b * l * 3 * d).map(|_| unit.sample(&mut rng)).collect();
    let w: Vec<f32> = (0..b * l * d).map(|_| unit.sample(&mut rng)).collect();
    Ok((Tensor::from_vec(qkv, (b, l, 3 * d), dev)?.to_dtype(DType::BF16)?, Tensor::from_vec(w, (b, l, d), dev)?))
}

pub fn run(a: &BenchTrainAttentionArgs) -> anyhow::Result<ExitStatus> {
    let dev = crate::encoder::bench_device("cuda")?;
    let mask = Dropout::new(a.dropout, a.seed).next_mask();
    let mut checks = Vec::new();
    for &l in &a.check_lengths {
        let (qkv, w) = inputs(&dev, a.check_cells, l, a.heads, a.seed)?;
        for m in [None, mask] {
            // f32: the materialised path on the same (bf16) values
            let (o32, g32) = run_path(Path::Materialised, &qkv.to_dtype(DType::F32)?, &w, a.heads, m)?;
            let (of, gf) = run_path(Path::Fused, &qkv, &w, a.heads, m)?;
            let (om, gm) = run_path(Path::Materialised, &qkv, &w, a.heads, m)?;
            checks.push(json!({
                "len": l, "dropout": m.is_some(),
                "fused_out_rel": rel(&of, &o32)?, "fused_grad_rel": rel(&gf, &g32)?,
                "materialised_out_rel": rel(&om, &o32)?, "materialised_grad_rel": rel(&gm, &g32)?,
                "fused_vs_materialised_grad_rel": rel(&gf, &gm)?,
            }));
        }
    }
    let (qkv, w) = inputs(&dev, a.cells, a.len, a.heads, a.seed)?;
    let sync = || dev.synchronize();
    let mut seconds = serde_json::Map::new();
    for (name, path) in [("fused", Path::Fused), ("materialised", Path::Materialised)] {
        run_path(path, &qkv, &w, a.heads, mask)?;
        sync()?;
        let t = Instant::now();
        for _ in 0..a.repeat {
            run_path(path, &qkv, &w, a.heads, mask)?;
        }
        sync()?;
        seconds.insert(format!("{name}_s"), json!(t.elapsed().as_secs_f64() / a.repeat.max(1) as f64));
    }
    // the fused forward pass alone (outside a graph: no lse kept for a backward pass)
    {
        let f = || scfoundry::nn::flash_attention::attention(&qkv, a.heads, mask);
        f()?;
        sync()?;
        let t = Instant::now();
        for _ in 0..a.repeat {
            f()?;
        }
        sync()?;
        seconds.insert("fused_forward_s".into(), json!(t.elapsed().as_secs_f64() / a.repeat.max(1) as f64));
    }
    // useful FLOPs of a forward and backward pass: 2 products forward, 4 backward (the
    // recomputed q k^T not counted), of 2 l^2 64 each, per cell and head
    let flops = 6.0 * 2.0 * (a.len * a.len * 64) as f64 * (a.cells * a.heads) as f64;
    let fused_s = seconds["fused_s"].as_f64().unwrap_or(f64::NAN);
    println!(
        "{}",
        json!({
            "cells": a.cells, "len": a.len, "heads": a.heads, "dropout": a.dropout, "seed": a.seed, "repeat": a.repeat,
            "checks": checks, "seconds": seconds, "fused_tflops": flops / fused_s / 1e12,
            "materialised_over_fused": seconds["materialised_s"].as_f64().unwrap_or(f64::NAN) / fused_s,
            "fused_forward_tflops": flops / 3.0 / seconds["fused_forward_s"].as_f64().unwrap_or(f64::NAN) / 1e12,
        })
    );
    Ok(ExitStatus::Success)
}
