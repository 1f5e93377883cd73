#!/usr/bin/env python3
"""PyTorch side of Novae's throughput row: the inference path of novae's GraphEncoder
(torch_geometric GAT(v2=True, edge_dim=1, act="ELU") + AttentionAggregation) written in plain
torch (the GPU machine has torch only: no torch_geometric, no numpy), at the full size of
novae/model.py's defaults (embedding 100, hidden 128, 10 layers, 8 heads, output 64), random
weights, on the graph `scfoundry __bench-encoder --arch novae --graph-out FILE` wrote (the same
synthetic slide, the same 2-hop subgraphs, batches of the same cells in the same order).

    python3 bench/novae_torch.py --graph graph.json --batch 256 --device cuda
    # here only, with torch_geometric: the plain-torch layers against GATv2Conv at a small size
    python3 bench/novae_torch.py --check

Prints one JSON line: cells/s of the encoder over all valid cells (best of --repeat passes,
after one warm-up batch), batches built on the CPU beforehand and moved to the device inside
the timed loop (scfoundry's timing does the same).
"""

import argparse
import json
import time
from collections import deque

import torch
from torch import nn
import torch.nn.functional as F


class GATv2(nn.Module):
    """torch_geometric GATv2Conv(in, out, heads, concat, edge_dim=1, share_weights=False,
    add_self_loops=True, fill_value='mean', negative_slope=0.2, bias=True), in plain torch."""

    def __init__(self, inp, out, heads, concat):
        super().__init__()
        self.h, self.c, self.concat = heads, out, concat
        self.lin_l = nn.Linear(inp, heads * out)
        self.lin_r = nn.Linear(inp, heads * out)
        self.lin_edge = nn.Linear(1, heads * out, bias=False)
        self.att = nn.Parameter(torch.randn(1, heads, out) * 0.1)
        self.bias = nn.Parameter(torch.randn(heads * out if concat else out) * 0.1)

    def forward(self, x, src, dst, attr):
        n, h, c = x.shape[0], self.h, self.c
        ones = torch.ones_like(attr[:, 0])
        cnt = torch.zeros(n, device=x.device).index_add_(0, dst, ones).clamp(min=1)
        loop_attr = torch.zeros(n, 1, device=x.device).index_add_(0, dst, attr) / cnt[:, None]
        loop = torch.arange(n, device=x.device)
        src, dst, attr = torch.cat([src, loop]), torch.cat([dst, loop]), torch.cat([attr, loop_attr])
        xl = self.lin_l(x).view(n, h, c)
        xr = self.lin_r(x).view(n, h, c)
        xj = xl[src]
        e = F.leaky_relu(xj + xr[dst] + self.lin_edge(attr).view(-1, h, c), 0.2)
        s = (e * self.att).sum(-1)
        m = torch.full((n, h), float("-inf"), device=x.device).scatter_reduce(0, dst[:, None].expand(-1, h), s, "amax", include_self=True)
        ex = (s - m[dst]).exp()
        den = torch.zeros(n, h, device=x.device).index_add_(0, dst, ex)
        alpha = ex / (den[dst] + 1e-16)
        out = torch.zeros(n, h, c, device=x.device).index_add_(0, dst, xj * alpha[..., None])
        out = out.reshape(n, h * c) if self.concat else out.mean(1)
        return out + self.bias


