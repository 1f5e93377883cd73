"""Check that the installed anndata reads OUTPUT with obs and var equal to INPUT's.

    python obs_var_equal.py INPUT.h5ad OUTPUT.h5ad

Prints one line. Exit 0 when equal, or when this anndata cannot read INPUT at all (an older
version and a newer file: nothing is promised then); exit 1 otherwise. Values are compared, not
storage dtypes (a legacy file's integer column may come back as float64).
"""
import sys
import warnings
from pathlib import Path

import anndata as ad
import pandas as pd

warnings.filterwarnings("ignore")
inp, out = sys.argv[1], sys.argv[2]
for p in (inp, out):
    if not Path(p).is_file():
        sys.exit(f"{p}: no such file")
try:
    a = ad.read_h5ad(inp)
except Exception as e:  # noqa: BLE001
    print(f"anndata {ad.__version__} cannot read the input ({type(e).__name__}); nothing to compare")
    sys.exit(0)
try:
    b = ad.read_h5ad(out)
except Exception as e:  # noqa: BLE001
    print(f"anndata {ad.__version__} reads the input but not the output: {type(e).__name__}: {e}")
    sys.exit(1)
for name in ("obs", "var"):
    x, y = getattr(a, name), getattr(b, name)
    y = y[[c for c in x.columns if c in y.columns]]
    try:
        pd.testing.assert_frame_equal(x, y, check_dtype=False, check_names=False, check_index_type=False,
                                      check_column_type=False, check_categorical=True)
    except AssertionError as e:
        print(f"anndata {ad.__version__}: {name} differs: {e}")
        sys.exit(1)
    missing = [c for c in getattr(a, name).columns if c not in getattr(b, name).columns]
    if missing:
        print(f"anndata {ad.__version__}: {name} lost columns {missing}")
        sys.exit(1)
print(f"anndata {ad.__version__}: obs {a.obs.shape} and var {a.var.shape} equal")
