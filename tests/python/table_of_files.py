"""Read a table written by `embed --data a.h5ad b.h5ad --embedding-only`: its shape, file
column, cell names, and whether each file's rows equal that file's own embedding."""
import json
import sys

import anndata
import numpy as np

table = anndata.read_h5ad(sys.argv[1])
key = sys.argv[2]
parts = [anndata.read_h5ad(p) for p in sys.argv[3:]]
col = table.obs["scfoundry_file"]
equal = []
start = 0
for p in parts:
    n = p.n_obs
    equal.append(bool(np.array_equal(table.obsm[key][start:start + n], p.obsm[key])))
    start += n
print(json.dumps({
    "shape": list(table.shape),
    "files": [str(c) for c in col.cat.categories],
    "counts": [int((col == c).sum()) for c in col.cat.categories],
    "names_unique": bool(table.obs_names.is_unique),
    "first_name": str(table.obs_names[0]),
    "equal": equal,
}))
