"""Compare scfoundry's PCA output with scanpy's recipe on the same input; print JSON.

Usage: python pca_vs_scanpy.py INPUT.h5ad OUTPUT.h5ad
Runs normalize_total(1e4), log1p, highly_variable_genes(seurat, 2000) and pca(50, arpack)
with scanpy, reads our output with anndata.read_h5ad, and reports the agreement.
"""
import json
import sys
import warnings

import anndata as ad
import numpy as np
import scanpy as sc

warnings.filterwarnings("ignore")
inp, out = sys.argv[1], sys.argv[2]
n_comps = int(sys.argv[3]) if len(sys.argv) > 3 else 50
ref = ad.read_h5ad(inp)
sc.pp.normalize_total(ref, target_sum=1e4)
sc.pp.log1p(ref)
sc.pp.highly_variable_genes(ref, flavor="seurat", n_top_genes=2000)
sc.pp.pca(ref, n_comps=n_comps, mask_var="highly_variable", svd_solver="arpack", random_state=0)

ours = ad.read_h5ad(out)
ours_hvg = np.abs(ours.varm["PCs"]).sum(1) > 0
k = min(20, n_comps)
qa, _ = np.linalg.qr(ref.varm["PCs"][:, :k])
qb, _ = np.linalg.qr(ours.varm["PCs"][:, :k].astype(np.float64))
cosines = np.linalg.svd(qa.T @ qb, compute_uv=False)
# the embeddings themselves: per-component |correlation| (signs are arbitrary)
xa, xb = ref.obsm["X_pca"], ours.obsm["X_pca"]
corr = [float(abs(np.corrcoef(xa[:, i], xb[:, i])[0, 1])) for i in range(k)]
print(json.dumps({
    "n_obs": int(ours.n_obs),
    "obsm_shape": list(ours.obsm["X_pca"].shape),
    "obsm_dtype": str(ours.obsm["X_pca"].dtype),
    "hvg_scanpy": int(ref.var["highly_variable"].sum()),
    "hvg_ours": int(ours_hvg.sum()),
    "hvg_disagree": int((ours_hvg != ref.var["highly_variable"].values).sum()),
    "mean_cos_top20": float(cosines.mean()),
    "min_cos_top20": float(cosines.min()),
    "max_abs_dvr": float(np.abs(ref.uns["pca"]["variance_ratio"] - ours.uns["pca"]["variance_ratio"]).max()),
    "vr_ours_first": float(ours.uns["pca"]["variance_ratio"][0]),
    "min_corr_top20": float(min(corr)),
}))
