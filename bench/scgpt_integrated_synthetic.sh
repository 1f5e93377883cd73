#!/usr/bin/env bash
# scgpt_integrated on SYNTHETIC data: benchmark's batch-correction and bio-conservation scores of
# zero-shot `embed -m scgpt` against `integrate -m scgpt_integrated`, from the same small
# checkpoint (embsize 32, 2 layers, seeded random weights: bench/scgpt_integrated_checkpoint.py),
# on 3 seeds. CPU only; see docs/scgpt_integrated.md, "Integration on synthetic data".
#
#   bash bench/scgpt_integrated_synthetic.sh OUT_DIR [SEEDS] [EPOCHS]
#
# Needs: target/release/scfoundry (or $SCFOUNDRY), python3 with h5py and numpy for
# scripts/make_synthetic.py, and $TORCH_PYTHON (torch) for the checkpoint.
# CELLS (3000), GENES (400), TYPES (5), DEPTH (1500, median counts a cell) set the data.
set -euo pipefail
OUT=${1:?OUT_DIR}
SEEDS=${2:-"0 1 2"}
EPOCHS=${3:-5}
CELLS=${CELLS:-3000}
GENES=${GENES:-400}
TYPES=${TYPES:-5}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${SCFOUNDRY:-$ROOT/target/release/scfoundry}
PY=${PYTHON:-python3}
TORCH_PYTHON=${TORCH_PYTHON:-$HOME/.cache/scfoundry/torch-venv-scgpt/bin/python}
mkdir -p "$OUT"
DATA=$OUT/synthetic.h5ad
[ -f "$DATA" ] || "$PY" "$ROOT/scripts/make_synthetic.py" --cells "$CELLS" --genes "$GENES" --types "$TYPES" --batches 3 --depth "${DEPTH:-1500}" --seed 0 --out "$DATA"
RESULTS=$OUT/results.tsv
echo -e "seed\tepochs\tbatch_zero_shot\tbatch_integrated\tbio_zero_shot\tbio_integrated\ttotal_zero_shot\ttotal_integrated\tintegrate_seconds" > "$RESULTS"
for SEED in $SEEDS; do
  W=$OUT/weights-$SEED
  CK=$W/scgpt/whole_human
  [ -f "$CK/best_model.pt" ] || "$TORCH_PYTHON" "$ROOT/bench/scgpt_integrated_checkpoint.py" "$CK" "$GENES" "$SEED"
  Z=$OUT/zero-$SEED.h5ad
  I=$OUT/integrated-$SEED.h5ad
  rm -f "$Z" "$I"
  "$BIN" --quiet --weights-dir "$W" embed -m scgpt -d "$DATA" -o "$Z" --seed "$SEED"
  T0=$(date +%s.%N)
  "$BIN" --quiet --weights-dir "$W" integrate -m scgpt_integrated -d "$Z" -o "$I" --batch-key batch --seed "$SEED" --epochs "$EPOCHS"
  T1=$(date +%s.%N)
  "$BIN" --quiet benchmark -d "$I" -e X_scgpt,X_scgpt_integrated --label-key cell_type --batch-key batch -o "$OUT/bench-$SEED" --seed "$SEED"
  "$PY" - "$OUT/bench-$SEED/results.tsv" "$SEED" "$EPOCHS" "$T0" "$T1" >> "$RESULTS" <<'PY'
import csv, sys
rows = {r["embedding"]: r for r in csv.DictReader(open(sys.argv[1]), delimiter="\t")}
z, i = rows["X_scgpt"], rows["X_scgpt_integrated"]
f = lambda r, k: float(r[k])
print("\t".join([sys.argv[2], sys.argv[3]] + [f"{v:.4f}" for v in (
    f(z, "Batch correction"), f(i, "Batch correction"), f(z, "Bio conservation"), f(i, "Bio conservation"),
    f(z, "Total"), f(i, "Total"))] + [f"{float(sys.argv[5]) - float(sys.argv[4]):.0f}"]))
PY
  tail -1 "$RESULTS"
done
column -t "$RESULTS"
