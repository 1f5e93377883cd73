#!/usr/bin/env python3
"""Full-size scGPT (whole-human shape) and UCE (33 layers) with random weights, as
bench/fullsize_checkpoints.py makes them, whose gene lists also hold the genes of a data set, so
that its cells keep their real lengths: every gene of GENES gets a row of scGPT's vocabulary (one
of the placeholder rows), an ESM2 protein embedding for UCE (random, 5,120-d) and a row of
species_chrom.csv on one of the human chromosomes already there (so UCE's chromosome tokens do
not change). Needs torch. Written under OUT_DIR in the layout `--weights-dir` expects.

    python3 bench/embed_pipeline_models.py GENES OUT_DIR [scgpt] [uce]

GENES: one gene symbol per line (bench/tile_h5ad.py --genes-out).
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fullsize_checkpoints as full  # noqa: E402


def with_genes_scgpt(out, genes):
    path = out / "scgpt" / "whole_human" / "vocab.json"
    vocab = json.load(open(path))
    free = sorted((i for g, i in vocab.items() if g.startswith("SCFOUNDRY_PLACEHOLDER_")), reverse=True)
    placeholders = {i: g for g, i in vocab.items() if g.startswith("SCFOUNDRY_PLACEHOLDER_")}
    added = 0
    for g in genes:
        if g in vocab:
            continue
        i = free.pop()
        del vocab[placeholders[i]]
        vocab[g] = i
        added += 1
    json.dump(vocab, open(path, "w"))
    print(json.dumps({"model": "scgpt", "genes_added_to_vocab": added, "vocab": len(vocab)}))


def main():
    genes = [l.strip() for l in open(sys.argv[1]) if l.strip()]
    out = Path(sys.argv[2])
    which = sys.argv[3:] or ["scgpt", "uce"]
    torch.manual_seed(0)
    if "scgpt" in which:
        full.scgpt(out)
        with_genes_scgpt(out, genes)
    if "uce" in which:
        full.uce(out)
        full.uce_over_genes(out, genes)


if __name__ == "__main__":
    main()
