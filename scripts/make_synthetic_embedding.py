#!/usr/bin/env python3
"""A SYNTHETIC embedding-only .h5ad for scale runs of `scfoundry benchmark` (no counts).

    python scripts/make_synthetic_embedding.py --cells 1000000 --dims 50 --out /tmp/emb_1m.h5ad

Needs only numpy and h5py (writes the AnnData on-disk format itself, so it runs where anndata is
not installed). Seeded (numpy default_rng(--seed)): --types cell types with centres uniform in
[-3, 3]^d, --batches batches that shift every cell by a per-batch offset uniform in
[-0.5, 0.5]^d (times --batch-strength), Gaussian noise sd 1. obs: `cell_type`, `batch`
(categorical); obsm['X_emb'] (float32) and obsm['X_pre'], the same cells before integration
(batch offsets 4x larger), for `--pre-integrated X_pre`; X is an empty n x 1 CSR matrix, so
without that option PCR comparison is left out with a warning. uns['synthetic'] = True.
"""
import argparse
import os

import h5py
import numpy as np


def _attrs(obj, enc, ver, **kw):
    obj.attrs["encoding-type"] = enc
    obj.attrs["encoding-version"] = ver
    for k, v in kw.items():
        obj.attrs[k] = v


def _strings(g, name, values):
    ds = g.create_dataset(name, data=np.array(values, dtype=object), dtype=h5py.string_dtype())
    _attrs(ds, "string-array", "0.2.0")


def _categorical(g, name, codes, cats):
    c = g.create_group(name)
    _attrs(c, "categorical", "0.2.0", ordered=False)
    c.create_dataset("codes", data=codes.astype(np.int8 if len(cats) < 128 else np.int32))
    _strings(c, "categories", cats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", type=int, default=1_000_000)
    ap.add_argument("--dims", type=int, default=50)
    ap.add_argument("--types", type=int, default=10)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--batch-strength", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    n, d = a.cells, a.dims
    centres = rng.uniform(-3, 3, size=(a.types, d)).astype(np.float32)
    shifts = (a.batch_strength * rng.uniform(-0.5, 0.5, size=(a.batches, d))).astype(np.float32)
    types = rng.integers(0, a.types, size=n)
    batches = rng.integers(0, a.batches, size=n)
    x = rng.standard_normal(size=(n, d), dtype=np.float32)
    x += centres[types]
    x += shifts[batches]
    tmp = a.out + ".tmp"
    with h5py.File(tmp, "w") as f:
        _attrs(f, "anndata", "0.1.0")
        X = f.create_group("X")
        _attrs(X, "csr_matrix", "0.1.0", shape=np.array([n, 1]))
        X.create_dataset("data", data=np.zeros(0, np.float32))
        X.create_dataset("indices", data=np.zeros(0, np.int32))
        X.create_dataset("indptr", data=np.zeros(n + 1, np.int64))
        obs = f.create_group("obs")
        _attrs(obs, "dataframe", "0.2.0", _index="_index", **{"column-order": np.array(["cell_type", "batch"], dtype=h5py.string_dtype())})
        _strings(obs, "_index", [f"cell{i}" for i in range(n)])
        _categorical(obs, "cell_type", types, [f"type{t}" for t in range(a.types)])
        _categorical(obs, "batch", batches, [f"batch{b}" for b in range(a.batches)])
        var = f.create_group("var")
        _attrs(var, "dataframe", "0.2.0", _index="_index", **{"column-order": np.array([], dtype="float64")})
        _strings(var, "_index", ["none"])
        om = f.create_group("obsm")
        _attrs(om, "dict", "0.1.0")
        om.create_dataset("X_emb", data=x)
        x += 3.0 * shifts[batches]
        om.create_dataset("X_pre", data=x)
        for gname in ("varm", "obsp", "varp", "layers"):
            _attrs(f.create_group(gname), "dict", "0.1.0")
        uns = f.create_group("uns")
        _attrs(uns, "dict", "0.1.0")
        s = uns.create_dataset("synthetic", data=np.bool_(True))
        _attrs(s, "numeric-scalar", "0.2.0")
        g = uns.create_dataset("generator", data=f"scripts/make_synthetic_embedding.py seed={a.seed} types={a.types} batches={a.batches}", dtype=h5py.string_dtype())
        _attrs(g, "string", "0.2.0")
    os.replace(tmp, a.out)
    print(f"wrote {a.out}: {n} cells x {d} dims, {a.types} types, {a.batches} batches [SYNTHETIC]")


if __name__ == "__main__":
    main()
