#!/usr/bin/env python3
"""scanpy 1.11.5 reference for scfoundry's `embed --method pca`.

    python scripts/scanpy_pca_reference.py IN.h5ad OUT.json [--n-comps 50] [--n-top-genes 2000]

Runs exactly:

    sc.pp.normalize_total(adata, target_sum=1e4)
    sc.pp.log1p(adata)
    sc.pp.highly_variable_genes(adata, flavor="seurat", n_top_genes=2000)
    sc.pp.pca(adata, n_comps=50, mask_var="highly_variable", zero_center=True,
              svd_solver="arpack", random_state=0)

and writes JSON (NaN and +-inf are written as null):

    meta               versions, shapes, dtypes, timings, threadpool info
    var_names          all genes, file order
    hvg_names          highly variable genes, in var (file) order
    hvg_indices        their 0-based indices into var_names
    means              per gene, float64: log1p(mean of expm1(logX)) as scanpy's seurat flavour
    dispersions        per gene, float64: log(var/mean) (null where var == 0)
    dispersions_norm   per gene, float64, as used for the selection (adata.var holds a float32 copy)
    mean_bin           per gene, 0-based pd.cut bin code (20 equal-width bins)
    mean_bin_edges     the 21 edges pd.cut used (first edge lowered by 0.1% of the range)
    disp_cutoff        the n_top_genes-th highest non-null dispersions_norm; hvg = disp_norm >= cutoff
    variance           pca_.explained_variance_ (n_comps), S**2/(n_cells-1)
    variance_ratio     variance / total variance of ALL hvg columns (ddof=1)
    total_variance     that denominator
    components         n_comps x n_hvg, rows = PCs, columns in hvg order (== varm['PCs'][hvg].T)
    x_pca              n_cells x n_comps (float32 values; --x-pca-rows limits the rows written)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from importlib.metadata import version
from pathlib import Path

import numpy as np

warnings.filterwarnings("ignore", category=FutureWarning)


def clean(x):
    """Recursively turn numpy things into JSON-able Python with NaN/inf -> None."""
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    if isinstance(x, np.ndarray):
        if x.dtype.kind in "fc":
            arr = x.astype(np.float64)
            out = arr.tolist()
            if not np.all(np.isfinite(arr)):
                return clean(out)
            return out
        return x.tolist()
    if isinstance(x, (np.floating, float)):
        x = float(x)
        return x if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--n-comps", type=int, default=50)
    p.add_argument("--n-top-genes", type=int, default=2000)
    p.add_argument("--x-pca-rows", type=int, default=None,
                   help="write only the first N rows of X_pca (default: all)")
    args = p.parse_args()

    t0 = time.perf_counter()
    import anndata as ad
    import pandas as pd
    import scanpy as sc
    import scipy.sparse as sp
    t_import = time.perf_counter() - t0

    t = time.perf_counter()
    adata = ad.read_h5ad(args.input)
    t_read = time.perf_counter() - t
    x_in_type = type(adata.X).__name__
    x_in_dtype = str(adata.X.dtype)

    t = time.perf_counter()
    sc.pp.normalize_total(adata, target_sum=1e4)
    sc.pp.log1p(adata)
    x_log_dtype = str(adata.X.dtype)
    # Same call with inplace=False first, only to get the float64 dispersions_norm
    # (inplace=True stores a float32 copy in adata.var). It does not touch adata.
    df = sc.pp.highly_variable_genes(adata, flavor="seurat", n_top_genes=args.n_top_genes, inplace=False)
    sc.pp.highly_variable_genes(adata, flavor="seurat", n_top_genes=args.n_top_genes)
    t_hvg = time.perf_counter() - t
    hv = adata.var["highly_variable"].to_numpy()
    assert np.array_equal(hv, df["highly_variable"].to_numpy())

    t = time.perf_counter()
    sc.pp.pca(adata, n_comps=args.n_comps, mask_var="highly_variable", zero_center=True,
              svd_solver="arpack", random_state=0)
    t_pca = time.perf_counter() - t

    hvg_idx = np.flatnonzero(hv)
    comps = np.asarray(adata.varm["PCs"])[hvg_idx].T  # n_comps x n_hvg
    x_pca = np.asarray(adata.obsm["X_pca"])
    if args.x_pca_rows is not None:
        x_pca = x_pca[: args.x_pca_rows]

    # Recompute what pd.cut did, for the record.
    means = df["means"].to_numpy(dtype=np.float64)
    # retbins gives the unrounded edges (the Interval labels are rounded to 3 digits).
    mean_bin, edges = pd.cut(means, bins=20, retbins=True)
    dn = df["dispersions_norm"].to_numpy(dtype=np.float64)
    finite = dn[~np.isnan(dn)]
    n_top = min(args.n_top_genes, adata.n_vars, finite.size)
    cutoff = np.sort(finite)[::-1][n_top - 1]

    Xh = adata.X[:, hvg_idx]
    if sp.issparse(Xh):
        m = np.asarray(Xh.mean(axis=0, dtype=np.float64)).ravel()
        m2 = np.asarray(Xh.multiply(Xh).mean(axis=0, dtype=np.float64)).ravel()
    else:
        m = Xh.mean(axis=0, dtype=np.float64)
        m2 = (Xh.astype(np.float64) ** 2).mean(axis=0)
    n = adata.n_obs
    total_var = float(((m2 - m * m) * n / (n - 1)).sum())

    try:
        from threadpoolctl import threadpool_info
        pools = [{k: d.get(k) for k in ("internal_api", "prefix", "version", "architecture", "num_threads")}
                 for d in threadpool_info()]
    except Exception:  # pragma: no cover
        pools = []

    out = {
        "meta": {
            "input": str(args.input),
            "scanpy": version("scanpy"), "anndata": version("anndata"), "numpy": version("numpy"),
            "scipy": version("scipy"), "scikit-learn": version("scikit-learn"), "pandas": version("pandas"),
            "python": sys.version.split()[0],
            "n_cells": int(adata.n_obs), "n_genes": int(adata.n_vars), "n_hvg": int(hv.sum()),
            "n_comps": args.n_comps, "n_top_genes": args.n_top_genes,
            "x_input_type": x_in_type, "x_input_dtype": x_in_dtype, "x_log1p_dtype": x_log_dtype,
            "x_pca_dtype": str(adata.obsm["X_pca"].dtype), "components_dtype": str(adata.varm["PCs"].dtype),
            "recipe": ("normalize_total(target_sum=1e4); log1p; highly_variable_genes(flavor='seurat', "
                       f"n_top_genes={args.n_top_genes}); pca(n_comps={args.n_comps}, mask_var='highly_variable', "
                       "zero_center=True, svd_solver='arpack', random_state=0)"),
            "seconds": {"import": t_import, "read": t_read, "normalize_log1p_hvg": t_hvg, "pca": t_pca},
            "threadpools": pools,
        },
        "var_names": adata.var_names.astype(str).tolist(),
        "hvg_names": adata.var_names[hvg_idx].astype(str).tolist(),
        "hvg_indices": hvg_idx,
        "means": means,
        "dispersions": df["dispersions"].to_numpy(dtype=np.float64),
        "dispersions_norm": dn,
        "mean_bin": np.asarray(mean_bin.codes, dtype=np.int64),
        "mean_bin_edges": edges,
        "disp_cutoff": cutoff,
        "variance": np.asarray(adata.uns["pca"]["variance"], dtype=np.float64),
        "variance_ratio": np.asarray(adata.uns["pca"]["variance_ratio"], dtype=np.float64),
        "total_variance": total_var,
        "components": comps,
        "x_pca": x_pca,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(clean(out), f, allow_nan=False)
    vr = out["variance_ratio"][:5]
    print(f"{args.input}: {adata.n_obs} cells x {adata.n_vars} genes, {int(hv.sum())} HVGs, "
          f"variance_ratio[:5] = {np.round(vr, 5).tolist()}, pca {t_pca:.2f}s")


if __name__ == "__main__":
    main()
