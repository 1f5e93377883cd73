"""Write an .h5ad as an AnnData Zarr store with the installed anndata and zarr.

    python zarr_from_h5ad.py IN.h5ad OUT.zarr FORMAT

FORMAT 2: anndata's write_zarr in zarr format 2 (the only one with zarr 2). FORMAT 3 (zarr 3):
format 3 with a dense X sharded (chunks of 4 rows, shards of 16).
"""
import json
import pathlib
import sys

import anndata as ad
import zarr
from anndata._io.zarr import write_zarr

a = ad.read_h5ad(sys.argv[1])
zarr3 = int(zarr.__version__.split(".")[0]) >= 3
if zarr3 and sys.argv[3] == "3":
    ad.settings.zarr_write_format = 3
    write_zarr(sys.argv[2], a)
    # X is written again, sharded: the store must not be consolidated while it is edited
    root = pathlib.Path(sys.argv[2]) / "zarr.json"
    m = json.loads(root.read_text())
    m.pop("consolidated_metadata", None)
    root.write_text(json.dumps(m))
    x = a.X.toarray() if hasattr(a.X, "toarray") else a.X
    ad.io.write_elem(zarr.open_group(sys.argv[2], mode="r+"), "X", x, dataset_kwargs={"chunks": (4, a.n_vars), "shards": (16, a.n_vars)})
    assert json.loads((pathlib.Path(sys.argv[2]) / "X" / "zarr.json").read_text())["codecs"][0]["name"] == "sharding_indexed"
else:
    if zarr3:
        ad.settings.zarr_write_format = 2
    write_zarr(sys.argv[2], a)
