//! `scfoundry __bench-encoder`: throughput of the transformer encoder scfoundry runs (candle's
//! BERT encoder, which our geneformer loads) at a full-size shape with random weights.
//!
//! Cells take their token counts from a file of real lengths (genes expressed per cell, capped
//! at `--max-len`). With `--order sorted` the cells run longest first, so the cells of a batch
//! have nearly the same length and padding (masked) is a small share of the work; `file` runs
//! them as they come. FLOPs count only real tokens (as BENCHMARKS.md's encoder tables):
//! L x (2 s (4 d^2 + 2 d f) + 4 s^2 d) per cell of s tokens. The PyTorch side of the comparison
//! is bench/encoder_torch.py; bench/encoder_throughput.sh runs both on the device.

use std::time::Instant;

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config};
use serde_json::json;

use crate::args::BenchEncoderArgs;
use scfoundry::commands::ExitStatus;
use scfoundry::error::Error;
use scfoundry::nn::cls_encoder::{Arch, ClsEncoder};

/// Random weights of any requested shape (normal, sd 0.02), made on the device.
struct RandomWeights {
    /// Layer norms (the weights candle asks for with a constant initialiser) as 1 and 0
    /// (`--norm-weights ones`) instead of drawn like the rest.
    norms_constant: bool,
}

impl RandomWeights {
    fn new(a: &BenchEncoderArgs) -> Box<RandomWeights> {
        Box::new(RandomWeights { norms_constant: a.norm_weights == "ones" })
    }
}

impl SimpleBackend for RandomWeights {
    fn get(&self, s: Shape, _name: &str, h: candle_nn::Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        match h {
            candle_nn::Init::Const(c) if self.norms_constant => Tensor::full(c as f32, s, dev)?.to_dtype(dtype),
            _ => Tensor::randn(0f32, 0.02f32, s, dev)?.to_dtype(dtype),
        }
    }
    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("random weights have no shape for {name}")
    }
    fn contains_tensor(&self, _name: &str) -> bool {
        true
    }
}

pub use scfoundry::nn::cell_flops;

fn device_of(name: &str) -> anyhow::Result<Device> {
    Ok(bench_device(name)?)
}

/// `--device` of the `__bench-*` commands: the CPU, or CUDA device 0 as [`cuda_device`] opens it,
/// its default pool (which they allocate from, no resource installed) keeping its memory as
/// `--allocator async` does (`scfoundry::gpu::cuda::keep_in_default_pool`).
pub fn bench_device(name: &str) -> Result<candle_core::Device, scfoundry::error::Error> {
    let bad = |detail: String, hint: &str| scfoundry::error::Error::BadOption { option: "--device".into(), detail, hint: Some(hint.into()) };
    match name {
        "cpu" => Ok(candle_core::Device::Cpu),
        "cuda" => {
            let device = scfoundry::gpu::cuda_device(0).map_err(|e| bad(e.to_string(), "a CUDA build of scfoundry (scripts/build-cuda.sh) on a machine with a GPU"))?;
            #[cfg(feature = "cuda")]
            if let candle_core::Device::Cuda(d) = &device {
                let ctx = d.cuda_stream().context().clone();
                ctx.bind_to_thread().map_err(|e| bad(format!("cuCtxSetCurrent: {e}"), "a CUDA build of scfoundry on a machine with a GPU"))?;
                scfoundry::gpu::cuda::keep_in_default_pool(ctx.cu_device(), None).map_err(|e| bad(e.to_string(), "a CUDA build of scfoundry on a machine with a GPU"))?;
            }
            Ok(device)
        }
        other => Err(bad(format!("{other:?}"), "cpu or cuda")),
    }
}


fn dtype_of(name: &str) -> anyhow::Result<DType> {
    match name {
        "bf16" => Ok(DType::BF16),
        "f16" => Ok(DType::F16),
        "f32" => Ok(DType::F32),
        other => Err(Error::BadOption { option: "--dtype".into(), detail: format!("{other:?}"), hint: Some("bf16, f16 or f32".into()) }.into()),
    }
}

fn length_pool(a: &BenchEncoderArgs) -> anyhow::Result<Vec<usize>> {
    let text = std::fs::read_to_string(&a.lengths).map_err(|e| Error::Io { path: a.lengths.clone(), source: e })?;
    let pool: Vec<usize> = text.lines().filter_map(|l| l.trim().parse::<usize>().ok()).filter(|&n| n > 0).collect();
    if pool.is_empty() {
        return Err(Error::BadField { path: a.lengths.clone(), field: "lines".into(), detail: "holds no positive integer".into(), hint: None }.into());
    }
    Ok(pool)
}

/// Token counts of `a.cells` cells (from the lengths file, cycling, capped at `max_len`) and
/// their run order.
fn lengths(a: &BenchEncoderArgs, max_len: usize) -> anyhow::Result<(Vec<usize>, Vec<usize>)> {
    let pool = length_pool(a)?;
    let lens: Vec<usize> = (0..a.cells).map(|i| pool[i % pool.len()].min(max_len)).collect();
    let mut order: Vec<usize> = (0..lens.len()).collect();
    if a.order == "sorted" {
        order.sort_by_key(|&i| std::cmp::Reverse(lens[i]));
    }
    Ok((lens, order))
}

/// The batches of `order` (cells of `lens[i]` tokens, longest first when sorted) as `--batching`
/// says: by tokens (`gpu::backoff::TokenBudget`, as `embed`) or `--batch` cells each.
fn plan_batches(a: &BenchEncoderArgs, order: &[usize], lens: &[usize]) -> Vec<Vec<usize>> {
    if a.batching == "tokens" && !order.is_empty() {
        let budget = scfoundry::gpu::backoff::TokenBudget::new(a.batch, a.batch_growth, lens[order[0]]);
        budget.plan(order.len(), |k| lens[order[k]]).into_iter().map(|r| order[r].to_vec()).collect()
    } else {
        order.chunks(a.batch.max(1)).map(|c| c.to_vec()).collect()
    }
}

/// Token counts of `a.cells` cells with a `<cls>` token each (the lengths file's length + 1,
/// capped at `max_len`) and their run order.
fn cls_lengths(a: &BenchEncoderArgs, max_len: usize) -> anyhow::Result<(Vec<usize>, Vec<usize>)> {
    let pool = length_pool(a)?;
    let lens: Vec<usize> = (0..a.cells).map(|i| (pool[i % pool.len()] + 1).min(max_len)).collect();
    let mut order: Vec<usize> = (0..lens.len()).collect();
    if a.order == "sorted" {
        order.sort_by_key(|&i| std::cmp::Reverse(lens[i]));
    }
    Ok((lens, order))
}

