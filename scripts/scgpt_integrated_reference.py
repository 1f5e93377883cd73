#!/usr/bin/env python3
"""Parity fixture for scfoundry's scgpt_integrated (src/methods/scgpt_integrated.rs): one
training step of scGPT's integration fine-tuning, run by upstream's own code.

Run once by hand in the torch venv of scripts/scgpt_reference.py, never in CI (CI reads only
what this writes):

    ~/.cache/scfoundry/torch-venv-scgpt/bin/python scripts/scgpt_integrated_reference.py

What is upstream here (scgpt 0.2.4): TransformerModel built as examples/finetune_integration.py
builds it (do_mvc, do_dab, use_batch_labels, domain_spec_batchnorm=True, explicit_zero_prob,
ecs_threshold 0.8), scgpt.tokenizer.random_mask_value (mask ratio 0.4), scgpt.loss's
masked_mse_loss and criterion_neg_log_bernoulli, and the loss of its `train()`: GEP + its
Bernoulli term + GEPC + its Bernoulli term + 10 x ECS + dab_weight (1.0) x cross-entropy of the
reversed-gradient discriminator. What differs, on purpose:
- dropout 0 (upstream fine-tunes at 0.2) and float32 without autocast (upstream: fp16 autocast),
  so that losses and gradients compare exactly;
- use_fast_transformer=False (flash-attn does not run on a CPU); the vocabulary is passed as a
  plain dict (TransformerModel reads only vocab[pad_token]), so torchtext's Vocab is not needed
  by the model;
- a small model (2 layers, embsize 32, 4 heads, d_hid 64; the vocabulary of
  tests/fixtures/scgpt/tiny) with seeded random weights, every tensor perturbed;
- gradients are compared (one backward pass), not weights after an Adam step.

It writes tests/fixtures/scgpt_integrated/:
- initial.safetensors: every parameter and buffer (DSBN running statistics) before the step;
- batch.safetensors: gene ids, masked input values, target values, batch labels of 6 cells of
  1 + 30 tokens (one batch label in the minibatch, as upstream's per-batch sampler gives);
- grads.safetensors: the gradient of the total loss for every parameter (`grad.<name>`), the
  gradient of the DAB loss alone (`dab.<name>`), DSBN's running statistics after the step's
  forward pass (`after.<buffer>`), and the eval-mode `<cls>` embeddings (L2-normalised) of the
  cells after that update (`eval_cell_emb`);
- reference.json: each objective's loss and the total.
"""

import json
import struct
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "scgpt_integrated"
VOCAB = ROOT / "tests" / "fixtures" / "scgpt" / "tiny" / "vocab.json"
SEED = 0
N_CELLS, N_GENES, N_BATCHES, LABEL = 6, 30, 3, 1
D, HEADS, D_HID, LAYERS = 32, 4, 64, 2
MASK_RATIO, MASK_VALUE, PAD_VALUE = 0.4, -1, -2
ECS_THRES, ECS_WEIGHT, DAB_WEIGHT = 0.8, 10.0, 1.0


