#!/usr/bin/env python3
"""The oracle of bench/scgpt_integrated_synthetic.sh: upstream's own integration fine-tuning
(scgpt 0.2.4, examples/finetune_integration.py) from an upstream-format checkpoint on an .h5ad of
raw counts, then upstream's `encode_batch` embedding of every cell. Needs the torch venv of
scripts/scgpt_reference.py.

    python bench/scgpt_integrated_upstream.py DATA.h5ad CHECKPOINT_DIR OUT_DIR \
        [--seed 0] [--epochs 30] [--batch-key batch] [--into FILE.h5ad] [--device cuda]

Writes OUT_DIR/losses.tsv (each objective per epoch, the columns of scfoundry's losses.tsv),
OUT_DIR/embedding.npy (the L2-normalised <cls> embeddings, in DATA's cell order) and, with
--into, adds them to FILE.h5ad as obsm['X_scgpt_upstream'] (FILE must hold DATA's cells in
DATA's order, e.g. scfoundry's integrated output) for `scfoundry benchmark`.

What runs is finetune_integration.py's, with upstream's functions: Preprocessor
(filter_gene_by_counts 3, normalize_total 1e4, log1p, seurat_v3 HVGs across batches when there
are more than 1,200 genes, 51 bins), tokenize_and_pad_batch (<cls> + every gene, zeros kept),
train_test_split (10% validation), random_mask_value (0.4, redrawn each epoch), cells sorted by
batch and SubsetsBatchSampler (64 a minibatch, shuffled within a batch), TransformerModel with
do_mvc, do_dab, use_batch_labels, domain_spec_batchnorm, explicit_zero_prob, ecs_threshold 0.8,
pre_norm False, loaded where names and shapes match; train(): GEP + Bernoulli + GEPC + Bernoulli
+ 10 x ECS + 1.0 x DAB, Adam(lr 1e-4, eps 1e-4), clip_grad_norm 1.0, StepLR(1, 0.9); evaluate()
and the lowest validation MSE kept; eval_testdata()'s encode_batch on the batch-sorted cells in
chunks of 64. What differs, on purpose: use_fast_transformer=False and float32 without autocast
(the CPU unless --device cuda; upstream's defaults are flash-attention and fp16 autocast), no
wandb, and the seed (set_seed(SEED) instead of 42). Where anndata or scanpy is missing (a bare
torch environment, with bench/scgpt_upstream_shim.sh for the scgpt modules), the Preprocessor's
steps run in numpy (load_with_numpy: no HVG selection, so at most 1,200 genes).
"""
import argparse
import copy
import time
from pathlib import Path

import numpy as np
import torch

