#!/usr/bin/env bash
# The out-of-memory back-off with batches by tokens, on a GPU: scGPT at full size (random
# weights in the upstream format, bench/fullsize_checkpoints.py) embeds the 700 demo cells in bf16
# once freely, then under --gpu-memory-limit a third of the way from the loaded model to the
# free run's peak, so that batches are refused and the token budget halves (gpu/backoff.rs).
# Prints both runs' exit codes, the back-off note, the allocator's peaks and refusals, and how far
# the limited run's embeddings are from the free run's (batches of other sizes: bf16 rounding).
#
#   bash bench/backoff_gpu.sh OUT_DIR     # needs dist/cuda/scfoundry, python3 with torch and h5py
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: backoff_gpu.sh OUT_DIR}
mkdir -p "$OUT"
B=$PWD/${BIN:-dist/cuda/scfoundry}; export SCFOUNDRY_NO_PROGRESS=1
export LD_LIBRARY_PATH="/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
W=$(mktemp -d); R=$(mktemp -d)
python3 bench/fullsize_checkpoints.py "$W" > "$OUT/checkpoints.jsonl"
cp demo/pbmc68k_counts.h5ad "$R/cells.h5ad"
( cd "$R" && timeout 300 "$B" --weights-dir "$W" embed -m scgpt -d cells.h5ad -o free.h5ad --runs-dir runs/free --device cuda --precision bf16 ) > "$OUT/free.log" 2>&1
echo "free run rc=$?"
LIMIT=$(python3 -c "
import json,glob
g=json.load(open(glob.glob('$R/runs/free/*/tasks/1/gpu.json')[0]))
lo,pk=g['loaded_bytes'],g['stats']['peak_bytes']
print(lo+(pk-lo)//3)")
echo "limit $LIMIT bytes"
( cd "$R" && timeout 300 "$B" --weights-dir "$W" embed -m scgpt -d cells.h5ad -o limited.h5ad --runs-dir runs/limited --device cuda --precision bf16 --gpu-memory-limit "$LIMIT" ) > "$OUT/limited.log" 2>&1
echo "limited run rc=$?"
grep -i "out of memory\|halved\|batch" "$OUT/limited.log" | head -5
python3 - "$R" <<'PY'
import glob, json, sys, h5py, numpy as np
r = sys.argv[1]
for name in ("free", "limited"):
    g = json.load(open(glob.glob(f"{r}/runs/{name}/*/tasks/1/gpu.json")[0]))
    print(name, "peak", g["stats"]["peak_bytes"], "failed", g["stats"]["failed"], "batch_size", g.get("batch_size"), "backoff", g.get("backoff"))
a = h5py.File(f"{r}/free.h5ad", "r")["obsm/X_scgpt"][()].astype(np.float64)
b = h5py.File(f"{r}/limited.h5ad", "r")["obsm/X_scgpt"][()].astype(np.float64)
cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
rel = np.linalg.norm(a - b, axis=1) / np.linalg.norm(a, axis=1)
print(f"limited vs free: {a.shape[0]} cells, lowest cosine {cos.min():.6f}, largest relative difference {rel.max():.2e}")
print("parameters batch_size / batching:", h5py.File(f"{r}/limited.h5ad", "r")["uns/scfoundry/parameters/batch_size"][()], h5py.File(f"{r}/limited.h5ad", "r")["uns/scfoundry/parameters/batching"][()])
PY
