#!/usr/bin/env python3
"""One scanpy run for bench/pca_vs_scanpy.py, meant to run in a fresh process.

    python bench/scanpy_pca_child.py IN.h5ad OUT.h5ad

read_h5ad -> normalize_total(1e4) -> log1p -> highly_variable_genes(seurat, 2000)
-> pca(50, arpack, mask_var='highly_variable') -> write_h5ad. Prints one JSON line with the
per-step seconds and the BLAS / OpenMP libraries threadpoolctl sees.
"""
import json
import os
import sys
import time
import warnings

t0 = time.perf_counter()
warnings.filterwarnings("ignore")
import anndata as ad  # noqa: E402
import scanpy as sc  # noqa: E402

t = {"import": time.perf_counter() - t0}
src, dst = sys.argv[1], sys.argv[2]
s = time.perf_counter()
adata = ad.read_h5ad(src)
t["read"] = time.perf_counter() - s
s = time.perf_counter()
sc.pp.normalize_total(adata, target_sum=1e4)
sc.pp.log1p(adata)
sc.pp.highly_variable_genes(adata, flavor="seurat", n_top_genes=2000)
t["normalize_log1p_hvg"] = time.perf_counter() - s
s = time.perf_counter()
sc.pp.pca(adata, n_comps=50, mask_var="highly_variable", zero_center=True, svd_solver="arpack", random_state=0)
t["pca"] = time.perf_counter() - s
s = time.perf_counter()
adata.write_h5ad(dst)
t["write"] = time.perf_counter() - s
t["total_in_process"] = time.perf_counter() - t0

try:
    from threadpoolctl import threadpool_info
    pools = [{k: d.get(k) for k in ("internal_api", "prefix", "version", "architecture", "num_threads")}
             for d in threadpool_info()]
except Exception as e:  # pragma: no cover
    pools = [{"error": repr(e)}]
print(json.dumps({
    "seconds": t,
    "n_hvg": int(adata.var["highly_variable"].sum()),
    "variance_ratio_head": [float(x) for x in adata.uns["pca"]["variance_ratio"][:5]],
    "threadpools": pools,
    "env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS")},
}))
