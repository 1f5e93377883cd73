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
    python bench/random_models.py cellplm DATA OUT_DIR [--gene-column gene_ids] [--seed 0]
    python bench/random_models.py novae DATA OUT_DIR [--seed 0]
    python bench/random_models.py scbert DATA OUT_DIR [--seed 0]

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

cellplm: OUT_DIR/{20231027_85M.config.json, 20231027_85M.best.ckpt}, a `--model-dir` folder as
upstream's load_pretrain reads it at the released 85M shape (flowformer 4 x 1024, 8 heads,
GroupNorm embedder, GMVAE latent 512 with 16 clusters; the tensors as src/methods/cellplm.rs
Config::tensors names them, the embedding side only) over a gene_list of 19,374 genes: DATA's
var[--gene-column] ids expressed in the most cells first, then placeholders. The checkpoint is
torch.save of {"model_state_dict": ...}. Weights as scfoundation's, the gene table N(0, 1/900) so that a
cell's features are of order 1; norms 1 / 0.

novae: OUT_DIR/{config.json, model.safetensors}, a Hugging Face folder as Novae.save_pretrained
writes it (`--model-dir OUT_DIR`) at novae-human-0's shape (Novae's defaults: embedding 100, 10
GATv2 layers of 128 with 8 heads, output 64, 2 + 2 hops) over DATA's var_names as its
vocabulary (lower-cased, as Novae stores them). Weights as scfoundation's; the attention vectors
N(0, 0.05).

