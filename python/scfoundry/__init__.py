"""scfoundry from Python: run the scfoundry binary shipped in this package on an AnnData object.

    import anndata, scfoundry
    adata = anndata.read_h5ad("cells.h5ad")
    scfoundry.embed(adata, method="pca", n_comps=30)   # -> adata.obsm["X_pca"]

`embed` writes `adata` to a temporary .h5ad, runs `scfoundry embed --embedding-only` on it and
puts the embedding back in `adata.obsm`, matched by obs names. Keyword options become the
binary's flags (`n_comps=30` -> `--n-comps 30`, `runs_dir="runs"` -> `--runs-dir runs`; `True`
gives the bare flag, `False` and `None` leave it out); `scfoundry methods <name>` lists a
method's flags. The binary's own documentation is its `--help` and the project README.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

__all__ = ["ScfoundryError", "binary", "embed", "run"]


class ScfoundryError(RuntimeError):
    """The binary exited with a non-zero status; the message is its stderr."""

    def __init__(self, message: str, returncode: int, args: list[str]):
        super().__init__(message)
        self.returncode = returncode
        self.command = args


def binary() -> str:
    """Path of the scfoundry binary: $SCFOUNDRY_BINARY when set, else the one in this package."""
    env = os.environ.get("SCFOUNDRY_BINARY")
    if env:
        return env
    here = Path(__file__).resolve().parent / "bin" / "scfoundry"
    if not here.is_file():
        raise ScfoundryError(f"no scfoundry binary at {here}: reinstall the wheel, or set SCFOUNDRY_BINARY", 1, [])
    return str(here)


def _flags(options: dict) -> list[str]:
    out: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, ",".join(str(v) for v in value)]
        else:
            out += [flag, os.fspath(value) if isinstance(value, os.PathLike) else str(value)]
    return out


def run(*args: str, cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run the binary with `args`; raise ScfoundryError with its stderr when it fails."""
    cmd = [binary(), *map(str, args)]
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        raise ScfoundryError(r.stderr.strip() or f"scfoundry exited with status {r.returncode}", r.returncode, cmd)
    return r


def embed(adata, method: str = "genept", *, key: str | None = None, **options) -> str:
    """Embed the cells of `adata` with `method`; set `adata.obsm[key]` and return the key.

    `key` defaults to the name the binary writes (`X_<method>`). Raw counts go in `adata.X`
    (or name a layer with `layer="counts"`); `options` are the method's flags, as above.
    """
    import anndata  # the caller's AnnData: imported here so that `binary()` needs no anndata

    with tempfile.TemporaryDirectory(prefix="scfoundry-") as tmp:
        data = Path(tmp) / "input.h5ad"
        out = Path(tmp) / "embedding.h5ad"
        adata.write_h5ad(data)
        run("embed", "--quiet", "--method", method, "--data", str(data), "--out", str(out), "--embedding-only",
            *_flags(options), cwd=tmp)
        small = anndata.read_h5ad(out)
        keys = list(small.obsm.keys())
        if len(keys) != 1:
            raise ScfoundryError(f"expected one embedding in {out.name}, found {keys}", 1, [])
        emb = small.obsm[keys[0]]
        names = small.obs_names
        if not names.equals(adata.obs_names):
            if not adata.obs_names.is_unique:
                raise ScfoundryError("the output's cells are in another order and adata.obs_names are not unique", 1, [])
            at = names.get_indexer(adata.obs_names)
            if (at < 0).any():
                raise ScfoundryError("the output lacks some of adata's cells", 1, [])
            emb = emb[at]
        adata.obsm[key or keys[0]] = emb
        return key or keys[0]
