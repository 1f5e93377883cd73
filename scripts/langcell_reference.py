#!/usr/bin/env python3
"""Parity fixture for scfoundry's LangCell cell encoder (src/methods/langcell.rs).

Runs upstream's own functions from a checkout of PharMolix/LangCell (commit 69e41ef, passed
with --langcell-repo) on 50 real demo cells. Upstream's modules import training and loom
tooling at the top (loompy, datasets, the geneformer 0.0.1 pretrainer), so the functions used
are taken out of the files with `ast` and run unchanged:

- tokenisation: data_preprocess/preprocess.py (`obs['n_counts'] = X.sum(axis=1)`), then
  `LangCellTranscriptomeTokenizer.tokenize_anndata` (LangCell-annotation-zeroshot/utils.py) with
  `tokenize_cell` (geneformer_001/geneformer/tokenizer.py), the `create_dataset` truncation
  `input_ids[0:2048]`, and `LangCellDataCollatorForCellClassification._prepare_batch`, which
  prepends `<cls>` (= len(token_dictionary), added in utils.py) and cuts at 2048 again. The
  fixture model has 256 positions, so both cuts are at 256 here.
- model: transformers' `BertModel` (cell_bert is "the standard Huggingface BertModel") at a
  small size with seeded random weights (every tensor perturbed), saved with
  `save_pretrained(safe_serialization=False)` as ckpt/cell_bert/{config.json,pytorch_model.bin};
  cell_proj.bin = `torch.save(nn.Linear(hidden, 256).state_dict())`, the file
  `Pooler.__init__` reads with `self.proj.load_state_dict(torch.load(pretrained_proj))`.
- embedding: zero-shot.ipynb's `Pooler` class (taken from the notebook's first code cell) set
  as `model.pooler`; `model(input_ids, attention_mask).pooler_output` =
  normalize(proj(last_hidden_state[:, 0])), batches of 32 padded on the right with <pad> = 0.

The text encoder (text_bert, text_proj, ctm_head) is not needed to embed cells.

Inputs: tests/fixtures/geneformer/pbmc68k_50.h5ad (float32 counts, var['ensembl_id']) and
the V1-format dictionaries of tests/fixtures/geneformer/v1, copied here byte for byte.

    ~/.cache/scfoundry/torch-venv-bert4/bin/python scripts/langcell_reference.py --langcell-repo /tmp/LangCell
"""

import argparse
import ast
import json
import pickle
import platform
import shutil
from pathlib import Path

import anndata as ad
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from transformers import BertConfig, BertModel

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests/fixtures/langcell"
GF = REPO / "tests/fixtures/geneformer"
SEED = 0
INPUT_SIZE = 256
BATCH = 32
PROJ_DIM = 256


def take(path, name, namespace, method_of=None):
    """Run the source of one top-level def/class (or one method of a class) from upstream."""
    src = Path(path).read_text()
    if path.endswith(".ipynb"):
        nb = json.loads(src)
        src = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
        # notebook cells also hold shell magics and top-level loading; keep parseable lines only
        tree = ast.parse("\n".join(l for l in src.splitlines() if not l.lstrip().startswith(("%", "!"))))
    else:
        tree = ast.parse(src)
    for node in tree.body:
        if method_of and isinstance(node, ast.ClassDef) and node.name == method_of:
            for m in node.body:
                if isinstance(m, ast.FunctionDef) and m.name == name:
                    exec(compile(ast.Module(body=[m], type_ignores=[]), path, "exec"), namespace)
                    return namespace[name]
        if not method_of and isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), namespace)
            return namespace[name]
    raise SystemExit(f"{name} not found in {path}")


