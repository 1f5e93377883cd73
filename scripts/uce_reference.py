#!/usr/bin/env python3
"""Parity fixture for scfoundry's UCE (src/methods/uce.rs), from upstream's code path.

Run once by hand in a torch venv, never in CI (CI only reads what this writes):

    ~/.cache/scfoundry/torch-venv-scgpt/bin/python scripts/uce_reference.py

(that venv: torch 2.3.0 CPU, numpy 1.26.4, pandas, scanpy, anndata; UCE pins numpy 1.26.4 and
pandas 2.2.2 in its requirements.txt). UCE (github.com/snap-stanford/UCE, read at commit
8ead6e0) is not a pip package, so the parts of its code path that embedding runs are rebuilt
below, each quoting the upstream file and function it follows:

- model.py: `full_block`, `PositionalEncoding`, `TransformerModel` (forward: encoder Linear +
  GELU + LayerNorm times sqrt(d_model), positional encoding, post-norm nn.TransformerEncoder
  with `src_key_padding_mask=(1 - mask)`, decoder on every token, the CLS row L2-normalised);
- evaluate.py `run_eval`: the model's `pe_embedding` is an nn.Embedding over the token table,
  and the tokens are L2-normalised after the lookup; batches are (seq, batch) after permute;
- data_proc/data_utils.py `process_raw_anndata` (filter_genes min_cells=10, filter_cells
  min_genes=25, subset to genes with a protein embedding, counts as int64),
  `load_gene_embeddings_adata` (genes matched by lower-cased symbol), `get_species_to_pe`
  (keys upper-cased), `adata_path_to_prot_chrom_starts` (token = position in the species' key
  list + species offset; chromosome = code of the pandas Categorical "species_chromosome" over
  the whole csv; start), `get_spec_chrom_csv`;
- eval_data.py `MultiDatasetSentences.__getitem__` (weights = log1p(counts) / sum) and
  `sample_cell_sentences` (np.random.choice with replacement, argsort by chromosome,
  np.unique + np.random.shuffle of the chromosomes, chromosome open token = code +
  CHROM_TOKEN_OFFSET, genes by start, close token, CLS first, pad to pad_length),
  `MultiDatasetSentenceCollator` (batch cut to its longest sentence).

Small configuration: token_dim 32 (ESM2's is 5120), d_model 40 with upstream's 20 heads,
d_hid 80, 2 layers, output_dim 16 (the decoder's hidden 1024 is upstream's, hard-coded);
sample_size 1024 and pad_length 1536 as upstream. Weights are seeded random, every tensor
perturbed. The checkpoint is the model's state_dict saved with torch.save, as upstream's .torch
files, less `binary_decoder.*` and `gene_embedding_layer.*` (used for training only: its input
width 1280 + output_dim is hard-coded, 10 MB alone); scfoundry never reads them.

The token table (`pe_embedding.weight` in the checkpoint, as in the released checkpoints where
all_tokens.torch plus 1,895 chromosome rows make the 145,469 rows) has 4 special rows (pad 0,
chrom left 1, chrom right 2, cls 3), 40 "mouse" gene rows, the human gene rows, then one row
per chromosome category. The human protein-embedding file holds most demo genes (every 7th is
left out, so some genes have no embedding), 500 genes not in the data (over 1,000 keys in all, so
that pickle writes them in two SETITEMS batches), and a gene twice in
different case (upper-casing merges them, which shifts the positions after it).

Randomness: upstream samples from numpy's global, unseeded RNG. Here np.random.seed(SEED + row)
is set before each cell's sentence is drawn (scfoundry does the same), and each cell is run
alone (a batch of one: no padding). Upstream's batches pad to their longest sentence and pass
the float mask (1 - mask) as src_key_padding_mask, which PyTorch adds to the attention scores
(+1 at padding keys, not -inf): the embedding of a cell then depends on its batch. The cells
are also run that way (batches of 25, upstream's default) and the largest difference is recorded.
"""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "uce"
DATA = ROOT / "tests" / "fixtures" / "geneformer" / "pbmc68k_50.h5ad"
SEED = 0
TOKEN_DIM, D_MODEL, NHEAD, D_HID, NLAYERS, OUTPUT_DIM = 32, 40, 20, 80, 2, 16
PAD_LENGTH, SAMPLE_SIZE = 1536, 1024
PAD_TOKEN, CHROM_LEFT, CHROM_RIGHT, CLS_TOKEN = 0, 1, 2, 3
N_MOUSE = 40
PE_FILE = "Homo_sapiens.GRCh38.gene_symbol_to_embedding_ESM2.pt"


