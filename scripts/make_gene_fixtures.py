#!/usr/bin/env python3
"""Write the gene-id fixtures of tests/it/genes.rs (tests/fixtures/genes/) from committed data,
through the offline gene table (resources/genes/human.tsv.gz, scripts/make_gene_map.py):

- pbmc68k_50_symbols.h5ad: the geneformer fixture's 50 cells (tests/fixtures/geneformer/
  pbmc68k_50.h5ad) with var_names rewritten to the table's symbol of var['ensembl_id'] (the
  name as it was where the table has no symbol) and the ensembl_id column dropped: symbols only.
- pbmc68k_50_versioned.h5ad: the first 50 demo cells (demo/pbmc68k_counts.h5ad) with var_names
  rewritten to versioned Ensembl ids (ENSG...<.N>) where the geneformer fixture has an id, the
  symbol otherwise; no symbol column.

    $SCFOUNDRY_TEST_PYTHON scripts/make_gene_fixtures.py     # anndata, numpy
"""
import gzip
import os

import anndata as ad

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "genes")


def table():
    rows = [l.rstrip("\n").split("\t") for l in gzip.open(os.path.join(ROOT, "resources/genes/human.tsv.gz"), "rt") if not l.startswith("#")]
    return {i: s for i, s in rows[1:]}


def main():
    os.makedirs(OUT, exist_ok=True)
    id2sym = table()
    gf = ad.read_h5ad(os.path.join(ROOT, "tests/fixtures/geneformer/pbmc68k_50.h5ad"))
    ids = list(gf.var["ensembl_id"].astype(str))
    sym = gf.copy()
    sym.var_names = [id2sym.get(i, n) for i, n in zip(ids, gf.var_names)]
    sym.var = sym.var.drop(columns=["ensembl_id"])
    sym.write_h5ad(os.path.join(OUT, "pbmc68k_50_symbols.h5ad"), compression="gzip")

    demo = ad.read_h5ad(os.path.join(ROOT, "demo/pbmc68k_counts.h5ad"))[:50].copy()
    by_name = dict(zip(gf.var_names, ids))
    names = []
    for k, n in enumerate(demo.var_names):
        i = by_name.get(n, "")
        names.append(f"{i}.{k % 17 + 1}" if i else n)
    demo.var_names = names
    demo.uns = {}
    demo.write_h5ad(os.path.join(OUT, "pbmc68k_50_versioned.h5ad"), compression="gzip")
    print(f"wrote {OUT}: {sym.n_vars} symbols; {sum(1 for n in names if n.startswith('ENSG'))} of {len(names)} versioned ids")


if __name__ == "__main__":
    main()
