#!/usr/bin/env python3
"""Parity fixture for scfoundry's CellFM (src/methods/cellfm.rs), from the PyTorch port's own code.

Run once by hand, never in CI (CI only reads what this writes):

    git -C <CellFM-torch clone> archive b6c3673 layers | tar -x -C /tmp/cellfm-port
    ~/.cache/scfoundry/venv-cellfm/bin/python scripts/cellfm_reference.py /tmp/cellfm-port

That venv: torch (CPU is enough), numpy, pandas, scipy, scanpy, anndata, tqdm (what the port's
layers/utils.py imports). The port (github.com/biomed-AI/CellFM-torch, commit b6c3673) is not a
package: its `layers/` folder is imported from the clone, not rebuilt, and nothing of it is
copied into this repository. Used as they are:

- `layers.utils.read_h5ad` (counts of cells above 1e5 scaled down and rounded), `SCrna` (genes
  matched to gene_info, the first 2,048 kept, gene ids), `Prepare` and `build_dataset` (non-zero
  genes, log1p(x / T * 1e4), padding to 2,048, zero_idx), with the augmentations switched off
  through Prepare's own arguments (dw=False: no binomial down-sampling; mask_ratio=0: no masked
  genes), as a cell embedding wants;
- `layers.torch_finetune.FinetuneModel`: `encode` in eval mode (cls + the two ST_emb tokens in
  front; what model.py's Cell_FM returns as `cls_token`) and `embedding_infer` (cls alone, the
  path a state_dict without ST_emb gets in scfoundry).

SCrna reads `csv/expand_gene_info.csv` and `csv/updated_hgcn.tsv` relative to the working
directory, so this script runs in a temporary folder holding small files in those formats: a
gene table of 160 genes in the real gene_info.csv format (columns as upstream; 140 genes of the
demo data in a shuffled order, so gene ids differ from var order, and 20 genes it lacks) and an
HGNC table whose aliases match no gene (scfoundry matches symbols exactly; see docs/cellfm.md).
The gene table is also written to the fixture folder as gene_info.csv.

Small configuration: enc_dims 32, enc_nlayers 4, enc_num_heads 4 (the released 800M: 1536, 40,
48), FFN hidden 256 as upstream, lora 0, add_zero and pad_zero True as model.py sets them. Every
parameter is drawn anew from torch.manual_seed(0) (LayerNorm weights near 1, FFN.a non-zero) so
that none is left at an initial value that would hide a mistake.

Data: the 50 cells of tests/fixtures/geneformer/pbmc68k_50.h5ad (raw counts, 765 genes), the
first 300 genes kept, and cells 0, 1 and 2 multiplied by 500, 700 and 1,000 so that their totals pass
1e5 and read_h5ad's scaling is exercised; written to tests/fixtures/cellfm/cells.h5ad.

The checkpoint is written as main.py saves the port's Finetune_Cell_FM: torch.save of its
state_dict, the encoder under `extractor.net.` (less ST_enc, a training-only FFN of 260 KB) and a
classifier head under `cls.`.

Written to tests/fixtures/cellfm/: cellfm_torch.pt, cellfm_torch.json (enc_dims, enc_nlayers,
enc_num_heads: the heads are not in a state_dict), gene_info.csv, cells.h5ad, reference.json
(config, per cell the gene ids and float32 values the encoder sees, the 32-d cls embeddings of
`encode` and of `embedding_infer`).
"""

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import torch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests/fixtures/cellfm"
SOURCE = ROOT / "tests/fixtures/geneformer/pbmc68k_50.h5ad"
N_VAR = 300
N_IN_DATA = 140
N_ABSENT = 20
SCALED = {0: 500, 1: 700, 2: 1000}


class Cfg:
    """The attributes FinetuneModel reads (layers/utils.py Config_80M, small sizes)."""

    enc_dims = 32
    enc_nlayers = 4
    enc_num_heads = 4
    enc_dropout = 0.1
    dropout = 0.1
    lora = 0
    recompute = False
    add_zero = True
    pad_zero = True
    ecs = False
    ecs_threshold = 0.8
    nonz_len = 2048