PAD, MASK_VALUE, PAD_VALUE, N_BINS, N_HVG = "<pad>", -1, -2, 51, 1200
MASK_RATIO, ECS_THRES, DAB_WEIGHT, LR, SCHEDULE_RATIO, BATCH_SIZE, DROPOUT = 0.4, 0.8, 1.0, 1e-4, 0.9, 64, 0.2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-key", default="batch")
    ap.add_argument("--into")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    a = ap.parse_args()

    import json

    from scipy.sparse import issparse
    from sklearn.model_selection import train_test_split
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    from scgpt.data_sampler import SubsetsBatchSampler
    from scgpt.loss import criterion_neg_log_bernoulli, masked_mse_loss
    from scgpt.model import TransformerModel
    from scgpt.tokenizer import random_mask_value, tokenize_and_pad_batch

    try:
        import anndata
        from scgpt.preprocess import Preprocessor
        from scgpt.utils import set_seed
    except ImportError:  # no anndata/scanpy (a bare torch environment): the same steps in numpy
        anndata = None

        def set_seed(seed):  # scgpt.utils.set_seed's body
            import random
            random.seed(seed)
            np.random.seed(seed)
            torch.manual_seed(seed)
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False

    dev = torch.device(a.device)
    set_seed(a.seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ck = Path(a.checkpoint)
    vocab = json.loads((ck / "vocab.json").read_text())
    for s in [PAD, "<cls>", "<eoc>"]:
        if s not in vocab:
            vocab[s] = max(vocab.values()) + 1
    margs = json.loads((ck / "args.json").read_text())

    if anndata is not None:
        adata = anndata.read_h5ad(a.data)
        n_cells = adata.n_obs
        adata.obs["cell_order"] = np.arange(n_cells)
        adata.obs["str_batch"] = adata.obs[a.batch_key].astype(str)
        adata.obs["batch_id"] = adata.obs["str_batch"].astype("category").cat.codes.values
        adata = adata[:, [g in vocab for g in adata.var_names]].copy()
        Preprocessor(use_key="X", filter_gene_by_counts=3, filter_cell_by_counts=False, normalize_total=1e4,
                     result_normed_key="X_normed", log1p=True, result_log1p_key="X_log1p",
                     subset_hvg=N_HVG if adata.n_vars > N_HVG else False, hvg_flavor="seurat_v3",
                     binning=N_BINS, result_binned_key="X_binned")(adata, batch_key="str_batch")
        adata_sorted = adata[adata.obs["batch_id"].argsort()].copy()
        x = adata.layers["X_binned"]
        all_counts = x.toarray() if issparse(x) else np.asarray(x)
        genes = adata.var_names.tolist()
        batch_ids = np.array(adata.obs["batch_id"].tolist())
        sorted_counts, sorted_batch, sorted_order = None, None, None
    else:
        all_counts, genes, batch_ids = load_with_numpy(a.data, a.batch_key, vocab)
        n_cells = len(batch_ids)
        sorted_order = np.argsort(batch_ids)  # pandas' Series.argsort: numpy's quicksort
        sorted_counts, sorted_batch = all_counts[sorted_order], batch_ids[sorted_order]
    num_batch_types = len(set(batch_ids))
    train_data, valid_data, train_batch_labels, valid_batch_labels = train_test_split(
        all_counts, batch_ids, test_size=0.1, shuffle=True)
    gene_ids = np.array([vocab[g] for g in genes], dtype=int)
    max_seq_len = len(genes) + 1
    tok = lambda d: tokenize_and_pad_batch(d, gene_ids, max_len=max_seq_len, vocab=vocab, pad_token=PAD,
                                           pad_value=PAD_VALUE, append_cls=True, include_zero_gene=True)
    tokenized_train, tokenized_valid = tok(train_data), tok(valid_data)

    def prepare_data():
        mt = random_mask_value(tokenized_train["values"], mask_ratio=MASK_RATIO, mask_value=MASK_VALUE, pad_value=PAD_VALUE)
        mv = random_mask_value(tokenized_valid["values"], mask_ratio=MASK_RATIO, mask_value=MASK_VALUE, pad_value=PAD_VALUE)
        ts, vs = np.argsort(train_batch_labels), np.argsort(valid_batch_labels)
        tr = {"gene_ids": tokenized_train["genes"][ts], "values": mt[ts], "target_values": tokenized_train["values"][ts],
              "batch_labels": torch.from_numpy(train_batch_labels).long()[ts]}
        va = {"gene_ids": tokenized_valid["genes"][vs], "values": mv[vs], "target_values": tokenized_valid["values"][vs],
              "batch_labels": torch.from_numpy(valid_batch_labels).long()[vs]}
        return tr, va

    class SeqDataset(Dataset):
        def __init__(self, d):
            self.d = d

        def __len__(self):
            return self.d["gene_ids"].shape[0]

        def __getitem__(self, i):
            return {k: v[i] for k, v in self.d.items()}

    def loader(d, intra_shuffle):
        labels = d["batch_labels"].numpy()
        subsets = [np.where(labels == b)[0].tolist() for b in np.unique(labels)]
        return DataLoader(SeqDataset(d), batch_sampler=SubsetsBatchSampler(
            subsets, BATCH_SIZE, intra_subset_shuffle=intra_shuffle, inter_subset_shuffle=False, drop_last=False))

    model = TransformerModel(len(vocab), margs["embsize"], margs["nheads"], margs["d_hid"], margs["nlayers"], vocab=vocab,
                             dropout=DROPOUT, pad_token=PAD, pad_value=PAD_VALUE, do_mvc=True, do_dab=True,
                             use_batch_labels=True, num_batch_labels=num_batch_types, domain_spec_batchnorm=True,
                             n_input_bins=N_BINS, ecs_threshold=ECS_THRES, explicit_zero_prob=True,
                             use_fast_transformer=False, pre_norm=False).to(dev)
    model_dict = model.state_dict()
    pretrained = torch.load(ck / "best_model.pt", map_location=dev)
    pretrained = {k: v for k, v in pretrained.items() if k in model_dict and v.shape == model_dict[k].shape}
    model_dict.update(pretrained)
    model.load_state_dict(model_dict)
    print(f"loaded {len(pretrained)} of {len(model_dict)} tensors", flush=True)
    criterion_dab = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, eps=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=SCHEDULE_RATIO)

    def train(ld):
        model.train()
        sums, k = np.zeros(7), 0
        for bd in ld:
            ids, inp, tgt, bl = (bd[k].to(dev) for k in ("gene_ids", "values", "target_values", "batch_labels"))
            o = model(ids, inp, src_key_padding_mask=ids.eq(vocab[PAD]), batch_labels=bl, MVC=True, ECS=True)
            m = inp.eq(MASK_VALUE)
            parts = [masked_mse_loss(o["mlm_output"], tgt, m), criterion_neg_log_bernoulli(o["mlm_zero_probs"], tgt, m),
                     masked_mse_loss(o["mvc_output"], tgt, m), criterion_neg_log_bernoulli(o["mvc_zero_probs"], tgt, m),
                     o["loss_ecs"], criterion_dab(o["dab_output"], bl)]
            loss = parts[0] + parts[1] + parts[2] + parts[3] + 10 * parts[4] + DAB_WEIGHT * parts[5]
            model.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
            optimizer.step()
            sums += [p.item() for p in parts] + [loss.item()]
            k += 1
        return sums / max(k, 1)

    def evaluate(ld):
        model.eval()
        tot, n = 0.0, 0
        with torch.no_grad():
            for bd in ld:
                ids, inp, tgt, bl = (bd[k].to(dev) for k in ("gene_ids", "values", "target_values", "batch_labels"))
                o = model(ids, inp, src_key_padding_mask=ids.eq(vocab[PAD]), batch_labels=bl)
                tot += masked_mse_loss(o["mlm_output"], tgt, inp.eq(MASK_VALUE)).item() * len(ids)
                n += len(ids)
        return tot / n

    lines = ["epoch\tlr\tgep\tgep_zero\tgepc\tgepc_zero\tecs\tdab\ttotal\tvalid_gep_mse\tseconds"]
    best_val, best_model, best_epoch = float("inf"), None, 0
    for epoch in range(1, a.epochs + 1):
        t0 = time.time()
        tr, va = prepare_data()
        lr = scheduler.get_last_lr()[0]
        t = train(loader(tr, True))
        v = evaluate(loader(va, False))
        if v < best_val:
            best_val, best_model, best_epoch = v, copy.deepcopy(model), epoch
        scheduler.step()
        lines.append("\t".join([str(epoch), f"{lr:.3e}"] + [f"{x:.5f}" for x in t] + [f"{v:.5f}", f"{time.time() - t0:.1f}"]))
        print(lines[-1], flush=True)
    (out / "losses.tsv").write_text("\n".join(lines) + "\n")

    # eval_testdata: the batch-sorted cells, encode_batch in chunks of 64
    best_model.eval()
    if sorted_counts is None:
        xs = adata_sorted.layers["X_binned"]
        sorted_counts = xs.toarray() if issparse(xs) else np.asarray(xs)
        sorted_batch = np.array(adata_sorted.obs["batch_id"].tolist())
        sorted_order = adata_sorted.obs["cell_order"].to_numpy()
    ta = tok(sorted_counts)
    with torch.no_grad():
        emb = best_model.encode_batch(ta["genes"], ta["values"].float(), src_key_padding_mask=ta["genes"].eq(vocab[PAD]),
                                      batch_size=BATCH_SIZE, batch_labels=torch.from_numpy(sorted_batch).long(),
                                      time_step=0, return_np=True)
    emb = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    full = np.zeros((n_cells, emb.shape[1]), dtype=np.float32)
    full[sorted_order] = emb
    np.save(out / "embedding.npy", full)
    (out / "summary.json").write_text(json.dumps({"best_epoch": best_epoch, "best_valid_gep_mse": best_val,
                                                  "genes": len(genes), "loaded": sorted(pretrained),
                                                  "torch": torch.__version__, "seed": a.seed, "epochs": a.epochs}, indent=1))
    if a.into:
        import h5py
        with h5py.File(a.into, "r+") as f:
            if f["obsm"].get("X_scgpt_upstream") is not None:
                del f["obsm"]["X_scgpt_upstream"]
            ds = f["obsm"].create_dataset("X_scgpt_upstream", data=full)
            ds.attrs["encoding-type"] = "array"
            ds.attrs["encoding-version"] = "0.2.0"
    print(f"best epoch {best_epoch}, validation GEP MSE {best_val:.4f}", flush=True)


