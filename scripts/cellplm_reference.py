#!/usr/bin/env python3
"""Parity fixture for scfoundry's CellPLM (src/methods/cellplm.rs), from upstream's own code.

Run once by hand, never in CI (CI only reads what this writes):

    python3 -m venv ~/.cache/scfoundry/torch-venv-cellplm
    # torch 2.3.0 CPU, anndata, scanpy, sklearn: those of torch-venv-scgpt, through a .pth file
    echo ~/.cache/scfoundry/torch-venv-scgpt/lib/python3.11/site-packages \
        > ~/.cache/scfoundry/torch-venv-cellplm/lib/python3.11/site-packages/scgpt_torch.pth
    ~/.cache/scfoundry/torch-venv-cellplm/bin/pip install --no-deps cellplm==0.1.0.post2 einops
    ~/.cache/scfoundry/torch-venv-cellplm/bin/python scripts/cellplm_reference.py

The package is imported as released (PyPI cellplm 0.1.0.post2; its CellPLM/ tree is the
github.com/OmicsML/CellPLM code). Its dependencies pydance, mygene and hdf5plugin are not
needed on this code path (mygene only for symbol-to-Ensembl conversion, which the fixture's
genes never trigger) and are not installed. Every step is upstream's:

- model.OmicsFormer(**config) at a small configuration with the keys of upstream's released
  config (ckpt/20230926_85M.config.json: enc_mod flowformer, latent_mod gmvae, norm groupnorm,
  cat_pe false, dec_mod nbmlp, ...) but enc_hid 32, 2 layers, 4 heads, post_latent_dim 16,
  4 clusters, and a gene_list of 280 genes; built as for pre-training (with its NB decoder, so
  the checkpoint carries keys the embedding pipeline ignores, as the released one does). Every
  parameter is perturbed with seeded noise (norm scales and biases too).
- Saved as upstream's checkpoints are: `<prefix>.config.json` (json of the config, gene_list
  included) and `<prefix>.best.ckpt` (torch.save of {"model_state_dict": state_dict}). One
  tensor is left out to keep the fixture small: the 10,000 x 16 sinusoidal table
  `embedder.pe_enc.pe_enc.weight` (deterministic, and unused: OmicsEmbeddingLayer.forward sets
  pe = 0.); upstream's load_pretrain keeps the model's own value for a missing key.
- pipeline.cell_embedding.CellEmbeddingPipeline(pretrain_prefix, pretrain_directory) loads
  them (load_pretrain, head_type 'embedder'), then predict(adata, inference_config=
  {"batch_size": B}) embeds. Its TranscriptomicDataset groups cells by obs['batch'] (all cells
  one group without that column); each group is cut into chunks of B cells in data order
  (B = 0: the whole group), and each chunk is one forward pass in which the cells attend to
  each other. The fixture records four such compositions.

One change to upstream, stated: in eval mode GMVAELatentLayer draws the one-hot cluster y fed
to q(z|x, y) with Gumbel noise (GumbelSoftmax.sample_gumbel, torch.rand_like), so upstream's
embedding is random from call to call. The fixture replaces the Gumbel noise by zeros, which
makes y the argmax of the cluster logits (the noise-free mode); scfoundry does the same. The
script also measures, on the unpatched code, how far two seeded calls are apart.

Data: tests/fixtures/cellplm/cells.h5ad, written here: the first 64 cells of
demo/wu2020_tcells.h5ad (raw counts, 13 patients in obs['batch']), 300 genes of theirs in a
seeded order: 240 in the model's gene list, 60 not (dropped, as common_preprocess drops them);
the model's list adds 40 genes the data lacks (their columns are simply absent: the gene
embeddings of the present genes are summed).
"""

import json
import sys
from pathlib import Path

import anndata
import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch

import CellPLM
from CellPLM.latent import autoencoders
from CellPLM.model import OmicsFormer
from CellPLM.pipeline.cell_embedding import CellEmbeddingPipeline

SEED = 0
PREFIX = "tiny"
N_CELLS = 64
N_SHARED = 240
N_DATA_ONLY = 60
N_MODEL_ONLY = 40

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests/fixtures/cellplm"


