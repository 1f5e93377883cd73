#!/usr/bin/env python3
"""Seeded random models over a .h5ad's genes, for benchmarks (no torch needed).

    python bench/random_models.py genept DATA OUT_DIR [--dim 64] [--seed 0]
    python bench/random_models.py scimilarity DATA OUT_DIR [--genes 2000] [--hidden 128,64]
        [--latent 32] [--seed 0]

genept: OUT_DIR/GenePT_gene_embedding_ada_text.pickle, a dict {gene: numpy float64 vector} over
every var_name of DATA, as upstream's table (pickle protocol 4).

scimilarity: OUT_DIR/{encoder.ckpt, gene_order.tsv, layer_sizes.json, label_ints.csv}, an upstream
model folder over DATA's first --genes var_names. encoder.ckpt is what torch.save writes for
{"state_dict": Encoder.state_dict()} (a zip: encoder/data.pkl with torch._utils
_rebuild_tensor_v2 and persistent storage ids, encoder/data/<n> raw little-endian storages,
byteorder, version), written with zipfile + pickle as in tests/fixtures/scimilarity/tiny.
"""
from __future__ import annotations

import argparse
import collections
import io
import json
import pickle
import sys
import types
import zipfile
from pathlib import Path

import h5py
import numpy as np


def var_names(data: str) -> list[str]:
    with h5py.File(data, "r") as f:
        var = f["var"]
        idx = var.attrs.get("_index", "_index")
        return [x.decode() if isinstance(x, bytes) else str(x) for x in var[idx][:]]


def genept(args) -> None:
    genes = var_names(args.data)
    rng = np.random.default_rng(args.seed)
    table = {g: rng.normal(0.0, 1.0, size=args.dim) for g in genes}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "GenePT_gene_embedding_ada_text.pickle", "wb") as fh:
        pickle.dump(table, fh, protocol=4)
    print(f"genept table: {len(genes)} genes x {args.dim} in {out}")


# --- a torch.save checkpoint without torch: stand-ins pickled under torch's global names ---------
torch_mod = types.ModuleType("torch")
utils_mod = types.ModuleType("torch._utils")


def _rebuild_tensor_v2(*a):  # never called here; pickled by reference only
    raise NotImplementedError


_rebuild_tensor_v2.__module__ = "torch._utils"
utils_mod._rebuild_tensor_v2 = _rebuild_tensor_v2
torch_mod._utils = utils_mod
for _name in ("FloatStorage", "LongStorage"):
    _cls = type(_name, (), {"__module__": "torch"})
    setattr(torch_mod, _name, _cls)


class Tensor:
    def __init__(self, key: str, array: np.ndarray):
        self.key, self.array = key, array

    def __reduce__(self):
        shape = tuple(self.array.shape)
        stride = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
        return (_rebuild_tensor_v2, (Storage(self.key, self.array), 0, shape, stride, False, collections.OrderedDict()))


class Storage:
    def __init__(self, key: str, array: np.ndarray):
        self.key, self.array = key, array


class Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, Storage):
            cls = torch_mod.LongStorage if obj.array.dtype == np.int64 else torch_mod.FloatStorage
            return ("storage", cls, obj.key, "cpu", int(obj.array.size))
        return None


def save_checkpoint(path: Path, state: dict[str, np.ndarray]) -> None:
    saved = {k: sys.modules.get(k) for k in ("torch", "torch._utils")}
    sys.modules["torch"], sys.modules["torch._utils"] = torch_mod, utils_mod
    try:
        sd = collections.OrderedDict((k, Tensor(str(i), v)) for i, (k, v) in enumerate(state.items()))
        buf = io.BytesIO()
        Pickler(buf, protocol=2).dump({"state_dict": sd})
    finally:
        for k, m in saved.items():
            if m is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = m
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("encoder/data.pkl", buf.getvalue())
        z.writestr("encoder/byteorder", "little")
        for i, v in enumerate(state.values()):
            z.writestr(f"encoder/data/{i}", np.ascontiguousarray(v).astype(v.dtype.newbyteorder("<")).tobytes())
        z.writestr("encoder/version", "3\n")


def scimilarity(args) -> None:
    genes = var_names(args.data)[: args.genes]
    hidden = [int(h) for h in args.hidden.split(",")]
    rng = np.random.default_rng(args.seed)
    state: dict[str, np.ndarray] = {}
    n_in = len(genes)
    for i, h in enumerate(hidden):
        p = f"network.{i}"
        state[f"{p}.1.weight"] = (rng.normal(0, 1, (h, n_in)) / np.sqrt(n_in)).astype(np.float32)
        state[f"{p}.1.bias"] = rng.normal(0, 0.1, h).astype(np.float32)
        state[f"{p}.2.weight"] = rng.uniform(0.5, 1.5, h).astype(np.float32)
        state[f"{p}.2.bias"] = rng.normal(0, 0.1, h).astype(np.float32)
        state[f"{p}.2.running_mean"] = rng.normal(0, 0.1, h).astype(np.float32)
        state[f"{p}.2.running_var"] = rng.uniform(0.5, 1.5, h).astype(np.float32)
        state[f"{p}.2.num_batches_tracked"] = np.array(1000, dtype=np.int64)
        state[f"{p}.3.weight"] = np.array([0.25], dtype=np.float32)
        n_in = h
    state[f"network.{len(hidden)}.weight"] = (rng.normal(0, 1, (args.latent, n_in)) / np.sqrt(n_in)).astype(np.float32)
    state[f"network.{len(hidden)}.bias"] = rng.normal(0, 0.1, args.latent).astype(np.float32)

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(out / "encoder.ckpt", state)
    (out / "gene_order.tsv").write_text("".join(g + "\n" for g in genes))
    (out / "layer_sizes.json").write_text(json.dumps({k: list(v.shape) for k, v in state.items()}))
    (out / "label_ints.csv").write_text('"",0\n0,"type_0"\n')
    print(f"scimilarity model: {len(genes)} genes -> {hidden} -> {args.latent} in {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="kind", required=True)
    g = sub.add_parser("genept")
    g.add_argument("--dim", type=int, default=64)
    s = sub.add_parser("scimilarity")
    s.add_argument("--genes", type=int, default=2000)
    s.add_argument("--hidden", default="128,64")
    s.add_argument("--latent", type=int, default=32)
    for p in (g, s):
        p.add_argument("data")
        p.add_argument("out_dir")
        p.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    genept(args) if args.kind == "genept" else scimilarity(args)


if __name__ == "__main__":
    main()
