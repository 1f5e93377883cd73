#!/usr/bin/env python3
"""PyTorch side of the scCello / LangCell throughput rows (torch only: no transformers, numpy
or h5py, as on the GPU machine).

Builds the released architecture in plain torch with random weights: BERT embeddings (word +
position + the one token-type row, LayerNorm eps 1e-12), post-norm encoder layers with ReLU
(nn.TransformerEncoderLayer with norm_first=False is exactly a BERT layer: self-attention,
add & LayerNorm, feed-forward, add & LayerNorm), the cell embedding read at <cls> (position 0)
and, for LangCell, cell_proj + L2 normalisation (zero-shot.ipynb's Pooler). Eval mode,
torch.inference_mode, batches padded on the right to their longest cell with a key-padding
mask, in file order (as upstream's DataLoader / Trainer run cells) or sorted by length.

A cell is <cls> and its genes: 1 + the lengths file's value, cut at --max-len (2,048), as
`scfoundry __bench-encoder --arch` does. FLOPs count only real tokens:
L x (2 s (4 d^2 + 2 d f) + 4 s^2 d) per cell. Prints one JSON line.

    python3 bench/bert_cell_torch.py --arch sccello --lengths bench/token_lengths_wu2020.txt
"""
import argparse
import json

import torch

from _timing import best_pass

# name: layers, hidden, heads, ffn, projection (see src/methods/cls_encoder.rs Arch::full_size)
ARCHS = {
    "sccello": (6, 256, 4, 512, None),
    # LangCell's cell_bert/config.json could not be read; Geneformer 12L-30M's shape, assumed
    "langcell": (12, 512, 8, 1024, 256),
}
VOCAB = 25427


def main(arch=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=sorted(ARCHS), default=arch, required=arch is None)
    ap.add_argument("--lengths", required=True)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--cells", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--order", default="file")
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    L, d, h, f, proj_dim = ARCHS[a.arch]
    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    dev = torch.device(a.device)
    pool = [int(l) for l in open(a.lengths) if l.strip() and int(l) > 0]
    lens = [min(pool[i % len(pool)] + 1, a.max_len) for i in range(a.cells)]
    order = list(range(a.cells))
    if a.order == "sorted":
        order.sort(key=lambda i: -lens[i])

    word = torch.nn.Embedding(VOCAB, d, padding_idx=0)
    pos = torch.nn.Embedding(2048, d)
    typ = torch.nn.Parameter(torch.randn(d) * 0.02)
    ln = torch.nn.LayerNorm(d, eps=1e-12)
    layer = torch.nn.TransformerEncoderLayer(d, h, f, dropout=0.0, activation="relu", batch_first=True, norm_first=False, layer_norm_eps=1e-12)
    enc = torch.nn.TransformerEncoder(layer, L, enable_nested_tensor=False)
    proj = torch.nn.Linear(d, proj_dim) if proj_dim else None
    mods = [word, pos, ln, enc] + ([proj] if proj else [])
    for m in mods:
        m.to(dev, dtype).eval()
    typ = typ.to(dev, dtype)
    batches = [order[i:i + a.batch] for i in range(0, len(order), a.batch)]

    def run(cells):
        n, length = len(cells), max(lens[i] for i in cells)
        ids = torch.zeros(n, length, dtype=torch.long)
        pad = torch.ones(n, length, dtype=torch.bool)
        for r, i in enumerate(cells):
            ids[r, 0] = VOCAB - 1  # <cls>
            ids[r, 1:lens[i]] = torch.arange(lens[i] - 1) % 25000 + 5
            pad[r, :lens[i]] = False
        ids, pad = ids.to(dev), pad.to(dev)
        x = ln(word(ids) + pos(torch.arange(length, device=dev))[None] + typ)
        hcls = enc(x, src_key_padding_mask=pad)[:, 0]
        if proj is not None:
            hcls = torch.nn.functional.normalize(proj(hcls), dim=-1)
        return hcls.float().cpu()

    best = best_pass(run, batches, dev, a.repeat)
    flops = sum(L * (2 * s * (4 * d * d + 2 * d * f) + 4 * s * s * d) for s in lens)
    computed = sum(len(b) * max(lens[i] for i in b) for b in batches)
    print(json.dumps({
        "tool": "pytorch", "version": torch.__version__, "arch": a.arch,
        "encoder": "BERT embeddings + nn.TransformerEncoder (post-norm, relu) + key padding mask, <cls> read-out" + (", cell_proj + normalize" if proj else ""),
        "layers": L, "hidden": d, "heads": h, "ffn": f, "max_len": a.max_len, "embedding_dim": proj_dim or d,
        "dtype": a.dtype, "device": a.device, "order": a.order, "batch": a.batch, "cells": a.cells, "seconds": best,
        "cells_per_s": a.cells / best, "useful_tflops": flops / best / 1e12,
        "mean_tokens": sum(lens) / a.cells, "padding_share": 1 - sum(lens) / computed,
    }), flush=True)


if __name__ == "__main__":
    main()
