#!/usr/bin/env bash
# scgpt_integrated on SYNTHETIC data: benchmark's batch-correction and bio-conservation scores of
# zero-shot `embed -m scgpt`, of ours (`integrate -m scgpt_integrated`) and of upstream's own
# fine-tuning loop (bench/scgpt_integrated_upstream.py, scgpt 0.2.4), all from the same small
# checkpoint (embsize 32, 2 layers, 4 heads) pretrained briefly by upstream's code on synthetic
# data of another seed (bench/scgpt_integrated_pretrain.py). CPU only; see
# docs/scgpt_integrated.md, "Integration on synthetic data".
#
#   bash bench/scgpt_integrated_synthetic.sh OUT_DIR [SEEDS] [EPOCHS]
#
# SEEDS ("0 1 2") seed the fine-tuning runs (ours and upstream's) and the benchmark; the data
# (seed 0) and the pretrained checkpoint (data seed 1000) are the same for every seed.
# EPOCHS (30, upstream's) for both fine-tuning loops.
# Needs: the release binary ($SCFOUNDRY, else $CARGO_TARGET_DIR's or target/'s), python with h5py
# and numpy for scripts/make_synthetic.py ($PYTHON), and $TORCH_PYTHON (torch 2.3 + scgpt 0.2.4,
# the venv of scripts/scgpt_reference.py).
# CELLS (3000), GENES (50), TYPES (5), DEPTH (1500, median counts a cell) set the data;
# BATCH_SIGMA (0.3) the batch effect's spread (scripts/make_synthetic.py --batch-sigma),
# BATCH_DEPTH (unset) each batch's depth factor (--batch-depth, e.g. 1,0.5,0.25);
# SHARED_GENES=1 draws the pretraining cells from the evaluation data's genes, types and batches;
# PRETRAIN_CELLS (CELLS), PRETRAIN_EPOCHS (8), PRETRAIN_LR (2e-3) and PRETRAIN_DEVICE (cpu) the
# pretraining; DEVICE
# (cpu) where ours embeds and fine-tunes, PRECISION its --precision (unset: the default).
# UPSTREAM=0 skips upstream's loop, UPSTREAM_DEVICE (cpu) is where it trains;
# THREADS (1) is each fine-tuning's CPU threads (OMP_NUM_THREADS, RAYON_NUM_THREADS).
set -euo pipefail
OUT=${1:?OUT_DIR}
SEEDS=${2:-"0 1 2"}
EPOCHS=${3:-30}
CELLS=${CELLS:-3000}
GENES=${GENES:-50}
TYPES=${TYPES:-5}
DEPTH=${DEPTH:-1500}
UPSTREAM=${UPSTREAM:-1}
THREADS=${THREADS:-1}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${SCFOUNDRY:-}" ]; then
  for b in "${CARGO_TARGET_DIR:-$ROOT/target}/x86_64-unknown-linux-gnu/release/scfoundry" "${CARGO_TARGET_DIR:-$ROOT/target}/release/scfoundry"; do
    [ -x "$b" ] && SCFOUNDRY=$b && break
  done
fi
BIN=${SCFOUNDRY:?build the release binary or set SCFOUNDRY}
PY=${PYTHON:-python3}
TORCH_PYTHON=${TORCH_PYTHON:-$HOME/.cache/scfoundry/torch-venv-scgpt/bin/python}
mkdir -p "$OUT"
DATA=$OUT/synthetic.h5ad
PRE=$OUT/pretrain.h5ad
SYN=(--cells "$CELLS" --genes "$GENES" --types "$TYPES" --batches 3 --depth "$DEPTH" --batch-sigma "${BATCH_SIGMA:-0.3}" ${BATCH_DEPTH:+--batch-depth "$BATCH_DEPTH"})
# SHARED_GENES=1: the pretraining cells are other cells of the evaluation data's genes, cell
# types and batches (--model-seed 0); else another seed's genes altogether
PRE_MODEL=(); [ "${SHARED_GENES:-0}" = 1 ] && PRE_MODEL=(--model-seed 0)
[ -f "$DATA" ] || "$PY" "$ROOT/scripts/make_synthetic.py" "${SYN[@]}" --seed 0 --out "$DATA"
[ -f "$PRE" ] || "$PY" "$ROOT/scripts/make_synthetic.py" "${SYN[@]}" "${PRE_MODEL[@]}" --seed 1000 --out "$PRE" --cells "${PRETRAIN_CELLS:-$CELLS}"
# the checkpoint, in the weights folder's layout (embed -m scgpt reads it from there)
W=$OUT/weights
CK=$W/scgpt/whole_human
[ -f "$CK/best_model.pt" ] || "$TORCH_PYTHON" "$ROOT/bench/scgpt_integrated_pretrain.py" "$PRE" "$CK" \
  --epochs "${PRETRAIN_EPOCHS:-8}" --lr "${PRETRAIN_LR:-2e-3}" --seed 0 --device "${PRETRAIN_DEVICE:-cpu}" 2>&1 | grep -v Warning | grep '^{' || true
