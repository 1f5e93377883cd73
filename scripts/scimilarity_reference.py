#!/usr/bin/env python3
"""Parity fixture for scfoundry's SCimilarity (src/methods/scimilarity.rs), from upstream's code.

Run once by hand, never in CI (CI only reads what this writes):

    pip install --no-deps --target ~/.cache/scfoundry/scimilarity-pkg scimilarity==0.4.1
    PYTHONPATH=~/.cache/scfoundry/scimilarity-pkg \
        ~/.cache/scfoundry/torch-venv-scgpt/bin/python scripts/scimilarity_reference.py

(that venv: torch 2.3.0 CPU, numpy, pandas, scanpy, anndata, zarr). The package is imported as
released (scimilarity 0.4.1 on PyPI; its nn_models.py is identical to github.com/Genentech/
scimilarity at 3ce3ec8, its cell_embedding.py and utils.py differ there only in typing imports,
f-strings and a zarr class name), and its own code runs every step:

- nn_models.Encoder at a small configuration (n_genes = the fixture's gene order, hidden
  [32, 24], latent 16; upstream's released model is hidden [1024, 1024], latent 128), seeded
  random weights with every tensor perturbed (BatchNorm running statistics and the PReLU slopes
  too, so that each part of the layer matters), saved with Encoder.save_state (torch.save of
  {"state_dict": ...}) as encoder.ckpt;
- the model folder as training_models.MetricLearning.save_all writes it: layer_sizes.json
  ({state_dict key: shape}), gene_order.tsv ("\\n".join), label_ints.csv (pandas, QUOTE_NONNUMERIC);
- cell_embedding.CellEmbedding(model_path) reads that folder (architecture from layer_sizes.json);
- utils.align_dataset(data, ce.gene_order) then utils.lognorm_counts(data) (normalize_total to
  1e4 over the aligned genes, log1p), as upstream's tutorials do; then
  ce.get_embeddings(data.X) (the encoder's output is L2-normalised by Encoder.forward).

The gene order holds 240 of the demo data's 765 genes (seeded choice) and 60 symbols that are
not in the data (zero-filled by align_dataset), sorted as upstream's gene orders are (see
below). The data is
tests/fixtures/geneformer/pbmc68k_50.h5ad (50 cells of raw counts, symbols in var_names) with
its counts in layers['counts'], as lognorm_counts requires. align_dataset is called with
gene_overlap_threshold=1 (its default 5000 is more than this fixture's whole gene order).

align_dataset builds its result with anndata.concat(join="outer"), whose var index is the
pandas union of the gene order and the data's genes: sorted, whatever gene_order.tsv's order.
Upstream's gene orders are sorted (so the columns match the weights); an unsorted order would
feed the model columns that do not match its weights (a first version of this fixture, with a
shuffled order, showed it). scfoundry follows gene_order.tsv's order; the two agree for sorted
files, which this fixture uses.
"""

import csv
import json
import sys
from pathlib import Path

import anndata
import numpy as np
import pandas as pd
import torch

import scimilarity
from scimilarity.cell_embedding import CellEmbedding
from scimilarity.nn_models import Encoder
from scimilarity.utils import align_dataset, lognorm_counts

SEED = 0
HIDDEN = [32, 24]
LATENT = 16
N_FROM_DATA = 240
N_ABSENT = 60

ROOT = Path(__file__).resolve().parent.parent
DATA = "tests/fixtures/geneformer/pbmc68k_50.h5ad"
OUT = ROOT / "tests/fixtures/scimilarity"


def main():
    rng = np.random.default_rng(SEED)
    torch.manual_seed(SEED)
    data = anndata.read_h5ad(ROOT / DATA)
    genes = list(data.var_names)
    order = list(rng.choice(genes, N_FROM_DATA, replace=False)) + [f"ABSENT{i}" for i in range(N_ABSENT)]
    # sorted, as upstream's training writes gene_order.tsv (training_tutorial.ipynb select_genes:
    # `gene_order = sorted(gene_order)`; tests/data/gene_order.tsv, 28,231 genes, is sorted):
    # align_dataset's outer concat returns the columns in pandas' sorted union order, which is
    # the file's order only for a sorted file
    order = sorted(str(g) for g in order)

    enc = Encoder(n_genes=len(order), latent_dim=LATENT, hidden_dim=HIDDEN)
    with torch.no_grad():
        for name, t in enc.state_dict().items():
            if name.endswith("num_batches_tracked"):
                continue
            if name.endswith("running_var"):
                t.copy_(torch.rand_like(t) * 1.5 + 0.25)
            elif name.endswith("running_mean"):
                t.copy_(torch.randn_like(t) * 0.3)
            elif ".3.weight" in name:  # PReLU slope
                t.copy_(torch.rand_like(t) * 0.5)
            else:
                t.add_(torch.randn_like(t) * 0.05)

    model = OUT / "tiny"
    model.mkdir(parents=True, exist_ok=True)
    enc.save_state(str(model / "encoder.ckpt"))
    sd = enc.state_dict()
    (model / "layer_sizes.json").write_text(json.dumps({k: list(sd[k].size()) for k in sd}))
    (model / "gene_order.tsv").write_text("\n".join(order))
    pd.Series({0: "T cell", 1: "B cell"}).to_csv(model / "label_ints.csv", quoting=csv.QUOTE_NONNUMERIC)

    ce = CellEmbedding(model_path=str(model))
    data.layers["counts"] = data.X.copy()
    aligned = align_dataset(data, ce.gene_order, gene_overlap_threshold=1)
    aligned = lognorm_counts(aligned)
    assert list(aligned.var_names) == order, "align_dataset put the columns in another order"
    X = aligned.X
    emb = ce.get_embeddings(X.toarray() if hasattr(X, "toarray") else X)
    # batch size does not change the result (BatchNorm in eval mode)
    emb7 = ce.get_embeddings(X.toarray() if hasattr(X, "toarray") else X, buffer_size=7)
    assert np.abs(emb - emb7).max() < 1e-6

    dense = X.toarray() if hasattr(X, "toarray") else np.asarray(X)
    present = [g for g in order if g in set(genes)]
    ref = {
        "made_by": "scripts/scimilarity_reference.py",
        "upstream": f"scimilarity {scimilarity.__version__} (PyPI; github.com/Genentech/scimilarity): nn_models.Encoder, cell_embedding.CellEmbedding, utils.align_dataset + lognorm_counts",
        "versions": {"torch": torch.__version__, "numpy": np.__version__, "anndata": anndata.__version__, "python": sys.version.split()[0]},
        "seed": SEED,
        "config": {"n_genes": len(order), "hidden_dim": HIDDEN, "latent_dim": LATENT},
        "data": DATA,
        "genes": {"in_order": len(order), "in_data": len(present), "missing": len(order) - len(present)},
        "aligned_var_names": [str(v) for v in aligned.var_names],
        "lognorm_first_cells": dense[:3].tolist(),
        "embeddings": emb.astype(np.float64).tolist(),
    }
    (OUT / "reference.json").write_text(json.dumps(ref))
    print(f"wrote {OUT}: {len(order)} genes ({len(present)} in the data), {emb.shape[0]} cells x {emb.shape[1]}")


if __name__ == "__main__":
    main()