class StableNumpy:
    def __getattr__(self, k):
        return getattr(np, k)

    @staticmethod
    def argsort(a, *args, **kw):
        kw.setdefault("kind", "stable")
        return np.argsort(a, *args, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--langcell-repo", required=True, help="a checkout of PharMolix/LangCell at 69e41ef")
    args = ap.parse_args()
    up = Path(args.langcell_repo)
    OUT.mkdir(parents=True, exist_ok=True)
    for f in ["token_dictionary.pkl", "gene_median_dictionary.pkl"]:
        shutil.copyfile(GF / "v1" / f, OUT / f)
    with open(OUT / "token_dictionary.pkl", "rb") as f:
        token_dictionary = pickle.load(f)
    with open(OUT / "gene_median_dictionary.pkl", "rb") as f:
        gene_median_dict = pickle.load(f)
    token_dictionary["<cls>"] = len(token_dictionary)  # utils.py, at import
    cls_id = token_dictionary["<cls>"]

    adata = ad.read_h5ad(GF / "pbmc68k_50.h5ad")
    assert adata.X.dtype == np.float32
    adata.obs["n_counts"] = adata.X.sum(axis=1)  # data_preprocess/preprocess.py
    # tokenize_anndata reads obs['filter_pass'] and only catches AttributeError, which pandas
    # does not raise for a missing column (KeyError): every cell passes here
    adata.obs["filter_pass"] = 1

    def tokenize(numpy_module):
        ns = {"np": numpy_module}
        take(str(up / "geneformer_001/geneformer/tokenizer.py"), "tokenize_cell", ns)
        tokenize_anndata = take(str(up / "LangCell-annotation-zeroshot/utils.py"), "tokenize_anndata", ns, method_of="LangCellTranscriptomeTokenizer")

        # TranscriptomeTokenizer.__init__'s attributes, with the fixture dictionaries
        tk = type("Tk", (), {})()
        tk.custom_attr_name_dict = None
        tk.gene_median_dict = gene_median_dict
        tk.gene_token_dict = {k: v for k, v in token_dictionary.items() if k != "<cls>"}
        tk.gene_keys = list(gene_median_dict.keys())
        tk.genelist_dict = dict(zip(tk.gene_keys, [True] * len(tk.gene_keys)))
        cells, _ = tokenize_anndata(tk, adata.copy())
        full = [len(c) for c in cells]
        cells = [list(c[0:INPUT_SIZE]) for c in cells]  # create_dataset's truncate (2048 upstream)
        # LangCellDataCollatorForCellClassification._prepare_batch (add_cls=True)
        return [[int(t) for t in ([cls_id] + c)[:INPUT_SIZE]] for c in cells], full

    cells, full = tokenize(StableNumpy())
    default_cells, _ = tokenize(np)

    # ---- cell encoder and projection at a small size, release formats
    torch.manual_seed(SEED)
    cfg = BertConfig(
        vocab_size=len(token_dictionary), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, hidden_act="relu", max_position_embeddings=INPUT_SIZE,
        hidden_dropout_prob=0.02, attention_probs_dropout_prob=0.02, pad_token_id=0,
        layer_norm_eps=1e-12, type_vocab_size=2, initializer_range=0.02,
    )
    model = BertModel(cfg)
    proj = nn.Linear(cfg.hidden_size, PROJ_DIM)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(proj.named_parameters()):
            if "LayerNorm" in name or name.endswith("bias") or "token_type" in name:
                p.add_(torch.randn_like(p) * 0.1)
    bert_dir = OUT / "cell_bert"
    model.save_pretrained(bert_dir, safe_serialization=False)
    (bert_dir / "generation_config.json").unlink(missing_ok=True)
    torch.save(proj.state_dict(), OUT / "cell_proj.bin")

    # ---- zero-shot.ipynb: BertModel.from_pretrained + Pooler(cell_proj.bin)
    ns = {"nn": nn, "F": F, "torch": torch}
    Pooler = take(str(up / "LangCell-annotation-zeroshot/zero-shot.ipynb"), "Pooler", ns)
    model = BertModel.from_pretrained(bert_dir)
    model.pooler = Pooler(model.config, pretrained_proj=str(OUT / "cell_proj.bin"), proj_dim=PROJ_DIM)
    model.eval()

    def embed(cells, batch):
        out = []
        for s in range(0, len(cells), batch):
            chunk = cells[s:s + batch]
            L = max(len(c) for c in chunk)
            ids = torch.zeros(len(chunk), L, dtype=torch.long)
            mask = torch.zeros(len(chunk), L, dtype=torch.long)
            for r, c in enumerate(chunk):
                ids[r, :len(c)] = torch.tensor(c)
                mask[r, :len(c)] = 1
            with torch.no_grad():
                emb = model(ids, mask).pooler_output  # cell_encode(...)[1]
            out += [[float(f"{float(v):.8g}") for v in row] for row in emb]
        return out

    emb = embed(cells, BATCH)
    emb7 = embed(cells, 7)
    spread = max(abs(a - b) for r, q in zip(emb, emb7) for a, b in zip(r, q))
    ref = {
        "source": "scripts/langcell_reference.py",
        "upstream": "PharMolix/LangCell 69e41ef: preprocess.py n_counts, LangCellTranscriptomeTokenizer.tokenize_anndata + tokenize_cell, create_dataset truncation, collator <cls>, BertModel + zero-shot.ipynb Pooler",
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__, "numpy": np.__version__},
        "n_cells": len(cells),
        "input_size": INPUT_SIZE,
        "cls": cls_id,
        "vocab_size": len(token_dictionary),
        "proj_dim": PROJ_DIM,
        "tokens": cells,
        "cells_differing_under_default_argsort": sum(a != b for a, b in zip(cells, default_cells)),
        "truncated_cells": sum(l > INPUT_SIZE - 1 for l in full),
        "batch": BATCH,
        "max_abs_difference_batch_32_vs_7": spread,
        "embeddings": emb,
    }
    with open(OUT / "reference.json", "w") as f:
        json.dump(ref, f, separators=(",", ":"))
    lens = [len(c) for c in cells]
    print(f"tokens per cell {min(lens)}..{max(lens)}; truncated {ref['truncated_cells']}; cls {cls_id}; "
          f"differing under default argsort {ref['cells_differing_under_default_argsort']}; batch 32 vs 7 {spread:.2e}")
    print("norms", [round(float(np.linalg.norm(e)), 6) for e in emb[:3]])


if __name__ == "__main__":
    main()
