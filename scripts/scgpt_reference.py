#!/usr/bin/env python3
"""Parity fixture for scfoundry's scGPT (src/methods/scgpt.rs), from upstream's own code.

Run once by hand in a torch venv, never in CI (CI only reads what this writes):

    python3 -m venv ~/.cache/scfoundry/torch-venv-scgpt
    ~/.cache/scfoundry/torch-venv-scgpt/bin/pip install torch==2.3.0 torchtext==0.18.0 "numpy<2"
    ~/.cache/scfoundry/torch-venv-scgpt/bin/pip install scgpt==0.2.4 torch==2.3.0 torchtext==0.18.0 \
        "numpy<2" ipython "pyarrow<17" anndata
    ~/.cache/scfoundry/torch-venv-scgpt/bin/python scripts/scgpt_reference.py

It writes tests/fixtures/scgpt/:
- tiny/ : a checkpoint folder in the upstream format (best_model.pt, vocab.json, args.json) of a
  small scGPT TransformerModel (2 layers, embsize 32, 4 heads, d_hid 64; seeded random weights,
  every tensor perturbed so that a tensor loaded into the wrong place shows). best_model.pt uses
  flash-attn's `self_attn.Wqkv` names, as the released checkpoints do; best_model_inproj.pt is
  the same state_dict under nn.MultiheadAttention's names. The vocabulary is the demo genes less
  every 9th, plus 3 genes absent from the data, `<pad>` and `<cls>` (no `<eoc>`: embed_data
  appends it), ids shuffled.
- reference.json : token ids, binned values and cell embeddings of demo cells as upstream's
  embed_data computes them with this checkpoint, plus binning and RNG cases.

What is upstream here: TransformerModel and load_pretrained (scgpt 0.2.4), the model
construction of scgpt.tasks.cell_emb.embed_data, its per-cell Dataset (rebuilt: it is local to
get_batch_cell_embeddings), scgpt.data_collator.DataCollator with binning, and the forward pass
`model._encode` with the `<cls>` row normalised by its L2 norm. What differs, on purpose:
- randomness: upstream draws from unseeded global RNGs. Here numpy's global RNG is seeded before
  each cell's binning with (SEED + cell row) mod 2**32, and the sampling of cells longer than
  max_length uses np.random.permutation from the same stream instead of torch.randperm (the
  collator's _sample is replaced by that one change). scfoundry does the same.
- DataLoader runs in the main process (num_workers=0), so the seeds above hold.
- PyTorch's nested-tensor fast path of nn.TransformerEncoder in eval mode is switched off for the
  fixture (torch.backends.mha.set_fastpath_enabled(False)); the embeddings with it on are
  compared and the largest difference recorded.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "scgpt"
SEED = 0
N_CELLS = 50
ARGS = {
    # the whole-human args.json's names; small sizes
    "embsize": 32,
    "nheads": 4,
    "d_hid": 64,
    "nlayers": 2,
    "n_layers_cls": 3,
    "dropout": 0.2,
    "pad_token": "<pad>",
    "pad_value": -2,
    "mask_value": -1,
    "n_bins": 51,
    "input_style": "binned",
    "input_emb_style": "continuous",
    "max_seq_len": 1200,
    "fast_transformer": True,
}


def main():
    torch.manual_seed(SEED)
    import anndata
    import scgpt
    from scgpt.model import TransformerModel
    from scgpt.tokenizer import GeneVocab
    from scgpt.utils import load_pretrained
    import scgpt.data_collator as dc
    from scgpt.preprocess import binning

    tiny = OUT / "tiny"
    tiny.mkdir(parents=True, exist_ok=True)
    adata = anndata.read_h5ad(ROOT / "demo" / "pbmc68k_counts.h5ad")
    genes = list(adata.var_names)
    rng = np.random.default_rng(SEED)
    kept = [g for i, g in enumerate(genes) if i % 9 != 4]
    tokens = kept + ["NOTINDATA1", "NOTINDATA2", "NOTINDATA3", "<pad>", "<cls>"]
    ids = rng.permutation(len(tokens))
    vocab_dict = {t: int(i) for t, i in zip(tokens, ids)}
    (tiny / "vocab.json").write_text(json.dumps(vocab_dict, indent=0))
    (tiny / "args.json").write_text(json.dumps(ARGS, indent=2))

    # ---- embed_data's model construction and loading
    model_dir = tiny
    vocab = GeneVocab.from_file(model_dir / "vocab.json")
    for s in ["<pad>", "<cls>", "<eoc>"]:
        if s not in vocab:
            vocab.append_token(s)
    mc = json.loads((model_dir / "args.json").read_text())

    def build():
        return TransformerModel(
            ntoken=len(vocab), d_model=mc["embsize"], nhead=mc["nheads"], d_hid=mc["d_hid"],
            nlayers=mc["nlayers"], nlayers_cls=mc["n_layers_cls"], n_cls=1, vocab=vocab,
            dropout=mc["dropout"], pad_token=mc["pad_token"], pad_value=mc["pad_value"],
            do_mvc=True, do_dab=False, use_batch_labels=False, domain_spec_batchnorm=False,
            explicit_zero_prob=False, use_fast_transformer=False, fast_transformer_backend="flash",
            pre_norm=False,
        )

    src = build()
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in src.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.add_(0.02 * torch.randn(p.shape, generator=g))
    sd = src.state_dict()
    flash = {k.replace("self_attn.in_proj_", "self_attn.Wqkv."): v for k, v in sd.items()}
    torch.save(flash, tiny / "best_model.pt")
    torch.save(sd, OUT / "best_model_inproj.pt")

    model = build()
    load_pretrained(model, torch.load(tiny / "best_model.pt", map_location="cpu"), verbose=False)
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k]), f"upstream's load_pretrained did not restore {k}"
    model.eval()

    adata.var["id_in_vocab"] = [vocab[g] if g in vocab else -1 for g in adata.var_names]
    matched = int((adata.var["id_in_vocab"] >= 0).sum())
    adata = adata[:, adata.var["id_in_vocab"] >= 0]
    vocab.set_default_index(vocab["<pad>"])
    gene_ids = np.array(vocab(adata.var_names.tolist()), dtype=int)

    # ---- seeded randomness (see the docstring)
    seeds = []
    real_binning = dc.binning

    def seeded_binning(row, n_bins):
        np.random.seed(seeds.pop(0))
        return real_binning(row=row, n_bins=n_bins)

    dc.binning = seeded_binning

    def numpy_sample(self, genes, expressions, max_length):
        _n = self.keep_first_n_tokens
        indices = torch.from_numpy(np.random.permutation(len(genes) - _n)[: max_length - _n])
        indices = torch.cat([torch.arange(_n), indices + _n], dim=0)
        return genes[indices], expressions[indices]

    dc.DataCollator._sample = numpy_sample

    def embed(first, n, max_length, batch_size=64):
        sub = adata[first:first + n]
        X = sub.X.toarray()

        class Dataset(torch.utils.data.Dataset):  # get_batch_cell_embeddings' Dataset
            def __len__(self):
                return len(X)

            def __getitem__(self, idx):
                row = X[idx]
                nz = np.nonzero(row)[0]
                values = row[nz]
                gs = gene_ids[nz]
                gs = np.insert(gs, 0, vocab["<cls>"])
                values = np.insert(values, 0, mc["pad_value"])
                return {"id": idx, "genes": torch.from_numpy(gs).long(), "expressions": torch.from_numpy(values).float()}

        collator = dc.DataCollator(
            do_padding=True, pad_token_id=vocab[mc["pad_token"]], pad_value=mc["pad_value"],
            do_mlm=False, do_binning=True, max_length=max_length, sampling=True, keep_first_n_tokens=1,
        )

        def collate(examples):
            seeds.extend((SEED + first + e["id"]) % 2**32 for e in examples)
            return collator(examples)

        loader = torch.utils.data.DataLoader(Dataset(), batch_size=batch_size, sampler=torch.utils.data.SequentialSampler(Dataset()), collate_fn=collate, num_workers=0)
        cells, embs = [], {True: [], False: []}
        for d in loader:
            for gi, ev in zip(d["gene"], d["expr"]):
                keep = gi != vocab[mc["pad_token"]]
                cells.append({"genes": gi[keep].tolist(), "values": ev[keep].tolist()})
            for fast in (False, True):
                torch.backends.mha.set_fastpath_enabled(fast)
                with torch.no_grad():
                    out = model._encode(d["gene"], d["expr"], src_key_padding_mask=d["gene"].eq(vocab[mc["pad_token"]]))
                embs[fast].append(out[:, 0, :].numpy())
        torch.backends.mha.set_fastpath_enabled(False)
        res = {}
        for fast, parts in embs.items():
            e = np.concatenate(parts).astype(np.float32)
            res[fast] = e / np.linalg.norm(e, axis=1, keepdims=True)
        fast_diff = float(np.max(np.abs(res[True] - res[False]) / np.maximum(np.abs(res[False]), 1e-3)))
        lens = [len(c["genes"]) for c in cells]
        return {
            "first_cell": first, "n_cells": n, "max_length": max_length, "batch_size": batch_size,
            "lengths": {"min": min(lens), "max": max(lens)},
            "cells": cells, "embeddings": res[False].tolist(),
            "fastpath_max_rel_diff": fast_diff,
        }

    cases = [embed(0, N_CELLS, 1200), embed(100, 8, 60, batch_size=3)]
    assert cases[0]["lengths"]["max"] < 1200 and cases[1]["lengths"]["max"] == 60

    # ---- binning and RNG cases (upstream's binning on float32 tensors, as the collator calls it)
    brng = np.random.default_rng(SEED + 2)
    rows = [
        [5.0], [3.0, 3.0], [1.0, 2.0], [1.0, 1.0, 1.0, 2.0, 7.0],
        brng.integers(1, 6, size=40).tolist(), brng.integers(1, 200, size=300).tolist(),
        np.round(np.log1p(brng.gamma(0.5, 20.0, size=120) + 1e-3), 3).tolist(),
        (brng.random(77) * 10).tolist(), (-brng.random(9)).tolist() + [0.5],
        adata.X[3].toarray()[0][adata.X[3].toarray()[0] > 0].tolist(),
    ]
    bins = []
    for i, r in enumerate(rows):
        np.random.seed(1000 + i)
        t = torch.tensor(np.array(r, dtype=np.float32))
        b = real_binning(row=t, n_bins=51)
        bins.append({"seed": 1000 + i, "values": np.array(r, dtype=np.float32).tolist(), "bins": [int(x) for x in b]})
    perms = []
    for s, n in [(0, 10), (7, 1), (123, 100), (2**32 - 1, 1000)]:
        np.random.seed(s)
        perms.append({"seed": s, "n": n, "permutation": np.random.permutation(n).tolist()})

    import importlib.metadata as md
    ref = {
        "made_by": "scripts/scgpt_reference.py",
        "versions": {"scgpt": md.version("scgpt"), "torch": torch.__version__, "numpy": np.__version__, "python": sys.version.split()[0]},
        "seed": SEED,
        "args": ARGS,
        "vocab": {"entries_in_file": len(vocab_dict), "tokens_with_appended": len(vocab), "demo_genes_matched": matched, "demo_genes": len(genes)},
        "state_dict_keys": sorted(flash.keys()),
        "cases": cases,
        "binning": bins,
        "permutations": perms,
    }
    (OUT / "reference.json").write_text(json.dumps(ref, separators=(",", ":")))
    for c in cases:
        print(f"case first={c['first_cell']} n={c['n_cells']} max_length={c['max_length']}: lengths {c['lengths']}, fast path max rel diff {c['fastpath_max_rel_diff']:.2e}")
    print(f"matched {matched}/{len(genes)} genes; wrote {OUT}")


if __name__ == "__main__":
    main()
