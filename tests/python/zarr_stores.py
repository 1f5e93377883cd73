"""Write the AnnData Zarr stores the Zarr tests read, with the installed anndata and zarr.

    python zarr_stores.py OUT_DIR

Writes, for one small dataset (96 cells x 40 genes, seeded counts; a categorical and a string
obs column, a string var column, obsm["X_umap"], uns), each store beside the .h5ad of the same
data written by the same anndata, and prints a JSON list of {"zarr", "h5ad", "format", ...}:

- csr.zarr: a CSR X whose arrays are Blosc-compressed, zarr format 2, consolidated metadata;
- dense.zarr: a dense X chunked by 16 rows, zarr format 2, no consolidated metadata;
- with zarr 3 (anndata >= 0.12), csr_v3.zarr: the CSR X in zarr format 3;
- with anndata >= 0.13, sharded_v3.zarr: zarr format 3 whose dense X is sharded (chunks of 8
  rows, shards of 32 rows) and whose CSR layer's arrays are sharded too.

Each claim (compressor, chunking, sharding, consolidation) is checked on the written metadata,
so a store that is not what the tests say fails here.
"""
import inspect
import json
import sys
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp
import zarr

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
zarr3 = int(zarr.__version__.split(".")[0]) >= 3
version = tuple(int(x) for x in ad.__version__.split(".")[:2])

rng = np.random.RandomState(0)
n_obs, n_vars = 96, 40
counts = rng.poisson(rng.gamma(0.6, 2.0, size=(1, n_vars)), size=(n_obs, n_vars)).astype(np.float32)
counts[:, 0] += 1  # no empty cell
obs = pd.DataFrame(
    {
        "cell_type": pd.Categorical(rng.choice(["B", "T", "NK"], n_obs)),
        # unique per cell: anndata keeps it a string column (strings_to_categoricals leaves it)
        "barcode": [f"BC{i:04d}-{rng.randint(1000)}" for i in range(n_obs)],
    },
    index=[f"cell{i}" for i in range(n_obs)],
)
var = pd.DataFrame({"symbol": [f"SYM{j}" for j in range(n_vars)]}, index=[f"gene{j}" for j in range(n_vars)])


def make(x):
    a = ad.AnnData(X=x, obs=obs.copy(), var=var.copy())
    a.obsm["X_umap"] = rng.normal(size=(n_obs, 2)).astype(np.float32)
    a.uns["note"] = "zarr fixture"
    return a


def blosc_kwargs(fmt):
    if not zarr3:
        from numcodecs import Blosc

        return {"compressor": Blosc(cname="lz4", clevel=5)}
    if fmt == 2:
        from numcodecs import Blosc

        return {"compressors": Blosc(cname="lz4", clevel=5)}
    return {"compressors": zarr.codecs.BloscCodec(cname="lz4", clevel=5)}


def write(a, path, fmt, consolidate, **kw):
    if zarr3:
        ad.settings.zarr_write_format = fmt
    # anndata's own writer, which takes the arrays' keyword arguments (compressor) too
    from anndata._io.zarr import write_zarr

    params = inspect.signature(write_zarr).parameters
    if "consolidate_metadata" in params:
        write_zarr(path, a, consolidate_metadata=consolidate, **kw)
    else:
        write_zarr(path, a, **kw)
    if consolidate:
        zarr.consolidate_metadata(str(path))
    else:
        # anndata 0.12 consolidates always: a store without it is the same store less the copy
        (Path(path) / ".zmetadata").unlink(missing_ok=True)
        root = Path(path) / "zarr.json"
        if root.exists():
            m = json.loads(root.read_text())
            m.pop("consolidated_metadata", None)
            root.write_text(json.dumps(m))


def meta(path, elem):
    """The metadata of an array: .zarray (v2) or zarr.json (v3)."""
    p = Path(path) / elem
    f = p / ".zarray" if (p / ".zarray").exists() else p / "zarr.json"
    return json.loads(f.read_text())


def check(cond, what):
    if not cond:
        sys.exit(f"fixture is not what it claims: {what}")


made = []
stores = [("csr", 2, True), ("dense", 2, False)]
if zarr3:
    stores.append(("csr_v3", 3, True))
if version >= (0, 13):
    stores.append(("sharded_v3", 3, True))
for name, fmt, consolidate in stores:
    dense = name.startswith("dense") or name.startswith("sharded")
    a = make(counts.copy() if dense else sp.csr_matrix(counts))
    if name == "sharded_v3":
        a.layers["counts"] = sp.csr_matrix(counts)
    zpath, hpath = out / f"{name}.zarr", out / f"{name}.h5ad"
    kw = {} if dense else blosc_kwargs(fmt)
    if name == "dense":
        kw["chunks"] = (16, n_vars)
    if name == "sharded_v3":
        write(a, zpath, fmt, False)
        g = zarr.open_group(str(zpath), mode="r+")
        ad.io.write_elem(g, "X", a.X, dataset_kwargs={"chunks": (8, n_vars), "shards": (32, n_vars)})
        ad.io.write_elem(g["layers"], "counts", a.layers["counts"], dataset_kwargs={"chunks": (64,), "shards": (256,)})
        zarr.consolidate_metadata(str(zpath))
    else:
        write(a, zpath, fmt, consolidate, **kw)
    a.write_h5ad(hpath)
    # the claims, on the metadata written
    if name.startswith("csr"):
        m = meta(zpath, "X/data")
        text = json.dumps(m)
        check("blosc" in text, f"{zpath}: X/data is not Blosc-compressed: {text}")
    if name == "dense":
        check(meta(zpath, "X")["chunks"] == [16, n_vars], f"{zpath}: X is not chunked by 16 rows")
    if name == "sharded_v3":
        m = meta(zpath, "X")
        check(m["codecs"][0]["name"] == "sharding_indexed", f"{zpath}: X is not sharded: {m['codecs']}")
        check(m["codecs"][0]["configuration"]["chunk_shape"] == [8, n_vars], f"{zpath}: X's inner chunks are not 8 rows")
        check(meta(zpath, "layers/counts/data")["codecs"][0]["name"] == "sharding_indexed", f"{zpath}: the layer is not sharded")
    has_v2 = (zpath / ".zgroup").exists()
    check(has_v2 == (fmt == 2), f"{zpath}: zarr format is not {fmt}")
    consolidated = (zpath / ".zmetadata").exists() or "consolidated_metadata" in json.loads((zpath / "zarr.json").read_text()) if fmt == 3 else (zpath / ".zmetadata").exists()
    check(bool(consolidated) == consolidate, f"{zpath}: consolidated metadata is {consolidated}, expected {consolidate}")
    made.append({"zarr": str(zpath), "h5ad": str(hpath), "format": fmt, "consolidated": consolidate, "x": "dense" if dense else "csr", "sharded": name == "sharded_v3"})
print(json.dumps({"anndata": ad.__version__, "zarr": zarr.__version__, "stores": made}))
