"""geneformer's `embed --device cuda` (DIR/gf_f32.h5ad, DIR/gf_bf16.h5ad, made from the parity
fixture tests/fixtures/geneformer/pbmc68k_50.h5ad) against transformers' cell embeddings in
tests/fixtures/geneformer/reference.json: the largest relative error over the cells.

    python3 bench/geneformer_embed_vs_reference.py DIR      # needs h5py and numpy
"""
import json
import sys

import h5py
import numpy as np

want = np.array(json.load(open("tests/fixtures/geneformer/reference.json"))["v1"]["embeddings"]["emb_layer_-1_cell"], dtype=np.float64)
for p in ("f32", "bf16"):
    got = h5py.File(f"{sys.argv[1]}/gf_{p}.h5ad", "r")["obsm/X_geneformer"][()].astype(np.float64)
    ok = ~np.isnan(want).any(axis=1)
    err = max(np.linalg.norm(got[i] - want[i]) / np.linalg.norm(want[i]) for i in np.where(ok)[0])
    print(f"geneformer embed --device cuda --precision {p}: largest relative error {err:.2e} over {ok.sum()} cells")