scbert: OUT_DIR/{panglao_pretrained.pth, panglao_10000.h5ad}, a `--model-dir` folder at the
released PerformerLM's shape (6 x 200, 10 heads of 64, 266 random features, feed-forward 800,
7 bins, 16,907 positions): the checkpoint as torch.save of {"model_state_dict": ...} (the tensors
src/methods/scbert.rs reads), the reference an .h5ad whose 16,906 var_names are DATA's expressed
genes, those expressed in the most cells first, then placeholders (one empty cell: only
var_names are read). Weights as scfoundation's; the gene2vec table N(0, 1), the projections N(0, 1)
(FAVOR+'s Gaussian features before orthogonalisation).
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


def var_column(data: str, column: str) -> list[str]:
    """DATA's var[column] as strings (a categorical column decoded)."""
    with h5py.File(data, "r") as f:
        col = f[f"var/{column}"]
        if isinstance(col, h5py.Group):  # categorical
            cats = [x.decode() if isinstance(x, bytes) else str(x) for x in col["categories"][:]]
            return [cats[i] for i in col["codes"][:]]
        return [x.decode() if isinstance(x, bytes) else str(x) for x in col[:]]


def expressed_first(names: list[str], cells: np.ndarray, n: int, placeholder=lambda i: f"SCFOUNDRY_PLACEHOLDER_{i}") -> list[str]:
    """n gene names: those expressed in the most cells first (stable, repeats dropped), then
    placeholder(0), placeholder(1), ..."""
    ranked = sorted(range(len(names)), key=lambda j: -cells[j])
    genes = list(dict.fromkeys(names[j] for j in ranked if cells[j]))[:n]
    return genes + [placeholder(i) for i in range(n - len(genes))]


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
    genes = expressed_first(names, cells, n_genes)
    (out / "OS_scRNA_gene_index.19264.tsv").write_text("gene_name\tindex\n" + "".join(f"{g}\t{i}\n" for i, g in enumerate(genes)))
    print(json.dumps({"model": "scfoundation", "parameters": int(sum(v.size for v in state.values())),
                      "layers": depth, "hidden": d, "heads": heads, "genes_from_data": sum(not g.startswith("SCFOUNDRY_PLACEHOLDER_") for g in genes),
                      "genes_expressed_in_data": int(sum(c > 0 for c in cells)), "out": str(out)}))


def scprint(args) -> None:
    d, layers, heads, ff = 256, 8, 4, 1024
    w, b = weight_makers(args.seed)

    ids = var_column(args.data, args.gene_column)
    genes = expressed_first(ids, expressing_cells(args.data, len(ids)), args.genes, lambda i: f"ENSG9{i:010d}")
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
    genes = expressed_first(names, cells, n_genes)
    (out / "gene_info.csv").write_text("HGNC_gene,h5_sample_frequency,biotype\n" + "".join(f"{g},0,placeholder\n" for g in genes))
    print(json.dumps({"model": "cellfm", "parameters": int(sum(v.size for v in state.values())), "layers": args.depth, "hidden": d,
                      "genes_from_data": sum(not g.startswith("SCFOUNDRY_PLACEHOLDER_") for g in genes), "out": str(out)}))


def cellplm(args) -> None:
    n_genes, d, layers, k, z, qz = 19374, 1024, 4, 16, 512, 512
    ids = var_column(args.data, args.gene_column)
    genes = expressed_first(ids, expressing_cells(args.data, len(ids)), n_genes)
    w, b = weight_makers(args.seed)
    state: dict[str, np.ndarray] = {"embedder.feat_enc.emb": w(n_genes, d) * np.float32(np.sqrt(d) / 30),
                                    "embedder.extra_linear.0.weight": w(d, d), "embedder.extra_linear.0.bias": b(d),
                                    "embedder.extra_linear.3.weight": np.ones(d, np.float32), "embedder.extra_linear.3.bias": np.zeros(d, np.float32)}
    for i in range(layers):
        p = f"encoder.layers.{i}"
        for proj in ("query", "key", "value", "out"):
            state[f"{p}.self_attn.{proj}_projection.weight"] = w(d, d)
            state[f"{p}.self_attn.{proj}_projection.bias"] = b(d)
        state[f"{p}._ff_block.0.weight"], state[f"{p}._ff_block.0.bias"] = w(2 * d, d), b(2 * d)
        state[f"{p}._ff_block.3.weight"], state[f"{p}._ff_block.3.bias"] = w(d, 2 * d), b(d)
        for n in ("norm1", "norm2"):
            state[f"{p}.{n}.weight"], state[f"{p}.{n}.bias"] = np.ones(d, np.float32), np.zeros(d, np.float32)
    state["pre_latent_norm.norm.weight"], state["pre_latent_norm.norm.bias"] = np.ones(d, np.float32), np.zeros(d, np.float32)
    p = "latent.layers.1.inference"
    state[f"{p}.inference_qyx.0.logits.weight"], state[f"{p}.inference_qyx.0.logits.bias"] = w(k, d), b(k)
    state[f"{p}.inference_qzyx.0.weight"], state[f"{p}.inference_qzyx.0.bias"] = w(qz, d + k), b(qz)
    state[f"{p}.inference_qzyx.2.mu.weight"], state[f"{p}.inference_qzyx.2.mu.bias"] = w(z, qz), b(z)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefix = "20231027_85M"
    save_checkpoint(out / f"{prefix}.best.ckpt", state, lambda sd: {"model_state_dict": sd})
    config = {"name": "random_85M_shape", "enc_mod": "flowformer", "enc_hid": d, "enc_layers": layers, "enc_head": 8, "latent_mod": "gmvae",
              "post_latent_dim": z, "norm": "groupnorm", "num_clusters": k, "cat_pe": False, "dar": False, "input_covariate": False,
              "ecs": False, "dsbn": False, "gene_list": genes}
    (out / f"{prefix}.config.json").write_text(json.dumps(config))
    print(json.dumps({"model": "cellplm", "parameters": int(sum(v.size for v in state.values())), "genes": n_genes,
                      "genes_from_data": sum(not g.startswith("SCFOUNDRY_PLACEHOLDER_") for g in genes), "out": str(out)}))


def novae(args) -> None:
    e, hidden, layers, out_size, heads = 100, 128, 10, 64, 8
    names = [n.lower() for n in var_names(args.data)]
    w, b = weight_makers(args.seed)
    rng = np.random.default_rng(args.seed + 1)
    t: list = [("cell_embedder.embedding.weight", (len(names), e), lambda: w(len(names), e) * np.float32(np.sqrt(e))),
               ("cell_embedder.linear.weight", (e, e), lambda: w(e, e)), ("cell_embedder.linear.bias", (e,), lambda: b(e))]
    for i in range(layers):
        inp = e if i == 0 else hidden
        c = out_size if i + 1 == layers else hidden // heads
        hc, p = heads * c, f"encoder.gnn.convs.{i}."
        for n in ("lin_l", "lin_r"):
            t += [(p + n + ".weight", (hc, inp), lambda hc=hc, inp=inp: w(hc, inp)), (p + n + ".bias", (hc,), lambda hc=hc: b(hc))]
        t += [(p + "lin_edge.weight", (hc, 1), lambda hc=hc: w(hc, 1)),
              (p + "att", (1, heads, c), lambda c=c: 0.05 * rng.standard_normal((1, heads, c), dtype=np.float32)),
              (p + "bias", (hc if i + 1 < layers else c,), lambda n=(hc if i + 1 < layers else c): b(n))]
    a = "encoder.node_aggregation.attention_aggregation."
    t += [(a + "gate_nn.weight", (1, out_size), lambda: w(1, out_size)), (a + "gate_nn.bias", (1,), lambda: b(1)),
          (a + "nn.weight", (out_size, out_size), lambda: w(out_size, out_size)), (a + "nn.bias", (out_size,), lambda: b(out_size))]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n = write_safetensors(out / "model.safetensors", t)
    config = {"embedding_size": e, "hidden_size": hidden, "num_layers": layers, "output_size": out_size, "heads": heads,
              "n_hops_local": 2, "n_hops_view": 2, "batch_size": 256, "var_names": names}
    (out / "config.json").write_text(json.dumps(config))
    print(json.dumps({"model": "novae", "parameters": n, "vocabulary": len(names), "out": str(out)}))


def scbert(args) -> None:
    d, depth, heads, dh, nb, ffn, bins, n_genes = 200, 6, 10, 64, 266, 800, 7, 16906
    inner = heads * dh
    names = var_names(args.data)
    cells = expressing_cells(args.data, len(names))
    genes = expressed_first(names, cells, n_genes)
    w, b = weight_makers(args.seed)
    rng = np.random.default_rng(args.seed + 1)
    state: dict[str, np.ndarray] = {"token_emb.weight": w(bins, d) * np.float32(np.sqrt(d)),
                                    "pos_emb.emb.weight": rng.standard_normal((n_genes + 1, d), dtype=np.float32)}
    ones, zeros = (lambda n: np.ones(n, np.float32)), (lambda n: np.zeros(n, np.float32))
    for i in range(depth):
        p = f"performer.net.layers.{i}."
        state[p + "0.norm.weight"], state[p + "0.norm.bias"] = ones(d), zeros(d)
        for n in ("to_q", "to_k", "to_v"):
            state[p + f"0.fn.{n}.weight"] = w(inner, d)
        state[p + "0.fn.to_out.weight"], state[p + "0.fn.to_out.bias"] = w(d, inner), b(d)
        state[p + "0.fn.fast_attention.projection_matrix"] = rng.standard_normal((nb, dh), dtype=np.float32)
        state[p + "1.norm.weight"], state[p + "1.norm.bias"] = ones(d), zeros(d)
        state[p + "1.fn.fn.w1.weight"], state[p + "1.fn.fn.w1.bias"] = w(ffn, d), b(ffn)
        state[p + "1.fn.fn.w2.weight"], state[p + "1.fn.fn.w2.bias"] = w(d, ffn), b(d)
    state["norm.weight"], state["norm.bias"] = ones(d), zeros(d)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(out / "panglao_pretrained.pth", state, lambda sd: {"model_state_dict": sd})
    with h5py.File(out / "panglao_10000.h5ad", "w") as f:
        def strings(group, name, values):
            ds = group.create_dataset(name, data=np.array(values, dtype=object), dtype=h5py.string_dtype("utf-8"))
            ds.attrs.update({"encoding-type": "string-array", "encoding-version": "0.2.0"})
        x = f.create_group("X")
        x.attrs.update({"encoding-type": "csr_matrix", "encoding-version": "0.1.0"})
        x.attrs["shape"] = np.array([1, n_genes], dtype=np.int64)
        x.create_dataset("data", data=np.zeros(0, np.float32))
        x.create_dataset("indices", data=np.zeros(0, np.int32))
        x.create_dataset("indptr", data=np.zeros(2, np.int64))
        for name, index in (("obs", ["cell0"]), ("var", genes)):
            g = f.create_group(name)
            g.attrs.update({"encoding-type": "dataframe", "encoding-version": "0.2.0", "_index": "_index"})
            g.attrs["column-order"] = np.array([], dtype=h5py.string_dtype("utf-8"))
            strings(g, "_index", index)
        for name in ("layers", "obsm", "obsp", "varm", "varp", "uns"):
            f.create_group(name).attrs.update({"encoding-type": "dict", "encoding-version": "0.1.0"})
        f.attrs.update({"encoding-type": "anndata", "encoding-version": "0.1.0"})
    print(json.dumps({"model": "scbert", "parameters": int(sum(v.size for v in state.values())), "genes": n_genes,
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
    pl = sub.add_parser("cellplm")
    pl.add_argument("--gene-column", default="gene_ids")
    nv = sub.add_parser("novae")
    sb = sub.add_parser("scbert")
    for p in (g, s, f, r, v, c, m, pl, nv, sb):
        p.add_argument("data")
        p.add_argument("out_dir")
        p.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    {"genept": genept, "scimilarity": scimilarity, "scfoundation": scfoundation, "scprint": scprint, "scvi": scvi, "c2s": c2s, "cellfm": cellfm, "cellplm": cellplm, "novae": novae, "scbert": scbert}[args.kind](args)


if __name__ == "__main__":
    main()
