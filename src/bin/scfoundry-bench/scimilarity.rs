//! `scfoundry __bench-scimilarity`: throughput of the SCimilarity encoder (see
//! `methods/scimilarity.rs`) at its full size (28,231 genes -> 1024 -> 1024 -> 128 by default)
//! with random weights, on synthetic cells.
//!
//! The cells are made by a formula that bench/scimilarity_torch.py repeats exactly: gene j of
//! cell i has the count v + 1 when v = (7919 i + 104729 j) mod 97 is below 5 (about 5% of the
//! genes), else 0; each cell is then log-normalised to 1e4 as the embed task does. Two timings,
//! the best of `--repeat` passes over all cells in batches of `--batch`:
//! `cells_per_s` from dense host rows (each batch copied to the device, the embeddings copied
//! back), `sparse_cells_per_s` from the cells' raw counts as sparse rows, as `scfoundry embed`
//! runs: each batch log-normalised on all cores, its non-zero values uploaded from page-locked
//! memory and scattered into dense rows on the device, read back while the next batch is
//! built; and `model_cells_per_s` with the dense batches already on the device (the encoder
//! alone).

use std::time::Instant;

use candle_core::{Device, Tensor};
use serde_json::json;

use crate::args::BenchScimilarityArgs;
use scfoundry::commands::ExitStatus;
use scfoundry::error::Error;
use scfoundry::methods::scimilarity::{Alignment, Encoder};
use scfoundry::nn::sparse_rows::SparseRows;

/// The synthetic count of gene `j` in cell `i` (bench/scimilarity_torch.py has the same formula).
pub fn synthetic_count(i: usize, j: usize) -> f32 {
    let v = (i as u64 * 7919 + j as u64 * 104729) % 97;
    if v < 5 {
        (v + 1) as f32
    } else {
        0.0
    }
}

fn device_of(name: &str) -> anyhow::Result<Device> {
    Ok(crate::encoder::bench_device(name)?)
}

pub fn run(a: &BenchScimilarityArgs) -> anyhow::Result<ExitStatus> {
    let hidden: Vec<usize> = a.hidden.split(',').map(|s| s.trim().parse::<usize>()).collect::<Result<_, _>>().map_err(|e| Error::BadOption { option: "--hidden".into(), detail: e.to_string(), hint: Some("comma-separated sizes, e.g. 1024,1024".into()) })?;
    let device = device_of(&a.device)?;
    let enc = Encoder::random(a.genes, &hidden, a.latent, device.clone(), a.seed)?;
    let g = a.genes;
    // host rows, log-normalised as the embed task does
    let mut rows = vec![0f32; a.cells * g];
    for (i, r) in rows.chunks_mut(g).enumerate() {
        let mut total = 0f64;
        for (j, x) in r.iter_mut().enumerate() {
            *x = synthetic_count(i, j);
            total += *x as f64;
        }
        let f = if total > 0.0 { (1e4 / total) as f32 } else { 0.0 };
        r.iter_mut().for_each(|x| *x = (*x * f).ln_1p());
    }
    let bounds: Vec<(usize, usize)> = (0..a.cells).step_by(a.batch.max(1)).map(|s| (s, (s + a.batch.max(1)).min(a.cells))).collect();
    let from_host = || -> anyhow::Result<f64> {
        let t = Instant::now();
        for &(s, e) in &bounds {
            let _ = enc.embed_rows(&rows[s * g..e * g], e - s)?;
        }
        device.synchronize()?;
        Ok(t.elapsed().as_secs_f64())
    };
    // the raw counts as sparse rows (the data's genes in the model's order)
    let sparse_counts: Vec<(Vec<u32>, Vec<f32>)> = (0..a.cells)
        .map(|i| (0..g).filter_map(|j| Some((j as u32, synthetic_count(i, j))).filter(|e| e.1 > 0.0)).unzip())
        .collect();
    let names: Vec<String> = (0..g).map(|j| format!("g{j}")).collect();
    let align = Alignment::new(&names, &names);
    let from_sparse = || -> anyhow::Result<f64> {
        let t = Instant::now();
        let mut lagged = scfoundry::gpu::readback::Lagged::new();
        for &(s, e) in &bounds {
            let b = SparseRows::build(e - s, g, |k, out| {
                let (idx, v) = &sparse_counts[s + k];
                align.lognorm_sparse(idx, v, out)
            })
            .map_err(|(k, v)| anyhow::anyhow!("cell {}: count {v}", s + k))?;
            let _ = lagged.push((), &enc.forward_sparse(&b)?)?;
        }
        let _ = lagged.finish()?;
        Ok(t.elapsed().as_secs_f64())
    };
    let on_device: Vec<Tensor> = bounds.iter().map(|&(s, e)| Tensor::from_slice(&rows[s * g..e * g], (e - s, g), &device)).collect::<candle_core::Result<_>>()?;
    let model_only = || -> anyhow::Result<f64> {
        let t = Instant::now();
        for x in &on_device {
            let _ = enc.forward(x)?;
        }
        device.synchronize()?;
        Ok(t.elapsed().as_secs_f64())
    };
    // warm-up, then the best of `repeat`
    from_host()?;
    from_sparse()?;
    model_only()?;
    let (mut best_host, mut best_sparse, mut best_model) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
    for _ in 0..a.repeat.max(1) {
        best_host = best_host.min(from_host()?);
        best_sparse = best_sparse.min(from_sparse()?);
        best_model = best_model.min(model_only()?);
    }
    // a checksum of the first cell's embedding, to compare runs
    let first: f32 = enc.embed_rows(&rows[..g], 1)?.iter().sum();
    let out = json!({
        "tool": "scfoundry", "version": env!("CARGO_PKG_VERSION"), "encoder": "scimilarity (candle)",
        "genes": g, "hidden": hidden, "latent": a.latent, "dtype": "f32", "device": a.device,
        "batch": a.batch, "cells": a.cells, "seed": a.seed,
        "seconds": best_host, "cells_per_s": a.cells as f64 / best_host,
        "sparse_seconds": best_sparse, "sparse_cells_per_s": a.cells as f64 / best_sparse,
        "model_seconds": best_model, "model_cells_per_s": a.cells as f64 / best_model,
        "first_cell_sum": first,
    });
    println!("{out}");
    Ok(ExitStatus::Success)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_cells_are_about_five_percent_dense() {
        let nz = (0..97).filter(|&j| synthetic_count(3, j) > 0.0).count();
        assert_eq!(nz, 5);
        assert_eq!(synthetic_count(0, 0), 1.0);
    }
}
