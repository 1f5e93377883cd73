#!/usr/bin/env python3
"""Build scfoundry's small REAL demo datasets under demo/.

Sources (both BSD-3, shipped inside PyPI wheels, so this works offline with
only PyPI reachable):

* scirpy 0.22.5 wheel: scirpy/tests/data/wu2020_200_v0_11.h5ad
  -> demo/wu2020_tcells.h5ad  (200 T cells x 30,727 genes, raw counts,
     labels + real batches)
* scanpy 1.11.5 wheel: scanpy/datasets/10x_pbmc68k_reduced.h5ad
  -> demo/pbmc68k_counts.h5ad (700 PBMCs x 765 genes, integer counts
     reconstructed from the log1p-normalised raw.X, 10 cell types)

Usage:
    python scripts/make_demo.py [--out demo] [--scirpy-wheel W] [--scanpy-wheel W]

Without the wheel arguments the wheels are fetched with
`pip download --no-deps` into a temporary folder.  Run with the CI venv
(anndata 0.12.x); output is deterministic.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

warnings.filterwarnings("ignore", category=FutureWarning)

SCIRPY = ("scirpy", "0.22.5", "scirpy/tests/data/wu2020_200_v0_11.h5ad")
SCANPY = ("scanpy", "1.11.5", "scanpy/datasets/10x_pbmc68k_reduced.h5ad")


def fetch_wheel(pkg: str, ver: str, dest: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{pkg}=={ver}", "-d", str(dest)],
        check=True,
    )
    whls = sorted(dest.glob(f"{pkg}-{ver}-*.whl"))
    if not whls:
        raise SystemExit(f"no wheel for {pkg}=={ver} in {dest}")
    return whls[0]


def extract(wheel: Path, member: str, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        z.extract(member, dest)
    return dest / member


def check_counts_matrix(X: sp.csr_matrix, name: str) -> None:
    assert sp.isspmatrix_csr(X) or isinstance(X, sp.csr_array), name
    assert X.dtype == np.float32, (name, X.dtype)
    assert X.has_sorted_indices, name
    assert np.all(X.data == np.round(X.data)), f"{name}: non-integer counts"
    assert X.data.min() > 0, f"{name}: explicit zeros or negatives"


def make_wu2020(src: Path, out: Path) -> None:
    a = ad.read_h5ad(src)
    X = sp.csr_matrix(a.X, dtype=np.float32)
    X.sum_duplicates()
    X.sort_indices()
    X.eliminate_zeros()

    obs = pd.DataFrame(index=a.obs_names.astype(str))
    obs.index.name = None
    obs["cell_type"] = pd.Categorical(a.obs["cluster_orig"].astype(str))
    # batch = patient: 14 patients, 12 of them with >= 7 cell types each.
    # (sample has 30 levels, many with 1-3 cells.)
    obs["batch"] = pd.Categorical(a.obs["patient"].astype(str))
    for c in ["cluster_orig", "patient", "sample", "source"]:
        obs[c] = pd.Categorical(a.obs[c].astype(str))
    # The original file has its own 'batch' column: a 0-31 code of `sample`.
    obs["batch_orig"] = pd.Categorical(a.obs["batch"].astype(str))

    # var names ARE gene symbols already (e.g. CD40, LOC100505874); the
    # gene_ids column holds NCBI GeneIDs ("GeneID:100505874").
    var = pd.DataFrame(index=a.var_names.astype(str))
    var.index.name = None
    var["gene_ids"] = a.var["gene_ids"].astype(str).values
    var["feature_types"] = pd.Categorical(a.var["feature_types"].astype(str))
    assert var.index.is_unique

    out_ad = ad.AnnData(X=X, obs=obs, var=var)
    out_ad.obsm["X_umap_orig"] = np.asarray(a.obsm["X_umap_orig"], dtype=np.float64)
    out_ad.uns["source"] = f"{SCIRPY[0]} {SCIRPY[1]} wheel: {SCIRPY[2]} (BSD-3-Clause)"
    check_counts_matrix(out_ad.X, "wu2020")
    out_ad.write_h5ad(out, compression=None)
    print(f"wrote {out}: {out_ad.shape}, nnz={X.nnz}, {out.stat().st_size/1e6:.2f} MB")


def make_pbmc68k(src: Path, out: Path) -> None:
    a = ad.read_h5ad(src)
    R = a.raw.X
    R = sp.csr_matrix(R, dtype=np.float32)
    n_counts = a.obs["n_counts"].to_numpy(dtype=np.float64)
    # raw.X = round(log1p(counts / n_counts * 1e4), 3), normalised over the
    # full gene set before subsetting to these 765 genes. Invert it:
    rows = np.repeat(np.arange(R.shape[0]), np.diff(R.indptr))
    vals = np.expm1(R.data.astype(np.float64)) * n_counts[rows] / 1e4
    ints = np.round(vals)
    dev = np.abs(vals - ints)
    frac_ok = float((dev < 1e-2).mean())
    rel = float((dev / vals).max())
    print(f"pbmc68k reconstruction: {frac_ok:.4%} of non-zeros within 1e-2 of an integer, "
          f"max rel dev {rel:.2e}, max abs dev {dev.max():.3f}, max count {ints.max():.0f}")
    # The only error source is raw.X's rounding to 3 decimals: |d log| <= 5e-4,
    # i.e. relative error <= ~5e-4, so the rounding is unambiguous while
    # count * 5e-4 < 0.5.
    assert rel < 1e-3 and ints.min() >= 1 and ints.max() * 1e-3 < 0.5
    # Round trip: re-normalising the integers reproduces raw.X to its 3 decimals.
    back = np.log1p(ints / n_counts[rows] * 1e4)
    assert np.abs(back - R.data).max() <= 5.01e-4
    X = sp.csr_matrix((ints.astype(np.float32), R.indices.copy(), R.indptr.copy()), shape=R.shape)
    X.sort_indices()
    X.eliminate_zeros()

    obs = pd.DataFrame(index=a.obs_names.astype(str))
    obs.index.name = None
    obs["cell_type"] = pd.Categorical(a.obs["bulk_labels"].astype(str))
    obs["bulk_labels"] = pd.Categorical(a.obs["bulk_labels"].astype(str))
    obs["louvain"] = pd.Categorical(a.obs["louvain"].astype(str))
    obs["phase"] = pd.Categorical(a.obs["phase"].astype(str))
    # totals over the ORIGINAL ~32k-gene matrix, not over these 765 genes:
    obs["n_counts_allgenes"] = a.obs["n_counts"].to_numpy(dtype=np.float32)
    obs["n_genes_allgenes"] = a.obs["n_genes"].to_numpy(dtype=np.int64)
    obs["percent_mito"] = a.obs["percent_mito"].to_numpy(dtype=np.float32)

    var = pd.DataFrame(index=a.raw.var_names.astype(str))
    var.index.name = None
    assert var.index.is_unique

    out_ad = ad.AnnData(X=X, obs=obs, var=var)
    out_ad.uns["source"] = (f"{SCANPY[0]} {SCANPY[1]} wheel: {SCANPY[2]} (BSD-3-Clause); "
                            "X = round(expm1(raw.X) * n_counts / 1e4)")
    check_counts_matrix(out_ad.X, "pbmc68k")
    out_ad.write_h5ad(out, compression=None)
    print(f"wrote {out}: {out_ad.shape}, nnz={X.nnz}, {out.stat().st_size/1e6:.2f} MB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="demo")
    p.add_argument("--scirpy-wheel")
    p.add_argument("--scanpy-wheel")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        sw = Path(args.scirpy_wheel) if args.scirpy_wheel else fetch_wheel(SCIRPY[0], SCIRPY[1], td)
        cw = Path(args.scanpy_wheel) if args.scanpy_wheel else fetch_wheel(SCANPY[0], SCANPY[1], td)
        make_wu2020(extract(sw, SCIRPY[2], td), out / "wu2020_tcells.h5ad")
        make_pbmc68k(extract(cw, SCANPY[2], td), out / "pbmc68k_counts.h5ad")


if __name__ == "__main__":
    main()
