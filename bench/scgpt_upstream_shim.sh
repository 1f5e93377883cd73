#!/usr/bin/env bash
# Make upstream scGPT 0.2.4's model importable on a machine where the scgpt package cannot be
# installed (no network, or a torch newer than the torch 2.3 / torchtext 0.18 that scgpt pins):
# unpack only the files the integration training step uses (scgpt/model/{model,dsbn,
# grad_reverse}.py, scgpt/loss.py, scgpt/tokenizer for tokenize_and_pad_batch and
# random_mask_value, scgpt/data_sampler.py for SubsetsBatchSampler) from the wheel, with package __init__ files that import nothing else, a
# stand-in for torchtext's Vocab (which GeneVocab subclasses) when torchtext is missing, and a
# `tqdm.trange` stand-in when tqdm is missing. Upstream's code runs as
# published; only the package's import side effects (torchtext's vocabulary, scanpy, ...) are
# left out.
#
#   pip download scgpt==0.2.4 --no-deps -d WHEELS     # where there is network
#   bash bench/scgpt_upstream_shim.sh WHEELS/scgpt-0.2.4-py3-none-any.whl DIR
#   PYTHONPATH=DIR python3 bench/scgpt_integrated_torch.py ...
set -euo pipefail
WHEEL=${1:?usage: scgpt_upstream_shim.sh SCGPT_WHEEL DIR}
DIR=${2:?usage: scgpt_upstream_shim.sh SCGPT_WHEEL DIR}
mkdir -p "$DIR"
python3 - "$WHEEL" "$DIR" <<'PY'
import os, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
need = ["scgpt/model/model.py", "scgpt/model/dsbn.py", "scgpt/model/grad_reverse.py", "scgpt/loss.py",
        "scgpt/tokenizer/__init__.py", "scgpt/tokenizer/gene_tokenizer.py", "scgpt/data_sampler.py"]
with zipfile.ZipFile(wheel) as z:
    for n in need:
        os.makedirs(os.path.join(out, os.path.dirname(n)), exist_ok=True)
        with open(os.path.join(out, n), "wb") as f:
            f.write(z.read(n))
open(os.path.join(out, "scgpt/__init__.py"), "w").write(
    "import logging\nlogger = logging.getLogger('scGPT')\n")
open(os.path.join(out, "scgpt/model/__init__.py"), "w").write(
    "from .model import TransformerModel\nfrom .dsbn import *\nfrom .grad_reverse import *\n")
try:
    import torchtext.vocab  # noqa: F401
except ImportError:
    # gene_tokenizer.py subclasses torchtext's Vocab for GeneVocab; tokenize_and_pad_batch and
    # random_mask_value do not use it
    os.makedirs(os.path.join(out, "torchtext"), exist_ok=True)
    open(os.path.join(out, "torchtext/__init__.py"), "w").write("")
    open(os.path.join(out, "torchtext/vocab.py"), "w").write(
        "class Vocab:\n    def __init__(self, *a, **k):\n        raise ImportError('torchtext is not installed')\n\n"
        "def vocab(*a, **k):\n    raise ImportError('torchtext is not installed')\n")
try:
    import tqdm  # noqa: F401
except ImportError:
    os.makedirs(os.path.join(out, "tqdm"), exist_ok=True)
    open(os.path.join(out, "tqdm/__init__.py"), "w").write("def trange(*a, **k):\n    return range(*a)\n")
print(f"scgpt shim in {out}: {', '.join(need)}")
PY
