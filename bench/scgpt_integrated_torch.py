#!/usr/bin/env python3
"""Upstream's integration training step in PyTorch (scgpt 0.2.4's TransformerModel configured as
examples/finetune_integration.py, its train() loss), timed: the PyTorch side of
bench/scgpt_integrated_gpu.sh.

    python bench/scgpt_integrated_torch.py CKPT_DIR N_GENES BATCH STEPS OUT_JSON [bf16|f32]

Random minibatches of BATCH cells x (1 + N_GENES) tokens, one batch label each; bf16 autocast
with fp32 master weights (Adam on fp32 parameters) or plain f32; flash-attention when installed
(use_fast_transformer=True), else PyTorch's attention. Records seconds per step (after 2 warm-up
steps) and peak GPU memory.
"""
import json
import sys
import time

import torch


def main():
    ckpt, n_genes, batch, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    prec = sys.argv[6] if len(sys.argv) > 6 else "bf16"
    from scgpt.model import TransformerModel
    from scgpt.loss import masked_mse_loss, criterion_neg_log_bernoulli
    args = json.load(open(f"{ckpt}/args.json"))
    vocab = json.load(open(f"{ckpt}/vocab.json"))
    dev = torch.device("cuda")
    try:
        import flash_attn  # noqa: F401
        fast = True
    except ImportError:
        fast = False
    model = TransformerModel(len(vocab), args["embsize"], args["nheads"], args["d_hid"], args["nlayers"], vocab=vocab,
                             dropout=0.2, pad_token="<pad>", pad_value=-2, do_mvc=True, do_dab=True, use_batch_labels=True,
                             num_batch_labels=3, domain_spec_batchnorm=True, n_input_bins=51, ecs_threshold=0.8,
                             explicit_zero_prob=True, use_fast_transformer=fast, pre_norm=False).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, eps=1e-4)
    ids = torch.tensor([vocab["<cls>"]] + list(range(n_genes)), device=dev).repeat(batch, 1)
    g = torch.Generator(device="cpu").manual_seed(0)

    def step():
        target = torch.randint(0, 51, (batch, n_genes + 1), generator=g).float().to(dev)
        target[:, 0] = 0
        inp = target.clone()
        inp[torch.rand(inp.shape, generator=g).to(dev) < 0.4] = -1
        labels = torch.full((batch,), int(torch.randint(0, 3, (1,), generator=g)), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=prec == "bf16"):
            o = model(ids, inp, src_key_padding_mask=ids.eq(vocab["<pad>"]), batch_labels=labels, MVC=True, ECS=True)
            m = inp.eq(-1)
            loss = (masked_mse_loss(o["mlm_output"], target, m) + criterion_neg_log_bernoulli(o["mlm_zero_probs"], target, m)
                    + masked_mse_loss(o["mvc_output"], target, m) + criterion_neg_log_bernoulli(o["mvc_zero_probs"], target, m)
                    + 10 * o["loss_ecs"] + torch.nn.functional.cross_entropy(o["dab_output"], labels))
        model.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    model.train()
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    sec = (time.perf_counter() - t) / steps
    json.dump({"impl": "pytorch", "precision": prec, "flash_attention": fast, "batch": batch, "tokens": n_genes + 1,
               "seconds_per_step": sec, "cells_per_second": batch / sec,
               "peak_gpu_bytes": torch.cuda.max_memory_allocated(), "torch": torch.__version__}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