# ---------------------------------------------------------------- model.py
def full_block(i, o, p):  # model.py full_block
    return nn.Sequential(nn.Linear(i, o), nn.LayerNorm(o), nn.GELU(), nn.Dropout(p))


class PositionalEncoding(nn.Module):  # model.py PositionalEncoding (max_len 1536)
    def __init__(self, d, dropout=0.1, max_len=1536):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe = torch.zeros(max_len, 1, d)
        pe[:, 0, 0::2] = torch.sin(pos * div)
        pe[:, 0, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe)

    def forward(self, x):
        return self.dropout(x + self.pe[: x.size(0)])


class TransformerModel(nn.Module):  # model.py TransformerModel
    def __init__(self, token_dim, d_model, nhead, d_hid, nlayers, output_dim, dropout=0.05):
        super().__init__()
        self.pos_encoder = PositionalEncoding(d_model, dropout)
        self.d_model = d_model
        self.encoder = nn.Sequential(nn.Linear(token_dim, d_model), nn.GELU(), nn.LayerNorm(d_model))
        layer = nn.TransformerEncoderLayer(d_model, nhead, d_hid, dropout)
        self.transformer_encoder = nn.TransformerEncoder(layer, nlayers)
        self.decoder = nn.Sequential(full_block(d_model, 1024, dropout), full_block(1024, output_dim, dropout),
                                     full_block(output_dim, output_dim, dropout), nn.Linear(output_dim, output_dim))
        self.binary_decoder = nn.Sequential(full_block(output_dim + 1280, 2048, dropout), full_block(2048, 512, dropout),
                                            full_block(512, 128, dropout), nn.Linear(128, 1))
        self.gene_embedding_layer = nn.Sequential(nn.Linear(token_dim, d_model), nn.GELU(), nn.LayerNorm(d_model))
        self.pe_embedding = None

    def forward(self, src, mask):
        src = self.encoder(src) * math.sqrt(self.d_model)
        src = self.pos_encoder(src)
        output = self.transformer_encoder(src, src_key_padding_mask=(1 - mask))
        gene_output = self.decoder(output)
        embedding = nn.functional.normalize(gene_output[0, :, :], dim=1)
        return gene_output, embedding


# ---------------------------------------------------------------- eval_data.py
def sample_cell_sentence(counts_row, dataset_idxs, chroms, starts):
    """MultiDatasetSentences.__getitem__ then sample_cell_sentences for one cell (batch of 1)."""
    counts = torch.tensor(counts_row).unsqueeze(0)
    weights = torch.log1p(counts)
    weights = weights / torch.sum(weights)
    weights = weights[0].numpy()
    weights = weights / sum(weights)  # "RE NORM after mask" (builtin sum: float64 in numpy 1.x)
    choice_idx = np.random.choice(np.arange(len(weights)), size=SAMPLE_SIZE, p=weights, replace=True)
    choosen_chrom = chroms[choice_idx]
    chrom_sort = np.argsort(choosen_chrom)
    choice_idx = choice_idx[chrom_sort]
    new_chrom = chroms[choice_idx]
    choosen_starts = starts[choice_idx]
    ordered = np.full((PAD_LENGTH), CLS_TOKEN)
    i = 1
    uq_chroms = np.unique(new_chrom)
    np.random.shuffle(uq_chroms)
    for chrom in uq_chroms:
        ordered[i] = int(chrom) + CHROM_TOKEN_OFFSET
        i += 1
        loc = np.where(new_chrom == chrom)[0]
        sort_by_start = np.argsort(choosen_starts[loc])
        to_add = choice_idx[loc[sort_by_start]]
        ordered[i:(i + len(to_add))] = dataset_idxs[to_add]
        i += len(to_add)
        ordered[i] = CHROM_RIGHT
        i += 1
    ordered[i:] = PAD_TOKEN
    return ordered, i


