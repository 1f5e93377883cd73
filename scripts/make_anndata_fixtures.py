#!/usr/bin/env python3
"""Write small deterministic .h5ad fixtures with the INSTALLED anndata version.

    python scripts/make_anndata_fixtures.py [--out tests/fixtures/anndata]

Run it once per anndata version, each in its own venv (Python 3.11):

    anndata 0.8.0   pip install "anndata==0.8.0" "pandas<2" "numpy<1.24" "h5py<3.10" "scipy<1.12"
    anndata 0.10.9  pip install "anndata==0.10.9" "pandas<2.3" "numpy<2" "scipy<1.14" "h5py<3.12"
    anndata 0.11.4  pip install -r ci/anndata-0.11.txt                      (Python 3.11)
    anndata 0.12.x  pip install -r ci/requirements.txt
    anndata 0.13.4  pip install -r ci/anndata-0.13.txt   (Python 3.12, pandas 3: the obs/var index and
                    string columns are written as `nullable-string-array`)

For anndata X.Y.* it writes, 40 cells x 30 genes, seed 0 (numpy RandomState, whose stream
is stable across numpy versions, so every version writes the same numbers):

    vX.Y_csr.h5ad        X CSR float32 integer counts + the full set of elements (obs with
                         categorical / string / int / float / bool / nullable int / nullable
                         bool columns, var, obsm, varm, layers['counts'], raw, uns)
    vX.Y_csc.h5ad        X CSC float64 (same obs/var)
    vX.Y_dense.h5ad      X dense int32 (same obs/var)
    vX.Y_csr_int64.h5ad  X CSR float32 whose indices/indptr are stored as int64

and next to each file `<name>.expected.json`: what a reader must find (shape, X row sums,
obs/var columns with kinds, categories and codes, obsm/varm/layers, raw, uns) plus `hdf5`:
the encoding attributes and stored dtypes read back with h5py.
"""
from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import scipy.sparse as sp

warnings.filterwarnings("ignore")

N_OBS, N_VARS, N_RAW_VARS, N_COMPS = 40, 30, 35, 5


def ad_version() -> tuple[int, int]:
    major, minor = ad.__version__.split(".")[:2]
    return int(major), int(minor)


def counts(rs: np.random.RandomState, n: int, m: int) -> np.ndarray:
    # NB-ish counts, ~35% non-zero, every row non-empty.
    lam = rs.gamma(shape=0.5, scale=2.0, size=(n, m))
    x = rs.poisson(lam).astype(np.int64)
    x[np.arange(n), np.arange(n) % m] += 1
    return x


def build():
    rs = np.random.RandomState(0)
    Xc = counts(rs, N_OBS, N_VARS)                       # int64 40 x 30
    Xraw = counts(rs, N_OBS, N_RAW_VARS)
    Xraw[:, :N_VARS] = Xc                                # raw holds X's genes plus 5 more

    cell_types = np.array(["T cell", "B cell", "NK cell"])
    ct_codes = rs.randint(0, 3, size=N_OBS)
    ct_codes[:3] = [0, 1, 2]                             # every category used
    obs = pd.DataFrame(index=[f"cell_{i}" for i in range(N_OBS)])
    obs["cell_type"] = pd.Categorical.from_codes(ct_codes, categories=cell_types)
    # Unique strings stay a plain string-array column. Repeated strings (`label`) are turned
    # into a categorical by anndata's write_h5ad (strings_to_categoricals), in every version.
    obs["barcode"] = np.array([f"AAC{i:03d}-1" for i in range(N_OBS)], dtype=object)
    obs["label"] = np.array([f"lbl_{i % 7}" for i in range(N_OBS)], dtype=object)
    obs["n_genes"] = (Xc > 0).sum(1).astype(np.int64)
    obs["score"] = np.round(rs.normal(size=N_OBS), 6).astype(np.float64)
    obs["is_good"] = (np.arange(N_OBS) % 3 == 0)
    ni = pd.array([i if i % 5 else None for i in range(N_OBS)], dtype="Int64")
    nb = pd.array([None if i % 7 == 0 else bool(i % 2) for i in range(N_OBS)], dtype="boolean")
    obs["nullable_int"] = ni
    obs["nullable_bool"] = nb

    var = pd.DataFrame(index=[f"gene_{j}" for j in range(N_VARS)])
    var["gene_group"] = pd.Categorical.from_codes(np.arange(N_VARS) % 4, categories=["a", "b", "c", "d"])
    var["dispersion"] = np.round(rs.uniform(0, 3, size=N_VARS), 6)

    raw_var = pd.DataFrame(index=[f"gene_{j}" for j in range(N_RAW_VARS)])
    raw_var["raw_mean"] = Xraw.mean(0).astype(np.float64)

    x_pca = np.round(rs.normal(size=(N_OBS, N_COMPS)), 6)
    pcs = np.round(rs.normal(size=(N_VARS, N_COMPS)), 6)
    uns = {
        "title": "scfoundry fixture",
        "n_int": 7,
        "x_float": 2.5,
        "flag": True,
        "params": {"method": "pca", "n_comps": 5, "inner": {"tol": 0.001, "name": "deep"}},
    }
    return Xc, Xraw, obs, var, raw_var, x_pca, pcs, uns


