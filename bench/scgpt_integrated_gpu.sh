#!/usr/bin/env bash
# scgpt_integrated's training on a GPU: ours (integrate --device cuda, float32) against upstream's
# training step in PyTorch (bench/scgpt_integrated_torch.py: bf16 autocast with fp32 master
# weights, and f32) at the whole-human shape (embsize 512, 12 layers, 8 heads, 1,201 tokens a
# cell, minibatch 64) with random weights, in the same run; peak GPU memory of each. Not yet run:
# docs/scgpt_integrated.md claims no figures.
#
#   bash bench/scgpt_integrated_gpu.sh OUT_DIR
#
# Needs: dist/cuda/scfoundry (scripts/build-cuda.sh) or $SCFOUNDRY, python3 with h5py and numpy,
# and $TORCH_PYTHON with torch (CUDA) and scgpt 0.2.4 (flash-attn optional).
set -euo pipefail
OUT=${1:?OUT_DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${SCFOUNDRY:-$ROOT/dist/cuda/scfoundry}
PY=${PYTHON:-python3}
TORCH_PYTHON=${TORCH_PYTHON:-python3}
CELLS=${CELLS:-1280}
mkdir -p "$OUT"
W=$OUT/weights
CK=$W/scgpt/whole_human
[ -f "$CK/best_model.pt" ] || SHAPE=whole-human "$TORCH_PYTHON" "$ROOT/bench/scgpt_integrated_checkpoint.py" "$CK" 1200 0
DATA=$OUT/synthetic.h5ad
[ -f "$DATA" ] || "$PY" "$ROOT/scripts/make_synthetic.py" --cells "$CELLS" --genes 1200 --batches 3 --depth 3000 --seed 0 --out "$DATA"
for P in bf16 f32; do
  "$TORCH_PYTHON" "$ROOT/bench/scgpt_integrated_torch.py" "$CK" 1200 64 20 "$OUT/torch_$P.json" "$P"
done
# ours: one epoch over CELLS cells (minibatches of 64, 1,201 tokens); the run's cost report holds
# the peak GPU memory (gpu.json) and the time
/usr/bin/time -v "$BIN" --weights-dir "$W" integrate -m scgpt_integrated -d "$DATA" -o "$OUT/ours.h5ad" \
  --batch-key batch --epochs 1 --integration-batch-size 64 --device cuda 2> "$OUT/ours.time" || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.csv" || true
cat "$OUT"/torch_*.json; grep -E "Elapsed|Maximum resident" "$OUT/ours.time" || true
