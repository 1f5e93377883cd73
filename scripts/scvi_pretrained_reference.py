#!/usr/bin/env python3
"""Parity fixtures for `scfoundry embed --method scvi` (a pretrained scVI model's encoder).

Trains two tiny scVI models with scvi-tools on demo cells for a few seeded epochs, saves each
with `model.save(dir)` (scvi-tools' own folder format: model.pt holding model_state_dict,
var_names and attr_dict), and records what scvi-tools returns for a query file whose genes are
in another order, lack some of the model's genes and hold extra ones:

- `query.h5ad`: the query (raw counts, obs `batch`);
- `<config>/model.pt`: the saved model;
- `<config>/reference.json`: the model's genes, the query's aligned gene index (-1 = missing,
  zero-filled as scfoundry does), scvi-tools' `get_latent_representation()` on the aligned query
  (the latent mean; for latent_distribution "ln" the mean of softmax over 5,000 samples),
  `get_latent_representation(return_dist=True)` (qz mean and variance), the seed and versions.

Configurations (so that a wrong branch fails):
- `default`: SCVI() defaults (n_hidden 128, n_latent 10, n_layers 1, BatchNorm in the encoder,
  latent "normal", no covariate in the encoder);
- `deep_ln`: n_layers 2, n_hidden 32, n_latent 6, encode_covariates=True with three batches,
  use_layer_norm="both", use_batch_norm="none", latent_distribution="ln", gene_likelihood="nb".

Run by hand (scvi-tools is not part of CI); the outputs are committed:

    ~/.cache/scfoundry/scvi-venv/bin/python scripts/scvi_pretrained_reference.py \
        --data demo/pbmc68k_counts.h5ad --out tests/fixtures/scvi_pretrained
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import anndata as ad
import numpy as np
import scipy.sparse as sp
import scvi
import torch

CONFIGS = {
    "default": dict(model=dict(), batches=False),
    "deep_ln": dict(
        model=dict(
            n_layers=2, n_hidden=32, n_latent=6, encode_covariates=True, use_layer_norm="both",
            use_batch_norm="none", latent_distribution="ln", gene_likelihood="nb",
        ),
        batches=True,
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="demo/pbmc68k_counts.h5ad")
    ap.add_argument("--out", default="tests/fixtures/scvi_pretrained")
    ap.add_argument("--n-genes", type=int, default=120)
    ap.add_argument("--train-cells", type=int, default=400)
    ap.add_argument("--query-cells", type=int, default=60)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    full = ad.read_h5ad(args.data)
    X = full.X.toarray() if sp.issparse(full.X) else np.asarray(full.X)
    rng = np.random.default_rng(args.seed)
    # the model's genes: the most expressed ones, in the file's order
    order = np.sort(np.argsort(-X.sum(0))[: args.n_genes])
    genes = full.var_names[order].to_numpy()
    batches = np.array(["donor_a", "donor_b", "donor_c"])
    cells = rng.permutation(full.n_obs)
    train_idx, query_idx = cells[: args.train_cells], cells[args.train_cells : args.train_cells + args.query_cells]

    train = ad.AnnData(X=sp.csr_matrix(X[train_idx][:, order].astype(np.float32)))
    train.var_names = genes
    train.obs_names = full.obs_names[train_idx]
    train.obs["batch"] = batches[rng.integers(0, 3, train.n_obs)]

    # the query: 10 of the model's genes missing, 15 other genes added, columns shuffled
    missing = set(rng.choice(genes, 10, replace=False))
    others = [g for g in full.var_names if g not in set(genes)]
    extra = list(rng.choice(others, 15, replace=False))
    qgenes = [g for g in genes if g not in missing] + extra
    qgenes = list(rng.permutation(qgenes))
    col = {g: i for i, g in enumerate(full.var_names)}
    qX = X[query_idx][:, [col[g] for g in qgenes]].astype(np.float32)
    query = ad.AnnData(X=sp.csr_matrix(qX))
    query.var_names = qgenes
    query.obs_names = full.obs_names[query_idx]
    query.obs["batch"] = batches[rng.integers(0, 3, query.n_obs)]
    query.obs["batch"] = query.obs["batch"].astype("category")
    query.write_h5ad(out / "query.h5ad", compression=None)

    # what scfoundry computes from: the query aligned to the model's genes, missing ones zero
    qpos = {g: i for i, g in enumerate(qgenes)}
    aligned_idx = [qpos.get(g, -1) for g in genes]
    aX = np.zeros((query.n_obs, len(genes)), np.float32)
    for j, i in enumerate(aligned_idx):
        if i >= 0:
            aX[:, j] = qX[:, i]

    for name, cfg in CONFIGS.items():
        scvi.settings.seed = args.seed
        tr = train.copy()
        scvi.model.SCVI.setup_anndata(tr, batch_key="batch" if cfg["batches"] else None)
        model = scvi.model.SCVI(tr, **cfg["model"])
        model.train(max_epochs=args.epochs, batch_size=128, enable_progress_bar=False)
        d = out / name
        if d.exists():
            shutil.rmtree(d)
        model.save(str(d), save_anndata=False)
        aligned = ad.AnnData(X=sp.csr_matrix(aX))
        aligned.var_names = genes
        aligned.obs_names = query.obs_names
        if cfg["batches"]:
            aligned.obs["batch"] = query.obs["batch"].to_numpy()
        model.module.eval()
        torch.manual_seed(args.seed)
        z = model.get_latent_representation(aligned, batch_size=128)
        qm, qv = model.get_latent_representation(aligned, return_dist=True, batch_size=128)
        ref = {
            "config": name,
            "model_kwargs": cfg["model"],
            "scvi_tools": scvi.__version__,
            "torch": torch.__version__,
            "seed": args.seed,
            "epochs": args.epochs,
            "train_cells": int(train.n_obs),
            "model_genes": list(map(str, genes)),
            "query_genes": list(map(str, qgenes)),
            "aligned_index": aligned_idx,
            "missing_genes": sorted(map(str, missing)),
            "latent": np.asarray(z, np.float64).round(8).tolist(),
            "qz_mean": np.asarray(qm, np.float64).round(8).tolist(),
            "qz_var": np.asarray(qv, np.float64).round(8).tolist(),
            "mc_samples": 5000,
        }
        (d / "reference.json").write_text(json.dumps(ref) + "\n")
        print(name, z.shape, "saved to", d, "size", (d / "model.pt").stat().st_size)


if __name__ == "__main__":
    main()
