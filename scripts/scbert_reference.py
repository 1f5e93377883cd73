#!/usr/bin/env python3
"""Parity fixture for scfoundry's scBERT (src/methods/scbert.rs), run on upstream's own code.

Run once by hand, never in CI (CI only reads what this writes):

    mkdir -p /tmp/scbert-upstream
    git -C <checkout of github.com/TencentAILabHealthcare/scBERT> archive HEAD performer_pytorch \
        | tar -x -C /tmp/scbert-upstream
    ~/.cache/scfoundry/torch-venv-scbert/bin/python scripts/scbert_reference.py /tmp/scbert-upstream

The venv: torch (CPU use), einops, local-attention 1.4.4 (imported by upstream's module),
numpy, scanpy 1.11.5, anndata. The upstream checkout read was commit 262fd4b. Nothing of
upstream's is copied here: its `performer_pytorch` package is imported from the folder given on
the command line, and its PerformerLM is built with predict.py's arguments (num_tokens 7 =
bin_num 5 + 2, local_attn_heads 0, g2v_position_emb True, every other argument upstream's
default: dim_head 64, nb_features int(dim_head * ln dim_head), ff_mult 4, qkv_bias False) at a
small size: dim 32, depth 2, heads 2, dim_head 24 (so that heads x dim_head != dim), 300
reference genes. Gene2VecPositionalEmbedding reads `../data/gene2vec_16906.npy` relative to
the working directory, so a seeded random float64 table of the small size is written there.
Every parameter is then perturbed (seeded) so that no LayerNorm is the identity; the FAVOR+
projection matrices are the buffers upstream drew at construction (seeded), saved in the
checkpoint and never redrawn in eval mode.

The checkpoint is saved as upstream's utils.save_ckpt does: torch.save of a dict with `epoch`,
`model_state_dict`, `losses` (the optimizer and scheduler states are left out: nobody reads
them at inference). The reference gene list is a small `panglao_10000.h5ad` whose var_names fix
the gene order, as upstream's preprocess.py reads it.

Tokens follow preprocess.py and predict.py on the demo cells (tests/fixtures/scbert/demo.h5ad:
the 50 cells of tests/fixtures/geneformer/pbmc68k_50.h5ad, raw counts, then 9 seeded deep cells
and one without counts): the counts of the reference genes by name (absent genes zero; a
name found twice: its first column, as `obj.index`), sc.pp.normalize_total(target_sum=1e4) over
those genes, sc.pp.log1p(base=2), values above CLASS - 2 = 5 set to 5, `.long()` (truncation),
then a 0 appended. preprocess.py's sc.pp.filter_cells(min_genes=200) is not applied (every demo
cell is embedded; scfoundry embeds every cell too and reports the ones upstream would drop).

Cell embedding: PerformerLM(x, return_encodings=True) (the output of the final LayerNorm, before
to_out), averaged over the gene positions (all but the appended one), as BioLLM's
LoadScbert.get_cell_embedding with cell_emb_type 'mean'; the appended position's vector is saved
too. Each cell is run alone (a batch of one, as predict.py); the keys' FAVOR+ stabiliser is
torch.max over the whole batch tensor, so a cell's embedding depends on the cells it is batched
with: the cells are also run in batches of 3 (finetune.py's batch size) and the largest
difference is recorded.
"""

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "scbert"
DATA = ROOT / "tests" / "fixtures" / "geneformer" / "pbmc68k_50.h5ad"
SEED = 0
DIM, DEPTH, HEADS, DIM_HEAD = 32, 2, 2, 24
N_REF_GENES, N_REF_ONLY = 300, 40
BIN_NUM = 5
CLASS = BIN_NUM + 2


def reference_genes(data_genes, rng):
    """300 reference genes: 260 of the data's genes in a shuffled order, 40 the data lacks."""
    picked = rng.choice(len(data_genes), N_REF_GENES - N_REF_ONLY, replace=False)
    genes = [data_genes[i] for i in picked] + [f"REFONLY{i}" for i in range(N_REF_ONLY)]
    rng.shuffle(genes)
    return genes


def demo_cells(pbmc, rng):
    """The 50 PBMC cells, 9 seeded deep cells (totals near 1e5, so that bins 1 to 3 occur: the PBMC
    cells only reach bins 0, 4 and 5) and one cell with no counts; written as demo.h5ad."""
    import anndata as ad
    from scipy import sparse

    n = pbmc.n_vars
    lam = rng.gamma(0.3, 1.0, size=(9, n)) * (1e5 / (0.3 * n))
    deep = rng.poisson(lam).astype(np.float32)
    x = sparse.vstack([pbmc.X.astype(np.float32), sparse.csr_matrix(deep), sparse.csr_matrix((1, n), dtype=np.float32)]).tocsr()
    out = ad.AnnData(X=x)
    out.var_names = pbmc.var_names.tolist()
    out.obs_names = pbmc.obs_names.tolist() + [f"deep{i}" for i in range(9)] + ["empty"]
    OUT.mkdir(parents=True, exist_ok=True)
    out.write_h5ad(OUT / "demo.h5ad")
    return out


