//! `scfoundry-bench __bench-pairwise`: the benchmark's dense passes (`metrics::Dense`) on the
//! GPU against the CPU on the same synthetic cells: the exact k-NN (rows whose lists agree,
//! neighbours in common, the largest distance difference) and the label silhouette (largest
//! difference of a cell's value), each side's seconds. One JSON line.

use std::time::Instant;

use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use serde_json::json;

use crate::args::BenchPairwiseArgs;
use scfoundry::commands::ExitStatus;
use scfoundry::metrics::silhouette::{silhouette_samples_on, BetweenCluster, Distance};
use scfoundry::metrics::Dense;

pub fn run(a: &BenchPairwiseArgs) -> anyhow::Result<ExitStatus> {
    let device = crate::encoder::bench_device("cuda")?;
    let gpu = Dense::on(&device);
    let cpu = Dense::cpu();
    let (n, d) = (a.cells, a.dims);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(a.seed);
    let unit = Normal::new(0f32, 1.0)?;
    let centres: Vec<f32> = (0..a.labels * d).map(|_| 4.0 * unit.sample(&mut rng)).collect();
    let labels: Vec<u32> = (0..n).map(|i| (i % a.labels) as u32).collect();
    let mut x = vec![0f32; n * d];
    for i in 0..n {
        if i % 97 == 96 {
            let (prev, row) = x.split_at_mut(i * d);
            row[..d].copy_from_slice(&prev[(i - 1) * d..]);
            continue;
        }
        let c = labels[i] as usize;
        for j in 0..d {
            x[i * d + j] = centres[c * d + j] + unit.sample(&mut rng);
        }
    }
    let time = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        t.elapsed().as_secs_f64()
    };
    let mut g_nn = None;
    let gpu_knn_s = time(&mut || g_nn = Some(gpu.knn("90-NN", &x, n, d, a.k)));
    let mut g_sil = Vec::new();
    let gpu_sil_s = time(&mut || g_sil = silhouette_samples_on(&gpu, &x, n, d, &labels, 256, Distance::Euclidean, BetweenCluster::Nearest));
    let g_nn = g_nn.unwrap();
    let mut out = json!({
        "cells": n, "dims": d, "k": a.k, "labels": a.labels, "seed": a.seed,
        "gpu_knn_s": gpu_knn_s, "gpu_silhouette_s": gpu_sil_s,
        "gpu_passes": gpu.passes(), "fallbacks": gpu.fallbacks(),
    });
    if !a.gpu_only {
        let mut c_nn = None;
        let cpu_knn_s = time(&mut || c_nn = Some(cpu.knn("90-NN", &x, n, d, a.k)));
        let mut c_sil = Vec::new();
        let cpu_sil_s = time(&mut || c_sil = silhouette_samples_on(&cpu, &x, n, d, &labels, 256, Distance::Euclidean, BetweenCluster::Nearest));
        let c_nn = c_nn.unwrap();
        let (mut same_rows, mut common, mut max_dd) = (0usize, 0usize, 0f32);
        for i in 0..n {
            let (gr, cr) = (g_nn.row(i), c_nn.row(i));
            same_rows += (gr == cr) as usize;
            common += gr.iter().filter(|j| cr.contains(j)).count();
            for (p, q) in g_nn.row_dist(i).iter().zip(c_nn.row_dist(i)) {
                max_dd = max_dd.max((p - q).abs());
            }
        }
        let sil_diff = g_sil.iter().zip(&c_sil).map(|(p, q)| (p - q).abs()).fold(0f64, f64::max);
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        out["cpu_knn_s"] = json!(cpu_knn_s);
        out["cpu_silhouette_s"] = json!(cpu_sil_s);
        out["knn_rows_identical"] = json!(same_rows as f64 / n as f64);
        out["knn_neighbours_in_common"] = json!(common as f64 / (n * a.k) as f64);
        out["knn_max_distance_diff"] = json!(max_dd);
        out["silhouette_max_diff"] = json!(sil_diff);
        out["silhouette_mean_gpu_cpu"] = json!([mean(&g_sil), mean(&c_sil)]);
    }
    println!("{out}");
    Ok(ExitStatus::Success)
}