/// Best wall time of `repeat` passes over `batches` (after one untimed warm-up batch).
fn time_batches<B>(device: &Device, batches: &[B], repeat: usize, mut run_batch: impl FnMut(&B) -> anyhow::Result<()>) -> anyhow::Result<f64> {
    run_batch(&batches[0])?;
    device.synchronize()?;
    let mut best = f64::INFINITY;
    for _ in 0..repeat.max(1) {
        let t = Instant::now();
        for b in batches {
            run_batch(b)?;
        }
        device.synchronize()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// The best pass of [`time_read_back`], and where the host's time went in a pass (the mean over
/// the timed passes): queueing batches (`run`) and waiting for the read back of the batch before.
/// A pass whose `wait` is near zero was bound by the host, not the GPU.
struct ReadBackTiming {
    seconds: f64,
    queue_s: f64,
    wait_s: f64,
}

/// [`time_batches`] over batches whose `run` returns the embeddings on the device, each read
/// back as `embed` reads it: one batch behind (`gpu/readback.rs`), the last batch's read inside
/// the timed pass; with `sync`, each batch read before the next is queued.
fn time_read_back(device: &Device, batches: &[Vec<usize>], repeat: usize, sync: bool, mut run: impl FnMut(&[usize]) -> anyhow::Result<Tensor>) -> anyhow::Result<ReadBackTiming> {
    let mut lagged = scfoundry::gpu::readback::Lagged::new();
    let last = batches.last().map(|b| b.as_ptr());
    // host seconds queueing and waiting, over the timed passes (the warm-up batch, call 0, left out)
    let (mut calls, mut queue, mut wait) = (0usize, 0.0f64, 0.0f64);
    let seconds = time_batches(device, batches, repeat, |b| {
        let t0 = Instant::now();
        let e = run(b)?;
        let t1 = Instant::now();
        if sync {
            let _ = e.to_vec2::<f32>()?;
        } else {
            // the warm-up batch's read waits in `lagged` until the first pass's first batch
            let _ = lagged.push((), &e)?;
            if Some(b.as_ptr()) == last {
                let _ = lagged.finish()?;
            }
        }
        if calls > 0 {
            queue += (t1 - t0).as_secs_f64();
            wait += t1.elapsed().as_secs_f64();
        }
        calls += 1;
        Ok(())
    })?;
    let passes = repeat.max(1) as f64;
    Ok(ReadBackTiming { seconds, queue_s: queue / passes, wait_s: wait / passes })
}

/// Cell2Sentence's model (methods/c2s.rs, our GPT-NeoX) at Pythia's full size with random
/// weights: each batch's prompts packed end to end (no padding), embeddings averaged over each
/// cell's own tokens, as the c2s task runs it (in bf16 on a GPU through the fused causal stack).
fn run_c2s(a: &BenchEncoderArgs) -> anyhow::Result<ExitStatus> {
    use scfoundry::methods::c2s::{self, GptNeoX};
    let mut cfg = match a.arch.as_str() {
        "c2s-160m" => c2s::Config::pythia_160m(),
        "c2s-410m" => c2s::Config::pythia_410m(),
        other => return Err(Error::BadOption { option: "--arch".into(), detail: format!("{other:?}"), hint: Some("bert, c2s-160m, c2s-410m, sccello, langcell or scfoundation".into()) }.into()),
    };
    cfg.num_hidden_layers = a.layers.unwrap_or(cfg.num_hidden_layers);
    cfg.hidden_size = a.hidden.unwrap_or(cfg.hidden_size);
    cfg.num_attention_heads = a.heads.unwrap_or(cfg.num_attention_heads);
    cfg.intermediate_size = a.ffn.unwrap_or(cfg.intermediate_size);
    let dtype = dtype_of(&a.dtype)?;
    let max_len = a.max_len.unwrap_or(2048);
    let (lens, order) = lengths(a, max_len)?;
    let device = device_of(&a.device)?;
    // random weights in float32, the model then in --dtype (its bf16 output checked against them)
    let vb = VarBuilder::from_backend(RandomWeights::new(a), DType::F32, device.clone());
    let f32_model = GptNeoX::build(cfg.clone(), vb, DType::F32, device.clone())?;
    let model = f32_model.to_dtype(dtype)?;
    let batches = plan_batches(a, &order, &lens);
    let vocab = cfg.vocab_size;
    let seqs: Vec<Vec<u32>> = lens.iter().enumerate().map(|(i, &n)| (0..n).map(|p| 2 + ((i * 7919 + p * 104729) % (vocab - 2)) as u32).collect()).collect();
    let best = time_batches(&device, &batches, a.repeat, |cells| {
        let refs: Vec<&[u32]> = cells.iter().map(|&i| seqs[i].as_slice()).collect();
        model.embed(&refs)?;
        Ok(())
    })?;
    let check = first_batch_against_f32(dtype, &batches, cfg.hidden_size, |first| {
        let refs: Vec<&[u32]> = first.iter().map(|&i| seqs[i].as_slice()).collect();
        Ok((model.embed(&refs)?, f32_model.embed(&refs)?))
    })?;
    drop(f32_model);
    let real: usize = lens.iter().sum();
    let flops: f64 = lens.iter().map(|&s| c2s::forward_flops(&cfg, s)).sum();
    let out = json!({
        "tool": "scfoundry", "version": env!("CARGO_PKG_VERSION"), "encoder": "scfoundry GPT-NeoX (methods/c2s.rs), packed", "arch": a.arch,
        "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads, "ffn": cfg.intermediate_size,
        "rotary_dims": cfg.rotary_dims(), "max_len": max_len,
        "dtype": a.dtype, "device": a.device, "order": a.order, "batch": a.batch, "cells": a.cells,
        "batching": a.batching, "batches": batches.len(),
        "seconds": best, "cells_per_s": a.cells as f64 / best,
        "useful_tflops": flops / best / 1e12, "mean_tokens": real as f64 / a.cells as f64,
        "padding_share": 0.0, "against_f32": check,
    });
    println!("{out}");
    Ok(ExitStatus::Success)
}

/// `--arch`: the model's own encoder (`ClsEncoder`, as `embed` runs it) at its released shape
/// with random weights. A cell is `<cls>` and its genes: 1 + the file's length, cut at the
/// input size. FLOPs count the encoder only (the <cls> read-out and projection are negligible).
fn run_arch(a: &BenchEncoderArgs, arch: Arch) -> anyhow::Result<ExitStatus> {
    let dtype = dtype_of(&a.dtype)?;
    let device = device_of(&a.device)?;
    // float32 weights, the encoder then in --dtype, as `embed` loads it (LangCell's projection
    // stays float32: built in bf16 it met the float32 <cls> rows and failed, 2026-12-02)
    let vb = VarBuilder::from_backend(RandomWeights::new(a), DType::F32, device.clone());
    let mut model = ClsEncoder::with_weights(arch, vb, device.clone())?;
    model.set_precision(dtype)?;
    let (cfg, max_len) = (model.config.clone(), a.max_len.unwrap_or(model.input_size).min(model.input_size));
    let (lens, order) = cls_lengths(a, max_len)?;
    let cells: Vec<Vec<u32>> = (0..a.cells).map(|i| std::iter::once(model.cls).chain((1..lens[i]).map(|p| 5 + ((i * 7919 + p * 104729) % 25000) as u32)).collect()).collect();
    let batches = plan_batches(a, &order, &lens);
    let best = time_batches(&device, &batches, a.repeat, |b| {
        let _ = model.forward_batch(b.iter().map(|&i| cells[i].as_slice()).collect())?;
        Ok(())
    })?;
    let (l, d, f) = (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size);
    let real: usize = lens.iter().sum();
    let computed: usize = batches.iter().map(|b| b.len() * b.iter().map(|&i| lens[i]).max().unwrap_or(0)).sum();
    let flops: f64 = lens.iter().map(|&s| cell_flops(l, d, f, s)).sum();
    let out = json!({
        "tool": "scfoundry", "version": env!("CARGO_PKG_VERSION"), "arch": arch.name(),
        "encoder": "scfoundry ClsEncoder (candle-transformers BertModel, <cls> read-out)",
        "layers": l, "hidden": d, "heads": cfg.num_attention_heads, "ffn": f, "max_len": max_len,
        "embedding_dim": model.dim(),
        "dtype": a.dtype, "device": a.device, "order": a.order, "batch": a.batch, "cells": a.cells,
        "batching": a.batching, "batches": batches.len(),
        "seconds": best, "cells_per_s": a.cells as f64 / best,
        "useful_tflops": flops / best / 1e12, "mean_tokens": real as f64 / a.cells as f64,
        "padding_share": 1.0 - real as f64 / computed.max(1) as f64,
    });
    println!("{out}");
    Ok(ExitStatus::Success)
}

/// scBERT's PerformerLM (methods/scbert.rs, as `embed` runs it) at the released shape (6 x 200,
/// 10 heads of 64, 266 random features, 16,907 tokens) with random weights; --layers, --hidden,
/// --heads and --max-len (the positions) may override. The tokens are (7919 i + 104729 p) mod 6
/// with the last 0, as bench/scbert_torch.py; the lengths file is not read (every cell has all
/// the positions). `--dtype bf16`: the same weights in bfloat16, the first batch checked against
/// them in f32 (`against_f32`).
fn run_scbert(a: &BenchEncoderArgs) -> anyhow::Result<ExitStatus> {
    use scfoundry::methods::scbert::{Dims, ScBert};
    let mut dims = Dims::released();
    dims.depth = a.layers.unwrap_or(dims.depth);
    dims.dim = a.hidden.unwrap_or(dims.dim);
    dims.heads = a.heads.unwrap_or(dims.heads);
    dims.seq_len = a.max_len.unwrap_or(dims.seq_len);
    let dtype = match a.dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        d => return Err(Error::BadOption { option: "--dtype".into(), detail: format!("{d:?} with --arch scbert"), hint: Some("f32 (embed's default for scBERT) or bf16".into()) }.into()),
    };
    let device = device_of(&a.device)?;
    let vb = VarBuilder::from_backend(RandomWeights::new(a), DType::F32, device.clone());
    let f32_model = ScBert::build(dims, a.ffn.unwrap_or(4 * dims.dim), vb, std::path::Path::new("random"), device.clone())?;
    let n = dims.seq_len;
    let cells: Vec<Vec<u32>> = (0..a.cells).map(|i| (0..n).map(|p| if p + 1 == n { 0 } else { ((i * 7919 + p * 104729) % 6) as u32 }).collect()).collect();
    let batches: Vec<Vec<usize>> = (0..a.cells).collect::<Vec<_>>().chunks(a.batch.max(1)).map(|c| c.to_vec()).collect();
    let rows = |m: &ScBert, b: &[usize]| m.embed(&b.iter().map(|&i| cells[i].as_slice()).collect::<Vec<_>>());
    // below f32: the first batch against the same weights in f32, both on their default path
    let mut model = f32_model.to_dtype(dtype)?;
    let vs_f32 = first_batch_against_f32(dtype, &batches, dims.dim, |b| Ok((rows(&model, b)?, rows(&f32_model, b)?)))?;
    // the one-kernel FAVOR+ features (the GPU default) against candle's ops on the first batch
    let check = fused_vs_candle_ops(&mut model, |m: &mut ScBert| &mut m.fused, a.unfused, dims.dim, |m| batches.first().map(|first| Ok(rows(m, first)?)).transpose())?;
    let best = time_batches(&device, &batches, a.repeat, |b| {
        rows(&model, b)?;
        Ok(())
    })?;
    let out = json!({
        "tool": "scfoundry", "version": env!("CARGO_PKG_VERSION"), "arch": "scbert", "encoder": "scfoundry ScBert (methods/scbert.rs, FAVOR+ PerformerLM)",
        "layers": dims.depth, "hidden": dims.dim, "heads": dims.heads, "dim_head": dims.dim_head, "nb_features": dims.nb_features,
        "seq_len": n, "dtype": a.dtype, "device": a.device, "batch": a.batch, "cells": a.cells, "fused": model.fused,
        "seconds": best, "cells_per_s": a.cells as f64 / best, "useful_tflops": dims.cell_flops() * a.cells as f64 / best / 1e12,
        "fused_vs_candle_ops": check, "against_f32": vs_f32,
    });
    println!("{out}");
    Ok(ExitStatus::Success)
}

/// The fused path (scbert's, novae's and cellfm's default on a GPU; `flag` is the model's
/// `fused`) unless `--unfused`: the first batch's embeddings through it against candle's ops
/// (`first` embeds that batch on the model's path as set; `None` without a batch). The model is
/// left on the path the timing runs.
fn fused_vs_candle_ops<M>(model: &mut M, flag: fn(&mut M) -> &mut bool, unfused: bool, dim: usize, first: impl Fn(&M) -> anyhow::Result<Option<Vec<f32>>>) -> anyhow::Result<Option<serde_json::Value>> {
    let fused = *flag(model) && !unfused;
    *flag(model) = false;
    let mut check = None;
    if fused {
        if let Some(want) = first(model)? {
            *flag(model) = true;
            check = first(model)?.map(|got| against_f32(&got, &want, dim));
        }
    }
    *flag(model) = fused;
    Ok(check)
}

/// Below f32, the first batch's embeddings against the same weights in f32 on the same device
/// (`run` gives both for the batch's cells); `None` in f32 or without a batch.
fn first_batch_against_f32(dtype: DType, batches: &[Vec<usize>], dim: usize, run: impl FnOnce(&[usize]) -> anyhow::Result<(Vec<f32>, Vec<f32>)>) -> anyhow::Result<Option<serde_json::Value>> {
    match (dtype, batches.first()) {
        (DType::F32, _) | (_, None) => Ok(None),
        (_, Some(first)) => {
            let (got, want) = run(first)?;
            Ok(Some(against_f32(&got, &want, dim)))
        }
    }
}

/// Cell embeddings `got` (rows of `dim`) against `want` computed in f32: the lowest cosine and
/// the largest relative error (||a - b|| / ||b||) of a row.
pub fn against_f32(got: &[f32], want: &[f32], dim: usize) -> serde_json::Value {
    let (mut low, mut worst) = (1f64, 0f64);
    for (a, b) in got.chunks(dim).zip(want.chunks(dim)) {
        let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
        let (na, nb) = (a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt(), b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt());
        let diff = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum::<f64>().sqrt();
        low = low.min(dot / (na * nb).max(f64::MIN_POSITIVE));
        worst = worst.max(diff / nb.max(f64::MIN_POSITIVE));
    }
    json!({"cells": got.len() / dim.max(1), "lowest_cosine": low, "largest_rel_error": worst})
}

/// The synthetic input of bench cell `i` with `s` genes (bench/scfoundation_torch.py builds the
/// same): genes spread evenly over the 19,264 positions, log1p-scale values, then T = 4 and S.
pub fn scfoundation_cell(i: usize, s: usize, n_genes: usize) -> scfoundry::methods::scfoundation::CellInput {
    let step = (n_genes / s.max(1)).max(1);
    let mut positions: Vec<u32> = (0..s).map(|k| ((k * step) % n_genes) as u32).collect();
    let mut values: Vec<f32> = (0..s).map(|k| 0.5 + ((i * 7919 + k * 104729) % 1000) as f32 / 200.0).collect();
    positions.extend([n_genes as u32, n_genes as u32 + 1]);
    values.extend([4.0, 3.5]);
    scfoundry::methods::scfoundation::CellInput { positions, values }
}

/// scFoundation's encoder (methods/scfoundation.rs, as `embed` runs it) at the released 0.1B
/// shape (12 x 768, 12 heads, 100 bins, 19,266 positions) with seeded random weights. A cell is
/// its expressed genes (the lengths file's value, at most 19,264) plus T and S; its embedding is
/// the 3,072-d pooled vector. FLOPs count the encoder only.
fn run_scfoundation(a: &BenchEncoderArgs) -> anyhow::Result<ExitStatus> {
    use scfoundry::methods::scfoundation::{self, CellInput, Config, ScFoundation};
    let mut cfg = Config::released();
    cfg.depth = a.layers.unwrap_or(cfg.depth);
    cfg.hidden_dim = a.hidden.unwrap_or(cfg.hidden_dim);
    cfg.heads = a.heads.unwrap_or(cfg.heads);
    let n_genes = cfg.seq_len - 2;
    let dtype = dtype_of(&a.dtype)?;
    let device = device_of(&a.device)?;
    let tensors = scfoundation::random_tensors(&cfg, 0, &device)?;
    let model = ScFoundation::from_tensors(cfg.clone(), tensors, std::path::Path::new("random weights"), dtype, device.clone())?;
    let (genes, order) = lengths(a, a.max_len.unwrap_or(n_genes).min(n_genes))?;
    let cells: Vec<CellInput> = genes.iter().enumerate().map(|(i, &s)| scfoundation_cell(i, s, n_genes)).collect();
    let lens: Vec<usize> = cells.iter().map(|c| c.values.len()).collect();
    // by tokens, as embed batches scFoundation (cells packed: nothing is padded)
    let batches = plan_batches(a, &order, &lens);
    let best = time_batches(&device, &batches, a.repeat, |b| {
        model.embed(&b.iter().map(|&i| &cells[i]).collect::<Vec<_>>())?;
        Ok(())
    })?;
    let check = first_batch_against_f32(dtype, &batches, model.dim(), |first| {
        let f32_model = ScFoundation::from_tensors(cfg.clone(), scfoundation::random_tensors(&cfg, 0, &device)?, std::path::Path::new("random weights"), DType::F32, device.clone())?;
        let refs: Vec<&CellInput> = first.iter().map(|&i| &cells[i]).collect();
        Ok((model.embed(&refs)?, f32_model.embed(&refs)?))
    })?;
    let (l, d) = (cfg.depth, cfg.hidden_dim);
    let real: usize = lens.iter().sum();
    let flops: f64 = lens.iter().map(|&s| cell_flops(l, d, 4 * d, s)).sum();
    let out = json!({
        "tool": "scfoundry", "version": env!("CARGO_PKG_VERSION"), "arch": "scfoundation",
        "encoder": "scfoundry ScFoundation (methods/scfoundation.rs): value + gene embedding, packed post-norm transformer (fused in bf16 on a GPU), S/T/max/mean pooling",
        "layers": l, "hidden": d, "heads": cfg.heads, "ffn": 4 * d, "embedding_dim": model.dim(),
        "dtype": a.dtype, "device": a.device, "order": a.order, "batch": a.batch, "cells": a.cells,
        "batching": a.batching, "batches": batches.len(),
        "seconds": best, "cells_per_s": a.cells as f64 / best,
        "useful_tflops": flops / best / 1e12, "mean_tokens": real as f64 / a.cells as f64,
        "padding_share": 0.0, "against_f32": check,
    });
    println!("{out}");
    Ok(ExitStatus::Success)
}

/// The synthetic tokens of bench cell `i` with `s` expressed genes (bench/scprint_torch.py
/// builds the same): `max_len` genes spread over the `n_genes`, the first min(s, max_len) with
/// counts 1..50, the rest zero (as the Collator fills a cell up to max_len with zero genes).
pub fn scprint_cell(i: usize, s: usize, n_genes: usize, max_len: usize) -> scfoundry::methods::scprint::CellTokens {
    let step = (n_genes / max_len.max(1)).max(1);
    let genes: Vec<u32> = (0..max_len).map(|k| ((k * step + i) % n_genes) as u32).collect();
    let counts: Vec<f32> = (0..max_len).map(|k| if k < s { 1.0 + ((i * 7919 + k * 104_729) % 50) as f32 } else { 0.0 }).collect();
    let depth = counts.iter().sum::<f32>();
    scfoundry::methods::scprint::CellTokens { genes, counts, depth, expressed: s.min(max_len) }
}

/// scPRINT's transformer (methods/scprint.rs, as `embed` runs it) at medium-v1.5's shape
/// (d_model 256, 8 layers, 4 heads, 8 classes; `--layers`, `--hidden`, `--heads` may override)
/// with seeded random weights and 25,000 genes. Every cell has `--max-len` gene tokens (default
/// 4,000, as `embed`) plus the depth and 9 class tokens, whatever its expressed genes (the
/// lengths file), as upstream's Collator fills cells with zero-count genes: no padding.
fn run_scprint(a: &BenchEncoderArgs) -> anyhow::Result<ExitStatus> {
    use scfoundry::methods::scprint::{self, CellTokens, Config, ScPrint};
    let mut cfg = Config::medium(25_000);
    cfg.nlayers = a.layers.unwrap_or(cfg.nlayers);
    cfg.d_model = a.hidden.unwrap_or(cfg.d_model);
    cfg.nhead = a.heads.unwrap_or(cfg.nhead);
    cfg.num_heads_kv = cfg.nhead;
    let max_len = a.max_len.unwrap_or(scprint::DEFAULT_MAX_LEN).min(cfg.genes.len());
    let dtype = dtype_of(&a.dtype)?;
    let device = device_of(&a.device)?;
    let tensors = scprint::random_tensors(&cfg, 0, &device)?;
    let model = ScPrint::from_tensors(cfg.clone(), tensors, std::path::Path::new("random weights"), dtype, device.clone())?;
    let (expressed, order) = lengths(a, max_len)?;
    let cells: Vec<CellTokens> = expressed.iter().enumerate().map(|(i, &s)| scprint_cell(i, s, cfg.genes.len(), max_len)).collect();
    // every cell has the same tokens (no padding): batches by cells are batches by tokens
    let batches: Vec<Vec<usize>> = order.chunks(a.batch.max(1)).map(|c| c.to_vec()).collect();
    let best = time_batches(&device, &batches, a.repeat, |b| {
        model.embed(&b.iter().map(|&i| &cells[i]).collect::<Vec<_>>())?;
        Ok(())
    })?;
    let check = first_batch_against_f32(dtype, &batches, model.dim(), |first| {
        let f32_model = ScPrint::from_tensors(cfg.clone(), scprint::random_tensors(&cfg, 0, &device)?, std::path::Path::new("random weights"), DType::F32, device.clone())?;
        let refs: Vec<&CellTokens> = first.iter().map(|&i| &cells[i]).collect();
        Ok((model.embed(&refs)?, f32_model.embed(&refs)?))
    })?;
    let (l, d) = (cfg.nlayers, cfg.d_model);
    let s = max_len + cfg.cell_tokens();
    let flops = a.cells as f64 * cell_flops(l, d, 4 * d, s);
    let out = json!({
        "tool": "scfoundry", "version": env!("CARGO_PKG_VERSION"), "arch": "scprint",
        "encoder": "scfoundry ScPrint (methods/scprint.rs): gene + value + position embeddings, depth and class tokens, pre-norm transformer, mean of 4 class tokens",
        "layers": l, "hidden": d, "heads": cfg.nhead, "ffn": 4 * d, "embedding_dim": model.dim(), "max_len": max_len, "tokens": s,
        "dtype": a.dtype, "device": a.device, "order": a.order, "batch": a.batch, "cells": a.cells,
        "batches": batches.len(),
        "seconds": best, "cells_per_s": a.cells as f64 / best,
        "useful_tflops": flops / best / 1e12, "mean_expressed": expressed.iter().sum::<usize>() as f64 / a.cells as f64,
        "padding_share": 0.0, "against_f32": check,
    });
    println!("{out}");
    Ok(ExitStatus::Success)
}

/// `--arch novae`: Novae's encoder (methods/novae.rs, as `embed` runs it) at novae/model.py's
/// full size with random weights, on a synthetic slide: `--cells` cells on a jittered 15-micron
/// grid (seeded), Delaunay graph, 2-hop subgraphs of the valid cells, random z-scored
/// expression of `--max-len` genes (default 500, a targeted panel). Timed: the encoder over all
/// valid cells in batches of `--batch` (batch layout built beforehand, as the torch side does).
fn run_novae(a: &BenchEncoderArgs) -> anyhow::Result<ExitStatus> {
    use scfoundry::methods::novae::{Config, GraphBatch, Novae, SpatialGraph};
    use rand::{Rng, SeedableRng};
    let device = device_of(&a.device)?;
    let genes = a.max_len.unwrap_or(500);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let side = (a.cells as f64).sqrt().ceil() as usize;
    let xy: Vec<[f64; 2]> = (0..a.cells).map(|i| [(i % side) as f64 * 15.0 + rng.gen_range(-5.0..5.0), (i / side) as f64 * 15.0 + rng.gen_range(-5.0..5.0)]).collect();
    let graph = SpatialGraph::build(&xy, None).ok_or_else(|| Error::BadOption { option: "--cells".into(), detail: "too few cells for a triangulation".into(), hint: None })?;
    if let Some(p) = &a.graph_out {
        let mut indptr = vec![0usize];
        let (mut indices, mut dist) = (Vec::new(), Vec::new());
        for l in &graph.adj {
            for &(j, d) in l {
                indices.push(j);
                dist.push(d);
            }
            indptr.push(indices.len());
        }
        std::fs::write(p, json!({"indptr": indptr, "indices": indices, "dist": dist}).to_string()).map_err(|e| Error::Io { path: p.clone(), source: e })?;
    }
    let cfg = Config::full_size(genes);
    let (valid, sub) = graph.subgraphs(cfg.n_hops_local, cfg.n_hops_view);
    let mut model = Novae::random(cfg.clone(), device.clone(), 0)?;
    let rows: Vec<u32> = (0..genes as u32).collect();
    let gm = model.gene_matrix(&rows)?;
    let z: Vec<f32> = (0..a.cells * genes).map(|_| rng.gen_range(-2.0f32..2.0)).collect();
    let order: Vec<usize> = (0..a.cells).filter(|&i| valid[i]).collect();
    let batches: Vec<(GraphBatch, Vec<f32>)> = order
        .chunks(a.batch.max(1))
        .map(|c| {
            let b = GraphBatch::new(&graph, &sub, c, 1.0);
            let zb: Vec<f32> = b.nodes.iter().flat_map(|&v| z[v * genes..(v + 1) * genes].iter().copied()).collect();
            (b, zb)
        })
        .collect();
    // the one-kernel GATv2 attention (the GPU default) against candle's ops on the first batch
    let dim = model.dim();
    let check = fused_vs_candle_ops(&mut model, |m: &mut Novae| &mut m.fused, a.unfused, dim, |m| {
        batches.first().map(|(b, zb)| Ok(m.encode(&gm, zb, b)?)).transpose()
    })?;
    let best = time_batches(&device, &batches, a.repeat, |(b, zb)| {
        model.encode(&gm, zb, b)?;
        Ok(())
    })?;
    let nodes: usize = batches.iter().map(|b| b.0.nodes.len()).sum();
    let out = json!({
        "tool": "scfoundry", "version": env!("CARGO_PKG_VERSION"), "arch": "novae",
        "encoder": "scfoundry Novae (methods/novae.rs: GATv2 x 10 + attention aggregation)",
        "embedding": cfg.embedding_size, "hidden": cfg.hidden_size, "layers": cfg.num_layers, "heads": cfg.heads, "output": cfg.output_size,
        "genes": genes, "dtype": "f32", "fused": model.fused, "device": a.device, "batch": a.batch, "cells": a.cells, "valid_cells": order.len(),
        "mean_nodes": nodes as f64 / order.len().max(1) as f64, "edges": graph.n_edges(),
        "seconds": best, "cells_per_s": order.len() as f64 / best, "fused_vs_candle_ops": check,
    });
    println!("{out}");
    Ok(ExitStatus::Success)
}

/// The synthetic input of bench cell `i` with `s` genes (bench/cellfm_torch.py builds the same):
/// gene ids spread evenly over 1..=n_genes, values on log1p(x / T * 1e4)'s scale.
pub fn cellfm_cell(i: usize, s: usize, n_genes: usize) -> scfoundry::methods::cellfm::CellInput {
    let step = (n_genes / s.max(1)).max(1);
    let genes: Vec<u32> = (0..s).map(|k| 1 + ((k * step) % n_genes) as u32).collect();
    let values: Vec<f32> = (0..s).map(|k| 0.5 + ((i * 7919 + k * 104729) % 1000) as f32 / 200.0).collect();
    scfoundry::methods::cellfm::CellInput { genes, values }
}

/// FLOPs of one CellFM cell of `s` tokens (genes + cls + 2 ST): per layer the five retention
/// and three GLU projections (16 s d^2) and the linear retention K^T V and Q (K^T V) (4 s d hd).
pub fn cellfm_flops(layers: usize, d: usize, heads: usize, s: usize) -> f64 {
    let (l, d, hd, s) = (layers as f64, d as f64, (d / heads.max(1)) as f64, s as f64);
    l * (16.0 * s * d * d + 4.0 * s * d * hd)
}

/// CellFM's encoder (methods/cellfm.rs, as `embed` runs it) at the released 800M shape (40 x
/// 1536, 48 heads, 24,080 gene rows, cls + 2 ST tokens) with seeded random weights. A cell is
/// its expressed genes (the lengths file's value, at most 2,048: nonz_len); its embedding is
/// the cls row. --layers, --hidden, --heads may override.
fn run_cellfm(a: &BenchEncoderArgs) -> anyhow::Result<ExitStatus> {
    use scfoundry::methods::cellfm::{self, CellFm, CellInput, Dims};
    let mut dims = Dims::released();
    dims.depth = a.layers.unwrap_or(dims.depth);
    dims.dim = a.hidden.unwrap_or(dims.dim);
    dims.heads = a.heads.unwrap_or(dims.heads);
    let n_genes = dims.gene_rows - 2;
    let dtype = dtype_of(&a.dtype)?;
    let device = device_of(&a.device)?;
    let tensors = cellfm::random_tensors(&dims, 0, &device)?;
    let mut model = CellFm::from_tensors(tensors, dims.heads, std::path::Path::new("random weights"), dtype, device.clone())?;
    let (genes, order) = lengths(a, a.max_len.unwrap_or(cellfm::NONZ_LEN).min(cellfm::NONZ_LEN))?;
    let cells: Vec<CellInput> = genes.iter().enumerate().map(|(i, &s)| cellfm_cell(i, s, n_genes)).collect();
    let lens: Vec<usize> = cells.iter().map(|c| c.genes.len() + model.n_prefix()).collect();
    let batches = plan_batches(a, &order, &lens);
    // gpu::retention's kernels (the GPU default) against candle's ops on the first batch, in
    // the same dtype
    let dim = model.dim();
    let fused_check = fused_vs_candle_ops(&mut model, |m: &mut CellFm| &mut m.fused, a.unfused, dim, |m| {
        batches.first().map(|first| Ok(m.embed(&first.iter().map(|&i| &cells[i]).collect::<Vec<_>>())?)).transpose()
    })?;
    let best = time_batches(&device, &batches, a.repeat, |b| {
        model.embed(&b.iter().map(|&i| &cells[i]).collect::<Vec<_>>())?;
        Ok(())
    })?;
    let check = first_batch_against_f32(dtype, &batches, model.dim(), |first| {
        let f32_model = CellFm::from_tensors(cellfm::random_tensors(&dims, 0, &device)?, dims.heads, std::path::Path::new("random weights"), DType::F32, device.clone())?;
        let refs: Vec<&CellInput> = first.iter().map(|&i| &cells[i]).collect();
        Ok((model.embed(&refs)?, f32_model.embed(&refs)?))
    })?;
    let real: usize = lens.iter().sum();
    let computed: usize = batches.iter().map(|b| b.len() * b.iter().map(|&i| lens[i]).max().unwrap_or(0)).sum();
    let flops: f64 = lens.iter().map(|&s| cellfm_flops(dims.depth, dims.dim, dims.heads, s)).sum();
    let out = json!({
        "tool": "scfoundry", "version": env!("CARGO_PKG_VERSION"), "arch": "cellfm",
        "encoder": "scfoundry CellFm (methods/cellfm.rs): gene + value embedding, post-norm RetentionLayers (linear retention, GLU), cls read-out",
        "layers": dims.depth, "hidden": dims.dim, "heads": dims.heads, "embedding_dim": model.dim(),
        "dtype": a.dtype, "device": a.device, "order": a.order, "batch": a.batch, "cells": a.cells,
        "batching": a.batching, "batches": batches.len(),
        "seconds": best, "cells_per_s": a.cells as f64 / best,
        "useful_tflops": flops / best / 1e12, "mean_tokens": real as f64 / a.cells as f64,
        "padding_share": 1.0 - real as f64 / computed.max(1) as f64, "against_f32": check,
        "fused": model.fused, "fused_vs_candle_ops": fused_check,
    });
    println!("{out}");
    Ok(ExitStatus::Success)
}

pub fn run(a: &BenchEncoderArgs) -> anyhow::Result<ExitStatus> {
    match a.arch.as_str() {
        "bert" => run_bert(a),
        "cellfm" => run_cellfm(a),
        "scbert" => run_scbert(a),
        "scfoundation" => run_scfoundation(a),
        "scprint" => run_scprint(a),
        "novae" => run_novae(a),
        "gemm" => run_gemm(a),
        "scgpt" => run_scgpt(a),
        other => match Arch::parse(other) {
            Some(arch) => run_arch(a, arch),
            None => run_c2s(a),
        },
    }
}

/// `--arch scgpt`: scGPT's own model (methods/scgpt.rs, as `embed` runs it: the input encoding,
/// the encoder layers packed in `--dtype`, the `<cls>` row read out) at the whole-human shape with random weights (12 x 512, 8 heads, d_hid
/// 512, 60,694 genes; --layers, --hidden, --heads, --ffn may override), cells of the lengths
/// file's lengths plus `<cls>`, capped at --max-len (default 1,200), with random genes and bins.
/// Batches as `embed` (by tokens), each read back one batch behind. FLOPs are counted as for
/// `--arch bert` (the encoder layers only), so the two compare directly.
fn run_scgpt(a: &BenchEncoderArgs) -> anyhow::Result<ExitStatus> {
    use scfoundry::methods::scgpt::{Args, Cell, Model, DEFAULT_N_BINS};
    let (layers, d, heads, ffn) = (a.layers.unwrap_or(12), a.hidden.unwrap_or(512), a.heads.unwrap_or(8), a.ffn.unwrap_or(512));
    let max_len = a.max_len.unwrap_or(1200);
    let genes = 60_694;
    let dtype = dtype_of(&a.dtype)?;
    let device = device_of(&a.device)?;
    let args = Args { embsize: d, nheads: heads, d_hid: ffn, nlayers: layers, pad_token: "<pad>".into(), pad_value: -2.0, n_bins: DEFAULT_N_BINS, input_emb_style: "continuous".into() };
    let mut model = Model::random(args, genes, max_len, device.clone())?;
    model.set_precision(dtype)?;
    let (lens, order) = cls_lengths(a, max_len)?;
    let cls = model.tokenizer.cls_id;
    let cells: Vec<Cell> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| Cell {
            genes: std::iter::once(cls).chain((1..n).map(|p| ((i * 7919 + p * 104729) % genes) as u32)).collect(),
            values: std::iter::once(-2.0).chain((1..n).map(|p| ((i + p * 31) % DEFAULT_N_BINS) as f32)).collect(),
            sampled: false,
        })
        .collect();
    let batches = plan_batches(a, &order, &lens);
    let timing = time_read_back(&device, &batches, a.repeat, false, |b| Ok(model.embed_batch_tensor(&b.iter().map(|&i| &cells[i]).collect::<Vec<_>>())?))?;
    let best = timing.seconds;
    let real: usize = lens.iter().sum();
    let flops: f64 = lens.iter().map(|&s| cell_flops(layers, d, ffn, s)).sum();
    let out = json!({
        "tool": "scfoundry", "version": env!("CARGO_PKG_VERSION"), "arch": "scgpt",
        "encoder": "scfoundry scGPT (methods/scgpt.rs, as embed runs it)",
        "layers": layers, "hidden": d, "heads": heads, "ffn": ffn, "max_len": max_len, "genes": genes,
        "dtype": a.dtype, "device": a.device, "order": a.order, "batch": a.batch, "cells": a.cells,
        "batching": a.batching, "batches": batches.len(),
        "seconds": best, "cells_per_s": a.cells as f64 / best,
        "useful_tflops": flops / best / 1e12, "mean_tokens": real as f64 / a.cells as f64,
        "host_queue_s": timing.queue_s, "host_wait_s": timing.wait_s,
    });
    println!("{out}");
    Ok(ExitStatus::Success)
}

