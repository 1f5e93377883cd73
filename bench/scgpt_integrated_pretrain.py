#!/usr/bin/env python3
"""Briefly pretrain a small scGPT with upstream's own code (scgpt 0.2.4) on SYNTHETIC counts, and
save it in upstream's checkpoint format (best_model.pt, vocab.json, args.json), so that
`scfoundry embed -m scgpt` and `scfoundry integrate -m scgpt_integrated` load it. The start of
bench/scgpt_integrated_synthetic.sh. Needs the torch venv of scripts/scgpt_reference.py.

    python bench/scgpt_integrated_pretrain.py PRETRAIN.h5ad OUT_DIR [--epochs 6] [--seed 0]

PRETRAIN.h5ad: raw counts with gene_0 .. gene_{G-1} in var_names (scripts/make_synthetic.py,
with a seed other than the evaluation data's). The vocabulary is those genes and <pad>, <cls>,
<eoc>, as bench/scgpt_integrated_checkpoint.py writes it.

What is upstream here: the preprocessing (scgpt.preprocess.Preprocessor: normalize_total 1e4,
log1p, 51 bins of each cell's non-zero values), tokenize_and_pad_batch (<cls> + every gene,
zeros kept), random_mask_value (ratio 0.4), TransformerModel (embsize 32, 4 heads, d_hid 64,
2 layers, post-norm, continuous value encoder, explicit zero probabilities, MVC decoder,
use_fast_transformer=False) and the masked value objectives of upstream's pretraining and
fine-tuning examples: GEP (masked MSE) + its Bernoulli term + GEPC (MVC: the cell embedding
predicts each gene's value) + its Bernoulli term. No batch labels, no DAB, no DSBN (a
pretrained model has none). Adam (lr 1e-3, a short run), StepLR(gamma 0.9), clip
1.0, minibatches of 64 shuffled cells, 5% of cells held out; the epoch with the lowest
held-out GEP MSE is saved. float32, on the CPU unless --device cuda. Where anndata or scanpy
is missing, the preprocessing runs as the same steps in numpy (binned_with_numpy).
"""
import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

