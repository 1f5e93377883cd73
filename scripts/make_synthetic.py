#!/usr/bin/env python3
"""Seeded synthetic single-cell counts as an uncompressed .h5ad (SYNTHETIC data).

    python scripts/make_synthetic.py --cells 100000 --genes 3000 --out /tmp/x.h5ad \
        [--seed 0] [--types 10] [--batches 3] [--depth 290] [--check]

Model (negative binomial = Poisson-Gamma, sampled by inverse CDF so that only the ~6% non-zero
entries cost more than one uniform draw):

    mu_g            baseline gene means, log-normal (sigma 1.7), scaled so that a median cell
                    has --depth counts (default 290) over all genes
    type effect     each cell type up-regulates its own 6% of genes (log fold change
                    N(1.5, 0.4)) and all genes get a small type-specific jitter N(0, 0.15)
    batch effect    multiplicative per gene and batch: exp(N(0, 1) x --batch-sigma) (default 0.3);
                    --batch-depth F0,F1,.. also scales every cell of batch b by F_b (capture
                    efficiency / sequencing depth; default none: every batch at --depth)
    library size    per cell, log-normal exp(N(0, 0.35))
    counts          NB(mean = lib_c * mu_g * type_tg * batch_bg, dispersion theta = 0.6)

With 3000 genes this gives ~6% non-zero entries, a median of ~170 genes and ~290 counts per
cell; `--genes 6000 --depth 3100` gives ~1,100 (18%). Every block of 4096 cells has its own
seeded stream, so a file of N cells is the first N cells of any larger file with the same other arguments.

Written directly with h5py in anndata's on-disk encoding, in bounded memory (one block at a
time; non-zeros go to temporary files beside --out, then into contiguous datasets):
root encoding-type=anndata 0.1.0; X csr_matrix 0.1.0 (shape attr; data float32, indices
int32, indptr int32, or int64 when nnz >= 2**31); obs/var dataframe 0.2.0 (_index,
column-order); obs cell_type and batch categorical 0.2.0 (int8 codes, UTF-8 categories);
empty layers/obsm/obsp/varm/varp/uns dict groups. --check reads it back with anndata.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import h5py
import numpy as np

BLOCK = 4096          # cells per seeded stream (fixed, so a smaller file is a prefix of a larger one)
THETA = 1.0           # NB inverse dispersion (size)
SIGMA_MU = 1.7        # log-normal spread of baseline gene means
TARGET_COUNTS = 290.0 # default --depth: expected counts of a cell with library factor 1 (the median cell)
LIB_SIGMA = 0.35      # log-normal spread of library size
LIB_STEP = 0.05       # library factor is quantised to exp(k * LIB_STEP): lets P(0) be tabulated
LIB_K = int(np.ceil(4 * LIB_SIGMA / LIB_STEP))
BIG_MEAN = 4.0        # non-zeros with mean above this are drawn by rejection, not inverse CDF
STR = h5py.string_dtype("utf-8")


def model(seed: int, n_genes: int, n_types: int, n_batches: int, depth: float = TARGET_COUNTS,
          batch_sigma: float = 0.3, batch_depth: list[float] | None = None):
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xA11CE]))
    mu = np.exp(rng.normal(0.0, SIGMA_MU, size=n_genes))
    type_fc = np.exp(rng.normal(0.0, 0.15, size=(n_types, n_genes)))
    n_mark = max(1, int(round(0.06 * n_genes)))
    for t in range(n_types):
        idx = rng.choice(n_genes, size=n_mark, replace=False)
        type_fc[t, idx] *= np.exp(rng.normal(1.5, 0.4, size=n_mark))
    batch_fc = np.exp(rng.normal(0.0, 1.0, size=(n_batches, n_genes)) * batch_sigma)
    type_p = rng.dirichlet(np.full(n_types, 3.0))          # unequal cell-type proportions
    # mean table, row = type * n_batches + batch; each row scaled to `depth` counts in total
    table = (mu[None, None, :] * type_fc[:, None, :] * batch_fc[None, :, :]).reshape(n_types * n_batches, n_genes)
    table *= depth / table.sum(axis=1, keepdims=True)
    if batch_depth is not None:                             # row = type * n_batches + batch
        table *= np.tile(np.asarray(batch_depth, dtype=np.float64), n_types)[:, None]
    # P(count == 0) for every (row, library level): NB(theta) zero probability
    lib_levels = np.exp(np.arange(-LIB_K, LIB_K + 1) * LIB_STEP)
    m_all = table[:, None, :] * lib_levels[None, :, None]
    p0 = (THETA / (THETA + m_all)) ** THETA
    return (table.astype(np.float64), p0.reshape(-1, n_genes).astype(np.float32),
            lib_levels, type_p)


def sample_block(mdl, n_types, n_batches, n_cells, seed, block_id):
    table, p0tab, lib_levels, type_p = mdl
    n_lib = lib_levels.size
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xB10C, block_id]))
    ct = rng.choice(n_types, size=n_cells, p=type_p).astype(np.int8)
    bt = rng.integers(0, n_batches, size=n_cells).astype(np.int8)
    lk = np.clip(np.rint(rng.normal(0.0, LIB_SIGMA, size=n_cells) / LIB_STEP), -LIB_K, LIB_K).astype(np.int64) + LIB_K
    row = ct.astype(np.int64) * n_batches + bt
    u = rng.random(size=(n_cells, table.shape[1]), dtype=np.float32)
    nz_r, nz_c = np.nonzero(u > p0tab[row * n_lib + lk])
    del u
    m = table[row[nz_r], nz_c] * lib_levels[lk[nz_r]]          # float64 means of the non-zeros
    q = m / (THETA + m)
    k = np.zeros(m.size, dtype=np.float64)

    # small means: inverse CDF of NB conditioned on > 0 (a few steps each)
    small = np.flatnonzero(m <= BIG_MEAN)
    p0s = (1.0 - q[small]) ** THETA
    uu = p0s + rng.random(small.size) * (1.0 - p0s)             # uniform on (P(0), 1)
    pmf, cdf, qq, kk = p0s.copy(), p0s.copy(), q[small], np.zeros(small.size)
    act = np.arange(small.size)
    while act.size:
        pmf[act] *= (kk[act] + THETA) / (kk[act] + 1.0) * qq[act]
        kk[act] += 1.0
        cdf[act] += pmf[act]
        act = act[(uu[act] > cdf[act]) & (kk[act] < 10000)]
    k[small] = kk

    # large means: Poisson-Gamma draws, redrawn while zero (P(0) <= 0.2 here)
    big = np.flatnonzero(m > BIG_MEAN)
    todo = big
    while todo.size:
        lam = rng.gamma(THETA, m[todo] / THETA)
        x = rng.poisson(lam).astype(np.float64)
        k[todo] = x
        todo = todo[x == 0]

    indptr = np.zeros(n_cells + 1, dtype=np.int64)
    np.cumsum(np.bincount(nz_r, minlength=n_cells), out=indptr[1:])
    return ct, bt, k.astype(np.float32), nz_c.astype(np.int32), indptr


def write_str_array(g, name, values):
    d = g.create_dataset(name, data=np.asarray(values, dtype=object), dtype=STR)
    d.attrs["encoding-type"] = "string-array"
    d.attrs["encoding-version"] = "0.2.0"


def write_categorical(g, name, codes, categories):
    c = g.create_group(name)
    c.attrs["encoding-type"] = "categorical"
    c.attrs["encoding-version"] = "0.2.0"
    c.attrs["ordered"] = False
    d = c.create_dataset("codes", data=codes)
    d.attrs["encoding-type"] = "array"
    d.attrs["encoding-version"] = "0.2.0"
    write_str_array(c, "categories", categories)


def dataframe_group(f, name, index, columns):
    g = f.create_group(name)
    g.attrs["encoding-type"] = "dataframe"
    g.attrs["encoding-version"] = "0.2.0"
    g.attrs["_index"] = "_index"
    if columns:
        g.attrs["column-order"] = np.array(columns, dtype=object)
    else:
        g.attrs["column-order"] = np.array([], dtype=np.float64)   # what anndata writes
    write_str_array(g, "_index", index)
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", type=int, required=True)
    ap.add_argument("--genes", type=int, default=3000)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--types", type=int, default=10)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--depth", type=float, default=TARGET_COUNTS,
                    help="expected counts of the median cell (default %(default)s)")
    ap.add_argument("--batch-sigma", type=float, default=0.3,
                    help="spread of the batch effect: gene g in batch b is scaled by exp(N(0, 1) x this)")
    ap.add_argument("--batch-depth", default=None,
                    help="comma-separated depth factor of each batch (e.g. 1,0.5,0.25): batch b's "
                         "cells have F_b x --depth expected counts (default: all 1)")
    ap.add_argument("--model-seed", type=int, default=None,
                    help="seed of the gene means, cell-type and batch effects (default --seed); "
                         "files of one --model-seed and other --seed values are other cells of the same genes")
    ap.add_argument("--check", action="store_true", help="read back with anndata and print stats")
    args = ap.parse_args()
    assert args.types <= 127 and args.batches <= 127
    assert args.depth > 0, "--depth must be positive"
    batch_depth = None
    if args.batch_depth is not None:
        batch_depth = [float(v) for v in args.batch_depth.split(",")]
        assert len(batch_depth) == args.batches and all(v > 0 for v in batch_depth), \
            f"--batch-depth needs {args.batches} positive factors, one a batch"

    t0 = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    mdl = model(args.seed if args.model_seed is None else args.model_seed, args.genes, args.types,
                args.batches, args.depth, args.batch_sigma, batch_depth)

    tmp_data = out.with_name(out.name + ".tmp_data")
    tmp_idx = out.with_name(out.name + ".tmp_indices")
    ct_all = np.empty(args.cells, dtype=np.int8)
    bt_all = np.empty(args.cells, dtype=np.int8)
    indptr = np.zeros(args.cells + 1, dtype=np.int64)
    nnz = 0
    try:
        with open(tmp_data, "wb") as fd, open(tmp_idx, "wb") as fi:
            for start in range(0, args.cells, BLOCK):
                n = min(BLOCK, args.cells - start)
                ct, bt, data, idx, ip = sample_block(mdl, args.types, args.batches, n,
                                                     args.seed, start // BLOCK)
                ct_all[start:start + n] = ct
                bt_all[start:start + n] = bt
                indptr[start + 1:start + n + 1] = nnz + ip[1:]
                nnz += data.size
                data.tofile(fd)
                idx.tofile(fi)
        t_gen = time.perf_counter() - t0

        idx_dtype = np.int64 if nnz >= 2**31 else np.int32
        tmp_out = out.with_name(out.name + ".partial")
        with h5py.File(tmp_out, "w") as f:
            f.attrs["encoding-type"] = "anndata"
            f.attrs["encoding-version"] = "0.1.0"
            X = f.create_group("X")
            X.attrs["encoding-type"] = "csr_matrix"
            X.attrs["encoding-version"] = "0.1.0"
            X.attrs["shape"] = np.array([args.cells, args.genes], dtype=np.int64)
            dd = X.create_dataset("data", shape=(nnz,), dtype=np.float32)
            di = X.create_dataset("indices", shape=(nnz,), dtype=idx_dtype)
            X.create_dataset("indptr", data=indptr.astype(idx_dtype))
            step = 1 << 24
            with open(tmp_data, "rb") as fd, open(tmp_idx, "rb") as fi:
                for s in range(0, nnz, step):
                    e = min(nnz, s + step)
                    dd[s:e] = np.fromfile(fd, dtype=np.float32, count=e - s)
                    di[s:e] = np.fromfile(fi, dtype=np.int32, count=e - s).astype(idx_dtype, copy=False)

            obs = dataframe_group(f, "obs", [f"cell_{i}" for i in range(args.cells)], ["cell_type", "batch"])
            write_categorical(obs, "cell_type", ct_all, [f"type_{t}" for t in range(args.types)])
            write_categorical(obs, "batch", bt_all, [f"batch_{b}" for b in range(args.batches)])
            dataframe_group(f, "var", [f"gene_{g}" for g in range(args.genes)], [])
            for name in ("layers", "obsm", "obsp", "varm", "varp", "uns"):
                g = f.create_group(name)
                g.attrs["encoding-type"] = "dict"
                g.attrs["encoding-version"] = "0.1.0"
        os.replace(tmp_out, out)
    finally:
        for p in (tmp_data, tmp_idx):
            if p.exists():
                p.unlink()
    t_all = time.perf_counter() - t0
    counts = np.diff(indptr)
    print(f"wrote {out}: {args.cells} cells x {args.genes} genes, nnz {nnz} "
          f"({nnz / (args.cells * args.genes):.2%}), median genes/cell {np.median(counts):.0f}, "
          f"{out.stat().st_size / 1e6:.0f} MB, {t_gen:.1f}s sampling, {t_all:.1f}s total [SYNTHETIC]")

    if args.check:
        import anndata as ad
        a = ad.read_h5ad(out)
        tot = np.asarray(a.X.sum(axis=1)).ravel()
        print(a)
        print(f"check: X {type(a.X).__name__} {a.X.dtype}, median counts/cell {np.median(tot):.0f}, "
              f"median genes/cell {np.median(a.X.getnnz(axis=1)):.0f}, "
              f"cell types {a.obs['cell_type'].value_counts().sort_index().tolist()}, "
              f"batches {a.obs['batch'].value_counts().sort_index().tolist()}")


if __name__ == "__main__":
    main()