/// `--arch gemm`: the matrix-product ceiling that the encoders' useful TFLOP/s are held against
/// (the target is half the card's measured bf16 ceiling; the ceiling moves from day to day, so
/// the benchmark scripts measure it again in the same call). Square
/// products through cuBLAS (candle's matmul) at n = 4,096, 8,192 and 16,384 (`--hidden n` for one
/// size), `reps` products a timing, the best of `--repeat` timings; the ceiling is the fastest size.
fn run_gemm(a: &BenchEncoderArgs) -> anyhow::Result<ExitStatus> {
    let dtype = dtype_of(&a.dtype)?;
    let device = device_of(&a.device)?;
    let sizes = a.hidden.map_or(vec![4096, 8192, 16384], |n| vec![n]);
    let (mut by_size, mut ceiling) = (serde_json::Map::new(), 0f64);
    for &n in &sizes {
        let x = Tensor::randn(0f32, 1f32, (n, n), &device)?.to_dtype(dtype)?;
        let y = Tensor::randn(0f32, 1f32, (n, n), &device)?.to_dtype(dtype)?;
        let flops = 2.0 * (n as f64).powi(3);
        // a quarter of a second of products a timing at ~790 TFLOP/s (at most 200 products)
        let reps = ((2e14 / flops) as usize).clamp(1, 200);
        x.matmul(&y)?;
        device.synchronize()?;
        let mut best = f64::INFINITY;
        for _ in 0..a.repeat.max(1) {
            let t = Instant::now();
            for _ in 0..reps {
                x.matmul(&y)?;
            }
            device.synchronize()?;
            best = best.min(t.elapsed().as_secs_f64() / reps as f64);
        }
        let tflops = flops / best / 1e12;
        by_size.insert(n.to_string(), json!(tflops));
        ceiling = ceiling.max(tflops);
    }
    let out = json!({
        "tool": "scfoundry", "version": env!("CARGO_PKG_VERSION"), "arch": "gemm", "encoder": "square matrix products (cuBLAS through candle)",
        "dtype": a.dtype, "device": a.device, "tflops_by_size": by_size, "ceiling_tflops": ceiling, "half_ceiling_tflops": ceiling / 2.0,
    });
    println!("{out}");
    Ok(ExitStatus::Success)
}

