#!/usr/bin/env bash
# Timing of `scfoundry finetune` with unfrozen BERT layers (geneformer, cellama) on a GPU, at the
# models' full sizes with seeded random weights (timing only: random weights learn nothing real).
# Opt-in: CI has no GPU. docs/finetune.md has the results and the command that made them.
#
#   bench/finetune_gpu.sh [OUT_DIR]
#
# Needs: dist/cuda/scfoundry (scripts/build-cuda.sh), python3 with torch (bench/random_geneformer.py)
# and numpy (bench/random_minilm.py), and .devcarry/minilm (scripts/devcarry.sh).
# Data: demo/pbmc68k_counts.h5ad (700 cells, 10 cell types), batch 32, 3 epochs, no early stop.
# For each model: --unfreeze-layers 0 (head on the stored embedding), 1 and 2 on the GPU, and
# --unfreeze-layers 1 on the CPU for comparison; then a table of seconds per epoch.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/scfoundry-finetune}}
mkdir -p "$OUT"
BIN=${BIN:-dist/cuda/scfoundry}
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export SCFOUNDRY_NO_PROGRESS=1 HDF5_USE_FILE_LOCKING=FALSE
W=$(mktemp -d /tmp/scfoundry-ft.XXXX)
cp demo/pbmc68k_counts.h5ad "$W/cells.h5ad"
run() { echo "\$ $*" >>"$OUT/log.txt"; "$@" >>"$OUT/log.txt" 2>&1; echo "exit $?" >>"$OUT/log.txt"; }
COMMON=(-d "$W/cells.h5ad" --label-key cell_type --epochs 3 --batch-size 32 --patience 0 --seed 0 --runs-dir "$W/runs")

python3 bench/random_geneformer.py bench/pbmc68k_genes.txt "$W/gf" --seed 0 | tee -a "$OUT/log.txt"
for dev_n in cuda:0 cuda:1 cuda:2 cpu:1; do
  dev=${dev_n%%:*}; n=${dev_n##*:}
  run "$BIN" finetune -m geneformer "${COMMON[@]}" --model-dir "$W/gf" --gene-column index \
    --unfreeze-layers "$n" --device "$dev" -o "$OUT/geneformer-$dev-u$n"
done

python3 bench/random_minilm.py .devcarry/minilm "$W/weights" "$W/manifest.toml" --seed 0 | tee -a "$OUT/log.txt"
for dev_n in cuda:0 cuda:1 cuda:2 cpu:1; do
  dev=${dev_n%%:*}; n=${dev_n##*:}
  SCFOUNDRY_MANIFEST=$W/manifest.toml SCFOUNDRY_WEIGHTS_DIR=$W/weights \
    run "$BIN" finetune -m cellama "${COMMON[@]}" --unfreeze-layers "$n" --device "$dev" -o "$OUT/cellama-$dev-u$n"
done

python3 - "$OUT" <<'PY' | tee "$OUT/summary.tsv"
import json, sys, glob, os
print("run\tepochs\tseconds_per_epoch\tfirst_epoch_s\ttrain_loss_first\ttrain_loss_last\tdevice")
for d in sorted(glob.glob(os.path.join(sys.argv[1], "*-u*"))):
    try:
        p = json.load(open(os.path.join(d, "finetune.json")))
    except OSError:
        print(f"{os.path.basename(d)}\tfailed (see log.txt)")
        continue
    h = p["history"]
    later = [e["seconds"] for e in h[1:]] or [h[0]["seconds"]]
    print(f"{os.path.basename(d)}\t{len(h)}\t{sum(later) / len(later):.2f}\t{h[0]['seconds']:.2f}\t"
          f"{h[0]['train_loss']:.4f}\t{h[-1]['train_loss']:.4f}\t{p['options']['device']}")
PY
