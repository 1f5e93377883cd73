//! `scfoundry __bench-scvi`: throughput of the pretrained-scVI embedding path
//! (`methods/scvi_pretrained.rs`: log1p, the encoder MLP, q_m back to the host) at a
//! full-size shape with random weights. Cells are synthetic counts (a fixed pattern, the same
//! as bench/scvi_torch.py's), made before timing; each batch is copied to the device, run and
//! copied back (`cells_per_s`); `sparse_cells_per_s` times the path `scfoundry embed --method
//! scvi` takes: each batch's non-zero counts laid out as CSR (`nn::sparse_rows`), uploaded and
//! made dense on the device, read back one batch behind. The PyTorch side is bench/scvi_torch.py.

use std::time::Instant;

use serde_json::json;

use crate::args::BenchScviArgs;
use scfoundry::commands::ExitStatus;
use scfoundry::methods::scvi_pretrained::{Arch, Latent, PretrainedScvi};
use scfoundry::nn::sparse_rows::SparseRows;

/// Synthetic counts of cell `i`, gene `j` (bench/scvi_torch.py computes the same).
pub fn synthetic_count(i: usize, j: usize) -> f32 {
    let h = (i.wrapping_mul(7919) + j.wrapping_mul(104_729)) % 23;
    if h < 6 { (h % 5) as f32 } else { 0.0 }
}

pub fn run(a: &BenchScviArgs) -> anyhow::Result<ExitStatus> {
    let device = crate::encoder::bench_device(&a.device)?;
    let arch = Arch {
        model_name: "SCVI".into(),
        scvi_version: "random".into(),
        n_hidden: a.hidden,
        n_latent: a.latent,
        n_layers: a.layers,
        gene_likelihood: "zinb".into(),
        latent_distribution: Latent::Normal,
        log_variational: true,
        encode_covariates: false,
        deeply_inject_covariates: true,
        batch_norm_encoder: true,
        layer_norm_encoder: false,
        n_batch: 1,
        batch_key: None,
        batch_categories: vec![],
    };
    let mut model = PretrainedScvi::random(&arch, a.genes, &device)?;
    let batch = a.batch.max(1);
    // a pool of distinct batches, cycled
    let pool: Vec<Vec<f32>> = (0..a.pool.max(1))
        .map(|p| (0..batch * a.genes).map(|k| synthetic_count(p * batch + k / a.genes, k % a.genes)).collect())
        .collect();
    let n_batches = a.cells.div_ceil(batch);
    let codes = vec![0u32; batch];
    let rows: Vec<usize> = (0..batch).collect();
    let mut run_batch = |b: usize| -> anyhow::Result<usize> {
        let n = batch.min(a.cells - b * batch);
        let x = pool[b % pool.len()][..n * a.genes].to_vec();
        let z = model.embed(x, &codes[..n], 0, &rows[..n])?;
        Ok(z.len())
    };
    run_batch(0)?;
    device.synchronize()?;
    let mut best = f64::INFINITY;
    for _ in 0..a.repeat.max(1) {
        let t = Instant::now();
        for b in 0..n_batches {
            run_batch(b)?;
        }
        device.synchronize()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    // the same batches as (column, count) entries, laid out and made dense on the device in the timing
    let sparse_pool: Vec<Vec<Vec<(u32, f32)>>> = pool
        .iter()
        .map(|p| p.chunks(a.genes).map(|r| r.iter().enumerate().filter(|e| *e.1 != 0.0).map(|(j, &v)| (j as u32, v)).collect()).collect())
        .collect();
    // as `embed` runs them: each batch laid out as CSR on all cores, made dense on the device,
    // read back while the next batch runs
    let time_sparse = |model: &mut PretrainedScvi| -> anyhow::Result<f64> {
        let t = Instant::now();
        let mut lagged = scfoundry::gpu::readback::Lagged::new();
        for b in 0..n_batches {
            let n = batch.min(a.cells - b * batch);
            let cells = &sparse_pool[b % sparse_pool.len()][..n];
            let rows_of = SparseRows::new(cells, a.genes);
            let _ = lagged.push((), &model.forward_sparse(&rows_of, &codes[..n])?)?;
        }
        let _ = lagged.finish()?;
        Ok(t.elapsed().as_secs_f64())
    };
    time_sparse(&mut model)?;
    // the sparse path's first batch against the dense path's (the device's CSR kernel against
    // dense rows copied from the host)
    let n0 = batch.min(a.cells);
    let dense0 = model.embed(pool[0][..n0 * a.genes].to_vec(), &codes[..n0], 0, &rows[..n0])?;
    let sparse0 = model.embed_sparse(&SparseRows::new(&sparse_pool[0][..n0], a.genes), &codes[..n0], 0, &rows[..n0])?;
    let sparse_vs_dense = dense0.iter().zip(&sparse0).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    let mut best_sparse = f64::INFINITY;
    for _ in 0..a.repeat.max(1) {
        best_sparse = best_sparse.min(time_sparse(&mut model)?);
    }
    let flops = 2.0 * a.cells as f64 * (a.genes * a.hidden + (a.layers - 1) * a.hidden * a.hidden + 2 * a.hidden * a.latent) as f64;
    println!(
        "{}",
        json!({
            "tool": "scfoundry", "version": env!("CARGO_PKG_VERSION"), "model": "scvi encoder (methods/scvi_pretrained.rs)",
            "genes": a.genes, "hidden": a.hidden, "latent": a.latent, "layers": a.layers, "batch": batch,
            "cells": a.cells, "device": a.device, "dtype": "f32", "seconds": best,
            "cells_per_s": a.cells as f64 / best, "useful_tflops": flops / best / 1e12,
            "sparse_seconds": best_sparse, "sparse_cells_per_s": a.cells as f64 / best_sparse,
            "sparse_vs_dense_max_abs": sparse_vs_dense,
        })
    );
    Ok(ExitStatus::Success)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_counts_are_sparse_small_integers() {
        let v: Vec<f32> = (0..2000).map(|j| synthetic_count(3, j)).collect();
        let nz = v.iter().filter(|x| **x > 0.0).count();
        assert!(nz > 200 && nz < 600, "{nz}");
        assert!(v.iter().all(|x| x.fract() == 0.0 && *x <= 4.0));
    }
}
