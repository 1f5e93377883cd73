#!/usr/bin/env bash
# The GPU runtime's checks and benchmarks, run on a machine with an NVIDIA GPU (CUDA 13 driver),
# with the binary from scripts/build-cuda.sh. Opt-in: CI has no GPU. BENCHMARKS.md, "GPU runtime",
# has the results and the command that made them.
#
#   bench/gpu_runtime.sh [OUT_DIR]
#
# Needs: dist/cuda/scfoundry, python3 with numpy and h5py, .devcarry/minilm (config.json,
# tokenizer.json and the safetensors header of all-MiniLM-L6-v2: `scripts/devcarry.sh` makes it),
# and for the RMM comparison the rmm-cu13 wheels installed (PYTHONPATH).
# What it does:
#   1. `scfoundry doctor`;
#   2. cellama with seeded random weights of all-MiniLM-L6-v2's shapes embeds the demo cells on the
#      CPU, then on the GPU under each allocator; a limit forces the out-of-memory back-off; a
#      device budget runs managed memory larger than a simulated small card;
#   3. bench/gpu_runtime_check.py checks each run's gpu.json (pointer attributes, counters,
#      default-pool high-water mark) and that every GPU embedding equals the CPU one;
#   4. allocation latency: `scfoundry doctor --bench-alloc` and bench/alloc_rmm.py in the same run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/scfoundry-gpu}}
mkdir -p "$OUT"
BIN=${BIN:-dist/cuda/scfoundry}
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export SCFOUNDRY_NO_PROGRESS=1 HDF5_USE_FILE_LOCKING=FALSE
W=$(mktemp -d /tmp/scfoundry-gpu.XXXX)
log() { echo "== $*" | tee -a "$OUT/log.txt"; }
run() { echo "\$ $*" >>"$OUT/log.txt"; "$@" >>"$OUT/log.txt" 2>&1; local rc=$?; echo "exit $rc" >>"$OUT/log.txt"; return $rc; }

log doctor
"$BIN" doctor | tee "$OUT/doctor.txt"
"$BIN" doctor --json >"$OUT/doctor.json"

log "random MiniLM weights"
python3 bench/random_minilm.py .devcarry/minilm "$W/weights" "$W/manifest.toml" --seed 0 | tee -a "$OUT/log.txt"
export SCFOUNDRY_MANIFEST=$W/manifest.toml SCFOUNDRY_WEIGHTS_DIR=$W/weights
cp demo/pbmc68k_counts.h5ad "$W/cells.h5ad"

log "cpu reference"
run "$BIN" embed -m cellama -d "$W/cells.h5ad" -o "$W/cpu.h5ad" --runs-dir "$W/runs/cpu"

declare -A EXTRA=(
  [async]=""
  [pool]="--initial-pool-size 1GiB --maximum-pool-size 4GiB"
  [managed]=""
  [managed-pool]="--maximum-pool-size 4GiB"
  [cuda]=""
)
for mode in async pool managed managed-pool cuda; do
  log "gpu $mode"
  # shellcheck disable=SC2086
  run "$BIN" embed -m cellama -d "$W/cells.h5ad" -o "$W/$mode.h5ad" --runs-dir "$W/runs/$mode" \
    --device cuda --allocator "$mode" ${EXTRA[$mode]} --allocation-log "$W/$mode.alloc.csv"
done

# The back-off: a limit a third of the way from the loaded model to the async run's peak.
LIMIT=$(python3 -c "
import json,glob
g=json.load(open(glob.glob('$W/runs/async/*/tasks/1/gpu.json')[0]))
lo,pk=g['loaded_bytes'],g['stats']['peak_bytes']
print(lo+(pk-lo)//3)")
log "gpu async with --gpu-memory-limit $LIMIT (forced back-off)"
run "$BIN" embed -m cellama -d "$W/cells.h5ad" -o "$W/limited.h5ad" --runs-dir "$W/runs/limited" \
  --device cuda --gpu-memory-limit "$LIMIT"
log "gpu pool capped below the model (out of memory at one cell: a clear error)"
"$BIN" embed -m cellama -d "$W/cells.h5ad" -o "$W/toosmall.h5ad" --runs-dir "$W/runs/toosmall" \
  --device cuda --allocator pool --initial-pool-size 16MiB --maximum-pool-size 64MiB 2>"$W/toosmall.err"
echo "$?" >"$W/toosmall.exit"
cat "$W/toosmall.err" >>"$OUT/log.txt"
log "gpu managed on a simulated 64 MiB card (--device-budget)"
run "$BIN" embed -m cellama -d "$W/cells.h5ad" -o "$W/budget.h5ad" --runs-dir "$W/runs/budget" \
  --device cuda --allocator managed --device-budget 64MiB
log "errors: no such device"
run "$BIN" embed -m cellama -d "$W/cells.h5ad" -o "$W/nodev.h5ad" --device cuda --gpu 7
echo "$?" >"$W/nodev.exit"

log "geneformer and scgpt on the GPU (the small parity checkpoints of tests/fixtures)"
unset SCFOUNDRY_MANIFEST
GF=tests/fixtures/geneformer
run "$BIN" embed -m geneformer -d $GF/pbmc68k_50.h5ad -o "$W/gf-cpu.h5ad" --model-dir $GF/v1 --runs-dir "$W/runs/gf-cpu"
run "$BIN" embed -m geneformer -d $GF/pbmc68k_50.h5ad -o "$W/gf-gpu.h5ad" --model-dir $GF/v1 --runs-dir "$W/runs/gf-gpu" \
  --device cuda --allocator pool --initial-pool-size 256MiB --maximum-pool-size 1GiB
mkdir -p "$W/sg/scgpt/whole_human" && cp tests/fixtures/scgpt/tiny/* "$W/sg/scgpt/whole_human/"
run "$BIN" --weights-dir "$W/sg" embed -m scgpt -d "$W/cells.h5ad" -o "$W/sg-cpu.h5ad" --runs-dir "$W/runs/sg-cpu"
run "$BIN" --weights-dir "$W/sg" embed -m scgpt -d "$W/cells.h5ad" -o "$W/sg-gpu.h5ad" --runs-dir "$W/runs/sg-gpu" \
  --device cuda --allocator managed-pool --maximum-pool-size 2GiB
export SCFOUNDRY_MANIFEST=$W/manifest.toml

log check
python3 bench/gpu_runtime_check.py "$W" | tee "$OUT/check.json"
CHECK=${PIPESTATUS[0]}
cp "$W"/runs/*/*/gpu.tsv "$OUT/" 2>/dev/null
for m in async pool managed managed-pool cuda limited budget; do
  cp "$W"/runs/$m/*/gpu.tsv "$OUT/gpu-$m.tsv" 2>/dev/null
done
rm -f "$OUT/gpu.tsv"

log "allocation latency"
"$BIN" doctor --bench-alloc --pairs "${PAIRS:-20000}" --json >"$OUT/alloc_ours.json"
if python3 -c "import rmm" 2>/dev/null; then
  python3 bench/alloc_rmm.py --pairs "${PAIRS:-20000}" >"$OUT/alloc_rmm.json"
else
  echo "rmm not importable: no RMM comparison" | tee -a "$OUT/log.txt"
fi
python3 bench/alloc_table.py "$OUT/alloc_ours.json" "$OUT/alloc_rmm.json" | tee "$OUT/alloc_table.md"
exit "$CHECK"