def upstream_tokens(adata, ref_genes):
    """preprocess.py then predict.py's binning, with scanpy, for every cell."""
    import anndata as ad
    import scanpy as sc
    from scipy import sparse

    counts = sparse.lil_matrix((adata.X.shape[0], len(ref_genes)), dtype=np.float32)
    obj = adata.var_names.tolist()
    for i, g in enumerate(ref_genes):
        if g in obj:
            counts[:, i] = adata.X[:, obj.index(g)]
    new = ad.AnnData(X=counts.tocsr())
    new.var_names = ref_genes
    sc.pp.normalize_total(new, target_sum=1e4)
    sc.pp.log1p(new, base=2)
    x = new.X.toarray()
    rows = []
    for r in range(x.shape[0]):
        full_seq = x[r].copy()
        full_seq[full_seq > (CLASS - 2)] = CLASS - 2
        full_seq = torch.from_numpy(full_seq).long()
        rows.append(torch.cat((full_seq, torch.tensor([0]))))
    return torch.stack(rows), x


def main():
    if len(sys.argv) != 2 or not (Path(sys.argv[1]) / "performer_pytorch").is_dir():
        sys.exit("usage: scbert_reference.py DIR  (DIR holds upstream's performer_pytorch/ package)")
    sys.path.insert(0, str(Path(sys.argv[1]).resolve()))
    from performer_pytorch import PerformerLM  # upstream's module, not ours

    if not hasattr(torch, "qr") or torch.__version__ >= "2.9":
        # torch.qr (used by upstream's orthogonal_matrix_chunk to draw the projection) is gone from
        # recent torch; torch.linalg.qr is its documented replacement (some=True <-> mode="reduced").
        torch.qr = lambda a, some=True: torch.linalg.qr(a, mode="reduced" if some else "complete")

    import anndata

    rng = np.random.default_rng(SEED)
    adata = demo_cells(anndata.read_h5ad(DATA), rng)
    ref_genes = reference_genes(adata.var_names.tolist(), rng)
    tokens, values = upstream_tokens(adata, ref_genes)

    torch.manual_seed(SEED)
    work = Path(tempfile.mkdtemp())
    (work / "data").mkdir()
    (work / "run").mkdir()
    g2v = rng.normal(0.0, 0.5, size=(N_REF_GENES, DIM))  # float64, as the released .npy
    np.save(work / "data" / "gene2vec_16906.npy", g2v)
    cwd = os.getcwd()
    os.chdir(work / "run")
    try:
        model = PerformerLM(num_tokens=CLASS, dim=DIM, depth=DEPTH, max_seq_len=N_REF_GENES + 1, heads=HEADS,
                            dim_head=DIM_HEAD, local_attn_heads=0, g2v_position_emb=True)
    finally:
        os.chdir(cwd)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "pos_emb.emb.weight":
                continue  # the gene2vec table, as loaded
            p.add_(torch.randn_like(p) * 0.1)
    model.eval()

    sd = model.state_dict()
    nb_features = sd["performer.net.layers.0.0.fn.fast_attention.projection_matrix"].shape[0]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scbert").mkdir(exist_ok=True)
    torch.save({"epoch": 1, "model_state_dict": sd, "losses": 0.0}, OUT / "scbert" / "panglao_pretrained.pth")
    ref = anndata.AnnData(X=np.zeros((2, N_REF_GENES), dtype=np.float32))
    ref.var_names = ref_genes
    ref.obs_names = ["ref0", "ref1"]
    ref.write_h5ad(OUT / "scbert" / "panglao_10000.h5ad")

    with torch.no_grad():
        means, lasts = [], []
        for r in range(tokens.shape[0]):
            enc = model(tokens[r : r + 1], return_encodings=True)
            means.append(enc[:, :-1, :].mean(dim=1)[0])
            lasts.append(enc[0, -1, :])
        means = torch.stack(means)
        lasts = torch.stack(lasts)
        batched = []
        for s in range(0, tokens.shape[0], 3):
            enc = model(tokens[s : s + 3], return_encodings=True)
            batched.append(enc[:, :-1, :].mean(dim=1))
        batched = torch.cat(batched)
        batch_diff = float(((batched - means).abs().max() / means.abs().max()).item())

    n_genes_expr = [int((values[r] > 0).sum()) for r in range(values.shape[0])]
    ref_json = {
        "upstream": "github.com/TencentAILabHealthcare/scBERT commit 262fd4b, performer_pytorch/performer_pytorch.py",
        "script": "scripts/scbert_reference.py",
        "torch": torch.__version__,
        "seed": SEED,
        "config": {"dim": DIM, "depth": DEPTH, "heads": HEADS, "dim_head": DIM_HEAD, "nb_features": nb_features,
                   "num_tokens": CLASS, "n_genes": N_REF_GENES, "seq_len": N_REF_GENES + 1},
        "data": "tests/fixtures/scbert/demo.h5ad",
        "reference_genes": ref_genes,
        "genes_matched": int(sum(1 for g in ref_genes if g in set(adata.var_names))),
        "genes_expressed": n_genes_expr,
        "tokens": tokens.tolist(),
        "cell_embedding_mean": means.tolist(),
        "position_last": lasts.tolist(),
        "batch_of_3_max_rel_diff": batch_diff,
    }
    (OUT / "reference.json").write_text(json.dumps(ref_json))
    print(f"wrote {OUT}: {tokens.shape[0]} cells, {nb_features} random features, "
          f"batch-of-3 vs alone max rel diff {batch_diff:.3e}")


if __name__ == "__main__":
    main()
