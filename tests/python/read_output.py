"""Read an scfoundry output with anndata and compare it with its input; print JSON.

Usage: python read_output.py INPUT.h5ad OUTPUT.h5ad KEY
Checks that everything of the input is still there, unchanged, and reports what was added.
"""
import json
import sys
import warnings

import anndata as ad
import numpy as np
import scipy.sparse as sp

warnings.filterwarnings("ignore")
inp, out, key = sys.argv[1], sys.argv[2], sys.argv[3]
a = ad.read_h5ad(inp)
b = ad.read_h5ad(out)


def dense(x):
    return x.toarray() if sp.issparse(x) else np.asarray(x)


prov = b.uns.get("scfoundry", {})
print(json.dumps({
    "anndata_version": ad.__version__,
    "shape_equal": a.shape == b.shape,
    "X_equal": bool(np.array_equal(dense(a.X), dense(b.X))),
    "obs_equal": bool(a.obs.equals(b.obs)),
    "var_equal": bool(a.var.equals(b.var)),
    "obs_names_equal": bool((a.obs_names == b.obs_names).all()),
    "layers_equal": sorted(a.layers.keys()) == sorted(b.layers.keys()),
    "obsm_keys_in": sorted(a.obsm.keys()),
    "obsm_keys_out": sorted(b.obsm.keys()),
    "embedding_shape": list(b.obsm[key].shape),
    "embedding_finite": bool(np.isfinite(b.obsm[key]).all()),
    "embedding_std": float(np.asarray(b.obsm[key]).std()),
    "uns_keys_in": sorted(a.uns.keys()),
    "uns_keys_out": sorted(b.uns.keys()),
    "provenance": {k: (v if isinstance(v, (str, int, float, bool)) else str(v)) for k, v in prov.items()},
    "parameters": {k: (v.item() if hasattr(v, "item") else v) for k, v in dict(prov.get("parameters", {})).items()},
}, default=str))
