#!/usr/bin/env python3
"""Parity fixture for scfoundry's Cell2Sentence (src/methods/c2s.rs), from upstream's own code.

Run once by hand, never in CI (CI only reads what this writes):

    git -C <cell2sentence checkout> rev-parse HEAD    # b2bea70569c27eef8480c919071ba92e7be9c032
    PYTHONPATH=~/.cache/scfoundry/c2s-extra \\
      ~/.cache/scfoundry/torch-venv-gf/bin/python scripts/c2s_reference.py --upstream <checkout>/src

torch-venv-gf has torch and transformers (and anndata, numpy, pandas, tokenizers);
~/.cache/scfoundry/c2s-extra holds what upstream's utils.py imports besides
(`pip install --target ~/.cache/scfoundry/c2s-extra --no-deps scikit-learn==1.7.2 scipy joblib
threadpoolctl cloudpickle`). `datasets` and `plotnine` are replaced by small stand-ins (upstream
only uses `Dataset.from_dict` and row access on the embedding path; plotnine only for plots).

What runs is upstream's code (vandijklab/cell2sentence, src/cell2sentence):
- utils.generate_vocabulary (upper-cased var names) and utils.generate_sentences (np.random.seed,
  then per cell sklearn.utils.shuffle of the stored entries and a stable argsort of -value, so
  ties are broken by the shuffle);
- prompt_formatter.PromptFormatter("cell_type_prediction", top_k_genes).format_hf_ds (random.seed,
  then random.choice of one of the 15 templates per cell, the sentence cut to its first k words);
- csmodel.CSModel.embed_cells_batched (tokenizer with padding_side='left', pad = eos, the model's
  output_hidden_states, hidden_states[-1][i].mean(0)).

Each cell is embedded alone (a batch of one, as scfoundry computes every cell), and once more in
upstream's batches of 8 (`tasks.embed_cells(inference_batch_size=8)`), where left padding shifts
the positions and the mean takes in the padding rows: the largest difference is recorded.

Small configuration: a byte-level BPE tokenizer trained here on the prompts (the real Pythia
tokenizer.json is not available offline; its pipeline is the same: NFC normaliser, ByteLevel
pre-tokenizer without prefix space, BPE, ByteLevel decoder, <|endoftext|> id 0 and <|padding|>
id 1), and a GPT-NeoX causal LM of hidden 32, 2 heads (head 16, rotary_pct 0.25 as Pythia: 4
rotary dims), intermediate 128, 2 layers, parallel residual (Pythia's), untied embed_out (as
Pythia), plus a 1-layer model with the sequential residual and tied embeddings (no embed_out
saved) in sequential/. Seeded random weights, LayerNorms perturbed; saved
with save_pretrained (config.json + model.safetensors), config.json then rewritten with the
transformers-4 key names the released C2S checkpoints carry (rotary_pct, rotary_emb_base).
"""

import argparse
import json
import random
import sys
import types
from pathlib import Path

import anndata
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
SEED = 42  # upstream's default random_state / random_seed; scfoundry gets --seed 42
TOP_K = 100
N_CELLS = 24
BATCH = 8


class _Dataset:
    """Stand-in for datasets.Dataset: from_dict, num_rows, row access."""

    def __init__(self, d):
        self.d = d
        self.num_rows = len(next(iter(d.values()))) if d else 0

    @classmethod
    def from_dict(cls, d):
        return cls(d)

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.d.items()}


def stub_modules():
    ds = types.ModuleType("datasets")
    ds.Dataset = _Dataset
    ds.DatasetDict = dict
    ds.load_from_disk = lambda p: (_ for _ in ()).throw(RuntimeError("not used"))
    ds.concatenate_datasets = lambda l: (_ for _ in ()).throw(RuntimeError("not used"))
    sys.modules["datasets"] = ds
    sys.modules["plotnine"] = types.ModuleType("plotnine")


def train_tokenizer(texts, out: Path):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|padding|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")
    fast.save_pretrained(out)


def tiny_model(vocab, layers, parallel, tied, hidden=32, heads=2, inter=128, seed=0):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=inter, hidden_act="gelu", rotary_pct=0.25, rotary_emb_base=10000,
                        max_position_embeddings=2048, layer_norm_eps=1e-5, use_parallel_residual=parallel,
                        tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    m = GPTNeoXForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "layernorm" in name or "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.02 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return m


