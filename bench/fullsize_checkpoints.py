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
- sccello/ (6 x 256, 4 heads, FFN 512, 2,048 positions, 25,427 tokens, one token type; the
  shape of sccello/configs/pretrain/sccello_bert_model.json): config.json, pytorch_model.bin,
  the fixture's dictionaries;
- langcell/ (cell_bert/ 12 x 512, 8 heads, FFN 1,024, 2,048 positions, 25,427 tokens, two token
  types: Geneformer 12L-30M's shape, as src/nn/cls_encoder.rs assumes; cell_proj.bin 512 -> 256):
  the layout of LangCell's ckpt/, the fixture's dictionaries.
Prints one JSON line a model: file sizes and parameter counts.

    python3 bench/fullsize_checkpoints.py OUT_DIR [--only geneformer_v1,sccello,...]
        [--genes-from DATA.h5ad:COLUMN] [--symbols-from DATA.h5ad]

--genes-from rewrites the Geneformer-family dictionaries (geneformer_v1/v2, sccello, langcell)
over DATA's var[COLUMN] ids, so that its cells are tokenised at their real length: the special
tokens keep their ids, then the genes expressed in the most cells, as many as the vocabulary
holds (sccello and langcell keep the last row for <cls> = len(token dictionary)); each gene's
median is the median of its nonzero counts per 10,000 (Geneformer's normalisation). --symbols-from
gives scGPT's placeholder vocabulary rows to DATA's var_names not in the vocabulary already, and
UCE a protein embedding and a chromosome row for each of DATA's expressed var_names.
The weights are random either way: the dictionaries only decide which genes become tokens.
"""
import argparse
import json
import pickle
import shutil
from pathlib import Path

try:  # torch writes the checkpoints; the dictionaries alone need only h5py and numpy
    import torch
except ImportError:
    torch = None

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


def bert_cls_model(out, name, shape, bert_dir, proj_dim):
    """A Geneformer-family encoder read at <cls> (scCello, LangCell's cell_bert) at full size,
    from its parity fixture, and LangCell's cell_proj."""
    src = FX / name
    fx_bert = src / "cell_bert" if bert_dir else src
    sd = torch.load(fx_bert / "pytorch_model.bin", map_location="cpu", weights_only=True)
    cfg = json.load(open(fx_bert / "config.json"))
    small = {cfg["hidden_size"]: shape["hidden_size"], cfg["intermediate_size"]: shape["intermediate_size"],
             cfg["vocab_size"]: shape["vocab_size"], cfg["max_position_embeddings"]: shape["max_position_embeddings"]}
    assert len(small) == 4, small
    prefix = next(p for p in ("bert.encoder.layer.", "encoder.layer.") if any(k.startswith(p) for k in sd))
    big = redraw(sd, small, prefix, shape["num_hidden_layers"])
    d = out / name
    bd = d / "cell_bert" if bert_dir else d
    bd.mkdir(parents=True, exist_ok=True)
    cfg.update(shape, hidden_act="relu")
    json.dump(cfg, open(bd / "config.json", "w"), indent=2)
    torch.save(big, bd / "pytorch_model.bin")
    files = [bd / "pytorch_model.bin"]
    if proj_dim:
        proj = {"weight": 0.02 * torch.randn(proj_dim, shape["hidden_size"]), "bias": 0.02 * torch.randn(proj_dim)}
        torch.save(proj, d / "cell_proj.bin")
        files.append(d / "cell_proj.bin")
        big = {**big, **{f"cell_proj.{k}": v for k, v in proj.items()}}
    for f in src.iterdir():
        if "dictionary" in f.name:
            shutil.copy(f, d / f.name)
    report(name, files, big)


def sccello(out):
    bert_cls_model(out, "sccello", dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, intermediate_size=512,
                                        max_position_embeddings=2048, vocab_size=25427, type_vocab_size=1), False, None)


def langcell(out):
    bert_cls_model(out, "langcell", dict(hidden_size=512, num_hidden_layers=12, num_attention_heads=8, intermediate_size=1024,
                                         max_position_embeddings=2048, vocab_size=25427, type_vocab_size=2), True, 256)


def read_var(data, column):
    """DATA's var[column] (`_index`: var_names) and, per var column, the cells expressing it and
    the median of its nonzero counts per 10,000 (X is CSR or dense)."""
    import h5py
    import numpy as np
    with h5py.File(data, "r") as f:
        var = f["var"]
        col = var.attrs["_index"] if column in ("_index", "index") else column
        v = var[col]
        if isinstance(v, h5py.Group):  # categorical
            cats = [x.decode() if isinstance(x, bytes) else str(x) for x in v["categories"][:]]
            ids = [cats[i] for i in v["codes"][:]]
        else:
            ids = [x.decode() if isinstance(x, bytes) else str(x) for x in v[:]]
        x = f["X"]
        n_var = len(ids)
        if isinstance(x, h5py.Group):
            data_, ind, ptr = x["data"][:].astype(np.float64), x["indices"][:], x["indptr"][:]
            rows = np.repeat(np.arange(len(ptr) - 1), np.diff(ptr))
        else:
            dense = x[:].astype(np.float64)
            rows, ind = np.nonzero(dense)
            data_ = dense[rows, ind]
        totals = np.bincount(rows, weights=data_, minlength=int(rows.max()) + 1 if len(rows) else 0)
        norm = data_ / totals[rows] * 10_000
    cells = np.bincount(ind, minlength=n_var)
    order = np.argsort(ind, kind="stable")
    starts = np.concatenate([[0], np.cumsum(cells)])
    medians = [float(np.median(norm[order[starts[j]:starts[j + 1]]])) if cells[j] else 0.0 for j in range(n_var)]
    return ids, cells, medians


def genes_over_data(out, spec):
    """Rewrite the Geneformer-family dictionaries under OUT over DATA:COLUMN (see --genes-from)."""
    data, column = spec.rsplit(":", 1)
    ids, cells, medians = read_var(data, column)
    ranked = sorted(range(len(ids)), key=lambda j: -cells[j])
    # scfoundry's Geneformer matches ids upper-cased (Ensembl ids are), scCello and LangCell exactly
    for name, rows_for_genes, key in (("geneformer_v1", 0, str.upper), ("geneformer_v2", 0, str.upper), ("sccello", 1, str), ("langcell", 1, str)):
        d = out / name
        tok_files = sorted(d.glob("token_dictionary*.pkl"))
        med_files = sorted(d.glob("gene_median_dictionary*.pkl"))
        cfg_file = d / "config.json" if (d / "config.json").is_file() else d / "cell_bert" / "config.json"
        if not (tok_files and med_files and cfg_file.is_file()):
            continue
        vocab = json.load(open(cfg_file))["vocab_size"]
        old = pickle.load(open(tok_files[0], "rb"))
        specials = {k: v for k, v in old.items() if str(k).startswith("<")}
        room = vocab - rows_for_genes - len(specials)
        tokens, medians_out, seen = dict(specials), {}, set()
        for j in ranked:
            if len(medians_out) >= room or cells[j] == 0:
                break
            g = key(ids[j].strip())
            if g in seen or g in specials:
                continue
            seen.add(g)
            tokens[g] = len(tokens)
            medians_out[g] = medians[j]
        assert max(tokens.values()) + 1 + rows_for_genes <= vocab, (name, len(tokens), vocab)
        pickle.dump(tokens, open(tok_files[0], "wb"))
        pickle.dump(medians_out, open(med_files[0], "wb"))
        print(json.dumps({"dictionaries": name, "genes": len(medians_out), "from": spec}), flush=True)


def uce_over_genes(out, genes):
    """Give every gene of GENES (symbols) an ESM2 protein embedding (random, 5,120-d) and a row of
    species_chrom.csv on one of the human chromosomes already there, so that UCE reads each cell
    at its real length and its chromosome tokens do not change."""
    d = out / "uce"
    pe_path = d / "protein_embeddings" / "Homo_sapiens.GRCh38.gene_symbol_to_embedding_ESM2.pt"
    pe = torch.load(pe_path, map_location="cpu", weights_only=True)
    new = [g for g in genes if g not in pe]
    for g in new:
        pe[g] = 0.1 * torch.randn(5120)
    torch.save(pe, pe_path)
    csv = d / "species_chrom.csv"
    lines = csv.read_text().splitlines()
    header = lines[0].split(",")
    col = {h: i for i, h in enumerate(header)}
    rows = [l.split(",") for l in lines[1:] if l.strip()]
    known = {r[col["gene_symbol"]] for r in rows if r[col["species"]] == "human"}
    chroms = sorted({r[col["chromosome"]] for r in rows if r[col["species"]] == "human"})
    extra = []
    for k, g in enumerate(g for g in genes if g not in known):
        r = [""] * len(header)
        r[col["species"]], r[col["gene_symbol"]] = "human", g
        r[col["chromosome"]] = chroms[k % len(chroms)]
        r[col["start"]] = str(10_000_000 + 1000 * k)
        if "end" in col:
            r[col["end"]] = str(10_000_000 + 1000 * k + 500)
        extra.append(",".join(r))
    csv.write_text("\n".join(lines + extra) + "\n")
    print(json.dumps({"model": "uce", "protein_embeddings_added": len(new), "chromosome_rows_added": len(extra)}))



def symbols_over_data(out, data):
    """Give scGPT's placeholder vocabulary rows to DATA's var_names, and UCE a protein embedding
    for each of them (see --symbols-from)."""
    ids, cells, _ = read_var(data, "_index")
    if (out / "uce" / "species_chrom.csv").is_file():
        uce_over_genes(out, [g for j, g in enumerate(ids) if cells[j]])
    path = out / "scgpt" / "whole_human" / "vocab.json"
    if not path.is_file():
        return
    vocab = json.load(open(path))
    new = [g for j, g in sorted(enumerate(ids), key=lambda t: -cells[t[0]]) if cells[j] and g not in vocab]
    placeholders = sorted((v, k) for k, v in vocab.items() if k.startswith("SCFOUNDRY_PLACEHOLDER_"))
    for (i, k), g in zip(placeholders, dict.fromkeys(new)):
        del vocab[k]
        vocab[g] = i
    json.dump(vocab, open(path, "w"))
    print(json.dumps({"vocabulary": "scgpt", "symbols_added": min(len(placeholders), len(set(new))), "from": data}), flush=True)


MAKERS = {"scgpt": scgpt, "uce": uce, "geneformer": geneformer, "sccello": sccello, "langcell": langcell}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--only", default="scgpt,uce,geneformer", help=f"comma-separated, of {','.join(MAKERS)}")
    ap.add_argument("--genes-from", metavar="DATA.h5ad:COLUMN")
    ap.add_argument("--symbols-from", metavar="DATA.h5ad")
    ap.add_argument("--dictionaries-only", action="store_true", help="only rewrite the dictionaries of models already in OUT_DIR")
    args = ap.parse_args()
    out = Path(args.out_dir)
    if not args.dictionaries_only:
        if torch is None:
            raise SystemExit("fullsize_checkpoints.py: writing checkpoints needs torch")
        torch.manual_seed(0)
        for name in args.only.split(","):
            MAKERS[name](out)
    if args.genes_from:
        genes_over_data(out, args.genes_from)
    if args.symbols_from:
        symbols_over_data(out, args.symbols_from)


if __name__ == "__main__":
    main()
