#!/usr/bin/env python3
"""Harmony benchmark: scfoundry's `harmonize` vs harmonypy 2.1.0, on the same inputs, in one run.

    cargo build --release --example harmony_bench
    python bench/harmony_vs_harmonypy.py --bench-bin target/release/examples/harmony_bench \
        [--cells 10000,100000] [--repeats 3] [--workdir /tmp/harmony-bench] [--json out.json]

Run it with a Python that has harmonypy 2.1.0 (`pip install harmonypy==2.1.0 scikit-learn`).
Data are SYNTHETIC (seed 0): N cells x 50 dims, 10 cell types (Gaussian centres, sd 3), 3
batches (a per-batch shift, sd 1.5), unit noise; float32, written once per N to --workdir as
raw files the Rust side reads (`examples/harmony_bench.rs`). Both sides run with harmonypy's
defaults and seed 0 (their random streams differ, so the corrected embeddings agree only in
aggregate: the script prints the 15-NN overlap between the two results on 2000 random cells).

Timed: `run_harmony` alone for harmonypy (in this process, input already float64, no import);
`harmonize` alone for scfoundry (in the example, after reading the files). Wall time (median
of --repeats, first run in brackets) and CPU time (all threads) per side; the ratio is
harmonypy / scfoundry. Threads: harmonypy's default (one per physical core), scfoundry's
rayon default (one per CPU) and matrixmultiply's (one per physical core).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def make_data(n: int, workdir: Path):
    zf, bf = workdir / f"z{n}.f32", workdir / f"b{n}.u32"
    rng = np.random.default_rng(0)
    d, n_batches, n_types = 50, 3, 10
    centers = rng.normal(0, 3, (n_types, d))
    shifts = rng.normal(0, 1.5, (n_batches, d))
    types = rng.integers(0, n_types, n)
    batches = rng.integers(0, n_batches, n)
    z = (centers[types] + shifts[batches] + rng.normal(0, 1, (n, d))).astype(np.float32)
    if not (zf.exists() and bf.exists()):
        z.tofile(zf)
        batches.astype(np.uint32).tofile(bf)
    return z, batches, zf, bf


def knn_overlap(a: np.ndarray, b: np.ndarray, k: int = 15, n_query: int = 2000) -> float:
    from sklearn.neighbors import NearestNeighbors
    rng = np.random.default_rng(1)
    q = rng.choice(len(a), size=min(n_query, len(a)), replace=False)
    ia = NearestNeighbors(n_neighbors=k + 1).fit(a).kneighbors(a[q], return_distance=False)[:, 1:]
    ib = NearestNeighbors(n_neighbors=k + 1).fit(b).kneighbors(b[q], return_distance=False)[:, 1:]
    return float(np.mean([len(set(x) & set(y)) / k for x, y in zip(ia, ib)]))


def fmt(ts):
    return f"{statistics.median(ts):.3f} ({ts[0]:.3f})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-bin", required=True, help="target/release/examples/harmony_bench")
    ap.add_argument("--cells", default="10000,100000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/harmony-bench")
    ap.add_argument("--json")
    a = ap.parse_args()
    if not Path(a.bench_bin).is_file():
        sys.exit(f"error: {a.bench_bin} not found: run `cargo build --release --example harmony_bench` first")
    import harmonypy
    from harmonypy import run_harmony
    from importlib.metadata import version

    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"harmonypy {version('harmonypy')}, numpy {np.__version__}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for n in [int(x) for x in a.cells.split(",")]:
        z, batches, zf, bf = make_data(n, workdir)
        z64 = z.astype(np.float64)
        meta = {"batch": batches}
        hp_wall, hp_cpu, h = [], [], None
        for _ in range(a.repeats):
            t, c = time.perf_counter(), time.process_time()
            h = run_harmony(z64, meta, "batch", verbose=False, random_state=0)
            hp_wall.append(time.perf_counter() - t)
            hp_cpu.append(time.process_time() - c)
        out = workdir / f"ours{n}.f32"
        p = subprocess.run([a.bench_bin, str(zf), str(bf), str(n), "50", str(a.repeats), str(out)],
                           capture_output=True, text=True, check=True)
        ours = json.loads(p.stdout.strip().splitlines()[-1])
        z_ours = np.fromfile(out, dtype=np.float32).reshape(n, 50)
        overlap = knn_overlap(z_ours, np.asarray(h.Z_corr))
        row = {
            "cells": n, "dims": 50, "batches": 3,
            "harmonypy_wall": hp_wall, "harmonypy_cpu": hp_cpu, "harmonypy_iterations": len(h.kmeans_rounds),
            "scfoundry_wall": ours["times"], "scfoundry_cpu": ours["cpu"], "scfoundry_iterations": ours["iterations"],
            "ratio_wall": statistics.median(hp_wall) / statistics.median(ours["times"]),
            "ratio_cpu": statistics.median(hp_cpu) / statistics.median(ours["cpu"]),
            "knn15_overlap": overlap,
        }
        rows.append(row)
        print(f"{n:>7} cells: harmonypy wall {fmt(hp_wall)} s cpu {statistics.median(hp_cpu):.2f} s "
              f"({row['harmonypy_iterations']} it) | scfoundry wall {fmt(ours['times'])} s cpu "
              f"{statistics.median(ours['cpu']):.2f} s ({ours['iterations']} it) | "
              f"ratio wall {row['ratio_wall']:.2f}x cpu {row['ratio_cpu']:.2f}x | 15-NN overlap {overlap:.3f}",
              flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