def save_safetensors(path, tensors):
    """The safetensors format, written by hand (no extra package in the venv)."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        dtype = {torch.float32: "F32", torch.int64: "I64", torch.int32: "I32"}[t.dtype]
        b = t.numpy().tobytes()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def main():
    from scgpt.model import TransformerModel
    from scgpt.tokenizer import random_mask_value
    from scgpt.loss import masked_mse_loss, criterion_neg_log_bernoulli

    torch.manual_seed(SEED)
    np.random.seed(SEED)
    OUT.mkdir(parents=True, exist_ok=True)
    vocab = json.loads(VOCAB.read_text())
    for s in ["<pad>", "<cls>", "<eoc>"]:
        if s not in vocab:
            vocab[s] = max(vocab.values()) + 1
    model = TransformerModel(
        len(vocab), D, HEADS, D_HID, LAYERS, vocab=vocab, dropout=0.0, pad_token="<pad>",
        pad_value=PAD_VALUE, do_mvc=True, do_dab=True, use_batch_labels=True,
        num_batch_labels=N_BATCHES, domain_spec_batchnorm=True, n_input_bins=51,
        ecs_threshold=ECS_THRES, explicit_zero_prob=True, use_fast_transformer=False, pre_norm=False,
    )
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        # running statistics that are not the defaults, so that the update shows
        for i in range(N_BATCHES):
            bn = model.dsbn.bns[i]
            bn.running_mean.copy_(0.1 * torch.randn(D, generator=g))
            bn.running_var.copy_(1.0 + 0.1 * torch.rand(D, generator=g))
    initial = {k: v.clone() for k, v in model.state_dict().items() if v.dtype == torch.float32}

    # ---- a minibatch as finetune_integration.py makes it: <cls> (value 0) + genes, zeros kept
    rng = np.random.default_rng(SEED)
    gene_names = [k for k in vocab if not k.startswith("<") and not k.startswith("NOTINDATA")]
    picked = rng.choice(len(gene_names), N_GENES, replace=False)
    ids = np.array([vocab["<cls>"]] + [vocab[gene_names[i]] for i in picked], dtype=np.int64)
    target = np.zeros((N_CELLS, N_GENES + 1), dtype=np.float32)
    for c in range(N_CELLS):
        nz = rng.random(N_GENES) < 0.6
        target[c, 1:][nz] = rng.integers(1, 51, nz.sum())
    gene_ids = torch.from_numpy(np.tile(ids, (N_CELLS, 1)))
    target_values = torch.from_numpy(target)
    input_values = random_mask_value(target_values, mask_ratio=MASK_RATIO, mask_value=MASK_VALUE, pad_value=PAD_VALUE)
    batch_labels = torch.full((N_CELLS,), LABEL, dtype=torch.long)

    # ---- upstream's train() step, float32
    def step():
        model.train()
        pad_mask = gene_ids.eq(vocab["<pad>"])
        out = model(gene_ids, input_values, src_key_padding_mask=pad_mask, batch_labels=batch_labels, MVC=True, ECS=True)
        masked = input_values.eq(MASK_VALUE)
        losses = {
            "gep": masked_mse_loss(out["mlm_output"], target_values, masked),
            "gep_zero": criterion_neg_log_bernoulli(out["mlm_zero_probs"], target_values, masked),
            "gepc": masked_mse_loss(out["mvc_output"], target_values, masked),
            "gepc_zero": criterion_neg_log_bernoulli(out["mvc_zero_probs"], target_values, masked),
            "ecs": out["loss_ecs"],
            "dab": torch.nn.CrossEntropyLoss()(out["dab_output"], batch_labels),
        }
        total = (losses["gep"] + losses["gep_zero"] + losses["gepc"] + losses["gepc_zero"]
                 + ECS_WEIGHT * losses["ecs"] + DAB_WEIGHT * losses["dab"])
        return losses, total

    losses, total = step()
    model.zero_grad()
    total.backward()
    grads = {f"grad.{n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    no_grad = sorted(n for n, p in model.named_parameters() if p.grad is None)
    after = {f"after.{k}": v.clone() for k, v in model.state_dict().items() if k.startswith("dsbn.")}
    # the DAB loss alone (its gradient reaches the encoder reversed); statistics restored first
    model.load_state_dict({**model.state_dict(), **initial})
    losses2, _ = step()
    model.zero_grad()
    losses2["dab"].backward()
    dab = {f"dab.{n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # eval mode after the first step's statistics update: DSBN reads its running statistics
    model.load_state_dict({**model.state_dict(), **{k[len("after."):]: v for k, v in after.items()}})
    model.eval()
    torch.backends.mha.set_fastpath_enabled(False)  # the plain (differentiable) path, as in training
    with torch.no_grad():
        emb = model.encode_batch(gene_ids, target_values, gene_ids.eq(vocab["<pad>"]), batch_size=N_CELLS,
                                 batch_labels=batch_labels, time_step=0)
    emb = emb / emb.norm(dim=1, keepdim=True)

    save_safetensors(OUT / "initial.safetensors", initial)
    save_safetensors(OUT / "batch.safetensors", {
        "gene_ids": gene_ids, "input_values": input_values.float(), "target_values": target_values,
        "batch_labels": batch_labels,
    })
    save_safetensors(OUT / "grads.safetensors", {**grads, **dab, **{k: v.float() for k, v in after.items() if v.dtype == torch.float32}, "eval_cell_emb": emb})
    ref = {
        "config": {"embsize": D, "nheads": HEADS, "d_hid": D_HID, "nlayers": LAYERS, "n_batches": N_BATCHES,
                   "ntoken": len(vocab), "pad_id": vocab["<pad>"], "mask_ratio": MASK_RATIO,
                   "ecs_threshold": ECS_THRES, "ecs_weight": ECS_WEIGHT, "dab_weight": DAB_WEIGHT,
                   "dsbn_eps": 6.1e-5, "dsbn_momentum": 0.1},
        "losses": {k: float(v) for k, v in losses.items()},
        "total": float(total),
        "no_gradient": no_grad,
        "torch": torch.__version__,
        "scgpt": __import__("scgpt").__version__ if hasattr(__import__("scgpt"), "__version__") else "0.2.4",
    }
    (OUT / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    print(json.dumps(ref["losses"]), ref["total"], "no gradient:", no_grad)


if __name__ == "__main__":
    main()
