#!/usr/bin/env bash
# Shards on one card: `scfoundry embed -m geneformer --device cuda --precision bf16` on 200,000
# real-length cells as 1 task, then as 2 and 4 shard tasks sharing card 0 (`--gpu 0,0`,
# `--gpu 0,0,0,0`), wall time of the whole command (planning, shards, merge), and the largest
# difference of each sharded embedding from the one-task run.
#
#   bash bench/shards_one_card_gpu.sh OUT_DIR [CELLS] [BINARY]     # BINARY: dist/cuda/scfoundry
#
# Data: demo/wu2020_tcells.h5ad (200 real T cells, 30,727 genes, 135-3,056 genes a cell, mean
# 994) tiled to CELLS cells by bench/tile_h5ad.py. Model: Geneformer V1's shape (6 x 256, 4 heads,
# FFN 512, 2,048 positions, 25,426 tokens) with seeded random weights (bench/random_geneformer.py,
# seed 0) whose vocabulary is the 12,047 genes detected in the 200 cells. Needs python3 with
# numpy + h5py (+ torch for pytorch_model.bin; numpy alone writes model.safetensors).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: shards_one_card_gpu.sh OUT_DIR [CELLS] [BINARY]}; CELLS=${2:-200000}; BIN=$(realpath "${3:-dist/cuda/scfoundry}")
PY=${PYTHON:-python3}
mkdir -p "$OUT"; W=$(realpath "$OUT")
export SCFOUNDRY_NO_PROGRESS=1
[[ -f $W/cells.h5ad ]] || "$PY" bench/tile_h5ad.py demo/wu2020_tcells.h5ad "$CELLS" "$W/cells.h5ad" --genes-out "$W/genes.txt"
[[ -d $W/gf ]] || "$PY" bench/random_geneformer.py "$W/genes.txt" "$W/gf" --seed 0
echo "machine: $(nproc) CPUs, $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
"$BIN" --version
run() {  # name, extra flags...
  local name=$1; shift
  rm -rf "$W/runs-$name" "$W/$name.h5ad"
  local t0 t1
  t0=$EPOCHREALTIME
  "$BIN" embed -m geneformer -d "$W/cells.h5ad" -o "$W/$name.h5ad" --model-dir "$W/gf" --gene-column index \
    --device cuda --precision bf16 --embedding-only --runs-dir "$W/runs-$name" --quiet "$@"
  t1=$EPOCHREALTIME
  local wall; wall=$(awk -v a="$t0" -v b="$t1" 'BEGIN{print b - a}')
  printf '%-10s wall %7.1f s  %7.0f cells/s  (%s)\n' "$name" "$wall" "$(awk -v n="$CELLS" -v w="$wall" 'BEGIN{print n / w}')" "$*"
  echo "$name $wall" >> "$W/walls.txt"
  # each task's row of trace.txt: name, status, realtime, peak_rss
  find "$W/runs-$name" -name trace.txt -exec awk -F'\t' 'NR==1{for(i=1;i<=NF;i++)h[$i]=i; next}{print "    ", $h["name"], $h["status"], $h["realtime"], $h["peak_rss"]}' {} \;
}
: > "$W/walls.txt"
# warm-up: the first CUDA context and cuBLASLt tuning of a process are not what is compared
"$BIN" embed -m geneformer -d demo/wu2020_tcells.h5ad -o "$W/warm.h5ad" --model-dir "$W/gf" --gene-column index \
  --device cuda --precision bf16 --embedding-only --runs-dir "$W/runs-warm" --quiet
for rep in 1 2; do
  run "one-$rep"
  run "two-$rep" --gpu 0,0 --shards 2
  run "four-$rep" --gpu 0,0,0,0 --shards 4
done
"$PY" - "$W" <<'PY'
import sys, h5py, numpy as np
w = sys.argv[1]
def emb(name):
    with h5py.File(f"{w}/{name}.h5ad", "r") as f:
        return f["obsm/X_geneformer"][:]
ref = emb("one-1")
for name in ["one-2", "two-1", "four-1"]:
    e = emb(name)
    d = np.abs(e.astype(np.float64) - ref)
    cos = (e * ref).sum(1) / np.linalg.norm(e, axis=1) / np.linalg.norm(ref, axis=1)
    print(f"{name:<8} vs one-1: max abs diff {d.max():.3g}, min cosine {cos.min():.7f}, shape {e.shape}")
walls = {}
for line in open(f"{w}/walls.txt"):
    n, t = line.split(); walls.setdefault(n.split("-")[0], []).append(float(t))
one = min(walls["one"])
for k in ["one", "two", "four"]:
    print(f"{k:<5} best wall {min(walls[k]):.1f} s  ratio to one task {min(walls[k]) / one:.3f}")
PY
