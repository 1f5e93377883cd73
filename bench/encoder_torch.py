#!/usr/bin/env python3
"""PyTorch side of the encoder throughput comparison (bench/encoder_throughput.sh).

Runs an encoder of the same shape as `scfoundry __bench-encoder` the way upstream scFM code
runs one: nn.TransformerEncoder (post-norm, GELU, batch_first), random weights, eval mode,
torch.inference_mode, batches padded to their longest cell with a key-padding mask, in the
order the cells come (`--order file`) or sorted by length (`--order sorted`). Cells take their
token counts from the same lengths file, cycling, capped at --max-len. FLOPs count only real
tokens: L x (2 s (4 d^2 + 2 d f) + 4 s^2 d) per cell. Prints one JSON line.
"""
import argparse
import json
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    for k in ["layers", "hidden", "heads", "ffn", "max_len"]:
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, required=True)
    ap.add_argument("--lengths", required=True)
    ap.add_argument("--cells", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--order", default="file")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--activation", default="gelu", choices=["gelu", "relu"], help="feed-forward activation (relu for all four encoder models: Geneformer's config.json, scGPT and UCE)")
    ap.add_argument("--pad-to", type=int, default=0, help="pad every batch to this length (UCE pads every cell to 1536 by design)")
    a = ap.parse_args()
    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    pool = [int(l) for l in open(a.lengths) if l.strip() and int(l) > 0]
    lens = [min(pool[i % len(pool)], a.max_len) for i in range(a.cells)]
    order = list(range(a.cells))
    if a.order == "sorted":
        order.sort(key=lambda i: -lens[i])
    dev = torch.device("cuda")
    layer = torch.nn.TransformerEncoderLayer(a.hidden, a.heads, a.ffn, dropout=0.0, activation=a.activation, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, a.layers, enable_nested_tensor=False).to(dev, dtype).eval()
    emb = torch.nn.Embedding(25426, a.hidden).to(dev, dtype)
    batches = [order[i:i + a.batch] for i in range(0, len(order), a.batch)]

    def run(cells):
        n, length = len(cells), max(max(lens[i] for i in cells), a.pad_to)
        ids = torch.zeros(n, length, dtype=torch.long)
        pad = torch.ones(n, length, dtype=torch.bool)
        for r, i in enumerate(cells):
            ids[r, :lens[i]] = torch.arange(lens[i]) % 25000 + 5
            pad[r, :lens[i]] = False
        ids, pad = ids.to(dev), pad.to(dev)
        h = enc(emb(ids), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(2).to(dtype)
        return (h * keep).sum(1).float().cpu()

    with torch.inference_mode():
        run(batches[0])
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(max(1, a.repeat)):
            t = time.perf_counter()
            for b in batches:
                run(b)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
    L, d, f = a.layers, a.hidden, a.ffn
    flops = sum(L * (2 * s * (4 * d * d + 2 * d * f) + 4 * s * s * d) for s in lens)
    computed = sum(len(b) * max(max(lens[i] for i in b), a.pad_to) for b in batches)
    print(json.dumps({
        "tool": "pytorch", "version": torch.__version__, "encoder": "nn.TransformerEncoder + key padding mask",
        "layers": L, "hidden": d, "heads": a.heads, "ffn": f, "max_len": a.max_len, "activation": a.activation, "dtype": a.dtype,
        "order": a.order, "batch": a.batch, "cells": a.cells, "seconds": best,
        "cells_per_s": a.cells / best, "useful_tflops": flops / best / 1e12,
        "mean_tokens": sum(lens) / a.cells, "padding_share": 1 - sum(lens) / computed,
    }), flush=True)


if __name__ == "__main__":
    main()
