#!/usr/bin/env python3
"""PyTorch side of the scFoundation throughput row (torch only: no numpy, einops or h5py, as on
the device).

Builds the released cell-embedding path in plain torch with seeded random weights, as upstream's
pretrainmodels/ defines it (github.com/biomap-research/scFoundation, model/, commit d09626a):
AutoDiscretizationEmbedding2 (Linear(1, 100), LeakyReLU(0.1), bin_alpha * h + Linear(100, 100)(h),
softmax over the 100 bins, times the bin table), plus the gene-position embedding (19,267 rows),
then pytorchTransformerModule: a ModuleList of 12 nn.TransformerEncoderLayer(768, 12 heads,
3,072, ReLU, post-norm, batch_first) run with src_key_padding_mask, and a final LayerNorm. The
cell embedding is get_embedding.py's --pool_type all: the last token (S), the one before (T),
and max and mean over the genes, 4 x 768 = 3,072. The Performer decoder is not part of it.

A cell is its expressed genes (the lengths file's value, at most 19,264) plus T and S, with the
same synthetic positions and values as `scfoundry __bench-encoder --arch scfoundation`. Upstream
runs one cell at a time (--batch 1); larger batches pad to the longest cell and pool each cell
over its own tokens. FLOPs count the encoder over real tokens only:
L x (2 s (4 d^2 + 2 d f) + 4 s^2 d) per cell of s tokens. Prints one JSON line.

    python3 bench/scfoundation_torch.py --lengths bench/token_lengths_wu2020.txt --batch 8
"""
import argparse
import json

import torch

from _timing import best_pass

N_GENES = 19264
SEQ_LEN = N_GENES + 2


def cell(i, s):
    """Positions and values of bench cell i with s genes (as src/bin/scfoundry-bench/encoder.rs)."""
    step = max(N_GENES // max(s, 1), 1)
    pos = [(k * step) % N_GENES for k in range(s)] + [N_GENES, N_GENES + 1]
    val = [0.5 + ((i * 7919 + k * 104729) % 1000) / 200.0 for k in range(s)] + [4.0, 3.5]
    return pos, val


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", required=True)
    ap.add_argument("--cells", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--order", default="sorted")
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    L, d, h, bins = a.layers, a.hidden, a.heads, 100
    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    dev = torch.device(a.device)
    pool = [int(l) for l in open(a.lengths) if l.strip() and int(l) > 0]
    genes = [min(pool[i % len(pool)], N_GENES) for i in range(a.cells)]
    cells = [cell(i, s) for i, s in enumerate(genes)]
    lens = [len(c[0]) for c in cells]
    order = list(range(a.cells))
    if a.order == "sorted":
        order.sort(key=lambda i: -lens[i])

    mlp, mlp2 = torch.nn.Linear(1, bins), torch.nn.Linear(bins, bins)
    emb = torch.nn.Embedding(bins, d)
    emb_pad = torch.nn.Embedding(1, d)
    pos_emb = torch.nn.Embedding(SEQ_LEN + 1, d)
    layers = torch.nn.ModuleList(
        [torch.nn.TransformerEncoderLayer(d_model=d, nhead=h, dim_feedforward=4 * d, batch_first=True, norm_first=False) for _ in range(L)]
    )
    norm = torch.nn.LayerNorm(d)
    mods = [mlp, mlp2, emb, emb_pad, pos_emb, layers, norm]
    for m in mods:
        m.to(dev, dtype).eval()
    batches = [order[i:i + a.batch] for i in range(0, len(order), a.batch)]

    def run(idx):
        n, length = len(idx), max(lens[i] for i in idx)
        x = torch.zeros(n, length)
        p = torch.zeros(n, length, dtype=torch.long)
        pad = torch.ones(n, length, dtype=torch.bool)
        for r, i in enumerate(idx):
            pos, val = cells[i]
            x[r, :lens[i]] = torch.tensor(val)
            p[r, :lens[i]] = torch.tensor(pos)
            pad[r, :lens[i]] = False
        x, p, pad = x.to(dev, dtype), p.to(dev), pad.to(dev)
        # AutoDiscretizationEmbedding2 (bin_alpha 1.0), the pad row at padding
        hv = torch.nn.functional.leaky_relu(mlp(x.unsqueeze(2)), 0.1)
        w = torch.softmax(hv + mlp2(hv), dim=-1)
        e = torch.matmul(w, emb.weight)
        e = torch.where(pad.unsqueeze(2), emb_pad.weight[0], e)
        hs = e + pos_emb(p)
        for layer in layers:
            hs = layer(hs, src_key_padding_mask=pad)
        hs = norm(hs).float()
        out = []
        for r, i in enumerate(idx):
            g = hs[r, :lens[i]]
            out.append(torch.cat([g[-1], g[-2], g[:-2].max(0)[0], g[:-2].mean(0)]))
        return torch.stack(out).cpu()

    best = best_pass(run, batches, dev, a.repeat)
    f = 4 * d
    flops = sum(L * (2 * s * (4 * d * d + 2 * d * f) + 4 * s * s * d) for s in lens)
    computed = sum(len(b) * max(lens[i] for i in b) for b in batches)
    print(json.dumps({
        "tool": "pytorch", "version": torch.__version__, "arch": "scfoundation",
        "encoder": "AutoDiscretizationEmbedding2 + pos_emb + ModuleList of nn.TransformerEncoderLayer (post-norm, relu, key padding mask) + LayerNorm, S/T/max/mean pooling",
        "layers": L, "hidden": d, "heads": h, "ffn": f, "embedding_dim": 4 * d,
        "dtype": a.dtype, "device": a.device, "order": a.order, "batch": a.batch, "cells": a.cells, "seconds": best,
        "cells_per_s": a.cells / best, "useful_tflops": flops / best / 1e12,
        "mean_tokens": sum(lens) / a.cells, "padding_share": 1 - sum(lens) / computed,
    }), flush=True)


if __name__ == "__main__":
    main()
