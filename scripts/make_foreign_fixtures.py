#!/usr/bin/env python3
"""Write the files users have that are not current AnnData, in their real layouts, with h5py:

    python scripts/make_foreign_fixtures.py [--out tests/fixtures/foreign]

Run it with anndata 0.13 and scanpy installed (pip install -r ci/anndata-0.13.txt, Python 3.12).
Each file is written in the layout its tool writes, then read back by that tool's reader in
Python (anndata.read_h5ad, scanpy.read_10x_h5); what the reader gives is written beside it as
`<name>.reference.h5ad` (var names made unique, as every method needs), which the tests compare
scfoundry's results with.

    legacy_v0.6.h5ad      anndata < 0.7 (the layout of anndata's own archive v0.5.0, which
                          0.5-0.6 wrote): obs/var/raw.var as compound datasets of fixed-width
                          byte strings and numbers (first member the index), categorical columns
                          as integer codes with uns['<col>_categories'] (raw.var's in raw.cat),
                          X and raw.X as h5sparse groups (h5sparse_format, h5sparse_shape), obsm
                          as a compound dataset with one (n, k) member per key, uns as a group.
                          The data are make_anndata_fixtures.py's (40 cells x 30 genes, seed 0).
    tenx_v3.h5            Cell Ranger >= 3 (and Space Ranger's filtered matrix): matrix/{barcodes,
                          data int32, indices, indptr int64, shape int32 (genes, cells),
                          features/{_all_tag_keys, feature_type, genome, id, name, pattern, read,
                          sequence}}; 3 antibody features beside the genes, two genes sharing a
                          symbol.
    tenx_v3_two_genomes.h5  a barnyard v3 file: GRCh38 and mm10 genes, one matrix.
    tenx_v2.h5            Cell Ranger 2: GRCh38/{barcodes, data, gene_names, genes, indices,
                          indptr, shape}.
    tenx_v2_two_genomes.h5  Cell Ranger 2 with hg19 and mm10 groups.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import h5py
import numpy as np
import scipy.sparse as sp

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).parent))
from make_anndata_fixtures import build  # noqa: E402  (the same cells as the version matrix)


def fixed(strings) -> np.ndarray:
    return np.array([s.encode() for s in strings], dtype=f"S{max(1, max(len(s) for s in strings))}")


def records(index, cols: dict) -> np.ndarray:
    fields = [("index", fixed(index))] + [(k, v) for k, v in cols.items()]
    dt = [(k, v.dtype) for k, v in fields]
    out = np.zeros(len(index), dtype=dt)
    for k, v in fields:
        out[k] = v
    return out


def h5sparse(f: h5py.File, name: str, m: sp.csr_matrix) -> None:
    g = f.create_group(name)
    g.attrs["h5sparse_format"] = "csr"
    g.attrs["h5sparse_shape"] = np.array(m.shape)
    g["data"] = m.data
    g["indices"] = m.indices
    g["indptr"] = m.indptr


def legacy(out: Path) -> None:
    Xc, Xraw, obs, var, raw_var, x_pca, pcs, uns = build()
    path = out / "legacy_v0.6.h5ad"
    with h5py.File(path, "w") as f:
        h5sparse(f, "X", sp.csr_matrix(Xc.astype(np.float32)))
        f["obs"] = records(list(obs.index), {
            "cell_type": obs["cell_type"].cat.codes.to_numpy().astype(np.int8),
            "n_genes": obs["n_genes"].to_numpy().astype(np.int64),
            "score": obs["score"].to_numpy().astype(np.float64),
            "is_good": obs["is_good"].to_numpy().astype(bool),
        })
        f["var"] = records(list(var.index), {
            "gene_group": var["gene_group"].cat.codes.to_numpy().astype(np.int8),
            "dispersion": var["dispersion"].to_numpy().astype(np.float64),
        })
        obsm = np.zeros(len(obs), dtype=[("X_pca", np.float64, (x_pca.shape[1],))])
        obsm["X_pca"] = x_pca
        f["obsm"] = obsm
        varm = np.zeros(len(var), dtype=[("PCs", np.float64, (pcs.shape[1],))])
        varm["PCs"] = pcs
        f["varm"] = varm
        h5sparse(f, "raw.X", sp.csr_matrix(Xraw.astype(np.float32)))
        f["raw.var"] = records(list(raw_var.index), {"raw_mean": raw_var["raw_mean"].to_numpy()})
        f.create_group("raw.cat")
        u = f.create_group("uns")
        u["cell_type_categories"] = fixed(list(obs["cell_type"].cat.categories))
        u["gene_group_categories"] = fixed(list(var["gene_group"].cat.categories))
        u["title"] = uns["title"]                       # a str: h5py writes variable-length UTF-8
        u["n_int"] = np.int64(uns["n_int"])
        p = u.create_group("params")
        p["method"] = "pca"
        p["n_comps"] = np.int64(5)
    reference(path, read_legacy)


def read_legacy(path: Path):
    import anndata as ad
    return ad.read_h5ad(path)


def counts(rs, n_cells: int, n_features: int) -> sp.csc_matrix:
    lam = rs.gamma(shape=0.5, scale=2.0, size=(n_features, n_cells))
    x = rs.poisson(lam).astype(np.int32)
    x[np.arange(n_features) % n_features, np.arange(n_features) % n_cells] += 1
    return sp.csc_matrix(x)  # genes x cells, stored CSC: indptr over cells


def write_matrix(g: h5py.Group, m: sp.csc_matrix, barcodes) -> None:
    g["barcodes"] = fixed(barcodes)
    g["data"] = m.data.astype(np.int32)
    g["indices"] = m.indices.astype(np.int64)
    g["indptr"] = m.indptr.astype(np.int64)
    g["shape"] = np.array(m.shape, dtype=np.int32)


def tenx_v3(out: Path, name: str, genomes: list[str]) -> None:
    rs = np.random.RandomState(1)
    n_cells, per_genome, n_ab = 25, 20, 3
    ids, names, types, gen = [], [], [], []
    for gi, g in enumerate(genomes):
        for j in range(per_genome):
            ids.append(f"ENS{'G' if gi == 0 else 'MUSG'}{j:011d}")
            names.append(f"{g}_GENE{j}" if len(genomes) > 1 else f"GENE{j}")
            types.append("Gene Expression")
            gen.append(g)
    names[5] = names[4]                                   # two genes share a symbol (as in GRCh38)
    for k in range(n_ab):
        ids.append(f"CD{k}_TotalSeqB")
        names.append(f"CD{k}")
        types.append("Antibody Capture")
        gen.append("")
    m = counts(rs, n_cells, len(ids))
    with h5py.File(out / name, "w") as f:
        g = f.create_group("matrix")
        write_matrix(g, m, [f"AAACCTGAGC{i:06d}-1" for i in range(n_cells)])
        ft = g.create_group("features")
        ft["_all_tag_keys"] = fixed(["genome", "pattern", "read", "sequence"])
        ft["feature_type"] = fixed(types)
        ft["genome"] = np.array([x.encode() for x in gen], dtype="S8")
        ft["id"] = fixed(ids)
        ft["name"] = fixed(names)
        ft["pattern"] = np.array([b"" if t == "Gene Expression" else b"^(BC)" for t in types], dtype="S8")
        ft["read"] = np.array([b"" if t == "Gene Expression" else b"R2" for t in types], dtype="S4")
        ft["sequence"] = np.array([b"" if t == "Gene Expression" else b"ACGTACGT" for t in types], dtype="S8")
    reference(out / name, read_10x)


def tenx_v2(out: Path, name: str, genomes: list[str]) -> None:
    rs = np.random.RandomState(2)
    n_cells, n_genes = 25, 20
    barcodes = [f"AAACATACAAC{i:05d}-1" for i in range(n_cells)]
    with h5py.File(out / name, "w") as f:
        for gi, g in enumerate(genomes):
            m = counts(rs, n_cells, n_genes)
            grp = f.create_group(g)
            write_matrix(grp, m, barcodes)
            grp["genes"] = fixed([f"ENS{gi}G{j:011d}" for j in range(n_genes)])
            names = [f"GENE{j}" for j in range(n_genes)]
            names[7] = names[6]
            grp["gene_names"] = fixed(names)
    if len(genomes) == 1:
        reference(out / name, read_10x)


def read_10x(path: Path):
    import scanpy as sc
    return sc.read_10x_h5(path)


def reference(path: Path, reader) -> None:
    a = reader(path)
    a.var_names_make_unique()
    ref = path.with_name(path.stem + ".reference.h5ad")
    a.write_h5ad(ref)
    print(f"wrote {path} and {ref.name} ({a.n_obs} x {a.n_vars})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="tests/fixtures/foreign")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    legacy(out)
    tenx_v3(out, "tenx_v3.h5", ["GRCh38"])
    tenx_v3(out, "tenx_v3_two_genomes.h5", ["GRCh38", "mm10"])
    tenx_v2(out, "tenx_v2.h5", ["GRCh38"])
    tenx_v2(out, "tenx_v2_two_genomes.h5", ["hg19", "mm10"])


if __name__ == "__main__":
    main()
