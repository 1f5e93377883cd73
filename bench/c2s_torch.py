#!/usr/bin/env python3
"""PyTorch side of the Cell2Sentence throughput comparison (torch only: no transformers).

A GPT-NeoX (Pythia) causal LM written out in torch the way transformers' GPTNeoXModel runs it
(modeling_gpt_neox.py): embed_in; per layer input_layernorm, fused query_key_value laid out per
head, rotary embeddings (rotate-half) on the first rotary_pct of each head's dims,
scaled_dot_product_attention (transformers' default "sdpa" path), dense; MLP dense_h_to_4h, GELU,
dense_4h_to_h on post_attention_layernorm; parallel residual; final_layer_norm. Random weights,
eval mode, torch.inference_mode.

Batches are run as upstream Cell2Sentence runs them (csmodel.embed_cells_batched): padded on the
LEFT to the batch's longest prompt, an attention mask that hides the padding keys (with the
causal mask), positions 0..T-1 for every row, and the embedding the mean of the last hidden
state over all T rows (`--upstream-mean`, default) or over the real tokens only
(`--no-upstream-mean`). Cells come in file order (upstream's) or sorted by length (`--order
sorted`). Token counts come from the same lengths file as `scfoundry __bench-encoder --arch
c2s-160m`, cycling, capped at --max-len. FLOPs count only real tokens, as scfoundry does:
L x (2 s (4 d^2 + 2 d f) + 4 s^2 d) per cell. Prints one JSON line.

    python3 bench/c2s_torch.py --arch c2s-160m --lengths FILE --cells 2048 --batch 8 --dtype bf16
"""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

PRESETS = {  # EleutherAI/pythia-160m and pythia-410m config.json
    "c2s-160m": dict(layers=12, hidden=768, heads=12, ffn=3072),
    "c2s-410m": dict(layers=24, hidden=1024, heads=16, ffn=4096),
}
VOCAB = 50304
ROTARY_PCT = 0.25
BASE = 10000.0
EPS = 1e-5


class Layer(torch.nn.Module):
    def __init__(self, d, h, f):
        super().__init__()
        self.h = h
        self.input_layernorm = torch.nn.LayerNorm(d, eps=EPS)
        self.post_attention_layernorm = torch.nn.LayerNorm(d, eps=EPS)
        self.query_key_value = torch.nn.Linear(d, 3 * d)
        self.dense = torch.nn.Linear(d, d)
        self.dense_h_to_4h = torch.nn.Linear(d, f)
        self.dense_4h_to_h = torch.nn.Linear(f, d)

    def forward(self, x, cos, sin, mask):
        b, t, d = x.shape
        hs = d // self.h
        rot = cos.shape[-1]
        qkv = self.query_key_value(self.input_layernorm(x)).view(b, t, self.h, 3 * hs).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)

        def rope(z):
            zr, zp = z[..., :rot], z[..., rot:]
            z1, z2 = zr[..., : rot // 2], zr[..., rot // 2:]
            return torch.cat([zr * cos + torch.cat([-z2, z1], dim=-1) * sin, zp], dim=-1)

        q, k = rope(q), rope(k)
        if mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(hs))
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(hs))
        a = self.dense(o.transpose(1, 2).reshape(b, t, d))
        m = self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(self.post_attention_layernorm(x))))
        return x + a + m


class GptNeoX(torch.nn.Module):
    def __init__(self, layers, d, h, f):
        super().__init__()
        self.embed_in = torch.nn.Embedding(VOCAB, d)
        self.layers = torch.nn.ModuleList([Layer(d, h, f) for _ in range(layers)])
        self.final_layer_norm = torch.nn.LayerNorm(d, eps=EPS)
        hs = d // h
        rot = int(hs * ROTARY_PCT)
        self.register_buffer("inv_freq", 1.0 / (BASE ** (torch.arange(0, rot, 2, dtype=torch.float) / rot)), persistent=False)

    def forward(self, ids, mask):
        t = ids.shape[1]
        pos = torch.arange(t, device=ids.device, dtype=torch.float)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        x = self.embed_in(ids)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for l in self.layers:
            x = l(x, cos, sin, mask)
        return self.final_layer_norm(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="c2s-160m", choices=sorted(PRESETS))
    ap.add_argument("--lengths", required=True)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--cells", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--order", default="file")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--upstream-mean", action=argparse.BooleanOptionalAction, default=True)
    a = ap.parse_args()
    p = PRESETS[a.arch]
    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    pool = [int(l) for l in open(a.lengths) if l.strip() and int(l) > 0]
    lens = [min(pool[i % len(pool)], a.max_len) for i in range(a.cells)]
    order = list(range(a.cells))
    if a.order == "sorted":
        order.sort(key=lambda i: -lens[i])
    dev = torch.device(a.device)
    model = GptNeoX(p["layers"], p["hidden"], p["heads"], p["ffn"]).to(dev, dtype).eval()
    with torch.no_grad():
        for prm in model.parameters():
            prm.normal_(0.0, 0.02)
    batches = [order[i:i + a.batch] for i in range(0, len(order), a.batch)]

    def run(cells):
        n, t = len(cells), max(lens[i] for i in cells)
        ids = torch.zeros(n, t, dtype=torch.long)
        keep = torch.zeros(n, t, dtype=torch.bool)
        for r, i in enumerate(cells):
            s = lens[i]
            ids[r, t - s:] = (torch.arange(s) * 104729 + i * 7919) % (VOCAB - 2) + 2
            keep[r, t - s:] = True
        ids, keep = ids.to(dev), keep.to(dev)
        if bool(keep.all()):
            mask = None
        else:
            causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
            # padding keys hidden; a padding query keeps its own position so no row is empty
            mask = (causal[None] & keep[:, None, :]) | torch.eye(t, dtype=torch.bool, device=dev)[None]
            mask = mask[:, None]
        h = model(ids, mask)
        if a.upstream_mean:
            return h.mean(1).float().cpu()
        w = keep.unsqueeze(2).to(h.dtype)
        return ((h * w).sum(1) / w.sum(1)).float().cpu()

    with torch.inference_mode():
        run(batches[0])
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = float("inf")
        for _ in range(max(1, a.repeat)):
            t0 = time.perf_counter()
            for b in batches:
                run(b)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
    L, d, f = p["layers"], p["hidden"], p["ffn"]
    flops = sum(L * (2 * s * (4 * d * d + 2 * d * f) + 4 * s * s * d) for s in lens)
    computed = sum(len(b) * max(lens[i] for i in b) for b in batches)
    print(json.dumps({
        "tool": "pytorch", "version": torch.__version__, "encoder": "GPT-NeoX in torch (sdpa), left padding as upstream",
        "arch": a.arch, "layers": L, "hidden": d, "heads": p["heads"], "ffn": f, "max_len": a.max_len,
        "dtype": a.dtype, "device": a.device, "order": a.order, "batch": a.batch, "cells": a.cells, "seconds": best,
        "cells_per_s": a.cells / best, "useful_tflops": flops / best / 1e12,
        "mean_tokens": sum(lens) / a.cells, "padding_share": 1 - sum(lens) / computed,
    }), flush=True)


if __name__ == "__main__":
    main()