def make_adata(X, obs, var):
    kw = {}
    if ad_version() < (0, 9):
        kw["dtype"] = X.dtype                            # 0.8 casts X to float32 otherwise
    return ad.AnnData(X=X, obs=obs.copy(), var=var.copy(), **kw)


def kind(s: pd.Series) -> str:
    d = s.dtype
    if isinstance(d, pd.CategoricalDtype):
        return "categorical"
    if isinstance(d, pd.Int64Dtype) or str(d) in ("Int64", "Int32"):
        return "nullable-integer"
    if isinstance(d, pd.BooleanDtype):
        return "nullable-boolean"
    if isinstance(d, pd.StringDtype) or not isinstance(d, np.dtype):
        return "string"                                  # pandas 3: strings are pandas' string dtype
    if d == bool:
        return "bool"
    if np.issubdtype(d, np.integer):
        return "int"
    if np.issubdtype(d, np.floating):
        return "float"
    return "string"


def jsonable(v):
    if isinstance(v, dict):
        return {k: jsonable(x) for k, x in v.items()}
    if isinstance(v, (np.bool_, bool)):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, bytes):
        return v.decode()
    return v


def df_expect(df: pd.DataFrame) -> dict:
    out = {"index": [str(i) for i in df.index], "columns": []}
    for c in df.columns:
        s = df[c]
        k = kind(s)
        e = {"name": c, "kind": k}
        if k == "categorical":
            e["categories"] = [str(x) for x in s.cat.categories]
            e["codes"] = s.cat.codes.astype(int).tolist()
            e["ordered"] = bool(s.cat.ordered)
        elif k in ("nullable-integer", "nullable-boolean"):
            e["values"] = [None if pd.isna(x) else jsonable(x) for x in s.tolist()]
        else:
            e["values"] = [jsonable(x) for x in s.tolist()]
        out["columns"].append(e)
    return out


def h5_layout(path: Path) -> dict:
    """Encoding attrs and stored dtypes of every node, as written by this version."""
    info = {}
    with h5py.File(path, "r") as f:
        info["/"] = {k: jsonable(v) for k, v in f.attrs.items()}

        def visit(name, obj):
            e = {k: jsonable(v) for k, v in obj.attrs.items()}
            if isinstance(e.get("column-order"), list) or "column-order" in e:
                e["column-order"] = [str(x) for x in np.atleast_1d(obj.attrs["column-order"])]
            if isinstance(obj, h5py.Dataset):
                dt = obj.dtype
                sdt = h5py.check_string_dtype(dt)
                e["dtype"] = (f"vlen-str({sdt.encoding})" if sdt is not None and sdt.length is None
                              else f"fixed-str({sdt.encoding},{sdt.length})" if sdt is not None
                              else str(dt))
                e["shape"] = list(obj.shape)
            else:
                e["group"] = True
            info[name] = e

        f.visititems(visit)
    return info


