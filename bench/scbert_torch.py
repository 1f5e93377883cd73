#!/usr/bin/env python3
"""PyTorch side of the scBERT throughput comparison (`scfoundry __bench-encoder --arch scbert`).

A PerformerLM of scBERT's released shape (github.com/TencentAILabHealthcare/scBERT, predict.py
and its vendored performer_pytorch; rebuilt here in plain torch because the GPU machine has torch
only): token embedding over 7 bins plus a (seq_len x dim) gene2vec table; `depth` pre-LayerNorm
layers of FAVOR+ self-attention (q/k/v without bias to heads x dim_head, softmax-kernel random
features from a fixed (nb_features x dim_head) projection, queries stabilised by their row max,
keys by the max of the key tensor, eps 1e-4, non-causal linear attention, to_out) and a GELU
feed-forward (x4); the final LayerNorm; the cell embedding is the mean over the gene positions
(the appended last one left out), as scfoundry writes it. Defaults: dim 200, depth 6, heads 10,
dim_head 64, nb_features 266, 16,907 positions, batch 3 (methods/scbert.toml). Random weights
(normal sd 0.02, LayerNorms at 1/0), eval mode, torch.inference_mode, float32 (--tf32: TF32
products; --bf16: under torch.autocast to bfloat16, which runs the products in bf16 and the
exponentials, sums and norms in float32).

The tokens are the formula scfoundry uses: position p of cell i has (7919 i + 104729 p) mod 6,
and the last position 0. Best of --repeat timed passes after one warm-up batch. Prints one JSON
line (cells_per_s).
"""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from torch import nn


def favor_features(x, proj, is_query, eps=1e-4):
    """Softmax-kernel features of x (b, h, n, e) on proj (m, e)."""
    e = x.shape[-1]
    norm = e ** -0.25
    ratio = proj.shape[0] ** -0.5
    dash = torch.matmul(x * norm, proj.t())
    diag = (x * x).sum(-1, keepdim=True) / 2.0 * norm * norm
    if is_query:
        stab = dash.amax(-1, keepdim=True)
    else:
        stab = dash.amax()
    return ratio * (torch.exp(dash - diag - stab) + eps)


class Attention(nn.Module):
    def __init__(self, dim, heads, dim_head, nb_features):
        super().__init__()
        inner = heads * dim_head
        self.heads, self.dim_head = heads, dim_head
        self.q = nn.Linear(dim, inner, bias=False)
        self.k = nn.Linear(dim, inner, bias=False)
        self.v = nn.Linear(dim, inner, bias=False)
        self.out = nn.Linear(inner, dim)
        self.register_buffer("proj", torch.randn(nb_features, dim_head))

    def forward(self, x):
        b, n, _ = x.shape
        split = lambda t: t.view(b, n, self.heads, self.dim_head).transpose(1, 2)
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        q = favor_features(q, self.proj, True)
        k = favor_features(k, self.proj, False)
        d_inv = 1.0 / torch.matmul(q, k.sum(-2).unsqueeze(-1))
        ctx = torch.matmul(k.transpose(-1, -2), v)
        o = torch.matmul(q, ctx) * d_inv
        return self.out(o.transpose(1, 2).reshape(b, n, -1))


class Layer(nn.Module):
    def __init__(self, dim, heads, dim_head, nb_features):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, dim_head, nb_features)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.ff(self.n2(x))


class Performer(nn.Module):
    def __init__(self, num_tokens, seq_len, dim, depth, heads, dim_head, nb_features):
        super().__init__()
        self.tok = nn.Embedding(num_tokens, dim)
        self.register_buffer("pos", torch.randn(seq_len, dim))
        self.layers = nn.ModuleList([Layer(dim, heads, dim_head, nb_features) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids):
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)[:, :-1, :].mean(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", type=int, default=60)
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=16907)
    ap.add_argument("--dim", type=int, default=200)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--heads", type=int, default=10)
    ap.add_argument("--dim-head", type=int, default=64)
    ap.add_argument("--nb-features", type=int, default=int(64 * math.log(64)))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--tf32", action="store_true", help="allow TF32 matmuls (off: full float32, as scfoundry)")
    ap.add_argument("--bf16", action="store_true", help="run under torch.autocast(bfloat16)")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = a.tf32
    torch.manual_seed(0)
    dev = torch.device(a.device)
    model = Performer(7, a.seq_len, a.dim, a.depth, a.heads, a.dim_head, a.nb_features)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "n1" in name or "n2" in name or name.startswith("norm"):
                continue
            p.normal_(0.0, 0.02)
    model = model.to(dev).eval()
    i = torch.arange(a.cells, dtype=torch.int64)[:, None]
    p = torch.arange(a.seq_len, dtype=torch.int64)[None, :]
    ids = (i * 7919 + p * 104729) % 6
    ids[:, -1] = 0
    batches = [ids[s : s + a.batch] for s in range(0, a.cells, a.batch)]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    cast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.bf16)
    with torch.inference_mode(), cast:
        model(batches[0].to(dev)).cpu()
        sync()
        best = float("inf")
        for _ in range(max(1, a.repeat)):
            t = time.perf_counter()
            for b in batches:
                model(b.to(dev)).cpu()
            sync()
            best = min(best, time.perf_counter() - t)
    print(json.dumps({
        "tool": "torch", "version": torch.__version__, "arch": "scbert", "encoder": "PerformerLM (bench/scbert_torch.py)",
        "layers": a.depth, "hidden": a.dim, "heads": a.heads, "dim_head": a.dim_head, "nb_features": a.nb_features,
        "seq_len": a.seq_len, "dtype": "bf16 autocast" if a.bf16 else "f32", "tf32": a.tf32, "device": a.device, "batch": a.batch, "cells": a.cells,
        "seconds": best, "cells_per_s": a.cells / best,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
    }))


if __name__ == "__main__":
    main()
