#!/usr/bin/env python3
"""GenePT-w on the CPU: scfoundry vs upstream's numpy computation, on the same synthetic data.

    ~/.cache/scfoundry/venv-ci/bin/python bench/genept_cpu.py --scfoundry target/release/scfoundry

Makes (seeded) a sparse log-normalised AnnData of --cells x --genes (about 7% of entries
non-zero) and a gene table {symbol: 1536-d float64 numpy vector} covering 90% of the genes,
pickled as upstream's file is. Times:
- numpy: upstream's aorta_data_analysis.ipynb cell (lookup table loop, np.dot(X, lookup) / n on
  the dense X, as the notebook has it), after the pickle and the h5ad are loaded (load times
  reported apart);
- scfoundry: `scfoundry embed -m genept --model-dir ...` end to end (process, reading the h5ad and
  the pickle, writing the output), best of --repeat; checks the two agree within 1e-4 relative.
Prints one JSON line.
"""
import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time

import anndata
import numpy as np
import scipy.sparse as sp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scfoundry", required=True)
    ap.add_argument("--cells", type=int, default=20000)
    ap.add_argument("--genes", type=int, default=2000)
    ap.add_argument("--dim", type=int, default=1536)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    tmp = tempfile.mkdtemp(prefix="genept-bench-")
    names = [f"G{i}" for i in range(a.genes)]
    X = sp.random(a.cells, a.genes, density=0.07, format="csr", random_state=1, dtype=np.float32)
    X.data = np.log1p(X.data * 10).astype(np.float32)
    ad = anndata.AnnData(X=X)
    ad.var_names = names
    ad.obs_names = [f"c{i}" for i in range(a.cells)]
    data = os.path.join(tmp, "data.h5ad")
    ad.write_h5ad(data)
    table = {g: rng.normal(size=a.dim) for g in names if rng.random() < 0.9}
    tdir = os.path.join(tmp, "table")
    os.makedirs(tdir)
    with open(os.path.join(tdir, "GenePT_gene_embedding_ada_text.pickle"), "wb") as fp:
        pickle.dump(table, fp)

    t = time.perf_counter()
    with open(os.path.join(tdir, "GenePT_gene_embedding_ada_text.pickle"), "rb") as fp:
        emb_table = pickle.load(fp)
    load_table = time.perf_counter() - t
    t = time.perf_counter()
    sampled = anndata.read_h5ad(data)
    dense = sampled.X.toarray()
    load_data = time.perf_counter() - t
    best_np = float("inf")
    for _ in range(a.repeat):
        t = time.perf_counter()
        gene_names = list(sampled.var.index)
        lookup_embed = np.zeros(shape=(len(gene_names), a.dim))
        for i, gene in enumerate(gene_names):
            if gene in emb_table:
                lookup_embed[i, :] = emb_table[gene].flatten()
        ref = np.dot(dense, lookup_embed) / len(gene_names)
        best_np = min(best_np, time.perf_counter() - t)

    best_sf = float("inf")
    out = os.path.join(tmp, "out.h5ad")
    for _ in range(a.repeat):
        if os.path.exists(out):
            os.remove(out)
        t = time.perf_counter()
        subprocess.run([a.scfoundry, "--quiet", "embed", "-m", "genept", "-d", data, "-o", out, "--model-dir", tdir],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        best_sf = min(best_sf, time.perf_counter() - t)
    got = anndata.read_h5ad(out).obsm["X_genept"]
    rel = float(np.max(np.linalg.norm(got - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-30)))
    print(json.dumps({
        "cells": a.cells, "genes": a.genes, "dim": a.dim, "nnz": int(X.nnz), "table_genes": len(table),
        "numpy": {"version": np.__version__, "seconds": best_np, "cells_per_s": a.cells / best_np,
                  "load_table_s": load_table, "load_data_dense_s": load_data,
                  "with_loads_cells_per_s": a.cells / (best_np + load_table + load_data)},
        "scfoundry": {"seconds_end_to_end": best_sf, "cells_per_s": a.cells / best_sf},
        "max_rel_err": rel, "cpus": os.cpu_count(), "python": sys.version.split()[0],
    }))


if __name__ == "__main__":
    main()
