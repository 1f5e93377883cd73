#!/usr/bin/env python3
"""Full-size checkpoints with random weights, in the upstream file formats, for the GPU check
("run the full-size configurations with random weights on a GPU to check shapes
and memory"): the real weights cannot be downloaded on these machines.

    python3 bench/fullsize_checkpoints.py OUT_DIR      # needs torch; bench/fullsize_gpu.sh runs it

Each model is made from the small parity fixture in tests/fixtures/ (written by upstream's code
or its faithful reproduction, scripts/*_reference.py): the same state_dict keys, pickled by
torch.save as upstream's checkpoints are, every tensor redrawn at the released model's shape
(each small dimension mapped to its full size, layer 0's tensors repeated for every layer),
seeded (torch.manual_seed(0)): LayerNorm weights 1 + N(0, 0.02), everything else N(0, 0.02).
The gene vocabularies keep the fixture's genes (so the demo cells map as in the tests) and are
padded with placeholder genes to the released vocabulary size, so the embedding tables have
their real size. Written under OUT_DIR in the layout `--weights-dir` expects:

- scgpt/whole_human/{best_model.pt, vocab.json, args.json}: 12 layers x 512, 8 heads, d_hid 512,
  60,697-row gene embedding (60,696 genes + <eoc>);
- uce/33l_8ep_1024t_1280.torch: 33 layers x 1280, d_hid 5120, ESM2 token width 5120, output 1280,
  pe_embedding 145,469 x 5120 (its released size); uce/protein_embeddings/<human file> (the
  fixture's genes, 5120-d), species_chrom.csv, species_offsets.pkl, and a placeholder for the
  archive entry (weights pull keeps the archive beside what it extracts);
- geneformer_v1/ (6 x 256, 4 heads, FFN 512, 2,048 positions, 25,426 tokens) and geneformer_v2/
  (12 x 768, 12 heads, FFN 3,072, 4,096 positions, 20,275 tokens): config.json (relu, as
  upstream's pretraining), pytorch_model.bin, the fixture's dictionaries.
Prints one JSON line a model: file sizes and parameter counts.
"""
import json
import shutil
import sys
from pathlib import Path

import torch

FX = Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def redraw(sd, dims, layer_prefix, layers):
    """sd at full size: every dimension through `dims`, layer 0 repeated `layers` times."""
    out = {}
    for k, v in sd.items():
        if k.startswith(layer_prefix):
            i, rest = k[len(layer_prefix):].split(".", 1)
            if i != "0":
                continue
            names = [f"{layer_prefix}{j}.{rest}" for j in range(layers)]
        else:
            names = [k]
        shape = tuple(dims.get(d, d) for d in v.shape)
        for n in names:
            if v.dim() == 1 and n.endswith(".weight"):  # the only 1-d weights are LayerNorms
                t = 1 + 0.02 * torch.randn(shape)
            else:
                t = 0.02 * torch.randn(shape)
            out[n] = t.to(v.dtype).contiguous()
    return out


def report(name, files, sd):
    print(json.dumps({"model": name, "parameters": sum(t.numel() for t in sd.values()),
                      "files": {str(f.name): f.stat().st_size for f in files}}), flush=True)


def scgpt(out):
    src = FX / "scgpt" / "tiny"
    sd = torch.load(src / "best_model.pt", map_location="cpu", weights_only=True)
    vocab = json.load(open(src / "vocab.json"))
    full = 60696
    rows = sd["encoder.embedding.weight"].shape[0]
    assert rows == len(vocab) + 1, (rows, len(vocab))
    extra = {f"SCFOUNDRY_PLACEHOLDER_{i}": len(vocab) + i for i in range(full - len(vocab))}
    args = json.load(open(src / "args.json"))
    small = (args["embsize"], args["d_hid"], 3 * args["embsize"])
    assert len(set(small)) == 3 and rows not in small
    args.update(embsize=512, nheads=8, d_hid=512, nlayers=12)
    big = redraw(sd, {small[0]: 512, small[1]: 512, small[2]: 1536, rows: full + 1}, "transformer_encoder.layers.", 12)
    d = out / "scgpt" / "whole_human"
    d.mkdir(parents=True, exist_ok=True)
    torch.save(big, d / "best_model.pt")
    json.dump({**vocab, **extra}, open(d / "vocab.json", "w"))
    json.dump(args, open(d / "args.json", "w"), indent=2)
    report("scgpt", [d / "best_model.pt", d / "vocab.json"], big)


def uce(out):
    src = FX / "uce"
    sd = torch.load(src / "tiny.torch", map_location="cpu", weights_only=True)
    token = sd["pe_embedding.weight"].shape[1]
    d_model = sd["encoder.0.weight"].shape[0]
    d_hid = sd["transformer_encoder.layers.0.linear1.weight"].shape[0]
    out_dim = sd["decoder.3.weight"].shape[0]
    rows = sd["pe_embedding.weight"].shape[0]
    dims = {token: 5120, d_model: 1280, d_hid: 5120, 3 * d_model: 3840, out_dim: 1280, rows: 145469}
    assert len(dims) == 6, dims
    big = redraw(sd, dims, "transformer_encoder.layers.", 33)
    d = out / "uce"
    (d / "protein_embeddings").mkdir(parents=True, exist_ok=True)
    torch.save(big, d / "33l_8ep_1024t_1280.torch")
    pe_name = "Homo_sapiens.GRCh38.gene_symbol_to_embedding_ESM2.pt"
    genes = torch.load(src / "protein_embeddings" / pe_name, map_location="cpu", weights_only=True)
    torch.save({g: 0.1 * torch.randn(5120) for g in genes}, d / "protein_embeddings" / pe_name)
    shutil.copy(src / "species_chrom.csv", d / "species_chrom.csv")
    shutil.copy(src / "species_offsets.pkl", d / "species_offsets.pkl")
    (d / "protein_embeddings.tar.gz").write_bytes(b"placeholder: the archive's extracted file is beside it\n")
    report("uce", [d / "33l_8ep_1024t_1280.torch"], big)


def geneformer(out):
    src = FX / "geneformer"
    sd = torch.load(src / "v1" / "pytorch_model.bin", map_location="cpu", weights_only=True)
    cfg = json.load(open(src / "v1" / "config.json"))
    small = {cfg["hidden_size"]: "hidden_size", cfg["intermediate_size"]: "intermediate_size",
             cfg["vocab_size"]: "vocab_size", cfg["max_position_embeddings"]: "max_position_embeddings"}
    assert len(small) == 4, small
    for name, version, shape in (("geneformer_v1", "v1", dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, intermediate_size=512, max_position_embeddings=2048, vocab_size=25426)),
                                 ("geneformer_v2", "v2", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, max_position_embeddings=4096, vocab_size=20275))):
        dims = {k: shape[v] for k, v in small.items()}
        big = redraw(sd, dims, "bert.encoder.layer.", shape["num_hidden_layers"])
        # cls.predictions.* (the MLM head; upstream ties its decoder to the word embeddings) is
        # redrawn on its own like every tensor: embed never reads it
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        c = json.load(open(src / version / "config.json"))
        c.update(shape, hidden_act="relu")
        json.dump(c, open(d / "config.json", "w"), indent=2)
        torch.save(big, d / "pytorch_model.bin")
        for f in (src / version).iterdir():
            if "dictionary" in f.name:
                shutil.copy(f, d / f.name)
        report(name, [d / "pytorch_model.bin"], big)


def main():
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    for make in (scgpt, uce, geneformer):
        make(out)


if __name__ == "__main__":
    main()
