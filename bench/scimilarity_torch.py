#!/usr/bin/env python3
"""PyTorch side of the SCimilarity throughput comparison (`scfoundry __bench-scimilarity`).

The encoder of the same shape as upstream's nn_models.Encoder (github.com/Genentech/scimilarity,
rebuilt here because the GPU machine has torch only): per hidden layer Dropout, Linear, BatchNorm1d,
PReLU; then Linear to the latent size; F.normalize(p=2, dim=1). Random weights (Linear normal
sd 0.02), eval mode, torch.inference_mode, float32 (as upstream's CellEmbedding runs it).

The cells are the formula `scfoundry __bench-scimilarity` uses: gene j of cell i has the count
v + 1 when v = (7919 i + 104729 j) mod 97 is below 5, else 0; each cell log-normalised to 1e4.
Timings, best of --repeat after one warm-up:
- `upstream_cells_per_s`: as CellEmbedding.get_embeddings runs, each batch a dense tensor from
  pageable host memory (`torch.Tensor(X[i:i+b]).to(device)`) and its embeddings back with `.cpu()`;
- `cells_per_s`: dense rows from page-locked memory, `non_blocking=True`, each batch's embeddings
  back with `.cpu()` (the figure of earlier tables);
- `careful_cells_per_s`: what a careful user writes, the better of two: dense rows page-locked and
  non-blocking with the embeddings kept on the device and read once at the end, or each batch's
  non-zero values as a CSR tensor (page-locked, non-blocking) made dense on the device
  (`to_dense()`), read once at the end; `careful_input` says which won;
- `model_cells_per_s`: the batches already on the device (the encoder alone).
Prints one JSON line.
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn


class Encoder(nn.Module):
    def __init__(self, n_genes, latent_dim, hidden_dim):
        super().__init__()
        self.network = nn.ModuleList()
        width = n_genes
        for h in hidden_dim:
            self.network.append(nn.Sequential(nn.Dropout(p=0.5), nn.Linear(width, h), nn.BatchNorm1d(h), nn.PReLU()))
            width = h
        self.network.append(nn.Linear(width, latent_dim))

    def forward(self, x):
        for layer in self.network:
            x = layer(x)
        return F.normalize(x, p=2, dim=1)


def cells(n, genes):
    i = torch.arange(n, dtype=torch.int64)[:, None]
    j = torch.arange(genes, dtype=torch.int64)[None, :]
    v = (i * 7919 + j * 104729) % 97
    x = torch.where(v < 5, (v + 1).float(), torch.zeros(()))
    total = x.sum(1, keepdim=True)
    x = x * torch.where(total > 0, 1e4 / total, torch.zeros(()))
    return torch.log1p(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--genes", type=int, default=28231)
    ap.add_argument("--hidden", default="1024,1024")
    ap.add_argument("--latent", type=int, default=128)
    ap.add_argument("--cells", type=int, default=20480)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device(a.device)
    hidden = [int(h) for h in a.hidden.split(",")]
    enc = Encoder(a.genes, a.latent, hidden)
    with torch.no_grad():
        for m in enc.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0, 0.02)
                m.bias.zero_()
    enc = enc.to(dev).eval()
    host = cells(a.cells, a.genes)
    if dev.type == "cuda":
        host = host.pin_memory()
    bounds = [(s, min(s + a.batch, a.cells)) for s in range(0, a.cells, a.batch)]
    on_dev = [host[s:e].to(dev) for s, e in bounds]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def from_host():
        t = time.perf_counter()
        for s, e in bounds:
            enc(host[s:e].to(dev, non_blocking=True)).cpu()
        sync()
        return time.perf_counter() - t

    def model_only():
        t = time.perf_counter()
        for x in on_dev:
            enc(x)
        sync()
        return time.perf_counter() - t

    pageable = host.clone() if dev.type == "cuda" else host

    def upstream():
        t = time.perf_counter()
        for s, e in bounds:
            enc(torch.Tensor(pageable[s:e]).to(dev)).cpu()
        return time.perf_counter() - t

    def careful_dense():
        t = time.perf_counter()
        out = [enc(host[s:e].to(dev, non_blocking=True)) for s, e in bounds]
        torch.cat(out).cpu()
        return time.perf_counter() - t

    csr = [host[s:e].to_sparse_csr() for s, e in bounds]
    if dev.type == "cuda":
        csr = [torch.sparse_csr_tensor(c.crow_indices().pin_memory(), c.col_indices().pin_memory(), c.values().pin_memory(), c.shape) for c in csr]

    def careful_sparse():
        t = time.perf_counter()
        out = [enc(c.to(dev, non_blocking=True).to_dense()) for c in csr]
        torch.cat(out).cpu()
        return time.perf_counter() - t

    with torch.inference_mode():
        for f in (from_host, model_only, upstream, careful_dense, careful_sparse):
            f()
        r = max(a.repeat, 1)
        best_host = min(from_host() for _ in range(r))
        best_model = min(model_only() for _ in range(r))
        best_upstream = min(upstream() for _ in range(r))
        best_dense = min(careful_dense() for _ in range(r))
        best_sparse = min(careful_sparse() for _ in range(r))
    best_careful, careful_input = min((best_dense, "dense page-locked"), (best_sparse, "CSR made dense on the device"))
    print(json.dumps({
        "tool": "torch", "version": torch.__version__, "encoder": "scimilarity nn_models.Encoder shape (torch)",
        "genes": a.genes, "hidden": hidden, "latent": a.latent, "dtype": "f32", "device": a.device,
        "batch": a.batch, "cells": a.cells,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "seconds": best_host, "cells_per_s": a.cells / best_host,
        "upstream_cells_per_s": a.cells / best_upstream,
        "careful_cells_per_s": a.cells / best_careful, "careful_input": careful_input,
        "model_seconds": best_model, "model_cells_per_s": a.cells / best_model,
    }))


if __name__ == "__main__":
    main()
