#!/usr/bin/env bash
# Throughput rows of sccello and langcell on a GPU: scfoundry's own encoder
# (`__bench-encoder --arch`, cells sorted by length) against the same architecture in PyTorch
# (bench/bert_cell_torch.py; file order as upstream runs cells, and sorted), bf16, random
# weights, the released shapes, token lengths of real cells (+1 for <cls>, cut at 2,048).
#
#   bash bench/bert_cell_throughput.sh OUT_DIR [scfoundry-bench binary]
# Prints one JSON line per run and writes them to OUT_DIR/bert_cell_throughput.jsonl.
set -uo pipefail
out="${1:?usage: bert_cell_throughput.sh OUT_DIR [binary]}"
bin="${2:-dist/cuda/scfoundry-bench}"
py="${PYTHON:-python3}"
mkdir -p "$out"
export LD_LIBRARY_PATH="/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
jsonl="$out/bert_cell_throughput.jsonl"
: > "$jsonl"
real=bench/token_lengths_wu2020.txt
# arch batch cells
shapes=("sccello 64 2048" "langcell 32 2048")
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv | tee "$out/nvidia-smi.txt"
for s in "${shapes[@]}"; do
  read -r arch batch cells <<<"$s"
  common=(--lengths "$real" --cells "$cells" --batch "$batch" --dtype bf16)
  line=$("$bin" __bench-encoder --arch "$arch" "${common[@]}" --device cuda --order sorted 2>"$out/$arch.scfoundry.err") || line="{\"tool\":\"scfoundry\",\"error\":\"$(tail -1 "$out/$arch.scfoundry.err" | tr -d '"')\"}"
  echo "{\"shape\":\"$arch\",\"run\":$line}" | tee -a "$jsonl"
  for order in file sorted; do
    line=$("$py" "bench/${arch}_torch.py" "${common[@]}" --device cuda --order "$order" 2>"$out/$arch.torch.$order.err") || line="{\"tool\":\"pytorch\",\"error\":\"$(tail -1 "$out/$arch.torch.$order.err" | tr -d '"')\"}"
    echo "{\"shape\":\"$arch\",\"run\":$line}" | tee -a "$jsonl"
  done
done
