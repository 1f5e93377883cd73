#!/usr/bin/env python3
"""A SYNTHETIC embedding-only .h5ad for scale runs of `scfoundry benchmark` (no counts).

    python scripts/make_synthetic_embedding.py --cells 1000000 --dims 50 --out /tmp/emb_1m.h5ad

Seeded (numpy default_rng(--seed)): --types cell types with centres uniform in [-3, 3]^d, --batches
batches that shift every cell by a per-batch offset uniform in [-0.5, 0.5]^d (scaled by
--batch-strength), Gaussian noise sd 1. obs: `cell_type`, `batch` (categorical); obsm['X_emb']
(float32); X is an empty n x 1 sparse matrix (so PCR comparison, which needs a PCA of X, must be
left out: `--metrics` without pcr). uns['synthetic'] = True.
"""
import argparse

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp


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
    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical([f"type{t}" for t in types]),
            "batch": pd.Categorical([f"batch{b}" for b in batches]),
        },
        index=[f"cell{i}" for i in range(n)],
    )
    adata = ad.AnnData(X=sp.csr_matrix((n, 1), dtype=np.float32), obs=obs, var=pd.DataFrame(index=["none"]))
    adata.obsm["X_emb"] = x
    adata.uns["synthetic"] = True
    adata.uns["generator"] = f"scripts/make_synthetic_embedding.py seed={a.seed} types={a.types} batches={a.batches}"
    tmp = a.out + ".tmp.h5ad"
    adata.write_h5ad(tmp)
    import os

    os.replace(tmp, a.out)
    print(f"wrote {a.out}: {n} cells x {d} dims, {a.types} types, {a.batches} batches [SYNTHETIC]")


if __name__ == "__main__":
    main()
