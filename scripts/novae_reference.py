#!/usr/bin/env python3
"""Parity fixture for scfoundry's Novae (src/methods/novae.rs), from upstream's own package.

Run once by hand, never in CI (CI only reads what this writes):

    python3 -m venv ~/.cache/scfoundry/torch-venv-novae
    ~/.cache/scfoundry/torch-venv-novae/bin/pip install novae==1.1.2 torch-geometric==2.8.1
    ~/.cache/scfoundry/torch-venv-novae/bin/python scripts/novae_reference.py

Everything below calls the installed `novae` package (MICS-Lab/novae, now prism-oncology/novae,
PyPI 1.1.2) itself; nothing of its code path is rebuilt here:

- `novae.spatial_neighbors(adata, radius=RADIUS)` (novae/utils/build.py): scipy's Delaunay
  triangulation of obsm['spatial'], then the edges longer than the radius dropped;
- `novae.Novae(var_names=VOCAB, ...)` at a small configuration, every parameter seeded random,
  then `save_pretrained` (PyTorchModelHubMixin: model.safetensors + config.json, the format of the
  released MICS-Lab/novae-human-0) and `Novae.from_pretrained` of that folder;
- `model.compute_representations(adata)` (novae/model.py): normalize_total + log1p of the raw
  counts (utils/_validate.py), genes known to the model (all genes used: <= 100 genes, so no
  highly-variable selection), per-slide z-score (data/convert.py), each cell's n_hops_local
  subgraph (data/dataset.py), CellEmbedder (module/embed.py), the GATv2 encoder and the attention
  aggregation (module/encode.py, module/aggregate.py); obsm['novae_latent'] is the cell embedding.

Data: 160 cells x 80 genes of demo/pbmc68k_counts.h5ad (raw counts; the 80 genes detected in
the most cells), with seeded synthetic coordinates in microns: 159 cells uniform in a
220 x 220 square, one cell far away (its Delaunay edges are all longer than the radius, so it
has no neighbour: upstream leaves it out and fills its latent with zeros). The vocabulary is 70
of the 80 genes (lower-cased, as upstream keeps them) plus 30 names not in the data, shuffled.

Writes tests/fixtures/novae/: cells.h5ad (the input: raw counts + obsm['spatial']),
model/model.safetensors + model/config.json, reference.json (edge sets, gene indices,
per-gene means/stds, subgraph node sets, latent).
"""

import json
import shutil
import sys
from pathlib import Path

import anndata as ad
import numpy as np
import scipy.sparse as sp
import torch
from scipy.spatial import Delaunay

import novae

SEED = 0
N_CELLS = 160
N_GENES = 80
RADIUS = 50.0
CONFIG = dict(embedding_size=16, hidden_size=32, num_layers=3, heads=4, output_size=12, num_prototypes=16, histo_embedding_size=8)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "novae"


def make_cells() -> ad.AnnData:
    src = ad.read_h5ad(ROOT / "demo" / "pbmc68k_counts.h5ad")
    src = src[:N_CELLS].copy()
    detected = np.asarray((src.X > 0).sum(0)).ravel()
    genes = np.sort(np.argsort(-detected, kind="stable")[:N_GENES])
    x = sp.csr_matrix(src.X[:, genes], dtype=np.float32)
    rng = np.random.default_rng(SEED)
    coords = rng.uniform(0.0, 220.0, size=(N_CELLS, 2))
    coords[-1] = [600.0, 580.0]
    a = ad.AnnData(X=x)
    a.obs_names = [f"cell{i}" for i in range(N_CELLS)]
    a.var_names = list(src.var_names[genes])
    a.obsm["spatial"] = coords
    return a


def main() -> int:
    torch.manual_seed(SEED)
    np.random.seed(SEED)
    OUT.mkdir(parents=True, exist_ok=True)
    cells = make_cells()
    cells.write_h5ad(OUT / "cells.h5ad", compression=None)

    rng = np.random.default_rng(SEED + 1)
    data_genes = list(cells.var_names)
    known = [data_genes[i] for i in sorted(rng.choice(len(data_genes), 70, replace=False))]
    vocab = [g.lower() for g in known] + [f"absentgene{i}" for i in range(30)]
    vocab = [vocab[i] for i in rng.permutation(len(vocab))]

    model = novae.Novae(var_names=vocab, **CONFIG)
    gen = torch.Generator().manual_seed(SEED + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    model_dir = OUT / "model"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    model.save_pretrained(model_dir)
    for extra in model_dir.iterdir():
        if extra.name not in ("model.safetensors", "config.json"):
            extra.unlink()

    model = novae.Novae.from_pretrained(str(model_dir))
    adata = ad.read_h5ad(OUT / "cells.h5ad")

    # the edge sets: scipy's triangulation alone, then after the radius filter
    tri = Delaunay(adata.obsm["spatial"])
    tri_indptr, tri_indices = tri.vertex_neighbor_vertices
    novae.spatial_neighbors(adata, radius=RADIUS)
    dst = adata.obsp["spatial_distances"].tocsr()
    dst.sort_indices()

    model.compute_representations(adata, accelerator="cpu", num_workers=0)
    latent = np.asarray(adata.obsm["novae_latent"], dtype=np.float32)

    # what the model saw: genes used, their vocabulary rows, z-score statistics, subgraphs
    use = adata.var["novae_use_gene"].to_numpy()
    used_names = list(adata.var_names[use])
    gene_idx = model.cell_embedder.genes_to_indices(adata.var_names[use]).tolist()
    dm = model._init_datamodule(model._prepare_adatas(adata))
    conv = dm.dataset.torch_converter
    local = adata.obsp["spatial_distances_local"].tocsr()
    subgraphs = [sorted(local[i].indices.tolist()) for i in range(adata.n_obs)]
    valid = adata.obs["neighborhood_valid"].to_numpy().tolist()

    ref = {
        "novae_version": novae.__version__,
        "torch_geometric_version": __import__("torch_geometric").__version__,
        "torch_version": torch.__version__,
        "seed": SEED,
        "config": CONFIG,
        "radius": RADIUS,
        "n_hops_local": model.hparams.n_hops_local,
        "delaunay_indptr": tri_indptr.tolist(),
        "delaunay_indices": tri_indices.tolist(),
        "radius_indptr": dst.indptr.tolist(),
        "radius_indices": dst.indices.tolist(),
        "radius_distances": dst.data.tolist(),
        "used_genes": used_names,
        "gene_indices": gene_idx,
        "log1p_max": float(adata.X.max()),
        "means": conv.means[0].tolist(),
        "stds": conv.stds[0].tolist(),
        "subgraphs": subgraphs,
        "valid": valid,
        "latent_key": "novae_latent",
        "latent": latent.tolist(),
    }
    (OUT / "reference.json").write_text(json.dumps(ref))
    print(f"novae {novae.__version__}: {adata.n_obs} cells, {len(used_names)} genes used, "
          f"{sum(valid)} valid, {dst.nnz} edges after radius {RADIUS} ({len(tri_indices)} Delaunay), "
          f"latent {latent.shape}, |latent| max {np.abs(latent).max():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
