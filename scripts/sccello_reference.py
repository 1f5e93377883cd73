#!/usr/bin/env python3
"""Parity fixture for scfoundry's scCello (src/methods/sccello.rs).

Runs upstream's own code from a checkout of DeepGraphLearning/scCello (commit 767585b, passed
with --sccello-repo) on 50 real demo cells:

- tokenisation: `ProcessSingleCellData.from_h5ad_adata` (sccello/src/data/data_proc.py, the
  CELLxGENE sparse path that built the pre-training corpus; for the reference tokens each row is
  handed to `_extract_info_from_cell` with sorted column indices and numpy's argsort made stable,
  so that ties keep column order; the cells whose order differs under upstream's own code are
  counted) with the dictionaries loaded by
  upstream's `data_loading.get_prestored_data` (which appends `<cls>` = len(dictionary)), then
  the truncation of `TranscriptomeTokenizer.tokenize` (`input_ids[:truncate_length]`, <cls>
  included) at the model's input size;
- model: `PrototypeContrastiveForMaskedLM` (sccello/src/model_prototype_contrastive.py) at a
  small size with seeded random weights (every tensor perturbed, so that each one matters),
  saved with `save_pretrained` as the release is (config.json + model.safetensors, keys
  `bert.embeddings.tf_class_embeddings.weight`, ... as upstream names them);
- embedding: the zero-shot path of sccello/script/run_cell_type_clustering.py:
  `model(..., output_hidden_states=True).logits[:, -1, :]`, the last layer's state at
  position 0 (<cls>), batches of 24 padded on the right with <pad> = 0 and masked (as
  DataCollatorForCellClassification does), no normalisation (`--normalize 0`, the default).

Upstream's imports that only training needs (wandb, ipdb, torchmetrics, datasets, the cell
ontology files) are replaced by stubs; none of them takes part in tokenisation or the forward
pass. transformers 4.46.3 (scCello's subclasses do not build under transformers 5).

Inputs: tests/fixtures/geneformer/pbmc68k_50.h5ad (50 cells, float32 counts, var['ensembl_id'])
and the V1-format dictionaries of tests/fixtures/geneformer/v1 (pad=0, mask=1, genes), copied
here byte for byte. Upstream reads var['ensembl_ids']; the column is copied under that name
for the run.

    python3 -m venv ~/.cache/scfoundry/torch-venv-bert4   # torch + transformers==4.46.3
    git clone https://github.com/DeepGraphLearning/scCello /tmp/scCello && git -C /tmp/scCello checkout 767585b
    ~/.cache/scfoundry/torch-venv-bert4/bin/python scripts/sccello_reference.py --sccello-repo /tmp/scCello
"""

import argparse
import json
import platform
import shutil
import sys
import tempfile
import types
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import torch
import transformers

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests/fixtures/sccello"
GF = REPO / "tests/fixtures/geneformer"
SEED = 0
INPUT_SIZE = 256
BATCH = 24


def stub_modules():
    for name in ["wandb", "ipdb", "rdflib", "pytz", "psutil"]:
        if name not in sys.modules:
            try:
                __import__(name)
            except ImportError:
                sys.modules[name] = types.ModuleType(name)
    tmc = types.ModuleType("torchmetrics.functional.classification")
    for f in ["multiclass_accuracy", "multiclass_auroc", "f1_score"]:
        setattr(tmc, f, None)
    sys.modules["torchmetrics"] = types.ModuleType("torchmetrics")
    sys.modules["torchmetrics.functional"] = types.ModuleType("torchmetrics.functional")
    sys.modules["torchmetrics.functional.classification"] = tmc
    ds = types.ModuleType("datasets")

    class Dataset:  # upstream returns datasets.Dataset.from_pandas(df); the frame is enough here
        @staticmethod
        def from_pandas(df):
            return df

    ds.Dataset = Dataset
    ds.load_dataset = None
    ds.concatenate_datasets = None
    ds.load_from_disk = None
    sys.modules["datasets"] = ds
    co = types.ModuleType("sccello.src.cell_ontology")
    co.get_forbidden_cell_type_contrast = lambda branch: np.zeros((4, 4), dtype=bool)
    co.get_hierarchy_cell_type_contrast = lambda branch: (np.zeros((4, 4), dtype=np.float32),)
    sys.modules["sccello.src.cell_ontology"] = co
    return co


