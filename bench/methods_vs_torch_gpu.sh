#!/usr/bin/env bash
# GPU throughput rows of scbert, scfoundation, cellplm, novae, scprint and cellfm: scfoundry (candle, CUDA) against a PyTorch model of
# the same architecture, same cells, same batches, measured one after the other in one run.
# Opt-in: CI has no GPU. BENCHMARKS.md "GPU: per-method throughput" has the results.
#
#   bench/methods_vs_torch_gpu.sh [OUT_DIR] [MODEL...]     # models: scbert scfoundation cellplm novae scprint cellfm (default all)
#
# Needs: dist/cuda/scfoundry-bench (scripts/build-cuda.sh) and python3 with torch (no numpy needed).
# Each side prints one JSON line; they land in OUT_DIR/results.jsonl with a "side" field, and the
# whole output in OUT_DIR/log.txt. A failing command is logged and the script goes on; each command
# is stopped after STEP_TIMEOUT seconds (default 240) so one hang cannot eat a whole run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/scfoundry-methods-gpu}}
shift || true
MODELS=("$@")
[[ ${#MODELS[@]} -eq 0 ]] && MODELS=(scbert scfoundation cellplm novae scprint cellfm)
mkdir -p "$OUT"
BIN=${BIN:-dist/cuda/scfoundry-bench}
export SCFOUNDRY_NO_PROGRESS=1
G=$(mktemp -d /tmp/scfoundry-mg.XXXX)
: >"$OUT/results.jsonl"
# run SIDE MODEL CMD...: log the command, keep its JSON line(s)
run() {
  local side=$1 model=$2; shift 2
  echo "\$ $*" >>"$OUT/log.txt"
  local t0=$SECONDS
  timeout "${STEP_TIMEOUT:-240}" "$@" >"$G/out.txt" 2>"$G/err.txt"
  local rc=$?
  cat "$G/out.txt" "$G/err.txt" >>"$OUT/log.txt"
  echo "exit $rc after $((SECONDS - t0)) s" >>"$OUT/log.txt"
  grep '^{' "$G/out.txt" | while read -r line; do
    printf '{"side":"%s","model":"%s","rc":%d,"result":%s}\n' "$side" "$model" "$rc" "$line" >>"$OUT/results.jsonl"
  done
}
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv >>"$OUT/log.txt" 2>&1
for m in "${MODELS[@]}"; do
  case $m in
    scbert)
      run scfoundry scbert "$BIN" __bench-encoder --arch scbert --lengths bench/pbmc68k_genes.txt --device cuda --dtype f32 --batch 3 --cells 60 --repeat 2
      run torch scbert python3 bench/scbert_torch.py --device cuda --batch 3 --cells 60 --repeat 2 ;;
    scfoundation)
      A=(--lengths bench/token_lengths_wu2020.txt --cells 512 --batch 8 --order sorted --dtype f32 --device cuda)
      run scfoundry scfoundation "$BIN" __bench-encoder --arch scfoundation "${A[@]}"
      run torch scfoundation python3 bench/scfoundation_torch.py "${A[@]}"
      run torch-batch1 scfoundation python3 bench/scfoundation_torch.py --lengths bench/token_lengths_wu2020.txt --cells 128 --batch 1 --order sorted --dtype f32 --device cuda ;;
    cellplm)
      run scfoundry cellplm "$BIN" __bench-cellplm --device cuda --cells 100000 --batch 50000
      run torch cellplm python3 bench/cellplm_torch.py --device cuda --cells 100000 --batch 50000 ;;
    novae)
      run scfoundry novae "$BIN" __bench-encoder --arch novae --cells 20000 --batch 256 --device cuda --repeat 3 --lengths bench/token_lengths_wu2020.txt --graph-out "$G/graph.json"
      run torch novae python3 bench/novae_torch.py --graph "$G/graph.json" --batch 256 --genes 500 --device cuda --repeat 3 ;;
    scprint)
      A=(--lengths bench/token_lengths_wu2020.txt --cells 1024 --batch 64 --max-len 4000 --dtype f32 --device cuda)
      run scfoundry scprint "$BIN" __bench-encoder --arch scprint "${A[@]}"
      run torch-einsum scprint python3 bench/scprint_torch.py "${A[@]}" --attention einsum
      run torch-sdpa scprint python3 bench/scprint_torch.py "${A[@]}" --attention sdpa ;;
    cellfm)
      A=(--lengths bench/token_lengths_wu2020.txt --cells 512 --batch 4 --order sorted --dtype f32 --device cuda)
      run scfoundry cellfm "$BIN" __bench-encoder --arch cellfm "${A[@]}"
      run torch cellfm python3 bench/cellfm_torch.py "${A[@]}" ;;
    *) echo "unknown model $m" >>"$OUT/log.txt" ;;
  esac
done
cat "$OUT/results.jsonl"