class Encoder(nn.Module):
    def __init__(self, emb=100, hidden=128, layers=10, out=64, heads=8):
        super().__init__()
        convs = [GATv2(emb if i == 0 else hidden, hidden // heads, heads, True) for i in range(layers - 1)]
        convs.append(GATv2(hidden, out, heads, False))
        self.convs = nn.ModuleList(convs)
        self.gate_nn = nn.Linear(out, 1)
        self.nn = nn.Linear(out, out)

    def forward(self, x, src, dst, attr, graph, n_graphs):
        for i, conv in enumerate(self.convs):
            x = conv(x, src, dst, attr)
            if i + 1 < len(self.convs):
                x = F.elu(x)
        gate = self.gate_nn(x)[:, 0]
        m = torch.full((n_graphs,), float("-inf"), device=x.device).scatter_reduce(0, graph, gate, "amax", include_self=True)
        ex = (gate - m[graph]).exp()
        den = torch.zeros(n_graphs, device=x.device).index_add_(0, graph, ex)
        alpha = ex / (den[graph] + 1e-16)
        return torch.zeros(n_graphs, x.shape[1], device=x.device).index_add_(0, graph, self.nn(x) * alpha[:, None])


def subgraphs(indptr, indices, n, local=2, view=2):
    valid, subs = [], []
    for i in range(n):
        dist = {i: 0}
        q = deque([i])
        while q:
            u = q.popleft()
            if dist[u] == max(local, view):
                continue
            for v in indices[indptr[u]:indptr[u + 1]]:
                if v not in dist:
                    dist[v] = dist[u] + 1
                    q.append(v)
        ok = any(d == view for d in dist.values())
        valid.append(ok)
        subs.append(sorted(v for v, d in dist.items() if d <= local) if ok else [])
    return valid, subs


def make_batch(cells, subs, indptr, indices, dist):
    nodes, src, dst, attr, graph = [], [], [], [], []
    for b, c in enumerate(cells):
        base = len(nodes)
        pos = {v: base + k for k, v in enumerate(subs[c])}
        for v in subs[c]:
            for k in range(indptr[v], indptr[v + 1]):
                u = indices[k]
                if u in pos:
                    src.append(pos[u])
                    dst.append(pos[v])
                    attr.append(dist[k] / 20.0)
        nodes.extend(subs[c])
        graph.extend([b] * len(subs[c]))
    return (torch.tensor(nodes), torch.tensor(src), torch.tensor(dst), torch.tensor(attr, dtype=torch.float32)[:, None], torch.tensor(graph), len(cells))


def check():
    from torch_geometric.nn import GATv2Conv
    torch.manual_seed(0)
    n, e = 30, 120
    x = torch.randn(n, 16)
    ei = torch.randint(0, n, (2, e))
    ei = ei[:, ei[0] != ei[1]]
    ei = torch.unique(torch.cat([ei, ei.flip(0)], 1), dim=1)
    attr = torch.rand(ei.shape[1], 1) * 3
    worst = 0.0
    for concat, out in [(True, 4), (False, 12)]:
        ours = GATv2(16, out, 4, concat)
        ref = GATv2Conv(16, out, heads=4, concat=concat, edge_dim=1)
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(torch.randn_like(p) * 0.3)
        missing = ours.load_state_dict(ref.state_dict(), strict=False)
        assert not missing.missing_keys, missing
        a = ours(x, ei[0], ei[1], attr)
        b = ref(x, ei, edge_attr=attr)
        worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
    print(json.dumps({"check": "plain-torch GATv2 vs torch_geometric GATv2Conv", "max_rel_err": worst}))
    assert worst < 1e-5, worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--graph")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--genes", type=int, default=500)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    if a.check:
        return check()
    g = json.load(open(a.graph))
    indptr, indices, dist, n = g["indptr"], g["indices"], g["dist"], len(g["indptr"]) - 1
    valid, subs = subgraphs(indptr, indices, n)
    order = [i for i in range(n) if valid[i]]
    batches = [make_batch(order[k:k + a.batch], subs, indptr, indices, dist) for k in range(0, len(order), a.batch)]
    torch.manual_seed(0)
    dev = torch.device(a.device)
    z = torch.randn(n, a.genes)
    genes = F.normalize(torch.randn(a.genes, 100), dim=0)
    model = Encoder().to(dev).eval()
    genes = genes.to(dev)

    def run(bt):
        nodes, src, dst, attr, graph, nb = bt
        x = z[nodes].to(dev) @ genes
        return model(x, src.to(dev), dst.to(dev), attr.to(dev), graph.to(dev), nb)

    with torch.no_grad():
        run(batches[0])
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = float("inf")
        for _ in range(max(1, a.repeat)):
            t = time.perf_counter()
            for bt in batches:
                run(bt)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
    nodes = sum(len(b[0]) for b in batches)
    print(json.dumps({"tool": "torch", "version": torch.__version__, "arch": "novae", "device": a.device, "dtype": "f32",
                      "batch": a.batch, "cells": n, "valid_cells": len(order), "mean_nodes": nodes / max(1, len(order)),
                      "seconds": best, "cells_per_s": len(order) / best}))


if __name__ == "__main__":
    main()