class StableNumpy(types.ModuleType):
    """numpy with argsort's default kind made stable (ties in column order)."""

    def __init__(self):
        super().__init__("numpy_stable")

    def __getattr__(self, k):
        return getattr(np, k)

    @staticmethod
    def argsort(a, *args, **kw):
        kw.setdefault("kind", "stable")
        return np.argsort(a, *args, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sccello-repo", required=True, help="a checkout of DeepGraphLearning/scCello at 767585b")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for f in ["token_dictionary.pkl", "gene_median_dictionary.pkl"]:
        shutil.copyfile(GF / "v1" / f, OUT / f)

    # upstream's code reads its dictionaries from <repo>/data/token_vocabulary/: a copy of the
    # checkout with the fixture dictionaries there
    tmp = Path(tempfile.mkdtemp())
    shutil.copytree(Path(args.sccello_repo) / "sccello", tmp / "sccello")
    (tmp / "data/token_vocabulary").mkdir(parents=True)
    for f in ["token_dictionary.pkl", "gene_median_dictionary.pkl"]:
        shutil.copyfile(OUT / f, tmp / "data/token_vocabulary" / f)
    sys.path.insert(0, str(tmp))
    co = stub_modules()
    import sccello.src  # noqa: E402

    sccello.src.cell_ontology = co
    from sccello.src.data import data_proc  # noqa: E402
    from sccello.src.utils import data_loading  # noqa: E402
    from sccello.src import model_prototype_contrastive as mpc  # noqa: E402

    tok = data_loading.get_prestored_data("token_dictionary_pkl")
    cls_id = tok["<cls>"]

    adata = ad.read_h5ad(GF / "pbmc68k_50.h5ad")
    assert adata.X.dtype == np.float32
    adata.var["ensembl_ids"] = adata.var["ensembl_id"].astype(str)
    # the obs fields the CELLxGENE path filters on and carries along
    n = adata.n_obs
    adata.obs["organism"] = "Homo sapiens"
    adata.obs["assay"] = "10x 3' v2"
    adata.obs["is_primary_data"] = True
    for k in ["disease", "donor_id", "cell_type_ontology_term_id", "tissue", "tissue_ontology_term_id", "development_stage"]:
        adata.obs[k] = "x"

    upstream_extract = data_proc.ProcessSingleCellData._extract_info_from_cell

    def column_ordered(exprank, expnum, *args, **kw):
        # scipy's broadcast multiply returns COO, and its getrow hands the row's entries over in
        # descending column order; sorted, a stable argsort keeps ties in column order
        return upstream_extract(exprank.tocsr().sorted_indices(), expnum.tocsr().sorted_indices(), *args, **kw)

    def tokenize(numpy_module, stable):
        data_proc.np = numpy_module
        data_proc.ProcessSingleCellData._extract_info_from_cell = staticmethod(column_ordered if stable else upstream_extract)
        df = data_proc.ProcessSingleCellData.from_h5ad_adata(adata.copy(), "demo", is_cellxgene=True, require_raw=False)
        data_proc.np = np
        data_proc.ProcessSingleCellData._extract_info_from_cell = staticmethod(upstream_extract)
        # TranscriptomeTokenizer.tokenize: input_ids[:truncate_length]
        return [[int(t) for t in ids[:INPUT_SIZE]] for ids in df["gene_token_ids"]], [len(ids) for ids in df["gene_token_ids"]]

    cells, full_lens = tokenize(StableNumpy(), True)
    default_cells, _ = tokenize(np, False)
    assert len(cells) == n and all(c[0] == cls_id for c in cells)

    # ---- model at a small size, release format
    torch.manual_seed(SEED)
    cfg = transformers.BertConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, hidden_act="relu", max_position_embeddings=INPUT_SIZE,
        hidden_dropout_prob=0.02, attention_probs_dropout_prob=0.02, pad_token_id=0,
        layer_norm_eps=1e-12, type_vocab_size=1, initializer_range=0.02,
        position_embedding_type="absolute",
    )
    cfg.architectures = ["PrototypeContrastiveForMaskedLM"]
    cfg.tau, cfg.data_branch, cfg.total_logging_steps = 0.05, "frac100", 1
    model = mpc.PrototypeContrastiveForMaskedLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "layer_norm" in name or name.endswith("bias") or "_embeddings" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    # transformers 4.46 refuses safetensors for the tied MLM biases of this class, so the
    # checkpoint is written both ways: pytorch_model.bin by save_pretrained, and model.safetensors
    # (the Hub repository's file) with every state_dict entry under its own name
    model.save_pretrained(OUT, safe_serialization=False)
    (OUT / "generation_config.json").unlink(missing_ok=True)
    from safetensors.torch import save_file

    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, OUT / "model.safetensors", metadata={"format": "pt"})
    # read back from the written file (strict: every key of the class is in it)
    from safetensors.torch import load_file

    model = mpc.PrototypeContrastiveForMaskedLM(cfg)
    model.load_state_dict(load_file(OUT / "model.safetensors"), strict=True)
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
                logits = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).logits
            out += [[float(f"{float(v):.8g}") for v in row] for row in logits[:, -1, :]]
        return out

    emb = embed(cells, BATCH)
    emb7 = embed(cells, 7)
    spread = max(abs(a - b) for r, q in zip(emb, emb7) for a, b in zip(r, q))
    keys = sorted(torch.load if False else __import__("safetensors.torch", fromlist=["load_file"]).load_file(OUT / "model.safetensors").keys())
    ref = {
        "source": "scripts/sccello_reference.py",
        "upstream": "DeepGraphLearning/scCello 767585b: data_proc.ProcessSingleCellData.from_h5ad_adata, TranscriptomeTokenizer.tokenize truncation, PrototypeContrastiveForMaskedLM, run_cell_type_clustering.py logits[:, -1, :]",
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__, "numpy": np.__version__},
        "n_cells": n,
        "input_size": INPUT_SIZE,
        "cls": cls_id,
        "vocab_size": len(tok),
        "tokens": cells,
        "cells_differing_under_default_argsort": sum(a != b for a, b in zip(cells, default_cells)),
        "truncated_cells": sum(l > INPUT_SIZE for l in full_lens),
        "batch": BATCH,
        "max_abs_difference_batch_24_vs_7": spread,
        "checkpoint_keys": keys,
        "embeddings": emb,
    }
    with open(OUT / "reference.json", "w") as f:
        json.dump(ref, f, separators=(",", ":"))
    lens = [len(c) for c in cells]
    print(f"tokens per cell {min(lens)}..{max(lens)}; truncated {ref['truncated_cells']}; cls {cls_id}; "
          f"differing under default argsort {ref['cells_differing_under_default_argsort']}; batch 24 vs 7 {spread:.2e}")
    print("keys:", keys)


if __name__ == "__main__":
    main()
