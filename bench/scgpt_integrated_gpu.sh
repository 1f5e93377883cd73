#!/usr/bin/env bash
# scgpt_integrated's training on a GPU: first the same small model trained on --device cuda and
# cpu (the dropout kernel draws the CPU's masks, so the loss curves should differ only by
# float rounding);
# then the fused training attention against the materialised scores on random inputs
# (scfoundry-bench __bench-train-attention: each against f32, with and without dropout, and their
# seconds at the whole-human shape);
# then ours (integrate --device cuda, --precision f32, tf32 and bf16, and bf16 with
# SCFOUNDRY_TRAIN_ATTENTION=materialized)
# against upstream's training step in PyTorch (bench/scgpt_integrated_torch.py: bf16 autocast
# with fp32 master weights, and f32) at the whole-human shape (embsize 512, 12 layers, 8 heads,
# 1,201 tokens a cell, minibatch 64) with random weights, in the same run; peak GPU memory of
# each. Ours: 2 epochs over CELLS cells; each epoch's training speed and where its time went
# (minibatches, forward, backward, optimiser, validation) are columns of the report folder's
# losses.tsv, the peak GPU memory is in the run folder's report.json; last, one bf16 epoch with
# SCFOUNDRY_STEP_PROFILE=1 writes step_profile.tsv (seconds by region of the model).
#
#   bash bench/scgpt_integrated_gpu.sh OUT_DIR
#
# Needs: dist/cuda/scfoundry (scripts/build-cuda.sh) or $SCFOUNDRY, python3 with h5py and numpy,
# and $TORCH_PYTHON with torch (CUDA) and scgpt 0.2.4 (flash-attn optional;
# bench/scgpt_upstream_shim.sh makes its model importable without torchtext).
set -euo pipefail
OUT=${1:?OUT_DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${SCFOUNDRY:-$ROOT/dist/cuda/scfoundry}
BENCH_BIN=${SCFOUNDRY_BENCH:-$ROOT/dist/cuda/scfoundry-bench}
PY=${PYTHON:-python3}
TORCH_PYTHON=${TORCH_PYTHON:-python3}
CELLS=${CELLS:-1280}
mkdir -p "$OUT"
W=$OUT/weights
CK=$W/scgpt/whole_human
[ -f "$CK/best_model.pt" ] || SHAPE=whole-human "$TORCH_PYTHON" "$ROOT/bench/scgpt_integrated_checkpoint.py" "$CK" 1200 0
DATA=$OUT/synthetic.h5ad
[ -f "$DATA" ] || "$PY" "$ROOT/scripts/make_synthetic.py" --cells "$CELLS" --genes 1200 --batches 3 --depth 3000 --seed 0 --out "$DATA"
# the dropout kernel against the CPU: a small model (embsize 32, 2 layers), 3 epochs, both devices
"$TORCH_PYTHON" "$ROOT/bench/scgpt_integrated_checkpoint.py" "$OUT/small" 50 0
"$PY" "$ROOT/scripts/make_synthetic.py" --cells 600 --genes 50 --batches 3 --depth 3000 --seed 0 --out "$OUT/small.h5ad"
for D in cuda cpu; do
  "$BIN" integrate -m scgpt_integrated -d "$OUT/small.h5ad" -o "$OUT/small_$D.h5ad" --batch-key batch --epochs 3 \
    --integration-batch-size 64 --device $D --model-dir "$OUT/small" --runs-dir "$OUT/runs"
done
paste <(cut -f1-9 "$OUT/small_cuda/losses.tsv") <(cut -f9 "$OUT/small_cpu/losses.tsv")   # total on cuda, then cpu
"$BENCH_BIN" __bench-train-attention | tee "$OUT/train_attention.json"
for P in bf16 f32; do
  "$TORCH_PYTHON" "$ROOT/bench/scgpt_integrated_torch.py" "$CK" 1200 64 20 "$OUT/torch_$P.json" "$P"
done
# ours: two epochs (the second without one-time costs), f32, tf32 and bf16
for P in f32 tf32 bf16; do
  /usr/bin/time -v "$BIN" --weights-dir "$W" integrate -m scgpt_integrated -d "$DATA" -o "$OUT/ours_$P.h5ad" \
    --batch-key batch --epochs 2 --integration-batch-size 64 --device cuda --precision $P --runs-dir "$OUT/runs" \
    2> "$OUT/ours_$P.time" || true
  echo "ours $P:"; cat "$OUT/ours_$P/losses.tsv" || true
  grep -E "Elapsed|Maximum resident" "$OUT/ours_$P.time" || true
done
SCFOUNDRY_TRAIN_ATTENTION=materialized /usr/bin/time -v "$BIN" --weights-dir "$W" integrate -m scgpt_integrated -d "$DATA" \
  -o "$OUT/ours_bf16_materialized.h5ad" --batch-key batch --epochs 2 --integration-batch-size 64 --device cuda --precision bf16 \
  --runs-dir "$OUT/runs" 2> "$OUT/ours_bf16_materialized.time" || true
echo "ours bf16, attention through the (l x l) scores:"; cat "$OUT/ours_bf16_materialized/losses.tsv" || true
# where a bf16 step's time goes, by region of the model (the device synchronised at each mark)
SCFOUNDRY_STEP_PROFILE=1 "$BIN" --weights-dir "$W" integrate -m scgpt_integrated -d "$DATA" -o "$OUT/profile_bf16.h5ad" \
  --batch-key batch --epochs 1 --integration-batch-size 64 --device cuda --precision bf16 --runs-dir "$OUT/runs" || true
cat "$OUT/profile_bf16/step_profile.tsv" || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.csv" || true
cat "$OUT"/torch_*.json
