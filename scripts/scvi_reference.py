#!/usr/bin/env python3
"""scvi-tools reference for `scfoundry integrate --method scvi_denovo`.

Trains scvi-tools' SCVI with the settings scvi_denovo uses on the same cells and genes, writes
its latent mean to a copy of the input (obsm['X_scvi_tools_s<seed>'], one per seed), copies in
other embeddings to compare (--add KEY=FILE:OBSM_KEY), and writes scvi-tools' ELBO history per
seed to a TSV. Score the result with `scfoundry benchmark` (see BENCHMARKS.md, "Integration: scvi_denovo").

    ~/.cache/scfoundry/scvi-venv/bin/python scripts/scvi_reference.py \
        --data /tmp/wu.scvi_denovo.h5ad --out /tmp/wu.compare.h5ad --seeds 0 1 2 \
        --add X_scvi_denovo_s1=/tmp/wu.s1.h5ad:X_scvi_denovo \
        --history tests/fixtures/scvi/scvi_tools_wu2020_history.tsv

The venv: scvi-tools 1.3.3 (pip) over torch 2.3.0 CPU (see docs/scvi_denovo.md). Torch is not
part of CI: this script is run by hand and its outputs are committed.

Settings (scvi-tools names): genes = scanpy `highly_variable_genes(flavor="seurat",
n_top_genes)` on normalize_total(target_sum=1e4) + log1p of the counts (what scvi_denovo
selects), model on the raw counts of those genes; SCVI(n_latent=10, n_hidden=128, n_layers=1,
dropout_rate=0.1, dispersion="gene", gene_likelihood="nb"), train() with its defaults
(max_epochs = min(round(20000 / n * 400), 400), batch_size 128, train_size 0.9, Adam lr 1e-3
eps 0.01 weight_decay 1e-6, n_epochs_kl_warmup 400) and check_val_every_n_epoch=1 so that the
validation ELBO is logged every epoch. `scvi.settings.seed = seed` seeds torch, numpy and the
split.
"""
from __future__ import annotations

import argparse
import time

import anndata as ad
import numpy as np
import scanpy as sc
import scvi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help=".h5ad with raw counts in X (or --layer) and the batch column")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-key", default="batch")
    ap.add_argument("--layer", default=None)
    ap.add_argument("--n-top-genes", type=int, default=2000, help="0 keeps every gene")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--max-epochs", type=int, default=None)
    ap.add_argument("--add", action="append", default=[], help="KEY=FILE:OBSM_KEY, copied into the output's obsm")
    ap.add_argument("--history", default=None, help="TSV of scvi-tools' ELBO per epoch and seed")
    args = ap.parse_args()

    adata = ad.read_h5ad(args.data)
    counts = adata.layers[args.layer] if args.layer else adata.X
    work = ad.AnnData(X=counts.copy(), obs=adata.obs[[args.batch_key]].copy(), var=adata.var[[]].copy())
    work.layers["counts"] = work.X.copy()
    if args.n_top_genes and args.n_top_genes < work.n_vars:
        sc.pp.normalize_total(work, target_sum=1e4)
        sc.pp.log1p(work)
        sc.pp.highly_variable_genes(work, flavor="seurat", n_top_genes=args.n_top_genes)
        work = work[:, work.var["highly_variable"]].copy()
    print(f"{work.n_obs} cells x {work.n_vars} genes, scvi-tools {scvi.__version__}")
    rows = []
    for seed in args.seeds:
        scvi.settings.seed = seed
        m_data = work.copy()
        scvi.model.SCVI.setup_anndata(m_data, layer="counts", batch_key=args.batch_key)
        model = scvi.model.SCVI(m_data, n_latent=10, n_hidden=128, n_layers=1, dropout_rate=0.1, dispersion="gene", gene_likelihood="nb")
        t0 = time.time()
        model.train(max_epochs=args.max_epochs, check_val_every_n_epoch=1, accelerator="cpu", enable_progress_bar=False)
        secs = time.time() - t0
        z = model.get_latent_representation()
        adata.obsm[f"X_scvi_tools_s{seed}"] = z.astype(np.float32)
        h = model.history
        tr = h["elbo_train"].iloc[:, 0].to_numpy()
        va = h["elbo_validation"].iloc[:, 0].to_numpy() if "elbo_validation" in h else np.full_like(tr, np.nan)
        print(f"seed {seed}: {len(tr)} epochs in {secs:.1f}s, final ELBO train {tr[-1]:.2f} validation {va[-1]:.2f}")
        for e in range(len(tr)):
            rows.append(f"{seed}\t{e}\t{tr[e]:.4f}\t{va[e] if e < len(va) else float('nan'):.4f}")
    for spec in args.add:
        key, rest = spec.split("=", 1)
        path, okey = rest.rsplit(":", 1)
        adata.obsm[key] = np.asarray(ad.read_h5ad(path).obsm[okey], dtype=np.float32)
    adata.write_h5ad(args.out)
    if args.history:
        with open(args.history, "w") as f:
            f.write(f"# scvi-tools {scvi.__version__}, {work.n_obs} cells x {work.n_vars} genes, made by scripts/scvi_reference.py\n")
            f.write("seed\tepoch\telbo_train\telbo_validation\n")
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
