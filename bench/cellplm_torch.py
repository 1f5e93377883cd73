#!/usr/bin/env python3
"""PyTorch side of the CellPLM throughput row: the same architecture as scfoundry's
`__bench-cellplm` (CellPLM's released size: 19,374 genes, enc_hid 1024, 4 Flowformer layers of
8 heads, GroupNorm(4) in the embedder, LayerNorm before a GMVAE latent of 512 with 16 clusters),
written the way upstream runs it (CellPLM/embedder/omics.py: log1p of a sparse tensor and
torch.sparse.mm with the gene table; layer/flowformer.py: Flow_Attention's einsums; the latent
mean of q(z|x, y) with y one-hot), random weights, on the same synthetic cells: cell i expresses
gene (7919 i + 104729 p) mod genes with count 1 + (i + p) mod 5 for p < nnz.

torch only (no numpy, no CellPLM package). Prints one JSON line.

    python3 bench/cellplm_torch.py --device cuda --cells 100000 --batch 50000
    python3 bench/cellplm_torch.py --device cuda --dtype bf16 --pin    # the careful user's run

--dtype bf16 runs the forward pass under torch.autocast(bfloat16) (its Linear layers and einsums
in bf16, the sparse gene-table product in float32, which CUDA's sparse kernels need; upstream
runs float32); --pin keeps the host's sparse passes page-locked and copies them non-blocking.
"""

import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

EPS = 1e-6


class Flow(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.h = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):  # x: (1, L, d), as FlowformerLayer unsqueezes
        b, l, d = x.shape
        q = torch.sigmoid(self.q(x)).view(b, l, self.h, -1).transpose(1, 2)
        k = torch.sigmoid(self.k(x)).view(b, l, self.h, -1).transpose(1, 2)
        v = self.v(x).view(b, l, self.h, -1).transpose(1, 2)
        incoming = 1.0 / torch.einsum("nhld,nhd->nhl", q + EPS, k.sum(dim=2) + EPS)
        outgoing = 1.0 / torch.einsum("nhld,nhd->nhl", k + EPS, q.sum(dim=2) + EPS)
        sink = torch.einsum("nhld,nhd->nhl", q + EPS, (k * outgoing[..., None]).sum(dim=2) + EPS)
        source = torch.einsum("nhld,nhd->nhl", k + EPS, (q * incoming[..., None]).sum(dim=2) + EPS).clamp(-1.0, 1.0)
        allocation = torch.sigmoid(sink)
        competition = torch.softmax(source, dim=-1) * float(l)
        kv = torch.einsum("nhld,nhlm->nhdm", k, v * competition[..., None])
        out = torch.einsum("nhld,nhdm->nhlm", q * incoming[..., None], kv) * allocation[..., None]
        return self.o(out.transpose(1, 2).reshape(b, l, d))


class Layer(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.attn = Flow(d, heads)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x):
        x = x + self.attn(self.n1(x).unsqueeze(0))[0]
        return x + self.ff(self.n2(x))


class CellPLM(nn.Module):
    def __init__(self, genes, d, layers, heads, latent, clusters=16):
        super().__init__()
        self.emb = nn.Parameter(torch.randn(genes, d) * 0.02)
        self.extra = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.GroupNorm(4, d))
        self.layers = nn.ModuleList(Layer(d, heads) for _ in range(layers))
        self.pre = nn.LayerNorm(d)
        self.logits = nn.Linear(d, clusters)
        self.qz = nn.Linear(d + clusters, 512)
        self.mu = nn.Linear(512, latent)
        self.clusters = clusters

    def forward(self, x_sparse):
        # CUDA's sparse product has no bf16 kernel: it runs in float32 outside autocast
        with torch.autocast(x_sparse.device.type, enabled=False):
            h = torch.sparse.mm(torch.log1p(x_sparse), self.emb)
        h = self.extra(h)
        for l in self.layers:
            h = l(h)
        h = self.pre(h)
        y = F.one_hot(self.logits(h).argmax(-1), self.clusters).to(h.dtype)
        return self.mu(F.relu(self.qz(torch.cat([h, y], 1))))


def cells_sparse(start, n, nnz, genes, device):
    i = torch.arange(start, start + n, dtype=torch.long).repeat_interleave(nnz)
    p = torch.arange(nnz, dtype=torch.long).repeat(n)
    cols = (i * 7919 + p * 104729) % genes
    vals = (1 + (i + p) % 5).float()
    idx = torch.stack([i - start, cols])
    return torch.sparse_coo_tensor(idx, vals, (n, genes)).coalesce().to(device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--genes", type=int, default=19374)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--latent", type=int, default=512)
    ap.add_argument("--nnz", type=int, default=1000)
    ap.add_argument("--cells", type=int, default=100000)
    ap.add_argument("--batch", type=int, default=50000)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--pin", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    dev = torch.device(a.device)
    model = CellPLM(a.genes, a.hidden, a.layers, a.heads, a.latent).to(dev).eval()
    nnz = min(a.nnz, a.genes)
    # the sparse inputs are built on the host, as upstream's TranscriptomicDataset does, and copied per pass
    passes = [cells_sparse(s, min(a.batch, a.cells - s), nnz, a.genes, "cpu") for s in range(0, a.cells, a.batch)]
    if a.pin:
        passes = [x.pin_memory() for x in passes]
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    auto = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.dtype == "bf16")
    with torch.no_grad(), auto:
        model(passes[0].to(dev)).cpu()
        sync()
        best = float("inf")
        for _ in range(max(1, a.repeat)):
            t = time.perf_counter()
            checksum = 0.0
            for x in passes:
                z = model(x.to(dev, non_blocking=a.pin)).float().cpu()
                checksum += float(z.flatten()[:8].sum())
            sync()
            best = min(best, time.perf_counter() - t)
    print(json.dumps({
        "tool": "pytorch", "torch": torch.__version__, "model": "CellPLM architecture (bench/cellplm_torch.py), random weights",
        "genes": a.genes, "hidden": a.hidden, "layers": a.layers, "heads": a.heads, "latent": a.latent, "nnz": nnz,
        "cells": a.cells, "batch": a.batch, "passes": len(passes), "device": a.device, "dtype": a.dtype, "pinned": a.pin,
        "seconds": best, "cells_per_s": a.cells / best,
    }))


if __name__ == "__main__":
    main()
