#!/usr/bin/env python3
"""A small scGPT checkpoint folder (upstream's format: best_model.pt, vocab.json, args.json) for
the genes of a synthetic file (gene_0 .. gene_{G-1}), with seeded random weights: the start of
bench/scgpt_integrated_synthetic.sh. Needs torch (the venv of scripts/scgpt_reference.py).

    python bench/scgpt_integrated_checkpoint.py OUT_DIR N_GENES [SEED]

SHAPE=whole-human in the environment writes the whole-human shape instead (embsize 512, 8 heads,
d_hid 512, 12 layers) with random weights, for bench/scgpt_integrated_gpu.sh.

The state_dict is upstream's TransformerModel's as embed_data builds it (embsize 32, 4 heads,
d_hid 64, 2 layers): the names and shapes are written here by hand, with PyTorch's default
initialisation (Linear: U(+-1/sqrt(fan_in)); embeddings N(0, 1) with init_weights' U(+-0.1) for
the gene table; LayerNorm ones and zeros), so the scgpt package is not needed.
"""
import json
import math
import sys
from pathlib import Path

import os

import torch

D, HEADS, D_HID, LAYERS = (512, 8, 512, 12) if os.environ.get("SHAPE") == "whole-human" else (32, 4, 64, 2)


def main():
    out, n_genes = Path(sys.argv[1]), int(sys.argv[2])
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    vocab = {f"gene_{i}": i for i in range(n_genes)}
    for s in ["<pad>", "<cls>", "<eoc>"]:
        vocab[s] = len(vocab)
    sd = {}

    def lin(name, o, i):
        a = 1 / math.sqrt(i)
        sd[f"{name}.weight"] = (torch.rand(o, i, generator=g) * 2 - 1) * a
        sd[f"{name}.bias"] = (torch.rand(o, generator=g) * 2 - 1) * a

    def ln(name):
        sd[f"{name}.weight"] = torch.ones(D)
        sd[f"{name}.bias"] = torch.zeros(D)

    sd["encoder.embedding.weight"] = (torch.rand(len(vocab), D, generator=g) * 2 - 1) * 0.1
    ln("encoder.enc_norm")
    lin("value_encoder.linear1", D, 1)
    lin("value_encoder.linear2", D, D)
    ln("value_encoder.norm")
    for l in range(LAYERS):
        p = f"transformer_encoder.layers.{l}"
        a = math.sqrt(6 / (D + 3 * D))
        sd[f"{p}.self_attn.in_proj_weight"] = (torch.rand(3 * D, D, generator=g) * 2 - 1) * a
        sd[f"{p}.self_attn.in_proj_bias"] = torch.zeros(3 * D)
        lin(f"{p}.self_attn.out_proj", D, D)
        sd[f"{p}.self_attn.out_proj.bias"] = torch.zeros(D)
        lin(f"{p}.linear1", D_HID, D)
        lin(f"{p}.linear2", D, D_HID)
        ln(f"{p}.norm1")
        ln(f"{p}.norm2")
    torch.save(sd, out / "best_model.pt")
    (out / "vocab.json").write_text(json.dumps(vocab))
    (out / "args.json").write_text(json.dumps({
        "embsize": D, "nheads": HEADS, "d_hid": D_HID, "nlayers": LAYERS, "n_layers_cls": 3,
        "dropout": 0.2, "pad_token": "<pad>", "pad_value": -2, "mask_value": -1, "n_bins": 51,
        "input_style": "binned", "input_emb_style": "continuous", "max_seq_len": 1200,
    }, indent=1))


if __name__ == "__main__":
    main()
