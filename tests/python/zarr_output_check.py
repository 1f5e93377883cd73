"""Check that the installed anndata reads scfoundry's Zarr output as its input plus the embedding.

    python zarr_output_check.py INPUT OUTPUT.zarr REFERENCE.h5ad KEY

INPUT is the .zarr or .h5ad embedded; REFERENCE is the .h5ad output of the same run, whose
obsm[KEY] the store's must equal bit for bit. X, layers, obs, var, obsm and uns of the input
must come back equal. Prints one line; exit 1 on a difference. When this anndata cannot read
the input (a newer anndata's) or the output's zarr format (zarr 2 and a format 3 store), says
so and exits 0.
"""
import sys
import warnings

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp
import zarr

warnings.filterwarnings("ignore")
inp, out, ref, key = sys.argv[1:5]


def read(p):
    return ad.read_zarr(p) if p.endswith(".zarr") else ad.read_h5ad(p)


def dense(x):
    return x.toarray() if sp.issparse(x) else np.asarray(x)


if int(zarr.__version__.split(".")[0]) < 3 and not __import__("os").path.exists(f"{out}/.zgroup"):
    print(f"anndata {ad.__version__} with zarr {zarr.__version__} does not read zarr format 3; nothing to compare")
    sys.exit(0)
try:
    a = read(inp)
except Exception as e:  # noqa: BLE001
    print(f"anndata {ad.__version__} cannot read the input ({type(e).__name__}); nothing to compare")
    sys.exit(0)
b, r = read(out), ad.read_h5ad(ref)
fail = []
if not np.array_equal(dense(a.X), dense(b.X)):
    fail.append("X differs")
if sp.issparse(a.X) != sp.issparse(b.X):
    fail.append(f"X is {type(b.X).__name__}, the input's {type(a.X).__name__}")
for name in ("obs", "var"):
    try:
        pd.testing.assert_frame_equal(getattr(a, name), getattr(b, name), check_dtype=False, check_index_type=False, check_column_type=False)
    except AssertionError as e:
        fail.append(f"{name} differs: {e}")
for k in a.obsm:
    if k not in b.obsm or not np.array_equal(np.asarray(a.obsm[k]), np.asarray(b.obsm[k])):
        fail.append(f"obsm[{k}] lost or changed")
for k in a.layers:
    if k not in b.layers or not np.array_equal(dense(a.layers[k]), dense(b.layers[k])):
        fail.append(f"layers[{k}] lost or changed")
for k in a.uns:
    if k not in b.uns:
        fail.append(f"uns[{k}] lost")
if key not in b.obsm:
    fail.append(f"obsm[{key}] missing")
else:
    e, want = np.asarray(b.obsm[key]), np.asarray(r.obsm[key])
    if e.dtype != want.dtype or e.shape != want.shape or e.tobytes() != want.tobytes():
        fail.append(f"obsm[{key}] differs from the .h5ad output's")
if fail:
    print(f"anndata {ad.__version__}: " + "; ".join(fail))
    sys.exit(1)
print(f"anndata {ad.__version__}: {out} = input {a.shape} + obsm[{key}] {b.obsm[key].shape}")
