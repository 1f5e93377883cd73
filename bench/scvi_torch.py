#!/usr/bin/env python3
"""PyTorch side of the pretrained-scVI throughput comparison (`scfoundry __bench-scvi`).

Builds scvi-tools' scVI encoder at the same shape, in plain torch (the GPU machine has torch only):
per layer Linear -> BatchNorm1d(eps 1e-3, eval: running mean 0, variance 1) -> ReLU -> Dropout
(off in eval), then q_m = Linear(n_hidden, n_latent) and q_v = exp(Linear(...)) + 1e-4, as
scvi.nn.Encoder; random weights, eval mode, torch.inference_mode, float32. Cells are the same
synthetic counts as bench_scvi.rs (`synthetic_count`), a pool of batches made before timing and
cycled; each batch is copied to the GPU, log1p'd, encoded, and q_m copied back, as scvi-tools'
get_latent_representation does. Prints one JSON line.
"""
import argparse
import json
import time

import torch


def synthetic_batch(p, batch, genes):
    i = torch.arange(batch, dtype=torch.int64).unsqueeze(1) + p * batch
    j = torch.arange(genes, dtype=torch.int64).unsqueeze(0)
    h = (i * 7919 + j * 104729) % 23
    return torch.where(h < 6, (h % 5).float(), torch.zeros((), dtype=torch.float32))


class Encoder(torch.nn.Module):
    def __init__(self, genes, hidden, latent, layers):
        super().__init__()
        dims = [genes] + [hidden] * layers
        self.fc = torch.nn.Sequential(*[
            torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.BatchNorm1d(b, momentum=0.01, eps=0.001), torch.nn.ReLU(), torch.nn.Dropout(0.1))
            for a, b in zip(dims[:-1], dims[1:])
        ])
        self.mean_encoder = torch.nn.Linear(hidden, latent)
        self.var_encoder = torch.nn.Linear(hidden, latent)

    def forward(self, x):
        q = self.fc(torch.log1p(x))
        return self.mean_encoder(q), torch.exp(self.var_encoder(q)) + 1e-4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--genes", type=int, default=2000)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--latent", type=int, default=10)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--cells", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--pool", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device(a.device)
    enc = Encoder(a.genes, a.hidden, a.latent, a.layers).to(dev).eval()
    pool = [synthetic_batch(p, a.batch, a.genes) for p in range(max(1, a.pool))]
    if a.device == "cuda":
        pool = [x.pin_memory() for x in pool]
    n_batches = (a.cells + a.batch - 1) // a.batch

    def run(b):
        n = min(a.batch, a.cells - b * a.batch)
        x = pool[b % len(pool)][:n].to(dev, non_blocking=True)
        qm, _ = enc(x)
        return qm.cpu()

    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    with torch.inference_mode():
        run(0)
        sync()
        best = float("inf")
        for _ in range(max(1, a.repeat)):
            t = time.perf_counter()
            for b in range(n_batches):
                run(b)
            sync()
            best = min(best, time.perf_counter() - t)
    flops = 2.0 * a.cells * (a.genes * a.hidden + (a.layers - 1) * a.hidden * a.hidden + 2 * a.hidden * a.latent)
    print(json.dumps({
        "tool": "pytorch", "version": torch.__version__, "model": "scvi-tools Encoder shape in torch",
        "genes": a.genes, "hidden": a.hidden, "latent": a.latent, "layers": a.layers, "batch": a.batch,
        "cells": a.cells, "device": a.device, "dtype": "f32", "seconds": best,
        "cells_per_s": a.cells / best, "useful_tflops": flops / best / 1e12,
    }))


if __name__ == "__main__":
    main()
