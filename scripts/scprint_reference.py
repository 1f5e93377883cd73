#!/usr/bin/env python3
"""Parity fixture for scfoundry's scPRINT (src/methods/scprint.rs), from upstream's own code.

Run once by hand, never in CI (CI only reads what this writes):

    python3 -m venv ~/.cache/scfoundry/venv-scprint
    ~/.cache/scfoundry/venv-scprint/bin/pip install scprint==2.3.8 "pyarrow<17"
    ~/.cache/scfoundry/venv-scprint/bin/python scripts/scprint_reference.py

Upstream is imported, not rebuilt: scprint 2.3.8 (scPrint, Embedder), simpler-flash 1.0.7
(FlashTransformer, transformer="normal": flash attention needs a GPU) and scdataloader 2.1.3
(Collator, SimpleAnnDataset), as pip installs them. Two things cannot run offline and are
replaced: scdataloader's `load_genes` (it asks lamindb/bionty's gene table over the network) by a
table of this fixture's genes (Ensembl ids, sorted, one organism, as load_genes builds it); and
make_adata's `translate` of predicted class ids into ontology names (also a database
lookup; it only labels the class predictions, which are not compared).

Small configuration (medium-v1.5: d_model 256, 8 layers, 4 heads): 120 genes (Ensembl ids: 100
of the demo data's genes, the ones most often expressed, plus 20 ids the data lacks), d_model 32,
nhead 4 with num_heads_kv 2 (grouped-query attention, as the newer configs use; the released
medium has 4 and 4), 2 layers, ContinuousValueEncoder with 2 layers, depth token at input,
normalization `log` (config/base_v1.yml), a genomic-position encoding, "ESM2" gene embeddings
from a parquet file of random 48-d vectors (pooled to 32 by upstream's AdaptiveAvgPool1d), and
six classes (Embedder's four plus assay and organism, in an order where Embedder's are not the
first four). Weights are seeded random (torch.manual_seed(0)), every parameter drawn anew.

The checkpoint is written by Lightning itself (Trainer.save_checkpoint: state_dict,
hyper_parameters, versions, loops) and loaded back as scprint's `embed` CLI loads it
(`scPrint.load_from_checkpoint(ckpt, precpt_gene_emb=None, classes=label_counts,
transformer="normal")`); the Embedder then runs (how="random expr", add_zero_genes=0,
num_workers=0, float32, default pred_embedding) after np.random.seed(seed). The Collator's
output (gene ids, counts, depth) is recorded from inside model._predict.

Runs: max_len 73 with seed 0 (of the 50 cells, 31 have more expressed model genes and are sampled,
14 have fewer and get random zero genes, 5 have exactly 73: no draw), max_len 73 with seed 7 (other
draws), and max_len 120 (every model gene, in a random order; seed 3).
Written to tests/fixtures/scprint/: tiny.ckpt, cells.h5ad (the 50 demo cells of
tests/fixtures/geneformer/pbmc68k_50.h5ad with Ensembl ids as var_names, the first column of
each id) and reference.json.
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
OUT = ROOT / "tests/fixtures/scprint"
DATA = ROOT / "tests/fixtures/geneformer/pbmc68k_50.h5ad"
ORG = "NCBITaxon:9606"
N_IN_DATA = 100
N_ABSENT = 20
RUNS = [(73, 0), (73, 7), (120, 3)]
CLASSES = {
    "assay_ontology_term_id": 3,
    "cell_type_ontology_term_id": 5,
    "disease_ontology_term_id": 3,
    "organism_ontology_term_id": 2,
    "self_reported_ethnicity_ontology_term_id": 4,
    "sex_ontology_term_id": 2,
}


def main():
    import anndata

    OUT.mkdir(parents=True, exist_ok=True)
    src = anndata.read_h5ad(DATA)
    X = src.X.toarray() if hasattr(src.X, "toarray") else np.asarray(src.X)
    # unique Ensembl ids (a few symbols share one): the first column of each
    first = ~src.var["ensembl_id"].astype(str).duplicated().to_numpy()
    X = X[:, first]
    ids = src.var["ensembl_id"].astype(str)[first].tolist()
    cells = anndata.AnnData(X=__import__("scipy").sparse.csr_matrix(X.astype(np.float32)), obs=pd.DataFrame(index=src.obs_names.astype(str)), var=pd.DataFrame(index=ids))
    cells.write_h5ad(OUT / "cells.h5ad", compression="gzip")

    # model genes: the data's 100 most often expressed + 20 absent ids, sorted (load_genes' order)
    often = np.argsort(-(X > 0).sum(0), kind="stable")[:N_IN_DATA]
    in_data = [ids[i] for i in often]
    absent = [f"ENSG{99_000_000_000 + 7 * k:011d}" for k in range(N_ABSENT)]
    genes = sorted(in_data + absent)
    # the organism's gene table (what Preprocessor aligns the data to): all data genes + absent
    table = sorted(set(ids) | set(absent))
    genedf = pd.DataFrame({"organism": ORG, "symbol": table}, index=pd.Index(table, name="ensembl_gene_id"))

    # offline stand-ins (see the docstring)
    import scprint.model.utils as _u  # noqa: F401  (imported first: its TF list default)
    import scdataloader.collator as coll

    coll.load_genes = lambda organisms=ORG: genedf
    # make_adata names predicted classes through the ontology database: not needed here
    _u.translate = lambda *a, **k: None
    from scprint import scPrint
    from scprint.tasks.cell_emb import Embedder

    rng = np.random.default_rng(0)
    tmp = Path(tempfile.mkdtemp())
    emb_file = tmp / "gene_embeddings.parquet"
    pd.DataFrame(rng.normal(size=(len(genes), 48)).astype(np.float32), index=genes).to_parquet(emb_file)
    positions = [int(p) for p in rng.integers(1, 400, size=len(genes))]

    torch.manual_seed(0)
    model = scPrint(
        genes=genes,
        organisms=[ORG],
        d_model=32,
        nhead=4,
        num_heads_kv=2,
        nlayers=2,
        precpt_gene_emb=str(emb_file),
        gene_pos_enc=positions,
        normalization="log",
        expr_encoder_layers=2,
        transformer="normal",
        classes=CLASSES,
        labels_hierarchy={},
        num_batch_labels=3,
        label_decoders={k: {i: f"{k}:{i}" for i in range(n)} for k, n in CLASSES.items()},
        dropout=0.1,
        residual_in_fp32=True,
        checkpointing=False,
        fused_dropout_add_ln=False,
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1)
            elif "norm" in name or ".encoder.1." in name:
                p.copy_(1.0 + torch.randn_like(p) * 0.1)
            else:
                p.copy_(torch.randn_like(p) * (1.0 / max(p.shape[-1], 1)) ** 0.5)

    import lightning as L

    ckpt = OUT / "tiny.ckpt"
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(ckpt)

    # load as scprint's `embed` CLI does
    m = torch.load(ckpt, map_location="cpu")
    model = scPrint.load_from_checkpoint(ckpt, precpt_gene_emb=None, classes=m["hyper_parameters"]["label_counts"], transformer="normal")
    model = model.to(torch.float32).eval()
    diff = max((model.state_dict()[k].float() - v.float()).abs().max().item() for k, v in m["state_dict"].items())
    assert diff == 0.0, diff

    # what the Collator hands the model, recorded at _predict
    seen = []
    orig = model._predict

    def spy(gene_pos, expression, depth, *a, **k):
        seen.append((gene_pos.clone(), expression.clone(), depth.clone()))
        return orig(gene_pos, expression, depth, *a, **k)

    model._predict = spy
    # the Collator's input: the data aligned to the organism's gene table (as Preprocessor does)
    up = anndata.AnnData(X=np.zeros((cells.n_obs, len(table)), dtype=np.float32), obs=pd.DataFrame({"organism_ontology_term_id": ORG}, index=cells.obs_names), var=pd.DataFrame(index=table))
    col = {g: i for i, g in enumerate(table)}
    up.X[:, [col[g] for g in ids]] = X.astype(np.float32)

    runs = []
    cwd = os.getcwd()
    os.chdir(tmp)  # Embedder writes its part files under data/
    try:
        for max_len, seed in RUNS:
            seen.clear()
            model.counter = 0
            emb = Embedder(batch_size=16, num_workers=0, how="random expr", max_len=max_len, add_zero_genes=0, doclass=False, doplot=False, dtype=torch.float32)
            np.random.seed(seed)
            out, _ = emb(model, up.copy())
            e = np.asarray(out.obsm["scprint_emb"], dtype=np.float64)
            toks = []
            for g, x, d in seen:
                for r in range(g.shape[0]):
                    toks.append({"genes": g[r].tolist(), "counts": x[r].tolist(), "depth": float(d[r])})
            # the same cells in one batch of 50 give the same rows (no padding, no mask)
            with torch.no_grad():
                G = torch.stack([torch.tensor(t["genes"]) for t in toks]).int()
                Xc = torch.stack([torch.tensor(t["counts"]) for t in toks])
                D = torch.tensor([t["depth"] for t in toks])
                o = orig(G, Xc, D, pred_embedding=emb.pred_embedding, keep_output=False)["embs"].double().numpy()
            runs.append({"max_len": max_len, "seed": seed, "tokens": toks, "embeddings": e.tolist(), "one_batch_max_abs_diff": float(np.abs(o - e).max())})
            print(f"max_len {max_len} seed {seed}: {len(toks)} cells, emb {e.shape}, one batch vs Embedder {np.abs(o - e).max():.2e}")
    finally:
        os.chdir(cwd)

    hp = m["hyper_parameters"]
    ref = {
        "made_by": "scripts/scprint_reference.py with scprint 2.3.8, simpler-flash 1.0.7, scdataloader 2.1.3, torch " + torch.__version__,
        "data": "tests/fixtures/scprint/cells.h5ad",
        "checkpoint": "tests/fixtures/scprint/tiny.ckpt",
        "config": {k: hp[k] for k in ["d_model", "nhead", "num_heads_kv", "nlayers", "normalization", "organisms"]},
        "classes": list(hp["label_counts"].keys()),
        "pred_embedding": list(Embedder().pred_embedding),
        "genes": genes,
        "genes_absent_from_data": absent,
        "runs": runs,
    }
    with open(OUT / "reference.json", "w") as f:
        json.dump(ref, f)
    print("wrote", OUT, {p.name: p.stat().st_size for p in OUT.iterdir()})


if __name__ == "__main__":
    sys.exit(main())