def legacy_config(path: Path, parallel: bool):
    """config.json as transformers 4 wrote it for Pythia/C2S (rotary_pct, rotary_emb_base)."""
    c = json.loads(path.read_text())
    rp = c.pop("rope_parameters", None) or {}
    c.pop("rope_scaling", None)
    c["rotary_pct"] = rp.get("partial_rotary_factor", c.get("rotary_pct", 0.25))
    c["rotary_emb_base"] = int(rp.get("rope_theta", c.get("rotary_emb_base", 10000)))
    c["use_parallel_residual"] = parallel
    c["torch_dtype"] = "float32"
    c.pop("dtype", None)
    path.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream", required=True, help="cell2sentence's src/ folder (holds cell2sentence/)")
    ap.add_argument("--data", default=str(ROOT / "tests/fixtures/geneformer/pbmc68k_50.h5ad"))
    ap.add_argument("--out", default=str(ROOT / "tests/fixtures/c2s"))
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer  # noqa: F401 (before the stand-ins)
    import transformers

    stub_modules()
    sys.path.insert(0, a.upstream)
    from cell2sentence import utils
    from cell2sentence.csmodel import CSModel
    from cell2sentence.prompt_formatter import PromptFormatter

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    adata = anndata.read_h5ad(a.data)[:N_CELLS].copy()

    # upstream: CSData.adata_to_arrow -> generate_vocabulary, generate_sentences (seed 42)
    vocab = utils.generate_vocabulary(adata)
    sentences = utils.generate_sentences(adata, vocab, delimiter=" ", random_state=SEED)
    rows = {"cell_name": list(adata.obs_names), "cell_sentence": list(sentences),
            "organism": ["Homo sapiens"] * adata.n_obs, "cell_type": [str(c) for c in adata.obs["cell_type"]]}
    pf = PromptFormatter(task="cell_type_prediction", top_k_genes=TOP_K, random_seed=SEED)
    prompts = list(pf.format_hf_ds(_Dataset(rows)).d["model_input"])

    train_tokenizer(prompts, out)
    tokenizer = AutoTokenizer.from_pretrained(out, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    ids = [tokenizer(p)["input_ids"] for p in prompts]

    # CSModel without its constructor (which downloads and re-saves a model): what
    # embed_cells_batched reads is self.tokenizer and self.device.
    cs = CSModel.__new__(CSModel)
    cs.tokenizer = tokenizer
    cs.device = "cpu"

    result = {}
    for sub, layers, parallel, tied, seed in [("", 2, True, False, 0), ("sequential", 1, False, True, 1)]:
        d = out / sub if sub else out
        d.mkdir(exist_ok=True)
        m = tiny_model(len(tokenizer), layers, parallel, tied, seed=seed)
        m.save_pretrained(d)
        (d / "generation_config.json").unlink(missing_ok=True)  # generation only; not read
        legacy_config(d / "config.json", parallel)
        model = AutoModelForCausalLM.from_pretrained(d).eval()
        with torch.no_grad():
            alone = [cs.embed_cells_batched(model, [p])[0] for p in prompts]
            batched = []
            for s in range(0, len(prompts), BATCH):
                batched += cs.embed_cells_batched(model, prompts[s:s + BATCH])
            # which hidden state upstream's hidden_states[-1] is under this transformers
            t = torch.tensor([ids[0]])
            o = model(input_ids=t, output_hidden_states=True)
            last = model.gpt_neox(input_ids=t).last_hidden_state
            after_norm = bool(torch.allclose(o.hidden_states[-1], last))
        alone = np.stack(alone).astype(np.float32)
        batched = np.stack(batched).astype(np.float32)
        rel = float(np.max(np.linalg.norm(batched - alone, axis=1) / np.linalg.norm(alone, axis=1)))
        result[sub or "parallel"] = {
            "dir": sub, "layers": layers, "use_parallel_residual": parallel,
            "hidden_states_last_is_final_layer_norm": after_norm,
            "embeddings": alone.tolist(),
            "upstream_batched_8_max_rel_diff": rel,
        }

    ref = {
        "made_by": "scripts/c2s_reference.py",
        "upstream": "vandijklab/cell2sentence b2bea70569c27eef8480c919071ba92e7be9c032",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "numpy": np.__version__,
                     "anndata": anndata.__version__},
        "data": str(Path(a.data).resolve().relative_to(ROOT)),
        "n_cells": adata.n_obs,
        "seed": SEED,
        "top_genes": TOP_K,
        "organism": "Homo sapiens",
        "sentences": list(sentences),
        "prompts": prompts,
        "token_ids": ids,
        "models": result,
    }
    (out / "reference.json").write_text(json.dumps(ref) + "\n")
    for k, v in result.items():
        print(k, "hidden_states[-1] after final_layer_norm:", v["hidden_states_last_is_final_layer_norm"],
              "batched-vs-alone max rel diff:", v["upstream_batched_8_max_rel_diff"])
    print("tokens per prompt:", [len(i) for i in ids][:8], "vocab", len(tokenizer))


if __name__ == "__main__":
    main()