[ -f "$CK/best_model.pt" ] || { echo "pretraining wrote no checkpoint" >&2; exit 1; }
RESULTS=$OUT/results.tsv
echo -e "seed\tepochs\tbatch_zero_shot\tbatch_ours\tbatch_upstream\tbio_zero_shot\tbio_ours\tbio_upstream\ttotal_zero_shot\ttotal_ours\ttotal_upstream\tours_seconds\tupstream_seconds" > "$RESULTS"
for SEED in $SEEDS; do
  Z=$OUT/zero-$SEED.h5ad
  I=$OUT/integrated-$SEED.h5ad
  rm -rf "$Z" "$I" "${I%.h5ad}" "$OUT/upstream-$SEED"
  "$BIN" --quiet --weights-dir "$W" embed -m scgpt -d "$DATA" -o "$Z" --seed "$SEED" --device "${DEVICE:-cpu}" ${PRECISION:+--precision "$PRECISION"}
  # ours and upstream's loop run side by side, one thread each (THREADS), so that neither
  # oversubscribes the cores; each times itself
  EMB=X_scgpt,X_scgpt_integrated
  if [ "$UPSTREAM" = 1 ]; then
    ( S=$(date +%s.%N); OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS "$TORCH_PYTHON" "$ROOT/bench/scgpt_integrated_upstream.py" "$DATA" "$CK" "$OUT/upstream-$SEED" \
        --seed "$SEED" --epochs "$EPOCHS" --device "${UPSTREAM_DEVICE:-cpu}" > "$OUT/upstream-$SEED.log" 2>&1; echo "$S $(date +%s.%N)" > "$OUT/upstream-$SEED.time" ) &
    EMB=$EMB,X_scgpt_upstream
  fi
  T0=$(date +%s.%N)
  RAYON_NUM_THREADS=$THREADS "$BIN" --quiet integrate -m scgpt_integrated -d "$Z" -o "$I" --batch-key batch --seed "$SEED" --epochs "$EPOCHS" --model-dir "$CK" --device "${DEVICE:-cpu}" ${PRECISION:+--precision "$PRECISION"}
  T1=$(date +%s.%N)
  wait
  T2=$T1
  if [ "$UPSTREAM" = 1 ]; then
    [ -f "$OUT/upstream-$SEED/embedding.npy" ] || { tail "$OUT/upstream-$SEED.log" >&2; exit 1; }
    "$TORCH_PYTHON" - "$OUT/upstream-$SEED/embedding.npy" "$I" <<'PY'
import sys, h5py, numpy as np
e = np.load(sys.argv[1])
with h5py.File(sys.argv[2], "r+") as f:
    ds = f["obsm"].create_dataset("X_scgpt_upstream", data=e)
    ds.attrs["encoding-type"], ds.attrs["encoding-version"] = "array", "0.2.0"
PY
    read -r U0 U1 < "$OUT/upstream-$SEED.time"
    T1=$(python3 -c "print($T1)"); T2=$(python3 -c "print($T1 + $U1 - $U0)")
  fi
  "$BIN" --quiet benchmark -d "$I" -e "$EMB" --label-key cell_type --batch-key batch -o "$OUT/bench-$SEED" --seed "$SEED"
  "$PY" - "$OUT/bench-$SEED/results.tsv" "$SEED" "$EPOCHS" "$T0" "$T1" "$T2" >> "$RESULTS" <<'PY'
import csv, sys
rows = {r["embedding"]: r for r in csv.DictReader(open(sys.argv[1]), delimiter="\t")}
keys = ["X_scgpt", "X_scgpt_integrated", "X_scgpt_upstream"]
def f(k, col):
    return f"{float(rows[k][col]):.4f}" if k in rows else "NA"
t0, t1, t2 = map(float, sys.argv[4:7])
up = f"{t2 - t1:.0f}" if "X_scgpt_upstream" in rows else "NA"
print("\t".join([sys.argv[2], sys.argv[3]] + [f(k, c) for c in ("Batch correction", "Bio conservation", "Total") for k in keys]
                + [f"{t1 - t0:.0f}", up]))
PY
  tail -1 "$RESULTS"
done
column -t "$RESULTS" 2>/dev/null || cat "$RESULTS"
