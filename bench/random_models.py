#!/usr/bin/env python3
"""Seeded random models over a .h5ad's genes, for benchmarks (no torch needed).

    python bench/random_models.py genept DATA OUT_DIR [--dim 64] [--seed 0]
    python bench/random_models.py scimilarity DATA OUT_DIR [--genes 2000] [--hidden 128,64]
        [--latent 32] [--seed 0]
    python bench/random_models.py scfoundation DATA OUT_DIR [--hidden 768] [--depth 12]
        [--heads 12] [--seed 0]
    python bench/random_models.py scprint DATA OUT_DIR [--genes 25000] [--gene-column gene_ids]
        [--seed 0]
    python bench/random_models.py scvi DATA OUT_DIR [--genes 2000] [--hidden 128] [--latent 10]
        [--layers 1] [--seed 0]
    python bench/random_models.py c2s DATA OUT_DIR [--size 410m] [--seed 0]
    python bench/random_models.py cellfm DATA OUT_DIR [--depth 40] [--seed 0]

genept: OUT_DIR/GenePT_gene_embedding_ada_text.pickle, a dict {gene: numpy float64 vector} over
every var_name of DATA, as upstream's table (pickle protocol 4).

scimilarity: OUT_DIR/{encoder.ckpt, gene_order.tsv, layer_sizes.json, label_ints.csv}, an upstream
model folder over DATA's first --genes var_names. encoder.ckpt is what torch.save writes for
{"state_dict": Encoder.state_dict()} (a zip: encoder/data.pkl with torch._utils
_rebuild_tensor_v2 and persistent storage ids, encoder/data/<n> raw little-endian storages,
byteorder, version), written with zipfile + pickle as in tests/fixtures/scimilarity/tiny.

scfoundation: OUT_DIR/{models/models.ckpt, OS_scRNA_gene_index.19264.tsv}, the layout of
upstream's repository (`--model-dir OUT_DIR`). models.ckpt is torch.save of {"cell": {"state_dict":
{"model.<MaeAutobin parameter>": tensor}, "config": {...}}} with the encoder side of the released
0.1B model (12 x 768, 12 heads, feed-forward 3,072, 100 value bins, 19,266 positions; the
decoder is not written: cell embeddings do not read it). The gene list is DATA's expressed
var_names, those expressed in the most cells first, then placeholders, 19,264 in all, so that
cells keep (nearly) their real length. Weights
N(0, 1/fan_in), layer norms' weights 1, biases N(0, 0.02): random, for speed and precision runs.

scprint: OUT_DIR/medium-v1.5.ckpt, a Lightning checkpoint ({"state_dict", "hyper_parameters"}) at
medium-v1.5's shape as src/methods/scprint.rs Config::medium describes it (d_model 256, 8 layers,
4 heads, 4 kv heads, log normalization, depth token, the 8 classes), the encoder side only. Genes:
DATA's var[--gene-column] ids expressed in the most cells first, then placeholders, --genes in
all. Weights as scfoundation's.

scvi: OUT_DIR/model.pt, what scvi-tools' `model.save(OUT_DIR)` writes for an SCVI model at its
defaults (BatchNorm in the encoder, latent "normal", no covariate in the encoder): {"model_state_dict",
"var_names", "attr_dict": {"registry_", "init_params_"}}, with the encoder's tensors only (embedding
reads no other) over DATA's --genes var_names expressed in the most cells. Weights as scfoundation's;
BatchNorm running means N(0, 0.1), variances U(0.5, 1.5).

c2s: OUT_DIR/{config.json, model.safetensors, tokenizer.json}, a Hugging Face GPTNeoXForCausalLM
folder (`--model-dir OUT_DIR`) at Pythia-410M's shape (24 x 1024, 16 heads, feed-forward 4,096,
rotary on a quarter of each head, parallel residual; --size 160m: 12 x 768, 12 heads) without the
LM head (cell embeddings do not read it); float32 safetensors written by hand. The tokenizer is
tests/fixtures/c2s/tokenizer.json (a 400-token byte-level BPE trained on the fixture's prompts:
the real Pythia tokenizer cannot be fetched offline), so prompts of DATA's genes are longer than
the released model's tokenizer makes them. DATA is not read. Weights as scfoundation's.

cellfm: OUT_DIR/{cellfm_torch.pt, gene_info.csv}, a `--model-dir` folder as the PyTorch port's
FinetuneModel state_dict (torch.save without torch) at the released 800M shape (40 x 1536, 48
heads, the ST tokens; --depth fewer layers) and its gene table of 24,078 genes: DATA's expressed
var_names, those expressed in the most cells first, then placeholders (gene_emb 24,080 rows).
The tensors as src/methods/cellfm.rs random_tensors names them; weights N(0, 1/fan_in), the
value encoder's `a` N(0, 0.1), layer norms 1 / 0.
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


def save_checkpoint(path: Path, state: dict[str, np.ndarray], wrap=lambda sd: {"state_dict": sd}) -> None:
    """torch.save of wrap(state_dict) (default {"state_dict": ...}) without torch."""
    saved = {k: sys.modules.get(k) for k in ("torch", "torch._utils")}
    sys.modules["torch"], sys.modules["torch._utils"] = torch_mod, utils_mod
    try:
        sd = collections.OrderedDict((k, Tensor(str(i), v)) for i, (k, v) in enumerate(state.items()))
        buf = io.BytesIO()
        Pickler(buf, protocol=2).dump(wrap(sd))
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


def weight_makers(seed: int):
    """Seeded makers of random weights, N(0, 1/fan_in) (fan_in: the last dimension), and biases,
    N(0, 0.02), drawn from one generator in call order."""
    rng = np.random.default_rng(seed)

    def weight(*shape):
        return rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-1]))

    def bias(n):
        return 0.02 * rng.standard_normal(n, dtype=np.float32)

    return weight, bias


def scfoundation(args) -> None:
    n_genes, bins, d, depth, heads = 19264, 100, args.hidden, args.depth, args.heads
    ff, seq_len = 4 * d, n_genes + 2
    w, b = weight_makers(args.seed)

    state: dict[str, np.ndarray] = {
        "model.token_emb.mlp.weight": w(bins, 1), "model.token_emb.mlp.bias": b(bins),
        "model.token_emb.mlp2.weight": w(bins, bins), "model.token_emb.mlp2.bias": b(bins),
        "model.token_emb.emb.weight": w(bins, d), "model.token_emb.emb_mask.weight": w(1, d),
        "model.token_emb.emb_pad.weight": w(1, d), "model.pos_emb.weight": w(seq_len + 1, d),
    }
    for i in range(depth):
        p = f"model.encoder.transformer_encoder.{i}."
        state.update({
            p + "self_attn.in_proj_weight": w(3 * d, d), p + "self_attn.in_proj_bias": b(3 * d),
            p + "self_attn.out_proj.weight": w(d, d), p + "self_attn.out_proj.bias": b(d),
            p + "linear1.weight": w(ff, d), p + "linear1.bias": b(ff),
            p + "linear2.weight": w(d, ff), p + "linear2.bias": b(d),
            p + "norm1.weight": np.ones(d, np.float32), p + "norm1.bias": b(d),
            p + "norm2.weight": np.ones(d, np.float32), p + "norm2.bias": b(d),
        })
    state["model.encoder.norm.weight"] = np.ones(d, np.float32)
    state["model.encoder.norm.bias"] = b(d)
    # as upstream's models.ckpt: convertconfig merges config, model_config[model], dataset_config['rnaseq']
    encoder = {"hidden_dim": d, "depth": depth, "heads": heads, "dim_head": d // heads, "seq_len": seq_len,
               "module_type": "transformer", "norm_first": False}
    config = {"model": "mae_autobin", "model_config": {"mae_autobin": {
        "encoder": encoder, "n_class": bins + 4, "pad_token_id": 103, "mask_token_id": 102, "bin_num": bins,
        "bin_alpha": 1.0, "model": "mae_autobin", "bin_type": "auto_bin"}},
        "dataset_config": {"rnaseq": {"seq_len": seq_len, "gene_num": n_genes}}}
    out = Path(args.out_dir)
    (out / "models").mkdir(parents=True, exist_ok=True)
    save_checkpoint(out / "models" / "models.ckpt", state, lambda sd: {"cell": {"state_dict": sd, "config": config}})
    names = var_names(args.data)
    cells = expressing_cells(args.data, len(names))
    ranked = sorted(range(len(names)), key=lambda j: -cells[j])  # most cells first (stable)
    genes = list(dict.fromkeys(names[j] for j in ranked if cells[j]))[:n_genes]
    genes += [f"SCFOUNDRY_PLACEHOLDER_{i}" for i in range(n_genes - len(genes))]
    (out / "OS_scRNA_gene_index.19264.tsv").write_text("gene_name\tindex\n" + "".join(f"{g}\t{i}\n" for i, g in enumerate(genes)))
    print(json.dumps({"model": "scfoundation", "parameters": int(sum(v.size for v in state.values())),
                      "layers": depth, "hidden": d, "heads": heads, "genes_from_data": sum(not g.startswith("SCFOUNDRY_PLACEHOLDER_") for g in genes),
                      "genes_expressed_in_data": int(sum(c > 0 for c in cells)), "out": str(out)}))


def scprint(args) -> None:
    d, layers, heads, ff = 256, 8, 4, 1024
    w, b = weight_makers(args.seed)

    with h5py.File(args.data, "r") as f:
        col = f["var"][args.gene_column]
        if isinstance(col, h5py.Group):  # categorical
            cats = [x.decode() if isinstance(x, bytes) else str(x) for x in col["categories"][:]]
            ids = [cats[i] for i in col["codes"][:]]
        else:
            ids = [x.decode() if isinstance(x, bytes) else str(x) for x in col[:]]
    cells = expressing_cells(args.data, len(ids))
    ranked = sorted(range(len(ids)), key=lambda j: -cells[j])
    genes = list(dict.fromkeys(ids[j] for j in ranked if cells[j]))[: args.genes]
    genes += [f"ENSG9{i:010d}" for i in range(args.genes - len(genes))]
    classes = ["cell_type_ontology_term_id", "tissue_ontology_term_id", "disease_ontology_term_id", "age_group",
               "assay_ontology_term_id", "self_reported_ethnicity_ontology_term_id", "sex_ontology_term_id",
               "organism_ontology_term_id"]
    n = len(genes)
    state: dict[str, np.ndarray] = {
        "gene_encoder.embeddings.weight": w(n, d), "pos_encoder.pe": w(n, d),
        "class_encoder.embedding.weight": w(len(classes) + 1, d),
    }
    for e in ("expr_encoder", "depth_encoder"):
        state.update({f"{e}.encoder.0.weight": w(d, 1), f"{e}.encoder.0.bias": b(d),
                      f"{e}.encoder.1.weight": np.ones(d, np.float32), f"{e}.encoder.1.bias": b(d),
                      f"{e}.encoder.4.weight": w(d, d), f"{e}.encoder.4.bias": b(d)})
    for i in range(layers):
        p = f"transformer.blocks.{i}."
        state.update({
            p + "mixer.Wqkv.weight": w(3 * d, d), p + "mixer.Wqkv.bias": b(3 * d),
            p + "mixer.out_proj.weight": w(d, d), p + "mixer.out_proj.bias": b(d),
            p + "norm1.weight": np.ones(d, np.float32), p + "norm1.bias": b(d),
            p + "norm2.weight": np.ones(d, np.float32), p + "norm2.bias": b(d),
            p + "mlp.fc1.weight": w(ff, d), p + "mlp.fc1.bias": b(ff),
            p + "mlp.fc2.weight": w(d, ff), p + "mlp.fc2.bias": b(d),
        })
    state["transformer.norm.weight"] = np.ones(d, np.float32)
    state["transformer.norm.bias"] = b(d)
    hp = {"genes": genes, "organisms": ["NCBITaxon:9606"], "d_model": d, "nhead": heads, "num_heads_kv": heads,
          "nlayers": layers, "normalization": "log", "depth_atinput": True, "expr_emb_style": "continuous",
          "attn_bias": "none", "label_counts": {c: 10 for c in classes}}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(out / "medium-v1.5.ckpt", state, lambda sd: {"state_dict": sd, "hyper_parameters": hp})
    print(json.dumps({"model": "scprint", "parameters": int(sum(v.size for v in state.values())), "genes": n,
                      "genes_from_data": sum(not g.startswith("ENSG9") for g in genes), "out": str(out)}))


def scvi(args) -> None:
    names = var_names(args.data)
    counts = expressing_cells(args.data, len(names))
    order = np.argsort(-counts, kind="stable")[: args.genes]
    genes = [names[i] for i in sorted(order)]
    weight, bias = weight_makers(args.seed)
    rng = np.random.default_rng(args.seed + 1)
    state: dict[str, np.ndarray] = {}
    n_in = len(genes)
    for i in range(args.layers):
        p = f"z_encoder.encoder.fc_layers.Layer {i}"
        state[f"{p}.0.weight"], state[f"{p}.0.bias"] = weight(args.hidden, n_in), bias(args.hidden)
        state[f"{p}.1.weight"] = np.ones(args.hidden, dtype=np.float32)
        state[f"{p}.1.bias"] = bias(args.hidden)
        state[f"{p}.1.running_mean"] = rng.normal(0, 0.1, args.hidden).astype(np.float32)
        state[f"{p}.1.running_var"] = rng.uniform(0.5, 1.5, args.hidden).astype(np.float32)
        state[f"{p}.1.num_batches_tracked"] = np.array(1000, dtype=np.int64)
        n_in = args.hidden
    for k in ("mean_encoder", "var_encoder"):
        state[f"z_encoder.{k}.weight"], state[f"z_encoder.{k}.bias"] = weight(args.latent, n_in), bias(args.latent)
    attr = {
        "registry_": {"model_name": "SCVI", "scvi_version": "1.3.3", "setup_args": {"batch_key": None}, "field_registries": {}},
        "init_params_": {"non_kwargs": {"n_hidden": args.hidden, "n_latent": args.latent, "n_layers": args.layers,
                                        "dropout_rate": 0.1, "dispersion": "gene", "gene_likelihood": "zinb",
                                        "latent_distribution": "normal"}, "kwargs": {"kwargs": {}}},
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(out / "model.pt", state, lambda sd: {"model_state_dict": sd, "var_names": genes, "attr_dict": attr})
    print(json.dumps({"model": "scvi", "genes": len(genes), "hidden": args.hidden, "latent": args.latent, "layers": args.layers, "out": str(out)}))


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], object]]) -> int:
    """A float32 safetensors file of (name, shape, make) entries, each made when it is written."""
    header, offset = {}, 0
    for name, shape, _ in tensors:
        n = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for _, shape, make in tensors:
            a = np.ascontiguousarray(make(), dtype="<f4")
            assert a.shape == tuple(shape), (a.shape, shape)
            f.write(a.tobytes())
    return offset // 4


def c2s(args) -> None:
    d, layers, heads, ff = {"410m": (1024, 24, 16, 4096), "160m": (768, 12, 12, 3072)}[args.size]
    vocab = 50304
    w, b = weight_makers(args.seed)
    ones = lambda n: (lambda: np.ones(n, np.float32))
    t: list = [("gpt_neox.embed_in.weight", (vocab, d), lambda: w(vocab, d))]
    for i in range(layers):
        p = f"gpt_neox.layers.{i}."
        t += [(p + "input_layernorm.weight", (d,), ones(d)), (p + "input_layernorm.bias", (d,), lambda: b(d)),
              (p + "post_attention_layernorm.weight", (d,), ones(d)), (p + "post_attention_layernorm.bias", (d,), lambda: b(d)),
              (p + "attention.query_key_value.weight", (3 * d, d), lambda: w(3 * d, d)),
              (p + "attention.query_key_value.bias", (3 * d,), lambda: b(3 * d)),
              (p + "attention.dense.weight", (d, d), lambda: w(d, d)), (p + "attention.dense.bias", (d,), lambda: b(d)),
              (p + "mlp.dense_h_to_4h.weight", (ff, d), lambda: w(ff, d)), (p + "mlp.dense_h_to_4h.bias", (ff,), lambda: b(ff)),
              (p + "mlp.dense_4h_to_h.weight", (d, ff), lambda: w(d, ff)), (p + "mlp.dense_4h_to_h.bias", (d,), lambda: b(d))]
    t += [("gpt_neox.final_layer_norm.weight", (d,), ones(d)), ("gpt_neox.final_layer_norm.bias", (d,), lambda: b(d))]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n = write_safetensors(out / "model.safetensors", t)
    config = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "vocab_size": vocab, "hidden_size": d,
              "num_hidden_layers": layers, "num_attention_heads": heads, "intermediate_size": ff, "hidden_act": "gelu",
              "rotary_pct": 0.25, "rotary_emb_base": 10000, "layer_norm_eps": 1e-5, "use_parallel_residual": True,
              "attention_bias": True, "max_position_embeddings": 2048, "tie_word_embeddings": False, "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    fixture = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "c2s" / "tokenizer.json"
    (out / "tokenizer.json").write_bytes(fixture.read_bytes())
    print(json.dumps({"model": "c2s", "size": args.size, "parameters": n, "layers": layers, "hidden": d, "heads": heads, "out": str(out)}))


def cellfm(args) -> None:
    n_genes, d, h = 24078, 1536, 256                       # h: the value encoder's hidden width
    rows = n_genes + 1 + (8 - (n_genes + 1) % 8) % 8
    w, _ = weight_makers(args.seed)
    rng = np.random.default_rng(args.seed + 1)
    state: dict[str, np.ndarray] = {
        "gene_emb": w(rows, d), "cls_token": w(1, 1, d),
        "value_enc.value_enc.w1.weight": w(h, 1), "value_enc.value_enc.w3.weight": w(h, h),
        "value_enc.value_enc.table.weight": w(d, h), "value_enc.value_enc.a": 0.1 * rng.standard_normal((1, 1), dtype=np.float32),
        "ST_emb": w(1, 2, d),
    }
    for i in range(args.depth):
        for n in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.u_proj", "attn.o_proj", "ffn.u_proj", "ffn.v_proj", "ffn.o_proj"):
            state[f"encoder.{i}.{n}.weight"] = w(d, d)
        for n in ("post_norm1", "post_norm2"):
            state[f"encoder.{i}.{n}.weight"] = np.ones(d, np.float32)
            state[f"encoder.{i}.{n}.bias"] = np.zeros(d, np.float32)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(out / "cellfm_torch.pt", state, lambda sd: sd)
    names = var_names(args.data)
    cells = expressing_cells(args.data, len(names))
    ranked = sorted(range(len(names)), key=lambda j: -cells[j])  # most cells first (stable)
    genes = list(dict.fromkeys(names[j] for j in ranked if cells[j]))[:n_genes]
    genes += [f"SCFOUNDRY_PLACEHOLDER_{i}" for i in range(n_genes - len(genes))]
    (out / "gene_info.csv").write_text("HGNC_gene,h5_sample_frequency,biotype\n" + "".join(f"{g},0,placeholder\n" for g in genes))
    print(json.dumps({"model": "cellfm", "parameters": int(sum(v.size for v in state.values())), "layers": args.depth, "hidden": d,
                      "genes_from_data": sum(not g.startswith("SCFOUNDRY_PLACEHOLDER_") for g in genes), "out": str(out)}))


def expressing_cells(data: str, n_var: int) -> np.ndarray:
    """Per var column of DATA's X (CSR or dense), the cells with a non-zero value."""
    with h5py.File(data, "r") as f:
        x = f["X"]
        if isinstance(x, h5py.Group):
            return np.bincount(x["indices"][:][x["data"][:] != 0], minlength=n_var)
        return (x[:] != 0).sum(axis=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="kind", required=True)
    g = sub.add_parser("genept")
    g.add_argument("--dim", type=int, default=64)
    s = sub.add_parser("scimilarity")
    s.add_argument("--genes", type=int, default=2000)
    s.add_argument("--hidden", default="128,64")
    s.add_argument("--latent", type=int, default=32)
    f = sub.add_parser("scfoundation")
    f.add_argument("--hidden", type=int, default=768)
    f.add_argument("--depth", type=int, default=12)
    f.add_argument("--heads", type=int, default=12)
    r = sub.add_parser("scprint")
    r.add_argument("--genes", type=int, default=25000)
    r.add_argument("--gene-column", default="gene_ids")
    v = sub.add_parser("scvi")
    v.add_argument("--genes", type=int, default=2000)
    v.add_argument("--hidden", type=int, default=128)
    v.add_argument("--latent", type=int, default=10)
    v.add_argument("--layers", type=int, default=1)
    c = sub.add_parser("c2s")
    c.add_argument("--size", choices=["410m", "160m"], default="410m")
    m = sub.add_parser("cellfm")
    m.add_argument("--depth", type=int, default=40)
    for p in (g, s, f, r, v, c, m):
        p.add_argument("data")
        p.add_argument("out_dir")
        p.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    {"genept": genept, "scimilarity": scimilarity, "scfoundation": scfoundation, "scprint": scprint, "scvi": scvi, "c2s": c2s, "cellfm": cellfm}[args.kind](args)


if __name__ == "__main__":
    main()
