#!/usr/bin/env python3
"""Parity fixture for scfoundry's GenePT-w (src/methods/genept.rs), as upstream computes it.

Run once by hand (CI only reads what this writes):

    ~/.cache/scfoundry/venv-ci/bin/python scripts/genept_reference.py

GenePT (github.com/yiqunchen/GenePT, read at 45a36bc) is notebooks, not a package. GenePT-w is
computed in aorta_data_analysis.ipynb (the cell after "GenePT-w"):

    lookup_embed = np.zeros(shape=(len(gene_names), EMBED_DIM))
    for i, gene in enumerate(gene_names):           # gene_names = list(adata.var.index)
        if gene in GPT_3_5_gene_embeddings:
            lookup_embed[i, :] = GPT_3_5_gene_embeddings[gene].flatten()
        else:
            count_missing += 1
    genePT_w_emebed = np.dot(adata.X, lookup_embed) / len(gene_names)

i.e. the expression-weighted SUM of the gene vectors divided by the number of genes in the data
(matched or not), with no further normalisation. That computation is repeated below with numpy
(float64, as upstream's lookup table) on a seeded random table.

The table is a pickled dict {gene symbol: numpy float64 vector}, as gene_embeddings_examples.ipynb
writes it (`np.array(openai...embedding)`, pickle.dump with Python's default protocol, 4). The
released table (GenePT_gene_embedding_ada_text.pickle in the pinned zip) has 1536-d vectors;
this one has DIM-d vectors to stay small: 600 of the demo data's 765 genes (so 165 are missing)
and 100 symbols not in the data. Two more pickles hold the first 10 genes in the other shapes
the loader must read: protocol 2 with plain lists of floats, and protocol 5 (numpy arrays
pickled through PickleBuffer, numpy's _frombuffer).
"""

import json
import pickle
import sys
from pathlib import Path

import anndata
import numpy as np

SEED = 0
DIM = 32
N_FROM_DATA = 600
N_ABSENT = 100

ROOT = Path(__file__).resolve().parent.parent
DATA = "tests/fixtures/geneformer/pbmc68k_50.h5ad"
OUT = ROOT / "tests/fixtures/genept"


def main():
    rng = np.random.default_rng(SEED)
    adata = anndata.read_h5ad(ROOT / DATA)
    genes = list(adata.var.index)
    keys = [str(g) for g in rng.choice(genes, N_FROM_DATA, replace=False)] + [f"ABSENT{i}" for i in range(N_ABSENT)]
    keys = [str(k) for k in rng.permutation(keys)]
    table = {k: rng.normal(size=DIM) for k in keys}

    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "GenePT_gene_embedding_ada_text.pickle", "wb") as fp:
        pickle.dump(table, fp)
    small = {k: table[k] for k in keys[:10]}
    with open(OUT / "lists_protocol2.pickle", "wb") as fp:
        pickle.dump({k: [float(x) for x in v] for k, v in small.items()}, fp, protocol=2)
    with open(OUT / "arrays_protocol5.pickle", "wb") as fp:
        pickle.dump(small, fp, protocol=5)

    # upstream's computation
    X = adata.X.toarray() if hasattr(adata.X, "toarray") else np.asarray(adata.X)
    count_missing = 0
    lookup_embed = np.zeros(shape=(len(genes), DIM))
    for i, gene in enumerate(genes):
        if gene in table:
            lookup_embed[i, :] = table[gene].flatten()
        else:
            count_missing += 1
    emb = np.dot(X, lookup_embed) / len(genes)

    ref = {
        "made_by": "scripts/genept_reference.py",
        "upstream": "github.com/yiqunchen/GenePT at 45a36bc, aorta_data_analysis.ipynb (GenePT-w cell)",
        "versions": {"numpy": np.__version__, "anndata": anndata.__version__, "python": sys.version.split()[0]},
        "seed": SEED,
        "dim": DIM,
        "data": DATA,
        "genes": {"in_data": len(genes), "missing": count_missing, "in_table": len(keys)},
        "first_keys": keys[:10],
        "embeddings": emb.tolist(),
    }
    (OUT / "reference.json").write_text(json.dumps(ref))
    print(f"wrote {OUT}: {len(keys)} genes x {DIM}; {count_missing} of {len(genes)} data genes missing; {emb.shape[0]} cells")


if __name__ == "__main__":
    main()