D, HEADS, D_HID, LAYERS = 32, 4, 64, 2
PAD, MASK_VALUE, PAD_VALUE, N_BINS, MASK_RATIO = "<pad>", -1, -2, 51, 0.4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("out")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    a = ap.parse_args()

    from scgpt.loss import criterion_neg_log_bernoulli, masked_mse_loss
    from scgpt.model import TransformerModel
    from scgpt.tokenizer import random_mask_value, tokenize_and_pad_batch

    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    dev = torch.device(a.device)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        import anndata
        from scgpt.preprocess import Preprocessor
    except ImportError:  # no anndata/scanpy (a bare torch environment): the same steps in numpy
        anndata = None
    if anndata is not None:
        adata = anndata.read_h5ad(a.data)
        genes = list(adata.var_names)
        Preprocessor(use_key="X", filter_gene_by_counts=False, filter_cell_by_counts=False, normalize_total=1e4,
                     result_normed_key="X_normed", log1p=True, result_log1p_key="X_log1p", subset_hvg=False,
                     binning=N_BINS, result_binned_key="X_binned")(adata)
        x = adata.layers["X_binned"]
        x = x.toarray() if hasattr(x, "toarray") else np.asarray(x)
    else:
        x, genes = binned_with_numpy(a.data)
    vocab = {g: i for i, g in enumerate(genes)}
    for s in [PAD, "<cls>", "<eoc>"]:
        vocab[s] = len(vocab)
    gene_ids = np.array([vocab[g] for g in genes], dtype=int)
    tok = tokenize_and_pad_batch(x, gene_ids, max_len=len(genes) + 1, vocab=vocab, pad_token=PAD, pad_value=PAD_VALUE,
                                 append_cls=True, include_zero_gene=True, cls_token="<cls>")
    n = tok["genes"].shape[0]
    perm = np.random.permutation(n)
    n_valid = max(1, int(0.05 * n))
    valid, train = perm[:n_valid], perm[n_valid:]

    model = TransformerModel(len(vocab), D, HEADS, D_HID, LAYERS, vocab=vocab, dropout=0.2, pad_token=PAD,
                             pad_value=PAD_VALUE, do_mvc=True, do_dab=False, use_batch_labels=False,
                             domain_spec_batchnorm=False, n_input_bins=N_BINS, input_emb_style="continuous",
                             explicit_zero_prob=True, use_fast_transformer=False, pre_norm=False).to(dev)
    tok = {k: v.to(dev) for k, v in tok.items()}
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)

    def losses(idx, values):
        ids = tok["genes"][idx]
        target = tok["values"][idx].float()
        inp = values[idx]
        o = model(ids, inp, src_key_padding_mask=ids.eq(vocab[PAD]), MVC=True, ECS=False)
        m = inp.eq(MASK_VALUE)
        parts = [masked_mse_loss(o["mlm_output"], target, m), criterion_neg_log_bernoulli(o["mlm_zero_probs"], target, m),
                 masked_mse_loss(o["mvc_output"], target, m), criterion_neg_log_bernoulli(o["mvc_zero_probs"], target, m)]
        return parts

    best, log = math.inf, []
    for epoch in range(1, a.epochs + 1):
        t0 = time.time()
        values = random_mask_value(tok["values"].cpu(), mask_ratio=MASK_RATIO, mask_value=MASK_VALUE, pad_value=PAD_VALUE).to(dev)
        model.train()
        sums, k = np.zeros(5), 0
        order = np.random.permutation(train)
        for s in range(0, len(order), a.batch_size):
            parts = losses(torch.from_numpy(order[s:s + a.batch_size]), values)
            loss = sum(parts)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sums += [p.item() for p in parts] + [loss.item()]
            k += 1
        model.eval()
        with torch.no_grad():
            vm = float(np.mean([losses(torch.from_numpy(valid[s:s + 256]), values)[0].item() for s in range(0, len(valid), 256)]))
        sched.step()
        row = {"epoch": epoch, **dict(zip(["gep", "gep_zero", "gepc", "gepc_zero", "total"], (sums / k).round(5).tolist())),
               "valid_gep_mse": round(vm, 5), "seconds": round(time.time() - t0, 1)}
        log.append(row)
        print(json.dumps(row), flush=True)
        if vm < best:
            best = vm
            torch.save({k: v.cpu() for k, v in model.state_dict().items()}, out / "best_model.pt")
    (out / "vocab.json").write_text(json.dumps(vocab))
    (out / "args.json").write_text(json.dumps({
        "embsize": D, "nheads": HEADS, "d_hid": D_HID, "nlayers": LAYERS, "n_layers_cls": 3,
        "dropout": 0.2, "pad_token": PAD, "pad_value": PAD_VALUE, "mask_value": MASK_VALUE, "n_bins": N_BINS,
        "input_style": "binned", "input_emb_style": "continuous", "max_seq_len": len(genes) + 1,
    }, indent=1))
    (out / "pretrain_log.json").write_text(json.dumps({"data": a.data, "seed": a.seed, "lr": a.lr, "epochs": log,
                                                       "torch": torch.__version__}, indent=1))


def binned_with_numpy(path):
    """Preprocessor's steps above without anndata and scanpy, on the counts of an .h5ad:
    binned_counts of its dense counts, and its genes."""
    x, genes = dense_counts(path)
    return binned_counts(x), genes


def dense_counts(path):
    """An .h5ad's counts (X, CSR, as scripts/make_synthetic.py writes them) as a dense cells x
    genes array, and its gene names, read with h5py."""
    import h5py
    with h5py.File(path, "r") as f:
        data, indices, indptr = f["X/data"][:], f["X/indices"][:], f["X/indptr"][:]
        n, g = (int(v) for v in f["X"].attrs["shape"])
        genes = [v.decode() if isinstance(v, bytes) else str(v) for v in f["var/_index"][:]]
    x = np.zeros((n, g), dtype=np.float64)
    for i in range(n):
        x[i, indices[indptr[i]:indptr[i + 1]]] = data[indptr[i]:indptr[i + 1]]
    return x, genes


def binned_counts(x):
    """Dense counts (cells x genes) scaled to 1e4 a cell, log1p, and each cell's non-zero values
    put in 51 bins at their quantiles, ties split at random (scgpt 0.2.4's Preprocessor with
    normalize_total 1e4, log1p and binning 51; its _digitize, side "both")."""
    tot = x.sum(1, keepdims=True)
    x = np.log1p(np.divide(x * 1e4, tot, out=np.zeros_like(x), where=tot > 0))
    binned = np.zeros(x.shape, dtype=np.int64)
    for i in range(x.shape[0]):
        nz = x[i].nonzero()[0]
        if nz.size == 0:
            continue
        v = x[i, nz]
        bins = np.quantile(v, np.linspace(0, 1, N_BINS - 1))
        left, right = np.digitize(v, bins), np.digitize(v, bins, right=True)
        binned[i, nz] = np.ceil(np.random.rand(len(v)) * (right - left) + left).astype(np.int64)
    return binned


if __name__ == "__main__":
    main()