def config(genes):
    # the released config's keys (ckpt/20230926_85M.config.json), small sizes
    return {
        "name": "tiny_fixture",
        "enc_mod": "flowformer",
        "enc_hid": 32,
        "enc_layers": 2,
        "enc_head": 4,
        "latent_mod": "gmvae",
        "lamda": 5.0,
        "post_latent_dim": 16,
        "dec_mod": "nbmlp",
        "dec_hid": 32,
        "dec_layers": 2,
        "model_dropout": 0.2,
        "mask_node_rate": 0.75,
        "mask_feature_rate": 0.25,
        "drop_node_rate": 0.3,
        "norm": "groupnorm",
        "dataset": "fixture",
        "architecture": "OmicsFormer",
        "w_li": 5.0,
        "w_en": 5.0,
        "num_clusters": 4,
        "out_dim": len(genes),
        "cat_pe": False,
        "max_batch_size": 4000,
        "dar": False,
        "input_covariate": False,
        "ecs": False,
        "dsbn": False,
        "dae": True,
        "mask_beta": True,
        "batch_num": 3,
        "dataset_num": 2,
        "gene_list": genes,
    }


def main():
    rng = np.random.default_rng(SEED)
    torch.manual_seed(SEED)
    OUT.mkdir(parents=True, exist_ok=True)

    # ---- data: 64 cells, 300 genes, raw counts
    demo = anndata.read_h5ad(ROOT / "demo/wu2020_tcells.h5ad")
    cells = demo[:N_CELLS]
    x = sp.csr_matrix(cells.X)
    detected = np.asarray((x > 0).sum(0)).ravel()
    names = np.asarray(cells.var_names)
    order = np.argsort(-detected, kind="stable")
    top = names[order[: N_SHARED + N_DATA_ONLY]]
    pick = rng.permutation(len(top))
    shared = list(top[pick[:N_SHARED]])
    data_only = list(top[pick[N_SHARED:]])
    absent = names[detected == 0]
    model_only = list(rng.choice(absent, N_MODEL_ONLY, replace=False))
    data_genes = list(rng.permutation(np.array(shared + data_only, dtype=object)))
    model_genes = list(rng.permutation(np.array(shared + model_only, dtype=object)))
    sub = cells[:, data_genes]
    counts = sp.csr_matrix(sub.X, dtype=np.float32)
    counts.sort_indices()
    obs = pd.DataFrame(
        {"batch": pd.Categorical(list(cells.obs["batch"].astype(str))), "cell_type": pd.Categorical(list(cells.obs["cell_type"].astype(str)))},
        index=list(cells.obs_names),
    )
    data = anndata.AnnData(X=counts, obs=obs, var=pd.DataFrame(index=data_genes))
    data.write_h5ad(OUT / "cells.h5ad", compression=None)

    # ---- model: built as for pre-training, perturbed, saved in upstream's checkpoint format
    cfg = config([str(g) for g in model_genes])
    model = OmicsFormer(**cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.1)
    state = {k: v for k, v in model.state_dict().items() if k != "embedder.pe_enc.pe_enc.weight"}
    ckpt_dir = OUT / "ckpt"
    ckpt_dir.mkdir(exist_ok=True)
    torch.save({"model_state_dict": state}, ckpt_dir / f"{PREFIX}.best.ckpt")
    with open(ckpt_dir / f"{PREFIX}.config.json", "w") as f:
        json.dump(cfg, f)

    # ---- upstream's pipeline, with the per-forward inputs and embedder outputs recorded
    pipe = CellEmbeddingPipeline(pretrain_prefix=PREFIX, pretrain_directory=str(ckpt_dir))
    calls = []
    emb_forward = type(pipe.model.embedder).forward

    def recording(self, x_dict, input_gene_list=None):
        h = emb_forward(self, x_dict, input_gene_list)
        calls.append({"gene_idx": x_dict["input_gene_mask"].tolist(), "h0": h.detach().clone()})
        return h

    type(pipe.model.embedder).forward = recording
    noise = autoencoders.GumbelSoftmax.sample_gumbel

    def predict(adata, batch_size, gumbel_zero=True, seed=None):
        calls.clear()
        autoencoders.GumbelSoftmax.sample_gumbel = (lambda self, logits, eps=1e-20: torch.zeros_like(logits)) if gumbel_zero else noise
        if seed is not None:
            torch.manual_seed(seed)
        out = pipe.predict(adata.copy(), inference_config={"batch_size": batch_size}, device="cpu").numpy()
        return out, [dict(c) for c in calls]

    no_batch = data.copy()
    del no_batch.obs["batch"]
    scenarios = {}
    groups_of = {}
    for name, ad_, bs in [("by_batch", data, 0), ("by_batch_chunks_4", data, 4), ("one_group", no_batch, 0), ("one_group_chunks_24", no_batch, 24)]:
        emb, cs = predict(ad_, bs)
        # which cells each forward saw, in upstream's order (TranscriptomicDataset, then chunks)
        if "batch" in ad_.obs:
            labels = ad_.obs["batch"].astype(str).to_numpy()
            classes = sorted(set(labels))
            groups = [np.nonzero(labels == c)[0] for c in classes]
        else:
            groups = [np.arange(ad_.n_obs)]
        forwards = []
        for g in groups:
            step = bs if bs > 0 else len(g)
            forwards += [g[j : j + step].tolist() for j in range(0, len(g), step)]
        assert [len(f) for f in forwards] == [c["h0"].shape[0] for c in cs], "forward sizes differ from the reconstruction"
        scenarios[name] = {"batch_column": "batch" in ad_.obs, "batch_size": bs, "forwards": forwards, "embeddings": emb.astype(float).round(8).tolist()}
        groups_of[name] = cs
    gene_idx = groups_of["one_group"][0]["gene_idx"]
    h0 = groups_of["one_group"][0]["h0"].numpy()

    # the same cell in different compositions: how far apart
    a = np.array(scenarios["one_group"]["embeddings"])
    b = np.array(scenarios["by_batch"]["embeddings"])
    c = np.array(scenarios["by_batch_chunks_4"]["embeddings"])
    comp = {
        "one_group_vs_by_batch_max_abs": float(np.abs(a - b).max()),
        "by_batch_vs_chunks_4_max_abs": float(np.abs(b - c).max()),
    }

    # upstream unpatched: the Gumbel draw makes two calls differ
    r1, _ = predict(no_batch, 0, gumbel_zero=False, seed=1)
    r2, _ = predict(no_batch, 0, gumbel_zero=False, seed=2)
    rel = lambda u, v: float(np.max(np.linalg.norm(u - v, axis=1) / np.linalg.norm(v, axis=1)))
    gumbel = {
        "seed1_vs_seed2_max_rel": rel(r1, r2),
        "seed1_vs_argmax_max_rel": rel(r1, a),
        "cells_differing_seed1_vs_argmax": int((np.linalg.norm(r1 - a, axis=1) > 1e-5).sum()),
    }
    print("compositions:", comp, "\ngumbel:", gumbel, file=sys.stderr)

    ref = {
        "made_by": "scripts/cellplm_reference.py",
        "upstream": f"cellplm 0.1.0.post2 (PyPI), torch {torch.__version__}",
        "seed": SEED,
        "data": "tests/fixtures/cellplm/cells.h5ad",
        "checkpoint": {"dir": "tests/fixtures/cellplm/ckpt", "prefix": PREFIX},
        "config": {k: v for k, v in cfg.items() if k != "gene_list"},
        "model_genes": len(model_genes),
        "data_genes": len(data_genes),
        "genes_used": sum(g in set(model_genes) for g in data_genes),
        "gene_idx": gene_idx,
        "h0_one_group": h0.astype(float).round(8).tolist(),
        "scenarios": scenarios,
        "composition_effect": comp,
        "upstream_gumbel_noise": gumbel,
    }
    with open(OUT / "reference.json", "w") as f:
        json.dump(ref, f)
    for p in sorted(OUT.rglob("*")):
        if p.is_file():
            print(p.relative_to(ROOT), p.stat().st_size, file=sys.stderr)


if __name__ == "__main__":
    main()
