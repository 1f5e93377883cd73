"""Read an embedding-only output with anndata and join it back onto the full data in another
cell order, as docs/orchestration.md shows: argv full.h5ad small.h5ad; prints JSON."""
import json
import sys

import anndata
import numpy as np

full = anndata.read_h5ad(sys.argv[1])
small = anndata.read_h5ad(sys.argv[2])
adata = full[::-1].copy()
adata.obsm["X_genept"] = small[adata.obs_names].obsm["X_genept"]
ok = bool(np.array_equal(adata.obsm["X_genept"], full[::-1].obsm["X_genept"]))
print(json.dumps({"shape": list(small.shape), "joined": ok, "method": str(small.uns["scfoundry"]["method"])}))
