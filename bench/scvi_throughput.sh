#!/usr/bin/env bash
# Pretrained-scVI embedding throughput on a GPU: scfoundry's path (`__bench-scvi`:
# PretrainedScvi::embed, batch copied to the GPU, log1p, encoder, q_m back) against the same
# encoder in plain PyTorch (bench/scvi_torch.py), float32, random weights, 100,000 synthetic
# cells of raw counts.
#
# Then, with EMBED_CELLS set, `scfoundry embed -m scvi` end to end (process start to output
# renamed, `--embedding-only`) on EMBED_CELLS real cells (demo/wu2020_tcells.h5ad tiled by
# bench/tile_h5ad.py) with a random scVI model over its 2,000 most expressed genes
# (bench/random_models.py scvi): the GPU default (its [batch] gpu_default), --batch-size 128,
# and the CPU on a tenth of the cells, whose rows the GPU's are compared with.
#
#   bash bench/scvi_throughput.sh OUT_DIR [scfoundry-bench binary]
#   EMBED_CELLS=200000 SCFOUNDRY=dist/cuda/scfoundry bash bench/scvi_throughput.sh OUT_DIR
# Prints one JSON line per run and writes them to OUT_DIR/scvi_throughput.jsonl; the end-to-end
# lines go to OUT_DIR/embed.txt.
set -uo pipefail
out="${1:?usage: scvi_throughput.sh OUT_DIR [binary]}"
bin="${2:-dist/cuda/scfoundry-bench}"
py="${PYTHON:-python3}"
mkdir -p "$out"
export LD_LIBRARY_PATH="/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
jsonl="$out/scvi_throughput.jsonl"
: > "$jsonl"
# name genes hidden latent layers batch cells
shapes=(
  "scvi_default_b128 2000 128 10 1 128 100000"
  "scvi_default_b1024 2000 128 10 1 1024 100000"
  "scvi_large_b1024 8000 512 50 2 1024 100000"
)
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv | tee "$out/nvidia-smi.txt"
for s in "${shapes[@]}"; do
  read -r name g h l n b c <<<"$s"
  common=(--genes "$g" --hidden "$h" --latent "$l" --layers "$n" --batch "$b" --cells "$c" --device cuda)
  line=$("$bin" __bench-scvi "${common[@]}" 2>"$out/$name.scfoundry.err") || line="{\"tool\":\"scfoundry\",\"error\":\"$(tail -1 "$out/$name.scfoundry.err" | tr -d '"')\"}"
  echo "{\"shape\":\"$name\",\"run\":$line}" | tee -a "$jsonl"
  line=$("$py" bench/scvi_torch.py "${common[@]}" 2>"$out/$name.torch.err") || line="{\"tool\":\"pytorch\",\"error\":\"$(tail -1 "$out/$name.torch.err" | tr -d '"')\"}"
  echo "{\"shape\":\"$name\",\"run\":$line}" | tee -a "$jsonl"
done

[[ -n ${EMBED_CELLS:-} ]] || exit 0
scf="${SCFOUNDRY:-$(dirname "$bin")/scfoundry}"
w=$(mktemp -d); trap 'rm -rf "$w"' EXIT
small=$((EMBED_CELLS / 10))
"$py" bench/tile_h5ad.py demo/wu2020_tcells.h5ad "$EMBED_CELLS" "$w/cells.h5ad" > /dev/null
"$py" bench/tile_h5ad.py demo/wu2020_tcells.h5ad "$small" "$w/small.h5ad" > /dev/null
"$py" bench/random_models.py scvi demo/wu2020_tcells.h5ad "$w/model" --genes 2000 --seed 0
embed() {  # name cells args...
  local name=$1 n=$2; shift 2
  local t0 t1; t0=$(date +%s.%N)
  ( cd "$w" && /usr/bin/time -v "$scf" embed -m scvi --model-dir model --embedding-only "$@" ) > "$out/$name.log" 2>&1
  local rc=$?; t1=$(date +%s.%N)
  "$py" - "$out/$name.log" "$name" "$rc" "$n" "$t0" "$t1" <<'PY' | tee -a "$out/embed.txt"
import re, sys
log, name, rc, n, t0, t1 = open(sys.argv[1]).read(), sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
t = t1 - t0
if rc != "0":
    sys.exit(print(name, f"rc={rc}: failed, see {sys.argv[1]}"))
rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log)
cpu = re.search(r"Percent of CPU this job got: (\d+)", log)
print(name, f"rc={rc}", n, "cells", f"{t:.2f} s", f"{n / t:,.0f} cells/s", "peak RSS", f"{int(rss.group(1)) / 1024:.0f} MiB" if rss else "?", "CPU", f"{cpu.group(1)}%" if cpu else "?")
PY
}
embed gpu_default "$EMBED_CELLS" -d cells.h5ad -o gpu.h5ad --device cuda
embed gpu_batch128 "$EMBED_CELLS" -d cells.h5ad -o gpu128.h5ad --device cuda --batch-size 128
embed cpu_default "$small" -d small.h5ad -o cpu.h5ad
embed gpu_small "$small" -d small.h5ad -o gpu_small.h5ad --device cuda
"$py" - "$w" <<'PY' | tee -a "$out/embed.txt"
import sys, h5py, numpy as np
w = sys.argv[1]
a, b = (h5py.File(f"{w}/{p}", "r")["obsm/X_scvi"][:] for p in ("cpu.h5ad", "gpu_small.h5ad"))
print(f"GPU vs CPU on the same cells: largest abs diff {np.abs(a - b).max():.2e} (largest value {np.abs(a).max():.2f})")
c, d = (h5py.File(f"{w}/{p}", "r")["obsm/X_scvi"][:] for p in ("gpu.h5ad", "gpu128.h5ad"))
print(f"GPU default batch vs 128: largest abs diff {np.abs(c - d).max():.2e}")
PY
