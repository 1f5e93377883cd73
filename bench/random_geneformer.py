"""A Geneformer model folder of the full V1 size (gf-6L-30M-i2048: 6 layers x 256, 4 heads,
intermediate 512, relu, 2,048 positions, vocab 25,426) with seeded random weights, for timing
`scfoundry finetune -m geneformer --device cuda` on a machine the real weights are not on.
Needs torch (the weights are written as pytorch_model.bin, which scfoundry reads as data); without
torch, numpy writes model.safetensors instead (a numpy generator with the same seed: other
random numbers, the same shapes and distribution).

    python3 bench/random_geneformer.py GENES OUT_DIR [--seed 0] [--layers 6]

GENES: one gene id per line (bench/pbmc68k_genes.txt: the var_names of
demo/pbmc68k_counts.h5ad); they become tokens 2.. of token_dictionary.json (upper-cased, as
Geneformer's tokenizer matches ids), each with median 1.0 in gene_median_dictionary.json. Run
the demo file with `--gene-column index`. The weights are random (normal, sd 0.02; LayerNorm
weights 1): timing only, not accuracy.
"""

import json
import sys
from pathlib import Path

try:
    import torch
except ImportError:  # numpy stands in: model.safetensors instead of pytorch_model.bin
    torch = None
    import numpy as np


def save_safetensors(sd, path):
    """The safetensors layout: a little-endian u64 header length, the JSON header, the data."""
    header, blobs, at = {}, [], 0
    for name, a in sd.items():
        b = np.ascontiguousarray(a, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h)
        for b in blobs:
            f.write(b)


def main():
    genes_path, out = Path(sys.argv[1]), Path(sys.argv[2])
    seed = int(sys.argv[sys.argv.index("--seed") + 1]) if "--seed" in sys.argv else 0
    out.mkdir(parents=True, exist_ok=True)
    vocab, d, layers, heads, ffn, positions = 25426, 256, 6, 4, 512, 2048
    if "--layers" in sys.argv:  # fewer layers: host-side timings on a CPU
        layers = int(sys.argv[sys.argv.index("--layers") + 1])
    config = {
        "architectures": ["BertForMaskedLM"], "model_type": "bert", "vocab_size": vocab,
        "hidden_size": d, "num_hidden_layers": layers, "num_attention_heads": heads,
        "intermediate_size": ffn, "hidden_act": "relu", "hidden_dropout_prob": 0.02,
        "attention_probs_dropout_prob": 0.02, "max_position_embeddings": positions,
        "type_vocab_size": 2, "initializer_range": 0.02, "layer_norm_eps": 1e-12,
        "pad_token_id": 0, "classifier_dropout": None,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    sd = {}
    if torch is not None:
        g = torch.Generator().manual_seed(seed)
        randn, ones, zeros = (lambda *s: torch.randn(*s, generator=g)), torch.ones, torch.zeros
    else:
        rng = np.random.default_rng(seed)
        randn, ones, zeros = (lambda *s: rng.standard_normal(s, dtype=np.float32)), np.ones, np.zeros

    def normal(name, *shape):
        sd[name] = randn(*shape) * 0.02

    def norm(prefix):
        sd[prefix + ".weight"] = ones(d)
        sd[prefix + ".bias"] = zeros(d)

    normal("bert.embeddings.word_embeddings.weight", vocab, d)
    normal("bert.embeddings.position_embeddings.weight", positions, d)
    normal("bert.embeddings.token_type_embeddings.weight", 2, d)
    norm("bert.embeddings.LayerNorm")
    for i in range(layers):
        p = f"bert.encoder.layer.{i}."
        for m in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            normal(p + m + ".weight", d, d)
            sd[p + m + ".bias"] = zeros(d)
        norm(p + "attention.output.LayerNorm")
        normal(p + "intermediate.dense.weight", ffn, d)
        sd[p + "intermediate.dense.bias"] = zeros(ffn)
        normal(p + "output.dense.weight", d, ffn)
        sd[p + "output.dense.bias"] = zeros(d)
        norm(p + "output.LayerNorm")
    if torch is not None:
        torch.save(sd, out / "pytorch_model.bin")
    else:
        save_safetensors(sd, out / "model.safetensors")
    genes = []
    for line in genes_path.read_text().splitlines():
        k = line.strip().upper()
        if k and k not in genes:
            genes.append(k)
    tokens = {"<pad>": 0, "<mask>": 1}
    tokens.update({k: i + 2 for i, k in enumerate(genes)})
    (out / "token_dictionary.json").write_text(json.dumps(tokens))
    (out / "gene_median_dictionary.json").write_text(json.dumps({k: 1.0 for k in genes}))
    n = sum(int(t.size if torch is None else t.numel()) for t in sd.values())
    print(json.dumps({"out": str(out), "parameters": n, "genes": len(genes), "seed": seed}))


if __name__ == "__main__":
    main()
