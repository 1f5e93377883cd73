"""A weights folder for cellama with all-MiniLM-L6-v2's real config and tokenizer but seeded
random weights of the real shapes, and a manifest that pins them: for GPU runs on machines the
real 91 MB model cannot be carried to (the GPU tests measure memory and allocators, not quality).

    python3 random_minilm.py SRC OUT_WEIGHTS OUT_MANIFEST [--seed 0]

SRC holds config.json, tokenizer.json and safetensors_header.json (the real model's header,
tensor names, dtypes and shapes). Needs numpy only.
"""

import hashlib
import json
import re
import struct
import sys
from pathlib import Path

import numpy as np


def main():
    src, weights, manifest_out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    seed = int(sys.argv[sys.argv.index("--seed") + 1]) if "--seed" in sys.argv else 0
    repo = Path(__file__).resolve().parent.parent
    header = json.loads((src / "safetensors_header.json").read_text())
    header.pop("__metadata__", None)
    rng = np.random.default_rng(seed)
    blobs, new_header, offset = [], {}, 0
    for name in sorted(header, key=lambda k: header[k]["data_offsets"][0]):
        h = header[name]
        shape = h["shape"]
        if h["dtype"] == "I64":
            a = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
        else:
            # LayerNorm weights near 1, everything else small: activations stay finite
            a = rng.normal(0.0, 0.05, size=shape).astype(np.float32)
            if name.endswith("LayerNorm.weight"):
                a += 1.0
        b = a.tobytes()
        new_header[name] = {"dtype": h["dtype"], "shape": shape, "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    hj = json.dumps(new_header, separators=(",", ":")).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    folder = weights / "cellama" / "all-MiniLM-L6-v2"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for b in blobs:
            f.write(b)
    for n in ("config.json", "tokenizer.json"):
        (folder / n).write_bytes((src / n).read_bytes())
    data = path.read_bytes()
    sha, size = hashlib.sha256(data).hexdigest(), len(data)
    text = (repo / "weights.toml").read_text()
    block = re.search(r'\[weights\."cellama-minilm-model"\].*?(?=\n\[weights\.)', text, re.S).group(0)
    new = re.sub(r'size = \d+', f"size = {size}", block)
    new = re.sub(r'sha256 = "[0-9a-f]+"', f'sha256 = "{sha}"', new)
    manifest_out.write_text(text.replace(block, new))
    print(json.dumps({"weights": str(weights), "model_bytes": size, "sha256": sha, "seed": seed}))


if __name__ == "__main__":
    main()
