#!/usr/bin/env python3
"""PyTorch side of the CellFM throughput row (torch only: no numpy, scanpy or h5py, as on the
device).

Builds the cell-embedding path of CellFM's PyTorch port (github.com/biomed-AI/CellFM-torch,
commit b6c3673: layers/torch_finetune.py FinetuneModel.encode in eval mode, layers/
torch_retention.py, layers/torch_model.py) in plain torch with seeded random weights, at the
released 800M shape (config.py Config: enc_dims 1536, enc_nlayers 40, enc_num_heads 48; gene
table of 24,078 genes -> 24,080 gene_emb rows):

- tokens: cls_token, the two ST_emb rows, then per gene gene_emb[id] + FFN(value) (Linear(1, 256),
  LeakyReLU(0.01), w3(h) + a * h, softmax, Linear(256, d)); padding zeroed;
- 40 RetentionLayers, post-norm: x = LN1(alpha x + MHRetention(x)), x = LN2(alpha x + GLU(x)),
  alpha = (2 * 40)^0.25, LayerNorm eps 1e-5; MHRetention (parallel form, no decay):
  Q = relu(x Wq) / sqrt(hd), K = relu(x Wk) / sqrt(hd) * key mask, V = x Wv * rsqrt(n - 3 + 1e-6),
  U = silu(x Wu), O = SRMSNorm_head(Q (K^T V)) * U, then Wo; GLU = Wo (x Wu * x Wv);
- the cell embedding is the cls row (1,536-d).

A cell is its expressed genes (the lengths file's value, at most 2,048: nonz_len) with the same
synthetic gene ids and values as `scfoundry __bench-encoder --arch cellfm`. Batches pad to their
longest cell (the port pads every cell to 2,048; --pad-to-nonz-len does that too). FLOPs count
real tokens only: L x (16 s d^2 + 4 s d hd) per cell of s tokens (genes + 3). Prints one JSON
line.

    python3 bench/cellfm_torch.py --lengths bench/token_lengths_wu2020.txt --batch 4
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F

from _timing import best_pass

N_GENES = 24078
GENE_ROWS = N_GENES + 1 + (-N_GENES - 1) % 8
NONZ_LEN = 2048
HIDDEN = 256


def cell(i, s):
    """Gene ids and values of bench cell i with s genes (as src/bin/scfoundry-bench/encoder.rs)."""
    step = max(N_GENES // max(s, 1), 1)
    genes = [1 + (k * step) % N_GENES for k in range(s)]
    vals = [0.5 + ((i * 7919 + k * 104729) % 1000) / 200.0 for k in range(s)]
    return genes, vals


def srms(x, dim):
    """SRMSNorm (float32): x / max(|x / sqrt(dim)|, 1e-12)."""
    dt = x.dtype
    x = x.float()
    n = torch.norm(x * (1.0 / math.sqrt(dim)), p=2, dim=-1, keepdim=True).clamp(min=1e-12)
    return (x / n).to(dt)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", required=True)
    ap.add_argument("--cells", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=48)
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--order", default="sorted")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--pad-to-nonz-len", action="store_true", help="pad every batch to 2,048 genes, as the port's collate does")
    a = ap.parse_args()
    L, d, h = a.layers, a.hidden, a.heads
    hd = d // h
    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    dev = torch.device(a.device)
    pool = [int(l) for l in open(a.lengths) if l.strip() and int(l) > 0]
    genes = [min(pool[i % len(pool)], NONZ_LEN) for i in range(a.cells)]
    cells = [cell(i, s) for i, s in enumerate(genes)]
    lens = [len(c[0]) for c in cells]
    order = list(range(a.cells))
    if a.order == "sorted":
        order.sort(key=lambda i: -lens[i])

    def w(*shape, scale=None):
        scale = scale if scale is not None else 1.0 / math.sqrt(shape[-1])
        return (torch.randn(*shape) * scale).to(dev, dtype)

    gene_emb = w(GENE_ROWS, d)
    prefix = w(1, 3, d)  # cls_token, ST_emb[0], ST_emb[1]
    w1, w3, table, a_ = w(HIDDEN, 1), w(HIDDEN, HIDDEN), w(d, HIDDEN), w(1, 1, scale=0.1)
    layers = []
    for _ in range(L):
        layers.append({
            "q": w(d, d), "k": w(d, d), "v": w(d, d), "u": w(d, d), "o": w(d, d),
            "gu": w(d, d), "gv": w(d, d), "go": w(d, d),
            "n1": torch.nn.LayerNorm(d).to(dev, dtype), "n2": torch.nn.LayerNorm(d).to(dev, dtype),
        })
    alpha = (2 * L) ** 0.25
    batches = [order[i:i + a.batch] for i in range(0, len(order), a.batch)]

    def run(idx):
        n = len(idx)
        lg = NONZ_LEN if a.pad_to_nonz_len else max(lens[i] for i in idx)
        g = torch.zeros(n, lg, dtype=torch.long)
        v = torch.zeros(n, lg)
        m = torch.zeros(n, lg)
        for r, i in enumerate(idx):
            gi, vi = cells[i]
            g[r, :lens[i]] = torch.tensor(gi)
            v[r, :lens[i]] = torch.tensor(vi)
            m[r, :lens[i]] = 1.0
        scale = torch.rsqrt(m.sum(-1) - 3 + 1e-6).view(n, 1, 1, 1)
        g, v, m, scale = g.to(dev), v.to(dev, dtype), m.to(dev, dtype), scale.to(dev, dtype)
        hv = F.leaky_relu(F.linear(v.unsqueeze(-1), w1), 0.01)
        hv = torch.softmax(F.linear(hv, w3) + hv * a_, dim=-1)
        x = gene_emb[g] + F.linear(hv, table)
        x = torch.cat([prefix.expand(n, -1, -1), x], dim=1)
        mask = torch.cat([torch.ones(n, 3, device=dev, dtype=dtype), m], dim=1)
        x = x * mask.unsqueeze(-1)
        km = mask.view(n, 1, -1, 1)
        t = x.shape[1]
        for p in layers:
            def heads(y):
                return y.view(n, t, h, hd).transpose(1, 2)
            q = torch.relu(heads(F.linear(x, p["q"]))) / math.sqrt(hd)
            k = torch.relu(heads(F.linear(x, p["k"]))) / math.sqrt(hd) * km
            vv = heads(F.linear(x, p["v"])) * scale
            u = F.silu(heads(F.linear(x, p["u"])))
            o = srms(torch.matmul(q, torch.matmul(k.transpose(-1, -2), vv)), hd) * u
            o = F.linear(o.transpose(1, 2).reshape(n, t, d), p["o"])
            x = p["n1"](x * alpha + o)
            ff = F.linear(F.linear(x, p["gu"]) * F.linear(x, p["gv"]), p["go"])
            x = p["n2"](x * alpha + ff)
        return x[:, 0].float().cpu()

    best = best_pass(run, batches, dev, a.repeat)
    toks = [s + 3 for s in lens]
    flops = sum(L * (16 * s * d * d + 4 * s * d * hd) for s in toks)
    pad_len = (lambda b: NONZ_LEN + 3) if a.pad_to_nonz_len else (lambda b: max(toks[i] for i in b))
    computed = sum(len(b) * pad_len(b) for b in batches)
    print(json.dumps({
        "tool": "pytorch", "version": torch.__version__, "arch": "cellfm",
        "encoder": "CellFM-torch FinetuneModel.encode (eval) in plain torch: gene + value embedding, post-norm RetentionLayers (linear retention, GLU), cls read-out",
        "layers": L, "hidden": d, "heads": h, "embedding_dim": d,
        "dtype": a.dtype, "device": a.device, "order": a.order, "batch": a.batch, "cells": a.cells,
        "pad_to_nonz_len": a.pad_to_nonz_len, "seconds": best,
        "cells_per_s": a.cells / best, "useful_tflops": flops / best / 1e12,
        "mean_tokens": sum(toks) / a.cells, "padding_share": 1 - sum(toks) / computed,
    }), flush=True)


if __name__ == "__main__":
    main()
