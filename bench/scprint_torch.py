#!/usr/bin/env python3
"""PyTorch side of the scPRINT throughput row (torch only: no numpy, scprint or simpler-flash,
as on the GPU machine).

Builds the cell-embedding path of scPRINT (github.com/cantinilab/scPRINT, PyPI scprint 2.3.8,
model/model.py and model/encoders.py; simpler-flash 1.0.7's FlashTransformer) in plain torch with
seeded random weights, at medium-v1.5's shape (d_model 256, 8 layers, 4 heads, 8 classes):
gene embedding (25,000 genes) + ContinuousValueEncoder(log2(1 + count)) (Linear(1, d), LayerNorm,
ReLU, Linear(d, d)) + the genomic-position table; in front, the depth token
(ContinuousValueEncoder(log2(1 + depth))) and the base + 8 class tokens; simpler-flash's pre-norm
blocks (x + MHA(LN(x)), x + MLP(LN(x)), LayerNorm eps 1e-6, packed Wqkv, GELU, 4 x d) and a final
LayerNorm; the cell embedding is the mean of 4 class tokens (Embedder's pred_embedding).

`--attention einsum` is upstream's non-flash SelfAttention (einsum, softmax, einsum: what
`transformer="normal"` runs); `--attention sdpa` is torch's scaled_dot_product_attention (flash
or memory-efficient kernels on the GPU: the closest plain-torch stand-in for upstream's
`transformer="flash"`, which needs the flash-attn package).

Every cell has --max-len gene tokens (as the Collator fills cells with zero-count genes), with
the same synthetic genes and counts as `scfoundry __bench-encoder --arch scprint` (the lengths
file gives the expressed genes per cell). FLOPs count the transformer over all tokens:
L x (2 s (4 d^2 + 2 d f) + 4 s^2 d) per cell of s tokens. Prints one JSON line.

    python3 bench/scprint_torch.py --lengths bench/token_lengths_wu2020.txt --batch 64
"""
import argparse
import json
import math

import torch

from _timing import best_pass

N_GENES = 25_000
N_CLASSES = 8
PRED = [1 + 1 + i for i in (0, 2, 5, 6)]  # cell_type, disease, ethnicity, sex after depth + base


def cell(i, s, max_len):
    """Gene ids, counts and depth of bench cell i with s expressed genes (as src/bin/scfoundry-bench/encoder.rs)."""
    step = max(N_GENES // max(max_len, 1), 1)
    genes = [(k * step + i) % N_GENES for k in range(max_len)]
    counts = [1.0 + ((i * 7919 + k * 104729) % 50) if k < s else 0.0 for k in range(max_len)]
    return genes, counts, sum(counts)


class ValueEncoder(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.l0, self.ln, self.l1 = torch.nn.Linear(1, d), torch.nn.LayerNorm(d), torch.nn.Linear(d, d)

    def forward(self, x):
        return self.l1(torch.relu(self.ln(self.l0(x.clamp(0, 100_000).unsqueeze(-1)))))


class Block(torch.nn.Module):
    def __init__(self, d, h, attention):
        super().__init__()
        self.h, self.attention = h, attention
        self.norm1, self.norm2 = torch.nn.LayerNorm(d, eps=1e-6), torch.nn.LayerNorm(d, eps=1e-6)
        self.wqkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        qkv = self.wqkv(self.norm1(x)).view(b, t, 3, self.h, d // self.h)
        q, k, v = qkv.unbind(2)
        if self.attention == "sdpa":
            o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        else:
            s = torch.einsum("bthd,bshd->bhts", q, k * (1.0 / math.sqrt(d // self.h)))
            o = torch.einsum("bhts,bshd->bthd", torch.softmax(s, dim=-1, dtype=v.dtype), v)
        x = x + self.out(o.reshape(b, t, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", required=True)
    ap.add_argument("--cells", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=4000)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--attention", choices=["einsum", "sdpa"], default="einsum")
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--order", default="sorted")
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    L, d, h = a.layers, a.hidden, a.heads
    max_len = min(a.max_len, N_GENES)
    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    dev = torch.device(a.device)
    pool = [int(l) for l in open(a.lengths) if l.strip() and int(l) > 0]
    expressed = [min(pool[i % len(pool)], max_len) for i in range(a.cells)]
    cells = [cell(i, s, max_len) for i, s in enumerate(expressed)]
    order = list(range(a.cells))
    if a.order == "sorted":
        order.sort(key=lambda i: -expressed[i])

    gene_emb = torch.nn.Embedding(N_GENES, d)
    pos = torch.nn.Embedding(N_GENES, d)
    expr_enc, depth_enc = ValueEncoder(d), ValueEncoder(d)
    class_emb = torch.nn.Embedding(N_CLASSES + 1, d)
    blocks = torch.nn.ModuleList([Block(d, h, a.attention) for _ in range(L)])
    norm = torch.nn.LayerNorm(d, eps=1e-6)
    for m in [gene_emb, pos, expr_enc, depth_enc, class_emb, blocks, norm]:
        m.to(dev, dtype).eval()
    batches = [order[i:i + a.batch] for i in range(0, len(order), a.batch)]
    pred = torch.tensor(PRED, device=dev)

    def run(idx):
        g = torch.tensor([cells[i][0] for i in idx], device=dev)
        x = torch.tensor([cells[i][1] for i in idx], device=dev)
        dep = torch.tensor([cells[i][2] for i in idx], device=dev)
        enc = gene_emb(g) + expr_enc(torch.log2(1 + x).to(dtype)) + pos(g)
        front = torch.cat([depth_enc(torch.log2(1 + dep).to(dtype)).unsqueeze(1), class_emb.weight.unsqueeze(0).expand(len(idx), -1, -1)], 1)
        hs = torch.cat([front, enc], 1)
        for blk in blocks:
            hs = blk(hs)
        hs = norm(hs[:, : N_CLASSES + 2]).float()
        return hs[:, pred].mean(1).cpu()

    best = best_pass(run, batches, dev, a.repeat)
    f = 4 * d
    s = max_len + N_CLASSES + 2
    flops = a.cells * L * (2 * s * (4 * d * d + 2 * d * f) + 4 * s * s * d)
    print(json.dumps({
        "tool": "pytorch", "version": torch.__version__, "arch": "scprint", "attention": a.attention,
        "encoder": "gene + value + position embeddings, depth and class tokens, simpler-flash pre-norm blocks (GELU), LayerNorm, mean of 4 class tokens",
        "layers": L, "hidden": d, "heads": h, "ffn": f, "embedding_dim": d, "max_len": max_len, "tokens": s,
        "dtype": a.dtype, "device": a.device, "order": a.order, "batch": a.batch, "cells": a.cells, "seconds": best,
        "cells_per_s": a.cells / best, "useful_tflops": flops / best / 1e12,
        "mean_expressed": sum(expressed) / a.cells, "padding_share": 0.0,
    }), flush=True)


if __name__ == "__main__":
    main()
