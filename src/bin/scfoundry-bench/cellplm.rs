//! `scfoundry __bench-cellplm`: throughput of CellPLM (see `methods/cellplm.rs`) at its released
//! size (19,374 genes, enc_hid 1024, 4 Flowformer layers of 8 heads, GMVAE latent 512 with 16
//! clusters) with random weights, on synthetic cells.
//!
//! Cell `i` expresses `--nnz` genes: gene (7919 i + 104729 p) mod genes with the count
//! 1 + (i + p) mod 5, for p = 0..nnz (bench/cellplm_torch.py repeats the formula). The cells are
//! cut into forward passes of `--batch` cells (cells attend to each other within a pass, as
//! the embed task runs them); the time is the best of `--repeat` passes over all cells, from
//! the (gene, log1p count) lists on the host to the embeddings back on the host. `--dtype bf16`
//! runs the products in bf16 (a path `embed` does not take yet) and checks the first pass
//! against f32.

use std::time::Instant;

use candle_core::Device;
use serde_json::json;

use crate::args::BenchCellplmArgs;
use scfoundry::commands::ExitStatus;
use scfoundry::error::Error;
use scfoundry::methods::cellplm::{CellPlm, Config, LatentKind};

/// The synthetic cell `i`: (gene row, log1p count) pairs (bench/cellplm_torch.py has the formula).
pub fn synthetic_cell(i: usize, nnz: usize, genes: usize) -> Vec<(u32, f32)> {
    let mut c: Vec<(u32, f32)> = (0..nnz).map(|p| (((i as u64 * 7919 + p as u64 * 104729) % genes as u64) as u32, (1 + (i + p) % 5) as f32)).collect();
    c.sort_by_key(|&(g, _)| g);
    // a gene drawn twice adds its counts (as a coalesced sparse tensor does)
    let mut out: Vec<(u32, f32)> = Vec::with_capacity(c.len());
    for (g, v) in c {
        match out.last_mut() {
            Some((h, w)) if *h == g => *w += v,
            _ => out.push((g, v)),
        }
    }
    out.into_iter().map(|(g, v)| (g, v.ln_1p())).collect()
}

fn device_of(name: &str) -> anyhow::Result<Device> {
    Ok(crate::encoder::bench_device(name)?)
}

pub fn run(a: &BenchCellplmArgs) -> anyhow::Result<ExitStatus> {
    let device = device_of(&a.device)?;
    let mut cfg = Config::released(a.genes);
    cfg.enc_hid = a.hidden;
    cfg.enc_layers = a.layers;
    cfg.enc_head = a.heads;
    cfg.post_latent_dim = a.latent;
    if a.hidden % a.heads != 0 || a.hidden % 4 != 0 {
        return Err(Error::BadOption { option: "--hidden".into(), detail: format!("{} is not divisible by --heads {} and by 4 (GroupNorm's groups)", a.hidden, a.heads), hint: None }.into());
    }
    let dtype = if a.dtype == "bf16" { candle_core::DType::BF16 } else { candle_core::DType::F32 };
    let model = CellPlm::random(cfg.clone(), dtype, device.clone(), a.seed)?;
    let cells: Vec<Vec<(u32, f32)>> = (0..a.cells).map(|i| synthetic_cell(i, a.nnz.min(a.genes), a.genes)).collect();
    let batch = a.batch.max(1);
    let passes: Vec<&[Vec<(u32, f32)>]> = cells.chunks(batch).collect();
    // warm-up: one pass
    model.embed(passes[0])?;
    device.synchronize()?;
    // bf16: the first pass against the same weights in f32 (the same seed) on the same device
    let check = if dtype == candle_core::DType::F32 {
        None
    } else {
        let want = CellPlm::random(cfg.clone(), candle_core::DType::F32, device.clone(), a.seed)?.embed(passes[0])?;
        Some(crate::encoder::against_f32(&model.embed(passes[0])?, &want, cfg.dim()))
    };
    let mut best = f64::INFINITY;
    let mut checksum = 0f64;
    for _ in 0..a.repeat.max(1) {
        let t = Instant::now();
        let mut sum = 0f64;
        for p in &passes {
            let z = model.embed(p)?;
            sum += z.iter().take(8).map(|&v| v as f64).sum::<f64>();
        }
        device.synchronize()?;
        best = best.min(t.elapsed().as_secs_f64());
        checksum = sum;
    }
    let d = a.hidden as f64;
    // per cell: projections and feed-forward 16 d^2 x 2 FLOPs per layer, flow attention
    // about 4 d^2 / heads x 2, the embedding nnz x d x 2, the latent head
    let clusters = match cfg.latent {
        LatentKind::Gmvae(k) => k,
        LatentKind::Vae => 0,
    } as f64;
    let per_cell = a.layers as f64 * (2.0 * 16.0 * d * d + 2.0 * 4.0 * d * d / a.heads as f64) + 2.0 * a.nnz as f64 * d + 2.0 * (d * d + (d + clusters) * 512.0 + 512.0 * a.latent as f64);
    let out = json!({
        "tool": "scfoundry", "version": env!("CARGO_PKG_VERSION"), "model": "cellplm (methods/cellplm.rs), random weights",
        "genes": a.genes, "hidden": a.hidden, "layers": a.layers, "heads": a.heads, "latent": a.latent, "nnz": a.nnz,
        "cells": a.cells, "batch": batch, "passes": passes.len(), "device": a.device, "dtype": a.dtype,
        "seconds": best, "cells_per_s": a.cells as f64 / best, "tflops": per_cell * a.cells as f64 / best / 1e12,
        "checksum": checksum, "against_f32": check,
    });
    println!("{out}");
    Ok(ExitStatus::Success)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_cells_follow_the_formula() {
        let c = synthetic_cell(3, 4, 19374);
        // genes (7919*3 + 104729 p) mod 19374 for p = 0..4, counts 1 + (3 + p) mod 5
        let mut want: Vec<(u32, f32)> = (0..4).map(|p| (((3 * 7919 + p * 104729) % 19374) as u32, ((1 + (3 + p) % 5) as f32).ln_1p())).collect();
        want.sort_by_key(|&(g, _)| g);
        assert_eq!(c.len(), want.len());
        for (a, b) in c.iter().zip(&want) {
            assert_eq!(a.0, b.0);
            assert!((a.1 - b.1).abs() < 1e-6, "{c:?}");
        }
        // a gene drawn twice sums its counts
        let c = synthetic_cell(0, 3, 1);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].0, 0);
        assert!((c[0].1 - 6f32.ln_1p()).abs() < 1e-6, "{c:?}");
    }
}