def main():
    global CHROM_TOKEN_OFFSET
    import anndata
    import scanpy as sc

    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "protein_embeddings").mkdir(exist_ok=True)
    rng = np.random.default_rng(SEED)
    torch.manual_seed(SEED)

    ad = anndata.read_h5ad(DATA)
    genes = list(ad.var_names)

    # ---- the species files (synthetic, in upstream's formats)
    # more than 1,000 keys: pickle writes a dict's items in batches of 1,000 (SETITEMS)
    human = [g for i, g in enumerate(genes) if i % 7 != 3] + [f"NOTINDATA{i}" for i in range(1, 500)] + ["Notindata3", "NOTINDATA3"]
    human = [human[i] for i in rng.permutation(len(human))]
    # the case pair must stay in this order for the position shift to show: put it mid-list
    human = [h for h in human if h.upper() != "NOTINDATA3"]
    assert len(human) + 2 > 1000
    mid = len(human) // 2
    human[mid:mid] = ["Notindata3", "NOTINDATA3"]
    mouse = [f"Mgene{i}" for i in range(N_MOUSE)]
    pe_dict = {g: torch.randn(TOKEN_DIM) for g in human}
    torch.save(pe_dict, OUT / "protein_embeddings" / PE_FILE)
    offsets = {"mouse": 4, "human": 4 + N_MOUSE}
    import pickle
    with open(OUT / "species_offsets.pkl", "wb") as f:
        pickle.dump(offsets, f)
    n_gene_rows = 4 + N_MOUSE + len(human)
    CHROM_TOKEN_OFFSET = n_gene_rows  # rows of all_tokens.torch (143574 upstream)

    # chromosomes of very unequal size, so that sentences differ in length (rare ones left out)
    human_chroms = ["1", "2", "3", "10", "11", "12", "20", "21", "22", "X", "Y", "MT"]
    chrom_p = np.array([30, 25, 20, 15, 12, 10, 2, 1, 1, 6, 0.5, 0.5])
    hu = sorted({h.upper() for h in human})
    hstarts = rng.permutation(len(hu)) * 1000 + 11
    hchrom = rng.choice(len(human_chroms), size=len(hu), p=chrom_p / chrom_p.sum())
    rows = [("human", g, human_chroms[c], int(s), int(s) + 500) for g, s, c in zip(hu, hstarts, hchrom)]
    mouse_chroms = ["1", "2", "19", "X"]
    rows += [("mouse", g.upper(), mouse_chroms[rng.integers(len(mouse_chroms))], int(1000 * k + 7), int(1000 * k + 900)) for k, g in enumerate(mouse)]
    rows = [rows[i] for i in rng.permutation(len(rows))]
    csv = pd.DataFrame(rows, columns=["species", "gene_symbol", "chromosome", "start", "end"])
    csv.to_csv(OUT / "species_chrom.csv", index=False)

    # data_utils.get_spec_chrom_csv
    gene_to_chrom_pos = pd.read_csv(OUT / "species_chrom.csv")
    gene_to_chrom_pos["spec_chrom"] = pd.Categorical(gene_to_chrom_pos["species"] + "_" + gene_to_chrom_pos["chromosome"])
    n_chrom_cats = len(gene_to_chrom_pos["spec_chrom"].cat.categories)

    # token table: specials, mouse, human (as all_tokens.torch), then the chromosome rows
    table = torch.randn(n_gene_rows + n_chrom_cats, TOKEN_DIM)

    # ---- model, seeded random weights, saved as upstream's state_dict
    model = TransformerModel(TOKEN_DIM, D_MODEL, NHEAD, D_HID, NLAYERS, OUTPUT_DIM)
    model.pe_embedding = nn.Embedding.from_pretrained(table)
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("pe_embedding"):
                continue
            if ("norm" in name or ".1.weight" in name or "encoder.2.weight" in name) and p.dim() == 1 and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    sd = {k: v for k, v in model.state_dict().items() if not k.startswith(("binary_decoder.", "gene_embedding_layer."))}
    torch.save(sd, OUT / "tiny.torch")
    # reload as run_eval does (strict, but for the two heads left out)
    model2 = TransformerModel(TOKEN_DIM, D_MODEL, NHEAD, D_HID, NLAYERS, OUTPUT_DIM)
    model2.pe_embedding = nn.Embedding.from_pretrained(torch.zeros(table.shape))
    missing, unexpected = model2.load_state_dict(torch.load(OUT / "tiny.torch", map_location="cpu"), strict=False)
    assert not unexpected and all(k.startswith(("binary_decoder.", "gene_embedding_layer.")) for k in missing)
    model2.eval()

    # ---- data_utils.process_raw_anndata (filter=True, upstream's default)
    sc.pp.filter_genes(ad, min_cells=10)
    sc.pp.filter_cells(ad, min_genes=25)
    assert ad.n_obs == 50, "the fixture expects no cell filtered out"
    # load_gene_embeddings_adata
    lower = {k.lower() for k in pe_dict}
    use = {x for x in ad.var_names if x.lower() in lower}
    adata = ad[:, ad.var_names.isin(use)].copy()
    counts = np.asarray(adata.X.toarray(), dtype=np.float32).astype(np.int64)
    # get_species_to_pe (upper-cased keys) and adata_path_to_prot_chrom_starts
    spec_pe_genes = list({k.upper(): v for k, v in pe_dict.items()}.keys())
    pe_row_idxs = torch.tensor([spec_pe_genes.index(k.upper()) + offsets["human"] for k in adata.var_names]).long()
    spec_chrom = gene_to_chrom_pos[gene_to_chrom_pos["species"] == "human"].set_index("gene_symbol")
    gene_chrom = spec_chrom.loc[[k.upper() for k in adata.var_names]]
    chroms = gene_chrom["spec_chrom"].cat.codes.values
    starts = gene_chrom["start"].values
    dataset_idxs = pe_row_idxs.numpy()

    sentences, lengths = [], []
    for c in range(adata.n_obs):
        np.random.seed((SEED + c) % 2**32)
        s, n = sample_cell_sentence(counts[c], dataset_idxs, chroms, starts)
        sentences.append(s)
        lengths.append(n)

    def run(idx):
        """run_eval's loop body for the cells `idx` (collated as MultiDatasetSentenceCollator)."""
        m = max(lengths[i] for i in idx)
        bs = torch.tensor(np.stack([sentences[i] for i in idx]))[:, :m]
        mask = torch.zeros((len(idx), PAD_LENGTH))
        for k, i in enumerate(idx):
            mask[k, : lengths[i]] = 1
        mask = mask[:, :m]
        with torch.no_grad():
            x = model2.pe_embedding(bs.permute(1, 0).long())
            x = nn.functional.normalize(x, dim=2)
            _, emb = model2.forward(x, mask=mask)
        return emb.numpy()

    emb = np.concatenate([run([c]) for c in range(adata.n_obs)]).astype(np.float32)
    batched = np.concatenate([run(list(range(s, min(s + 25, adata.n_obs)))) for s in range(0, adata.n_obs, 25)])
    batch_diff = float(np.max(np.abs(batched - emb)))
    cos = np.sum(batched * emb, axis=1)

    import importlib.metadata as md
    ref = {
        "made_by": "scripts/uce_reference.py",
        "upstream": "github.com/snap-stanford/UCE at 8ead6e0 (model.py, evaluate.py, eval_data.py, data_proc/data_utils.py)",
        "versions": {"torch": torch.__version__, "numpy": np.__version__, "pandas": pd.__version__, "scanpy": md.version("scanpy"), "python": sys.version.split()[0]},
        "seed": SEED,
        "config": {"token_dim": TOKEN_DIM, "d_model": D_MODEL, "nhead": NHEAD, "d_hid": D_HID, "nlayers": NLAYERS, "output_dim": OUTPUT_DIM,
                   "pad_length": PAD_LENGTH, "sample_size": SAMPLE_SIZE, "pad_token_idx": PAD_TOKEN, "chrom_token_left_idx": CHROM_LEFT,
                   "chrom_token_right_idx": CHROM_RIGHT, "cls_token_idx": CLS_TOKEN, "CHROM_TOKEN_OFFSET": CHROM_TOKEN_OFFSET, "species": "human"},
        "data": str(DATA.relative_to(ROOT)),
        "genes": {"in_data": len(genes), "after_filter_genes": int(ad.n_vars), "with_embedding": int(adata.n_vars),
                  "kept": list(adata.var_names), "token_ids": [int(t) for t in dataset_idxs], "chrom_codes": [int(c) for c in chroms]},
        "chrom_categories": [str(c) for c in gene_to_chrom_pos["spec_chrom"].cat.categories],
        "state_dict_keys": sorted(sd.keys()),
        "sentences": [[int(t) for t in s[:n]] for s, n in zip(sentences, lengths)],
        "embeddings": emb.tolist(),
        "upstream_batched_25": {"max_abs_diff": batch_diff, "min_cosine": float(cos.min())},
    }
    (OUT / "reference.json").write_text(json.dumps(ref, separators=(",", ":")))
    print(f"{adata.n_vars} genes of {len(genes)} ({ad.n_vars} after filter_genes); sentence lengths {min(lengths)}..{max(lengths)}; "
          f"batched (25) vs alone: max abs diff {batch_diff:.3e}, min cosine {cos.min():.6f}; wrote {OUT}")


if __name__ == "__main__":
    main()