def expected(a: ad.AnnData, path: Path, x_kind: str) -> dict:
    X = a.X
    rs = np.asarray(X.sum(axis=1, dtype=np.float64)).ravel()
    e = {
        "anndata_version": ad.__version__,
        "file": path.name,
        "shape": list(a.shape),
        "X": {"kind": x_kind, "dtype": str(X.dtype), "nnz": int(X.nnz) if sp.issparse(X) else int(np.count_nonzero(X)),
              "row_sums": rs.tolist(), "col_sums": np.asarray(X.sum(axis=0, dtype=np.float64)).ravel().tolist()},
        "obs": df_expect(a.obs),
        "var": df_expect(a.var),
        "obsm": {k: {"shape": list(v.shape), "dtype": str(v.dtype), "row0": np.asarray(v)[0].tolist()} for k, v in a.obsm.items()},
        "varm": {k: {"shape": list(v.shape), "dtype": str(v.dtype), "row0": np.asarray(v)[0].tolist()} for k, v in a.varm.items()},
        "layers": {k: {"shape": list(v.shape), "dtype": str(v.dtype), "sparse": sp.issparse(v),
                       "row_sums": np.asarray(v.sum(axis=1, dtype=np.float64)).ravel().tolist()} for k, v in a.layers.items() if k is not None},  # 0.13 lists X as layers[None]
        "raw": None,
        "uns": {k: jsonable(v) for k, v in a.uns.items()},
    }
    if a.raw is not None:
        e["raw"] = {"shape": list(a.raw.shape), "X_dtype": str(a.raw.X.dtype),
                    "X_row_sums": np.asarray(a.raw.X.sum(axis=1, dtype=np.float64)).ravel().tolist(),
                    "var": df_expect(a.raw.var)}
    e["hdf5"] = h5_layout(path)
    return e


def write(a: ad.AnnData, path: Path, x_kind: str, check_int64: bool = False) -> None:
    a.write_h5ad(path, compression=None)
    back = ad.read_h5ad(path)                      # round-trip sanity with the same version
    assert back.shape == a.shape
    with h5py.File(path, "r") as f:
        if check_int64:
            for k in ("indices", "indptr"):
                dt = f["X"][k].dtype
                assert dt == np.int64, f"{path}: X/{k} stored as {dt}, not int64"
    exp = expected(back, path, x_kind)
    path.with_suffix(".expected.json").write_text(json.dumps(exp, indent=1) + "\n")
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    assert path.stat().st_size < 200_000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="tests/fixtures/anndata")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    major, minor = ad_version()
    tag = f"v{major}.{minor}"

    Xc, Xraw, obs, var, raw_var, x_pca, pcs, uns = build()

    # --- full CSR file
    X = sp.csr_matrix(Xc.astype(np.float32))
    a = make_adata(X, obs, var)
    raw = make_adata(sp.csr_matrix(Xraw.astype(np.float32)), obs[[]], raw_var)
    a.raw = raw
    a.obsm["X_pca"] = x_pca
    a.varm["PCs"] = pcs
    a.layers["counts"] = sp.csr_matrix(Xc.astype(np.float32))
    for k, v in uns.items():
        a.uns[k] = v
    write(a, out / f"{tag}_csr.h5ad", "csr")

    # --- CSC float64
    write(make_adata(sp.csc_matrix(Xc.astype(np.float64)), obs, var), out / f"{tag}_csc.h5ad", "csc")

    # --- dense int32
    write(make_adata(Xc.astype(np.int32), obs, var), out / f"{tag}_dense.h5ad", "dense")

    # --- CSR with int64 indices / indptr
    X64 = sp.csr_matrix(Xc.astype(np.float32))
    X64.indices = X64.indices.astype(np.int64)
    X64.indptr = X64.indptr.astype(np.int64)
    assert X64.indices.dtype == np.int64 and X64.indptr.dtype == np.int64
    write(make_adata(X64, obs, var), out / f"{tag}_csr_int64.h5ad", "csr", check_int64=True)


if __name__ == "__main__":
    main()
