#!/usr/bin/env python3
"""Split the demo datasets into a labelled reference and a query for `scfoundry transfer`.

    ~/.cache/scfoundry/venv-ci/bin/python scripts/transfer_split.py [--out demo/out]

Writes (counts unchanged, all obs columns kept):
- pbmc68k_ref.h5ad / pbmc68k_query.h5ad: demo/pbmc68k_counts.h5ad split by cell parity (even
  cells are the reference, odd cells the query; 350 + 350). The test suite makes the same split
  in Rust (tests/it/transfer.rs).
- wu2020_ref.h5ad / wu2020_query.h5ad: demo/wu2020_tcells.h5ad split by patient: the query is
  patients Lung4, Lung5, Lung6, Renal1, Renal2 and Renal3 (82 cells), the reference the other
  eight patients (118 cells); a split across batches.
"""
import argparse
from pathlib import Path

import anndata as ad
import numpy as np

root = Path(__file__).resolve().parent.parent
p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--out", type=Path, default=root / "demo" / "out")
a = p.parse_args()
a.out.mkdir(parents=True, exist_ok=True)

pbmc = ad.read_h5ad(root / "demo" / "pbmc68k_counts.h5ad")
even = np.arange(pbmc.n_obs) % 2 == 0
pbmc[even].copy().write_h5ad(a.out / "pbmc68k_ref.h5ad")
pbmc[~even].copy().write_h5ad(a.out / "pbmc68k_query.h5ad")

wu = ad.read_h5ad(root / "demo" / "wu2020_tcells.h5ad")
q = wu.obs["patient"].isin(["Lung4", "Lung5", "Lung6", "Renal1", "Renal2", "Renal3"]).values
wu[~q].copy().write_h5ad(a.out / "wu2020_ref.h5ad")
wu[q].copy().write_h5ad(a.out / "wu2020_query.h5ad")
for f in sorted(a.out.glob("*_ref.h5ad")) + sorted(a.out.glob("*_query.h5ad")):
    print(f, ad.read_h5ad(f, backed="r").shape)
