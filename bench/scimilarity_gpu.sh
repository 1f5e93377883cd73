#!/usr/bin/env bash
# SCimilarity on a GPU machine, one run: the encoder at its released size (28,231 genes -> 1024
# -> 1024 -> 128, random weights) in `__bench-scimilarity` (dense host rows, sparse host rows as
# `embed` runs them, batches on the device) against bench/scimilarity_torch.py (upstream's
# get_embeddings loop, the earlier page-locked loop, a careful user's best, the model alone);
# then `scfoundry embed -m scimilarity` end to end (from process start to the output renamed)
# on CELLS real cells (demo/wu2020_tcells.h5ad tiled by bench/tile_h5ad.py; a random model over
# its first 28,231 genes by bench/random_models.py) with the default settings on the GPU, and
# on CPU_CELLS of them on the CPU for the same method's CPU figure.
#
#   bash bench/scimilarity_gpu.sh OUT_DIR        # needs dist/cuda13/scfoundry and scfoundry-bench
#                                                # (or their .xz), python3 with torch, numpy, h5py
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: scimilarity_gpu.sh OUT_DIR}; mkdir -p "$OUT"
CELLS=${CELLS:-200000}; CPU_CELLS=${CPU_CELLS:-20000}; PY=${PYTHON:-python3}
D=${DIST:-dist/cuda13}; T=$(mktemp -d)
for b in scfoundry scfoundry-bench; do
  if [[ -x $D/$b ]]; then cp "$D/$b" "$T/$b"; else xz -dc "$D/$b.xz" > "$T/$b" && chmod +x "$T/$b"; fi
done
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-} SCFOUNDRY_NO_PROGRESS=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "== encoder: scfoundry (best of 3) then PyTorch $("$PY" -c 'import torch; print(torch.__version__)')"
timeout 300 "$T/scfoundry-bench" __bench-scimilarity --device cuda --repeat 3 | tee "$OUT/bench.jsonl"
timeout 300 "$PY" bench/scimilarity_torch.py --device cuda --repeat 3 | tee -a "$OUT/bench.jsonl"
echo "== embed end to end"
W=$T/w; mkdir -p "$W"
"$PY" bench/tile_h5ad.py demo/wu2020_tcells.h5ad "$CELLS" "$W/cells.h5ad" > /dev/null
"$PY" bench/tile_h5ad.py demo/wu2020_tcells.h5ad "$CPU_CELLS" "$W/cpu_cells.h5ad" > /dev/null
"$PY" bench/random_models.py scimilarity "$W/cells.h5ad" "$W/model" --genes 28231 --hidden 1024,1024 --latent 128 --seed 0
run() {  # name cells args...
  local name=$1 n=$2; shift 2
  local t0; t0=$(date +%s.%N)
  ( cd "$W" && /usr/bin/time -v timeout 600 "$T/scfoundry" embed -m scimilarity --model-dir model --embedding-only "$@" ) > "$OUT/$name.log" 2>&1; local rc=$?
  local t1; t1=$(date +%s.%N)
  "$PY" -c "
import re,sys
t=float('$t1')-float('$t0'); log=open('$OUT/$name.log').read()
rss=re.search(r'Maximum resident set size \(kbytes\): (\d+)', log)
print('$name', 'rc=$rc', '$n cells', f'{t:.2f} s', f'{$n/t:,.0f} cells/s', 'peak RSS', f'{int(rss.group(1))/1024:.0f} MiB' if rss else '?')" | tee -a "$OUT/embed.txt"
}
run gpu_default "$CELLS" -d cells.h5ad -o gpu.h5ad --device cuda
run gpu_default_again "$CELLS" -d cells.h5ad -o gpu2.h5ad --device cuda
run cpu_default "$CPU_CELLS" -d cpu_cells.h5ad -o cpu.h5ad
run gpu_small "$CPU_CELLS" -d cpu_cells.h5ad -o gpu_small.h5ad --device cuda
# the GPU rows against the CPU's, same cells
"$PY" - "$W/cpu.h5ad" "$W/gpu_small.h5ad" <<'PY' | tee -a "$OUT/embed.txt"
import sys, h5py, numpy as np
a, b = (h5py.File(p, "r")["obsm/X_scimilarity"][:] for p in sys.argv[1:3])
cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
print(f"GPU vs CPU on the same cells: lowest cosine {cos.min():.7f}, largest abs diff {np.abs(a - b).max():.2e}")
PY
find "$W" -name gpu.tsv -exec cat {} \; | head -4 > "$OUT/gpu.tsv"
rm -rf "$T"
