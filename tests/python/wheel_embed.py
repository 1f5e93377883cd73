"""The scfoundry wheel, installed (pip --target) into SITE: its RECORD matches its files, and
scfoundry.embed equals the CLI's own output. argv: wheel SITE data.h5ad cli_out.h5ad key n_comps;
prints JSON."""
import base64
import csv
import hashlib
import io
import json
import sys
import zipfile

wheel, site, data, cli_out, key, n_comps = sys.argv[1:7]
sys.path.insert(0, site)

import anndata  # noqa: E402
import numpy as np  # noqa: E402

import scfoundry  # noqa: E402

# every file of the wheel has its sha256 and size in RECORD, and RECORD lists every file
bad = []
with zipfile.ZipFile(wheel) as z:
    names = set(z.namelist())
    rec_name = next(n for n in names if n.endswith(".dist-info/RECORD"))
    rows = list(csv.reader(io.StringIO(z.read(rec_name).decode())))
    listed = {r[0] for r in rows}
    for path, h, size in rows:
        if path == rec_name:
            continue
        d = z.read(path)
        want = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b"=").decode()
        if h != want or int(size) != len(d):
            bad.append(path)

adata = anndata.read_h5ad(data)
got_key = scfoundry.embed(adata, method="pca", n_comps=int(n_comps))
cli = anndata.read_h5ad(cli_out)
try:
    scfoundry.embed(adata, method="pca", n_comps=0)
    error = None
except scfoundry.ScfoundryError as e:
    error = {"message": str(e), "returncode": e.returncode}
print(json.dumps({
    "module": scfoundry.__file__,
    "binary": scfoundry.binary(),
    "record_bad": bad,
    "record_complete": listed == names,
    "key": got_key,
    "shape": list(adata.obsm[got_key].shape),
    "equal": bool(np.array_equal(adata.obsm[got_key], cli.obsm[key])),
    "error": error,
}))