def load_with_numpy(path, batch_key, vocab):
    """The data as the Preprocessor above leaves it, without anndata and scanpy: the genes in the
    vocabulary with at least 3 counts (filter_gene_by_counts), then scgpt_integrated_pretrain.py's
    binned_counts (1e4 a cell, log1p, 51 bins); no HVG selection, so at most 1,200 genes. The batch
    ids are the codes of the batch labels' sorted strings, as `astype(str).astype("category")`."""
    import sys

    import h5py
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from scgpt_integrated_pretrain import binned_counts, dense_counts
    x, names = dense_counts(path)
    with h5py.File(path, "r") as f:
        col = f["obs"][batch_key]
        labels = col["categories"][:][col["codes"][:]]
    labels = np.array([v.decode() if isinstance(v, bytes) else str(v) for v in labels])
    keep = np.array([nm in vocab for nm in names]) & (x.sum(0) >= 3)
    if keep.sum() > N_HVG:
        raise SystemExit(f"{keep.sum()} genes: selecting {N_HVG} HVGs needs scanpy (and anndata)")
    genes = [nm for nm, k in zip(names, keep) if k]
    batch_ids = np.searchsorted(np.unique(labels), labels)
    return binned_counts(x[:, keep]), genes, batch_ids


if __name__ == "__main__":
    main()