/// The synthetic token ids of bench cell `i` (positions 0..n).
fn bert_cell(i: usize, n: usize) -> Vec<u32> {
    (0..n).map(|p| 5 + ((i * 7919 + p * 104729) % 25000) as u32).collect()
}

/// `--arch bert`: a BERT encoder of the given shape (what geneformer runs; scGPT and UCE shapes
/// too) with random weights. Packed cells and variable-length attention
/// (methods/packed_bert.rs) by default; `--padded` runs candle-transformers' BertModel over
/// padded batches with a mask. The cell embedding is the mean over the cell's tokens.
fn run_bert(a: &BenchEncoderArgs) -> anyhow::Result<ExitStatus> {
    use scfoundry::nn::packed_bert::{Packed, PackedBert};
    let need = |v: Option<usize>, flag: &str| v.ok_or_else(|| Error::BadOption { option: flag.into(), detail: "is needed with --arch bert".into(), hint: None });
    let (layers, hidden, heads, ffn, max_len) = (need(a.layers, "--layers")?, need(a.hidden, "--hidden")?, need(a.heads, "--heads")?, need(a.ffn, "--ffn")?, need(a.max_len, "--max-len")?);
    let dtype = dtype_of(&a.dtype)?;
    let (lens, order) = lengths(a, max_len)?;
    let device = device_of(&a.device)?;
    let cfg: Config = serde_json::from_value(json!({
        "vocab_size": 25426, "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "intermediate_size": ffn, "hidden_act": a.activation,
        "hidden_dropout_prob": 0.0, "max_position_embeddings": max_len, "type_vocab_size": 2,
        "initializer_range": 0.02, "layer_norm_eps": 1e-12, "pad_token_id": 0,
        "classifier_dropout": null, "model_type": "bert"
    }))?;
    // the weights are drawn once and shared by both encoders (so --check compares like with like)
    let mut weights = std::collections::HashMap::new();
    let rand = VarBuilder::from_backend(RandomWeights::new(a), dtype, device.clone());
    let recorder = RecordingBackend { inner: rand, seen: std::sync::Mutex::new(&mut weights) };
    let vb = VarBuilder::from_backend(Box::new(recorder), dtype, device.clone());
    let padded_model = BertModel::load(vb, &cfg)?;
    // BertModel::load asks for `bert.` names when the source claims to have them (ours claims all)
    let weights: std::collections::HashMap<String, Tensor> = weights.into_iter().map(|(k, t)| (k.strip_prefix("bert.").map(str::to_string).unwrap_or(k), t)).collect();
    let vb = VarBuilder::from_tensors(weights, dtype, &device);
    let mut packed_model = PackedBert::load(vb, &cfg)?;
    packed_model.encoder.fused = !a.unfused;
    let batches = plan_batches(a, &order, &lens);
    let cells: Vec<Vec<u32>> = lens.iter().enumerate().map(|(i, &n)| bert_cell(i, n)).collect();
    let padded_run = |b: &[usize]| -> candle_core::Result<Tensor> {
        let len = b.iter().map(|&i| lens[i]).max().unwrap_or(1);
        let n = b.len();
        let mut ids = vec![0u32; n * len];
        let mut mask = vec![0u32; n * len];
        for (r, &i) in b.iter().enumerate() {
            ids[r * len..r * len + lens[i]].copy_from_slice(&cells[i]);
            mask[r * len..r * len + lens[i]].iter_mut().for_each(|m| *m = 1);
        }
        let ids = Tensor::from_vec(ids, (n, len), &device)?;
        let types = ids.zeros_like()?;
        let padded = b.iter().any(|&i| lens[i] < len);
        let mask = Tensor::from_vec(mask, (n, len), &device)?;
        let h = padded_model.forward(&ids, &types, if padded { Some(&mask) } else { None })?;
        // the cell embedding: mean over the real tokens (what geneformer returns)
        let w = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
        let counts = Tensor::new(b.iter().map(|&i| lens[i] as f32).collect::<Vec<_>>(), &device)?.unsqueeze(1)?;
        h.to_dtype(DType::F32)?.broadcast_mul(&w)?.sum(1)?.broadcast_div(&counts)
    };
    // host seconds by part of a packed batch (packing, embedding, encoder, pooling), summed
    let parts = std::cell::RefCell::new([0f64; 4]);
    let packed_run = |b: &[usize]| -> candle_core::Result<Tensor> {
        let t0 = Instant::now();
        let p = Packed::new(&b.iter().map(|&i| cells[i].as_slice()).collect::<Vec<_>>());
        let t1 = Instant::now();
        let x = packed_model.embed(&p)?;
        let t2 = Instant::now();
        let h = packed_model.encoder.forward(&x, &p.cu)?;
        let t3 = Instant::now();
        let pooled = PackedBert::mean_pool(&h, &p.cu, 0, 0)?;
        let mut parts = parts.borrow_mut();
        for (i, d) in [t1 - t0, t2 - t1, t3 - t2, t3.elapsed()].into_iter().enumerate() {
            parts[i] += d.as_secs_f64();
        }
        Ok(pooled)
    };
    let mut check = serde_json::Map::new();
    if a.check {
        let b = &batches[0];
        let rel = |x: &Tensor, y: &Tensor| -> candle_core::Result<f32> {
            let scale = y.abs()?.max_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()?.max(f32::MIN_POSITIVE);
            Ok((x.to_dtype(DType::F32)? - y.to_dtype(DType::F32)?)?.abs()?.max_all()?.to_scalar::<f32>()? / scale)
        };
        let p = Packed::new(&b.iter().map(|&i| cells[i].as_slice()).collect::<Vec<_>>());
        let h = packed_model.forward(&p)?;
        check.insert("check_embedding_packed_vs_padded".into(), json!(rel(&PackedBert::mean_pool(&h, &p.cu, 0, 0)?, &padded_run(b)?)?));
        // the embeddings read back one batch behind (gpu/readback.rs) against plain reads, over
        // parts of the first batches whose cell counts grow, stay and then shrink (a
        // run's last batch is shorter; the page-locked buffers are reused and regrown) (the same
        // rows, up to the pooling kernel's atomic adds)
        let first: Vec<&[usize]> = batches.iter().take(4).zip([2, 1, 1, 4]).map(|(b, k)| &b[..b.len().div_ceil(k)]).collect();
        let mut plain = Vec::new();
        for b in &first {
            plain.extend(packed_run(b)?.flatten_all()?.to_vec1::<f32>()?);
        }
        let (mut lagged, mut got) = (scfoundry::gpu::readback::Lagged::new(), Vec::new());
        for b in &first {
            got.extend(lagged.push((), &packed_run(b)?)?.map(|(_, v)| v).unwrap_or_default());
        }
        got.extend(lagged.finish()?.map(|(_, v)| v).unwrap_or_default());
        let scale = plain.iter().fold(f32::MIN_POSITIVE, |m, v| m.max(v.abs()));
        anyhow::ensure!(got.len() == plain.len(), "the lagged read-back gave {} values where plain reads gave {}", got.len(), plain.len());
        let diff = got.iter().zip(&plain).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
        check.insert("check_readback_lagged_vs_plain".into(), json!(diff));
        // the input embedding (one kernel in bf16 on a GPU) against candle's ops
        check.insert("check_embedding_kernel_vs_candle".into(), json!(rel(&packed_model.embed(&p)?, &packed_model.embed_candle(&p)?)?));
        // the cell embeddings' pooling (one kernel on a GPU) against candle's ops a cell at a time
        let spans: Vec<(usize, usize)> = p.cu.windows(2).map(|w| (w[0] as usize, (w[1] - w[0]) as usize)).collect();
        {
            use scfoundry::gpu::segment_pool::{pool_spans, pool_spans_candle, Pool};
            check.insert("check_pool_vs_candle".into(), json!(rel(&pool_spans(&h, &spans, Pool::Mean)?, &pool_spans_candle(&h, &spans, Pool::Mean)?)?));
            check.insert("check_max_pool_vs_candle".into(), json!(rel(&pool_spans(&h, &spans, Pool::Max)?, &pool_spans_candle(&h, &spans, Pool::Max)?)?));
        }
        // the attention alone, on random q, k, v of this batch's cells
        let qkv = Tensor::randn(0f32, 1f32, (p.tokens(), 3 * hidden), &device)?.to_dtype(dtype)?;
        let fused = scfoundry::gpu::varlen_attention::varlen_attention(&qkv, &p.cu, heads)?;
        let plain = scfoundry::gpu::varlen_attention::reference(&qkv, &p.cu, heads)?;
        check.insert("check_attention_vs_reference".into(), json!(rel(&fused, &plain)?));
        // the causal kernel (Cell2Sentence's GPT-NeoX) on the same q, k, v
        let fused = scfoundry::gpu::varlen_attention::varlen_attention_with(&qkv, &p.cu, heads, true)?;
        let plain = scfoundry::gpu::varlen_attention::reference_with(&qkv, &p.cu, heads, true)?;
        check.insert("check_causal_attention_vs_reference".into(), json!(rel(&fused, &plain)?));
        check.insert("fused_kernel".into(), json!(scfoundry::gpu::varlen_attention::fused_kernel_applies(&qkv, hidden / heads)));
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(d) = &device {
            check.insert("attention_kernel".into(), json!(scfoundry::gpu::varlen_attention::kernel_name(d)?));
        }
        // the whole encoder: fused GPU path against candle's ops on the same layers
        let x = Tensor::randn(0f32, 1f32, (p.tokens(), hidden), &device)?.to_dtype(dtype)?;
        let fused_applies = scfoundry::gpu::fused_encoder::applies(&packed_model.encoder, &x);
        check.insert("fused_encoder".into(), json!(fused_applies));
        if fused_applies {
            let fused = scfoundry::gpu::fused_encoder::forward(&packed_model.encoder, &x, &p.cu)?;
            let plain = packed_model.encoder.forward_unfused(&x, &p.cu)?;
            check.insert("check_fused_encoder_vs_unfused".into(), json!(rel(&fused, &plain)?));
        }
    }
    if a.profile {
        let b = &batches[0];
        let p = Packed::new(&b.iter().map(|&i| cells[i].as_slice()).collect::<Vec<_>>());
        let x = Tensor::randn(0f32, 1f32, (p.tokens(), hidden), &device)?.to_dtype(dtype)?;
        let steps = scfoundry::gpu::fused_encoder::profile(&packed_model.encoder, &x, &p.cu, 20)?;
        let total: f64 = steps.iter().map(|s| s.1).sum();
        let layer_flops: f64 = b.iter().map(|&i| cell_flops(1, hidden, ffn, lens[i])).sum();
        let mut prof = serde_json::Map::new();
        for (name, secs) in &steps {
            let e = prof.entry(name.to_string()).or_insert(json!(0.0));
            *e = json!(e.as_f64().unwrap_or(0.0) + secs * 1e3);
        }
        check.insert("profile_ms_per_layer".into(), json!(prof));
        check.insert("profile_tokens".into(), json!(p.tokens()));
        check.insert("profile_layer_tflops".into(), json!(layer_flops / total / 1e12));
    }
    // the embeddings read back one batch behind (gpu/readback.rs), as `embed` does, unless
    // --sync-batches
    let mut calls = 0usize;
    let timing = time_read_back(&device, &batches, a.repeat, a.sync_batches, |b| {
        let out = if a.padded { padded_run(b)? } else { packed_run(b)? };
        if calls == 0 {
            // the warm-up batch (modules loaded, first products timed) is not a pass's
            *parts.borrow_mut() = [0.0; 4];
        }
        calls += 1;
        Ok(out)
    })?;
    let best = timing.seconds;
    // the mean over the timed passes (the first may hold cuBLASLt timing a token count new to it)
    let per_pass = |v: f64| v / a.repeat.max(1) as f64;
    let host_parts: serde_json::Map<String, serde_json::Value> = ["pack", "embed", "encoder", "pool"].iter().zip(parts.borrow().iter()).map(|(k, &v)| (k.to_string(), json!(per_pass(v)))).collect();
    let real: usize = lens.iter().sum();
    let computed: usize = if a.padded { batches.iter().map(|b| b.len() * b.iter().map(|&i| lens[i]).max().unwrap_or(0)).sum() } else { real };
    let flops: f64 = lens.iter().map(|&s| cell_flops(layers, hidden, ffn, s)).sum();
    let mut out = json!({
        "tool": "scfoundry", "version": env!("CARGO_PKG_VERSION"),
        "encoder": if a.padded { "candle-transformers BertModel, padded batches with a mask" } else if a.unfused || !scfoundry::gpu::fused_encoder::applies(&packed_model.encoder, &Tensor::zeros((1, hidden), dtype, &device)?) { "scfoundry PackedBert (methods/packed_bert.rs), packed cells, candle ops" } else { "scfoundry PackedBert, packed cells, fused encoder (gpu/fused_encoder.rs)" },
        "layers": layers, "hidden": hidden, "heads": heads, "ffn": ffn, "max_len": max_len, "activation": a.activation,
        "dtype": a.dtype, "device": a.device, "order": a.order, "batch": a.batch, "cells": a.cells,
        "seconds": best, "cells_per_s": a.cells as f64 / best,
        "useful_tflops": flops / best / 1e12, "mean_tokens": real as f64 / a.cells as f64,
        "padding_share": 1.0 - real as f64 / computed.max(1) as f64,
        "read_back": if a.sync_batches { "each batch before the next" } else { "one batch behind" },
        // a pass's host seconds queueing batches and waiting for their read back (mean of the passes)
        "host_queue_s": timing.queue_s, "host_wait_s": timing.wait_s,
        // the packed path's queueing by part
        "host_parts_s": host_parts,
        "norm_weights": a.norm_weights,
        "batching": a.batching, "batches": batches.len(), "largest_batch": batches.iter().map(Vec::len).max().unwrap_or(0),
    });
    out.as_object_mut().expect("an object").extend(check);
    println!("{out}");
    Ok(ExitStatus::Success)
}

