#!/usr/bin/env python3
"""Parity fixture for scfoundry's scFoundation (src/methods/scfoundation.rs), from upstream's code.

Run once by hand, never in CI (CI only reads what this writes):

    git -C <scFoundation clone> archive d09626a model | tar -x -C /tmp/scf-up
    PYTHONPATH=~/.cache/scfoundry/scf-extra \\
      ~/.cache/scfoundry/torch-venv-gf/bin/python scripts/scfoundation_reference.py /tmp/scf-up/model

That venv: torch (CPU is enough), pandas, numpy, anndata. Upstream's pretrainmodels/ imports
einops and local_attention (the Performer decoder); they were installed beside it with
`pip install --target ~/.cache/scfoundry/scf-extra --no-deps einops==0.8.0 local-attention==1.9.0`.

Upstream (github.com/biomap-research/scFoundation, commit d09626a) is imported, not rebuilt:
`load.py` (load_model_frommmf, convertconfig, gatherData, main_gene_selection) and
`pretrainmodels/` (select_model -> MaeAutobin with a pytorchTransformerModule encoder and a
PerformerModule decoder). The per-cell loop of `get_embedding.py` (`--input_type singlecell
--output_type cell --pool_type all --pre_normalized F --tgthighres t4 --version ce`) cannot be
imported (it parses arguments and reads the 19,264-gene list at import), so its steps are
written out below in the same order, with the upstream calls.

Small configuration: 98 genes (so seq_len 100 = genes + T + S, as 19,264 + 2 = 19,266 upstream),
encoder 2 layers x 32 with 4 heads, decoder (a Performer, never used for cell embeddings)
1 layer x 16, bin_num 16, bin_alpha 0.7 (upstream 100 and 1.0: a value other than 1 shows it is
read), pad_token_id 103 and mask_token_id 102 as the released config. The genes are 90 genes of
upstream's OS_scRNA_gene_index.19264.tsv that the demo cells express plus 8 of its genes the
demo data lacks (zero-filled), written in upstream's tsv format. The demo data holds 765 genes:
the other 675 are dropped, as main_gene_selection drops them (the total count T is then the sum
over the kept genes, as upstream).

The checkpoint is written in the layout load_model_frommmf reads from models.ckpt: a dict with
one entry per model version ('cell', and 'rde' with other weights, to check the key is used),
each {'state_dict': {'model.<parameter>': tensor}, 'config': {'model': 'mae_autobin',
'model_config': {'mae_autobin': {...}}, 'dataset_config': {'rnaseq': {...}}}}; this script then
loads it back with upstream's load_model_frommmf and embeds with the model that returns.
Weights are seeded random (torch.manual_seed(0)), every tensor drawn anew.

Written to tests/fixtures/scfoundation/: models.ckpt, gene_index.tsv, reference.json (config,
genes, per cell the gathered values and gene positions the encoder sees, the 4 x 32 = 128-d
embeddings), and the cells run one at a time, as get_embedding.py does. The same cells run
as one padded batch through upstream's gatherData are recorded too (max difference at the
non-padded tokens), to show that batching, as scfoundry does it, is exact.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests/fixtures/scfoundation"
DATA = "tests/fixtures/geneformer/pbmc68k_50.h5ad"
N_IN_DATA = 90
N_ABSENT = 8
TGTHIGHRES = "t4"


def main():
    up = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(up))
    # upstream moves the model and inputs to CUDA unconditionally; on a CPU machine these are no-ops
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.Tensor.cuda = lambda self, *a, **k: self
    import load  # upstream model/load.py
    from pretrainmodels import select_model

    load.pd = pd  # load.main_gene_selection uses pandas without importing it
    import anndata

    OUT.mkdir(parents=True, exist_ok=True)
    adata = anndata.read_h5ad(ROOT / DATA)
    X = adata.X.toarray() if hasattr(adata.X, "toarray") else np.asarray(adata.X)
    # get_embedding.py: var.gene_name if present, else var_names
    cols = adata.var["gene_name"].tolist() if "gene_name" in adata.var else adata.var_names.tolist()

    full = pd.read_csv(up / "OS_scRNA_gene_index.19264.tsv", header=0, delimiter="\t")
    full_list = list(full["gene_name"])
    in_data = set(cols)
    expressed = {g for g, n in zip(cols, (X > 0).sum(0)) if n >= 5}
    chosen_in = [g for g in full_list if g in expressed][: N_IN_DATA * 3 : 3]
    assert len(chosen_in) == N_IN_DATA, len(chosen_in)
    absent = [g for g in full_list if g not in in_data][100 : 100 + N_ABSENT]
    keep = set(chosen_in) | set(absent)
    gene_list = [g for g in full_list if g in keep]  # upstream's order
    n_genes = len(gene_list)
    seq_len = n_genes + 2
    with open(OUT / "gene_index.tsv", "w") as f:
        f.write("gene_name\tindex\n")
        for i, g in enumerate(gene_list):
            f.write(f"{g}\t{i}\n")

    enc = {"hidden_dim": 32, "depth": 2, "heads": 4, "dim_head": 8, "seq_len": seq_len, "module_type": "transformer", "norm_first": False}
    dec = {"hidden_dim": 16, "depth": 1, "heads": 2, "dim_head": 8, "module_type": "performer", "seq_len": seq_len, "norm_first": False}
    model_cfg = {
        "mask_gene_name": False, "gene_num": seq_len, "seq_len": seq_len, "encoder": enc, "decoder": dec,
        "n_class": 104, "pad_token_id": 103, "mask_token_id": 102, "bin_num": 16, "bin_alpha": 0.7, "rawcount": True, "model": "mae_autobin",
    }
    rnaseq_cfg = {"bin_type": "auto_bin", "bin_num": 16, "value_mask_prob": 0.3, "zero_mask_prob": 0.03, "replace_prob": 0.8, "random_token_prob": 0.1}
    ckpt_cfg = {"model": "mae_autobin", "model_config": {"mae_autobin": model_cfg}, "dataset_config": {"rnaseq": rnaseq_cfg}}
    flat = dict(model_cfg)
    flat.update(rnaseq_cfg)
    flat["model"] = "mae_autobin"

    torch.manual_seed(0)

    def random_model():
        m = select_model(flat)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("bias"):
                    p.copy_(torch.randn_like(p) * 0.1)
                elif "norm" in name:
                    p.copy_(1.0 + torch.randn_like(p) * 0.1)
                elif "token_emb.mlp" in name:
                    p.copy_(torch.randn_like(p) * 0.8)
                else:
                    p.copy_(torch.randn_like(p) * (1.0 / max(p.shape[-1], 1)) ** 0.5)
        return m

    versions = {}
    for key in ("cell", "rde"):
        m = random_model()
        sd = {"model." + k: v.clone().contiguous() for k, v in m.state_dict().items()}
        versions[key] = {"state_dict": sd, "config": ckpt_cfg}
    torch.save(versions, OUT / "models.ckpt")

    # --- upstream's loader on the file just written
    model, config = load.load_model_frommmf(str(OUT / "models.ckpt"), "cell")
    model.eval()
    pad = config["pad_token_id"]

    # --- get_embedding.py, cell path
    df = pd.DataFrame(X, index=adata.obs_names.tolist(), columns=cols)
    df, to_fill = load.main_gene_selection(df, gene_list)  # (load.py's returns two values)
    assert sorted(to_fill) == sorted(absent)
    cells = []
    embs = []
    inputs = []
    with torch.no_grad():
        for i in range(df.shape[0]):
            row = df.iloc[i, :]
            tmpdata = (np.log1p(row / (row.sum()) * 1e4)).tolist()  # pre_normalized F
            totalcount = row.sum()
            x_in = torch.tensor(tmpdata + [float(TGTHIGHRES[1:]), np.log10(totalcount)]).unsqueeze(0)
            gene_ids = torch.arange(seq_len).repeat(x_in.shape[0], 1)
            value_labels = x_in > 0
            x, x_padding = load.gatherData(x_in, value_labels, pad)
            position_gene_ids, _ = load.gatherData(gene_ids, value_labels, pad)
            h = model.token_emb(torch.unsqueeze(x, 2).float(), output_weight=0)
            h += model.pos_emb(position_gene_ids)
            geneemb = model.encoder(h, x_padding)
            e = torch.concat([geneemb[:, -1, :], geneemb[:, -2, :], torch.max(geneemb[:, :-2, :], dim=1)[0], torch.mean(geneemb[:, :-2, :], dim=1)], axis=1)
            embs.append(e[0].tolist())
            inputs.append({"positions": position_gene_ids[0].tolist(), "values": x[0].tolist()})
            cells.append(df.index[i])

        # --- the same cells as one padded batch (gatherData pads each row to the longest)
        xs = []
        for i in range(df.shape[0]):
            row = df.iloc[i, :]
            xs.append(torch.tensor((np.log1p(row / row.sum() * 1e4)).tolist() + [float(TGTHIGHRES[1:]), np.log10(row.sum())]))
        xb = torch.stack(xs)
        labels = xb > 0
        xg, xpad = load.gatherData(xb, labels, pad)
        pg, _ = load.gatherData(torch.arange(seq_len).repeat(xb.shape[0], 1), labels, pad)
        pg[xpad] = 0  # pad_token_id 103 is past this small pos_emb table; padded keys are masked anyway
        hb = model.token_emb(torch.unsqueeze(xg, 2).float(), output_weight=0)
        hb += model.pos_emb(pg)
        gb = model.encoder(hb, xpad)
        worst = 0.0
        for i in range(xb.shape[0]):
            n = int(labels[i].sum())
            alone = torch.tensor(embs[i])
            g = gb[i, :n, :]
            e = torch.concat([g[-1], g[-2], g[:-2].max(0)[0], g[:-2].mean(0)])
            worst = max(worst, float((e - alone).abs().max()))

    lengths = [len(c["positions"]) for c in inputs]
    ref = {
        "made_by": "scripts/scfoundation_reference.py",
        "upstream": "github.com/biomap-research/scFoundation model/ at d09626a (load.py, get_embedding.py, pretrainmodels/)",
        "versions": {"torch": torch.__version__, "numpy": np.__version__, "pandas": pd.__version__},
        "data": DATA,
        "tgthighres": TGTHIGHRES,
        "config": flat,
        "genes": {"list": gene_list, "absent_from_data": sorted(absent), "in_data": len(cols)},
        "cells": cells,
        "inputs": inputs,
        "tokens_per_cell": {"min": min(lengths), "max": max(lengths)},
        "embeddings": embs,
        "upstream_batched": {"cells": len(embs), "max_abs_diff_vs_alone": worst},
    }
    with open(OUT / "reference.json", "w") as f:
        json.dump(ref, f)
    print(f"{len(embs)} cells, {len(embs[0])}-d, tokens per cell {min(lengths)}..{max(lengths)}, batched vs alone {worst:.2e}")


if __name__ == "__main__":
    main()
