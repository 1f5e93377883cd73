"""Tile a small real .h5ad with CSR counts into a large one: its cells repeated until N cells,
so timings see real per-cell gene counts at atlas scale. Needs numpy + h5py only (no anndata:
the GPU machine has neither anndata nor network).

    python3 bench/tile_h5ad.py SRC.h5ad N OUT.h5ad [--genes-out GENES.txt] [--spatial] [--hvg K]

The output holds X (CSR, the source's dtypes, int64 indptr), obs with a unique index
(`<source name>-<copy>`) and the source's var copied; layers, obsm, obsp, varm, varp and uns are
empty. `--genes-out` writes the var_names of the genes detected in at least one cell, one per
line (what bench/random_geneformer.py takes as its vocabulary). `--spatial` adds obsm['spatial']: the
cells on a square grid 15 microns apart, each moved by up to 5 microns (seeded, seed 0), as
`__bench-encoder --arch novae` lays out its slide. `--hvg K` adds var['highly_variable'], true
for the K genes detected in the most cells (what Novae needs above 100 genes).
"""

import sys

import h5py
import numpy as np


def strings(group, name, values):
    ds = group.create_dataset(name, data=np.array(values, dtype=object), dtype=h5py.string_dtype("utf-8"))
    ds.attrs["encoding-type"] = "string-array"
    ds.attrs["encoding-version"] = "0.2.0"


def main():
    src, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    genes_out = sys.argv[sys.argv.index("--genes-out") + 1] if "--genes-out" in sys.argv else None
    hvg = int(sys.argv[sys.argv.index("--hvg") + 1]) if "--hvg" in sys.argv else None
    with h5py.File(src, "r") as f, h5py.File(out, "w") as g:
        x = f["X"]
        if x.attrs.get("encoding-type") != "csr_matrix":
            sys.exit(f"{src}: X is {x.attrs.get('encoding-type')}, this script tiles CSR only")
        data, indices, indptr = x["data"][:], x["indices"][:], x["indptr"][:].astype(np.int64)
        rows, cols = (int(v) for v in x.attrs["shape"])
        names = [s.decode() if isinstance(s, bytes) else s for s in f["obs"][f["obs"].attrs["_index"]][:]]
        per = np.diff(indptr)
        copies = -(-n // rows)
        order = np.tile(np.arange(rows), copies)[:n]
        lengths = per[order]
        out_ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=out_ptr[1:])
        nnz = int(out_ptr[-1])
        X = g.create_group("X")
        X.attrs["encoding-type"] = "csr_matrix"
        X.attrs["encoding-version"] = "0.1.0"
        X.attrs["shape"] = np.array([n, cols], dtype=np.int64)
        d = X.create_dataset("data", shape=(nnz,), dtype=data.dtype, chunks=(min(nnz, 1 << 20),))
        i = X.create_dataset("indices", shape=(nnz,), dtype=indices.dtype, chunks=(min(nnz, 1 << 20),))
        X.create_dataset("indptr", data=out_ptr)
        whole = int(indptr[-1])
        for c in range(copies):  # one copy of the source at a time (the last one cut at n)
            r0, r1 = c * rows, min(n, (c + 1) * rows)
            stop = int(indptr[r1 - r0])
            d[out_ptr[r0]:out_ptr[r0] + stop] = data[:stop]
            i[out_ptr[r0]:out_ptr[r0] + stop] = indices[:stop]
            assert stop == whole or r1 == n
        obs = g.create_group("obs")
        obs.attrs.update({"encoding-type": "dataframe", "encoding-version": "0.2.0", "_index": "_index"})
        obs.attrs["column-order"] = np.array([], dtype=h5py.string_dtype("utf-8"))
        strings(obs, "_index", [f"{names[r]}-{k // rows}" for k, r in enumerate(order)])
        f.copy(f["var"], g, "var")
        for name in ["layers", "obsm", "obsp", "varm", "varp", "uns"]:
            e = g.create_group(name)
            e.attrs.update({"encoding-type": "dict", "encoding-version": "0.1.0"})
        if "--spatial" in sys.argv:
            side = int(np.ceil(np.sqrt(n)))
            k = np.arange(n)
            jitter = np.random.default_rng(0).uniform(-5.0, 5.0, (n, 2))
            xy = np.stack([(k % side) * 15.0, (k // side) * 15.0], axis=1) + jitter
            sp = g["obsm"].create_dataset("spatial", data=xy)
            sp.attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
        if hvg is not None:
            detected_in = np.bincount(indices, minlength=cols)
            top = np.argsort(-detected_in, kind="stable")[:hvg]
            flag = np.zeros(cols, dtype=bool)
            flag[top] = True
            var = g["var"]
            if "highly_variable" in var:
                del var["highly_variable"]
            hv = var.create_dataset("highly_variable", data=flag)
            hv.attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
            order = [c.decode() if isinstance(c, bytes) else str(c) for c in var.attrs.get("column-order", [])]
            var.attrs["column-order"] = np.array([c for c in order if c != "highly_variable"] + ["highly_variable"], dtype=h5py.string_dtype("utf-8"))
        g.attrs.update({"encoding-type": "anndata", "encoding-version": "0.1.0"})
        if genes_out:
            var = f["var"]
            ids = [s.decode() if isinstance(s, bytes) else s for s in var[var.attrs["_index"]][:]]
            detected = np.zeros(cols, dtype=bool)
            detected[np.unique(indices)] = True
            with open(genes_out, "w") as w:
                w.writelines(f"{ids[j]}\n" for j in np.flatnonzero(detected))
        print(f"{out}: {n} cells x {cols} genes, {nnz} stored values, genes per cell mean {lengths.mean():.0f}"
              f" (min {lengths.min()}, max {lengths.max()}), tiled from {rows} cells of {src}")


if __name__ == "__main__":
    main()