/// A weight source that remembers every tensor it hands out, so a second model can load the
/// very same tensors.
struct RecordingBackend<'a> {
    inner: VarBuilder<'static>,
    seen: std::sync::Mutex<&'a mut std::collections::HashMap<String, Tensor>>,
}

impl SimpleBackend for RecordingBackend<'_> {
    fn get(&self, s: Shape, name: &str, h: candle_nn::Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = self.inner.get_with_hints_dtype(s, name, h, dtype)?.to_device(dev)?;
        self.seen.lock().expect("not poisoned").insert(name.to_string(), t.clone());
        Ok(t)
    }
    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("random weights have no shape for {name}")
    }
    fn contains_tensor(&self, _name: &str) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The check runs both paths on a model whose fused path is on (a GPU) and leaves it on;
    /// with `--unfused` or on the CPU (fused off) there is no check and candle's ops are timed.
    #[test]
    fn fused_check_runs_both_paths_and_leaves_the_timed_one() {
        struct Toy {
            fused: bool,
            runs: std::cell::RefCell<Vec<bool>>,
        }
        let embed = |m: &Toy| {
            m.runs.borrow_mut().push(m.fused);
            Ok(Some(if m.fused { vec![1.0, 0.1] } else { vec![1.0, 0.0] }))
        };
        let toy = |fused| Toy { fused, runs: Default::default() };
        let mut m = toy(true);
        let check = fused_vs_candle_ops(&mut m, |m: &mut Toy| &mut m.fused, false, 2, embed).unwrap().expect("a check");
        assert!(m.fused && *m.runs.borrow() == [false, true], "candle's ops first, then the fused path");
        let low = check["lowest_cosine"].as_f64().unwrap();
        assert!(low < 0.999 && low > 0.99, "{check}");
        let mut m = toy(true);
        assert!(fused_vs_candle_ops(&mut m, |m: &mut Toy| &mut m.fused, true, 2, embed).unwrap().is_none());
        assert!(!m.fused && m.runs.borrow().is_empty(), "--unfused times candle's ops, unchecked");
        let mut m = toy(false);
        assert!(fused_vs_candle_ops(&mut m, |m: &mut Toy| &mut m.fused, false, 2, embed).unwrap().is_none());
        assert!(!m.fused && m.runs.borrow().is_empty());
    }

    #[test]
    fn flops_match_the_anchor_table() {
        // Geneformer V1 at 2048 tokens: 8041 cells/s is 311 TFLOP/s
        let tf = cell_flops(6, 256, 512, 2048) * 8041.0 / 1e12;
        assert!((tf - 311.0).abs() < 2.0, "{tf}");
        // UCE 33L: 230 cells/s is 550 TFLOP/s
        let tf = cell_flops(33, 1280, 5120, 1536) * 230.0 / 1e12;
        assert!((tf - 550.0).abs() < 3.0, "{tf}");
    }
}
