#!/usr/bin/env python3
"""Convert a released CellFM MindSpore checkpoint into the PyTorch port's checkpoint format,
which scfoundry reads (weights entry `cellfm-torch-state-dict`).

    pip install mindspore torch
    python3 scripts/cellfm_convert.py base_weight.ckpt <weights>/cellfm/cellfm_torch.pt \\
        --layers 40 --dims 1536 --heads 48

It does what the port's Cell_FM.load_weight does (github.com/biomed-AI/CellFM-torch, model.py at
commit b6c3673): mindspore's load_checkpoint, each name's `layer_norm.gamma/beta` renamed to
`weight/bias` (post_norm1/2 likewise), the optimizer state (`moment1.`, `moment2.`) and the
training counters (global_step, learning_rate, beta1_power, beta2_power, current_iterator_step,
last_overflow_iterator_step) left out, and then torch.save of the resulting FinetuneModel
state_dict (bare names: gene_emb, cls_token, value_enc.*, encoder.<i>.*, ...). It also writes
`<output stem>.json` with the sizes a state_dict does not hold (enc_num_heads; enc_dims and
enc_nlayers as a check), which scfoundry reads beside the state_dict.

Not run here: MindSpore and the released checkpoints cannot be had on this machine. The port
says it loads the 80M MindSpore weights; the 800M model (MindSpore CellFM class) has no ST_emb,
which scfoundry then reads through the port's embedding_infer path (cls token alone in front).
"""
import argparse
import json
from pathlib import Path

SKIP = {"global_step", "learning_rate", "beta1_power", "beta2_power", "current_iterator_step", "last_overflow_iterator_step"}


def torch_name(ms_name: str) -> str:
    """The port's map_ms_to_pt."""
    n = ms_name.replace("layer_norm.gamma", "weight").replace("layer_norm.beta", "bias")
    for k in ("post_norm1", "post_norm2"):
        n = n.replace(f"{k}.gamma", f"{k}.weight").replace(f"{k}.beta", f"{k}.bias")
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", help="MindSpore checkpoint (e.g. base_weight.ckpt, CellFM_80M_weight.ckpt)")
    ap.add_argument("out", help="output .pt (e.g. <weights>/cellfm/cellfm_torch.pt)")
    ap.add_argument("--layers", type=int, help="enc_nlayers (40 for the 800M model, 2 for the 80M)")
    ap.add_argument("--dims", type=int, default=1536, help="enc_dims")
    ap.add_argument("--heads", type=int, default=48, help="enc_num_heads (48 in both released configs)")
    a = ap.parse_args()

    import torch
    from mindspore.train.serialization import load_checkpoint

    ms = load_checkpoint(a.ckpt)
    sd = {}
    for k, v in ms.items():
        n = torch_name(k)
        if n.startswith(("moment1.", "moment2.")) or n in SKIP:
            continue
        sd[n] = torch.tensor(v.asnumpy()).float().contiguous()
    if "gene_emb" not in sd:
        raise SystemExit(f"{a.ckpt}: no `gene_emb` parameter: not a CellFM checkpoint (names: {sorted(sd)[:6]})")
    layers = len({k.split(".")[1] for k in sd if k.startswith("encoder.") and k.endswith("attn.q_proj.weight")})
    if a.layers is not None and a.layers != layers:
        raise SystemExit(f"{a.ckpt}: holds {layers} encoder layers, not --layers {a.layers}")
    dims = sd["gene_emb"].shape[1]
    if dims != a.dims:
        raise SystemExit(f"{a.ckpt}: gene_emb is {dims} wide, not --dims {a.dims}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(sd, out)
    with open(out.with_suffix(".json"), "w") as f:
        json.dump({"enc_dims": dims, "enc_nlayers": layers, "enc_num_heads": a.heads}, f)
    print(f"{out}: {len(sd)} tensors, {layers} layers x {dims}, gene_emb {tuple(sd['gene_emb'].shape)}, ST_emb {'present' if 'ST_emb' in sd else 'absent'}")


if __name__ == "__main__":
    main()
