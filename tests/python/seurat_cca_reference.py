"""numpy reference for scfoundry's Seurat CCA (RunCCA with standardize = TRUE).

    python seurat_cca_reference.py input.json

input.json: {"a": [...n1*f], "b": [...n2*f], "n1", "n2", "f", "k"}, cells in rows.
Each cell is standardised over the features (mean 0, sd with ddof 1, as Seurat's Standardize on
the feature x cell matrix's columns), M = A B^T, full SVD by LAPACK (numpy), the first k
components, each flipped so that the first cell of A has a non-negative entry. Prints JSON
{"d": [...k], "u": [...n1*k], "v": [...n2*k]}.
"""
import json
import sys

import numpy as np

inp = json.load(open(sys.argv[1]))
n1, n2, f, k = inp["n1"], inp["n2"], inp["f"], inp["k"]
a = np.asarray(inp["a"], dtype=np.float64).reshape(n1, f)
b = np.asarray(inp["b"], dtype=np.float64).reshape(n2, f)


def standardize(x):
    return (x - x.mean(axis=1, keepdims=True)) / x.std(axis=1, ddof=1, keepdims=True)


m = standardize(a) @ standardize(b).T
u, d, vt = np.linalg.svd(m, full_matrices=False)
u, d, v = u[:, :k], d[:k], vt[:k].T
sign = np.where(u[0] < 0, -1.0, 1.0)
u, v = u * sign, v * sign
print(json.dumps({"d": d.tolist(), "u": u.ravel().tolist(), "v": v.ravel().tolist()}))