def main():
    port = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(port))
    import anndata
    import scipy.sparse as sp
    from layers import utils as port_utils  # the port's layers/utils.py
    from layers.torch_finetune import FinetuneModel  # the port's layers/torch_finetune.py

    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)

    # --- data
    src = anndata.read_h5ad(SOURCE)
    X = src.X.toarray() if sp.issparse(src.X) else np.asarray(src.X)
    X = X[:, :N_VAR].astype(np.float32)
    for i, f in SCALED.items():
        X[i] *= f
    var = src.var_names[:N_VAR].tolist()
    ad = anndata.AnnData(X=sp.csr_matrix(X), obs=pd.DataFrame(index=src.obs_names.tolist()), var=pd.DataFrame(index=var))
    ad.write_h5ad(OUT / "cells.h5ad", compression=None)

    # --- gene table in gene_info.csv's format: 140 data genes (shuffled) + 20 absent ones
    expressed = [g for g, n in zip(var, (X > 0).sum(0)) if n >= 3]
    chosen = list(rng.choice(expressed, N_IN_DATA, replace=False))
    absent = [f"ABSENT{k}" for k in range(N_ABSENT)]
    table = chosen + absent
    rng.shuffle(table)
    info = pd.DataFrame(
        {
            "HGNC_gene": table,
            "h5_sample_frequency": rng.integers(100, 20000, len(table)),
            "biotype": ["RNA, long non-coding" if k % 7 == 0 else "gene with protein product" for k in range(len(table))],
            "gene_length": np.round(rng.uniform(1e3, 1e5, len(table)), 1),
            "exon_count": rng.integers(1, 50, len(table)).astype(float),
            "exon_length_total": rng.integers(500, 9000, len(table)).astype(float),
            "unique_exon_count": rng.integers(1, 40, len(table)).astype(float),
            "unique_exon_length_total": rng.integers(500, 9000, len(table)).astype(float),
            "feature": ["lncRNA" if k % 7 == 0 else "protein coding" for k in range(len(table))],
        }
    )
    info.to_csv(OUT / "gene_info.csv", index=False)
    hgcn = pd.DataFrame(
        {
            "HGNC ID": [f"HGNC:{k}" for k in range(len(table))],
            "Approved symbol": table,
            "Status": "Approved",
            "Alias symbols": [f"NOALIAS{k}A, NOALIAS{k}B" for k in range(len(table))],
            "Previous symbols": [f"NOPREV{k}" for k in range(len(table))],
        }
    )

    # --- the port's data path, in a folder holding its csv/ files
    work = Path(tempfile.mkdtemp(prefix="cellfm-ref-"))
    (work / "csv").mkdir()
    info.to_csv(work / "csv/expand_gene_info.csv", index=False)
    hgcn.to_csv(work / "csv/updated_hgcn.tsv", sep="\t", index=False)
    os.chdir(work)
    adata = port_utils.read_h5ad(str(OUT / "cells.h5ad"))
    adata.obs["celltype"] = "t"
    adata.obs["feat"] = 0
    adata.obs["batch_id"] = 0
    adata.obs["train"] = 0
    dataset = port_utils.SCrna(adata, mode="train")
    np.random.seed(0)
    prep = port_utils.Prepare(Cfg.nonz_len, pad=0, mask_ratio=0.0, dw=False)
    loader = port_utils.build_dataset(dataset, prep=prep, batch_size=len(dataset), pad_zero=True, drop=False, shuffle=False)
    batch = next(iter(loader))
    dw, gene, zero_idx, st = batch["dw_nzdata"], batch["nonz_gene"], batch["zero_idx"], batch["ST_feat"]
    assert float(dw[:, :, 0].sum()) == float(zero_idx.sum()), "no gene may be masked"

    # --- the model: seeded random weights, every parameter drawn anew
    torch.manual_seed(0)
    model = FinetuneModel(len(table), Cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("value_enc.a"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn_like(p) / fan_in ** 0.5)
    model.eval()
    head = torch.nn.Sequential(torch.nn.Linear(Cfg.enc_dims, 128), torch.nn.BatchNorm1d(128), torch.nn.LeakyReLU(), torch.nn.Linear(128, 3))
    # ST_enc (FFN(1, d), used in training only; 260 KB at any size) is left out to keep the
    # fixture small: the port loads with strict=False, and scfoundry never reads it
    sd = {"extractor.net." + k: v.clone().contiguous() for k, v in model.state_dict().items() if not k.startswith("ST_enc.")}
    sd.update({"cls." + k: v.clone() for k, v in head.state_dict().items()})
    torch.save(sd, OUT / "cellfm_torch.pt")
    # the sizes a state_dict cannot give (heads), in the port's Config names, beside it
    with open(OUT / "cellfm_torch.json", "w") as f:
        json.dump({"enc_dims": Cfg.enc_dims, "enc_nlayers": Cfg.enc_nlayers, "enc_num_heads": Cfg.enc_num_heads}, f)

    with torch.no_grad():
        emb, _ = model.encode(dw, gene, st, zero_idx)
        cls_encode = emb[:, 0]
        emb2, _ = model.embedding_infer(dw, gene, None, zero_idx)
        cls_infer = emb2[:, 0]
        # the same cells one at a time: padding to 2,048 makes every batch the same
        alone = torch.stack([model.encode(dw[i : i + 1], gene[i : i + 1], st[i : i + 1], zero_idx[i : i + 1])[0][0, 0] for i in range(dw.shape[0])])
    assert torch.isfinite(cls_encode).all() and torch.isfinite(cls_infer).all()

    inputs = []
    for i in range(dw.shape[0]):
        n = int(zero_idx[i].sum())
        inputs.append({"genes": gene[i, :n].tolist(), "values": dw[i, :n, 1].tolist(), "total": float(dataset.T[i])})
    lengths = [len(c["genes"]) for c in inputs]
    ref = {
        "made_by": "scripts/cellfm_reference.py",
        "upstream": "github.com/biomed-AI/CellFM-torch at b6c3673 (layers/torch_finetune.py FinetuneModel, layers/utils.py read_h5ad, SCrna, Prepare, build_dataset)",
        "versions": {"torch": torch.__version__, "numpy": np.__version__, "pandas": pd.__version__, "anndata": anndata.__version__},
        "data": "tests/fixtures/cellfm/cells.h5ad",
        "config": {"enc_dims": Cfg.enc_dims, "enc_nlayers": Cfg.enc_nlayers, "enc_num_heads": Cfg.enc_num_heads, "n_genes": len(table), "gene_emb_rows": int(model.gene_emb.shape[0])},
        "genes": {"table": table, "absent_from_data": sorted(absent), "kept": dataset.selected_gene_len},
        "scaled_cells": {str(k): {"factor": v, "total_all_genes": float(X[k].sum())} for k, v in SCALED.items()},
        "cells": adata.obs_names.tolist(),
        "inputs": inputs,
        "tokens_per_cell": {"min": min(lengths), "max": max(lengths)},
        "embeddings": cls_encode.tolist(),
        "embeddings_without_st": cls_infer.tolist(),
        "alone_vs_batch_max_abs_diff": float((alone - cls_encode).abs().max()),
    }
    with open(OUT / "reference.json", "w") as f:
        json.dump(ref, f)
    print(f"{len(inputs)} cells, {cls_encode.shape[1]}-d, genes per cell {min(lengths)}..{max(lengths)}, kept genes {dataset.selected_gene_len}, alone vs batch {ref['alone_vs_batch_max_abs_diff']:.2e}")


if __name__ == "__main__":
    main()
