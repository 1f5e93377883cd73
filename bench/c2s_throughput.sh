#!/usr/bin/env bash
# Cell2Sentence throughput on a GPU: scfoundry's GPT-NeoX (methods/c2s.rs; cells sorted by
# prompt length, packed) against a torch-only GPT-NeoX run as upstream runs it
# (bench/c2s_torch.py: left padding, attention mask, sdpa; file order and sorted), full-size
# Pythia-160M and -410M shapes, random weights, batch 8 (upstream's), prompt token counts from
# bench/c2s_prompt_lengths.txt (the 24 fixture prompts of tests/fixtures/c2s, 468-517 tokens:
# top 100 genes through a 400-token BPE trained on them; the real Pythia tokenizer was not
# available offline to measure with).
#
#   bash bench/c2s_throughput.sh OUT_DIR [scfoundry-bench binary]
# Prints one JSON line per run and writes them to OUT_DIR/c2s_throughput.jsonl.
set -uo pipefail
out="${1:?usage: c2s_throughput.sh OUT_DIR [binary]}"
bin="${2:-dist/cuda/scfoundry-bench}"
py="${PYTHON:-python3}"
mkdir -p "$out"
export LD_LIBRARY_PATH="/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
jsonl="$out/c2s_throughput.jsonl"
: > "$jsonl"
lengths=bench/c2s_prompt_lengths.txt
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv | tee "$out/nvidia-smi.txt"
# ours: bf16 (the GPU default: the fused causal stack, prompts packed) at upstream's batch of 8
# and at 64, and --precision f32; PyTorch: upstream's default (float32, file order, batch 8) and
# the careful user's (bf16, sorted by length, the best of batches 8, 32 and 64)
for arch in c2s-160m c2s-410m; do
  common=(--arch "$arch" --max-len 2048 --lengths "$lengths" --cells 1024)
  for run in "bf16 8" "bf16 64" "f32 8"; do
    set -- $run
    line=$("$bin" __bench-encoder "${common[@]}" --dtype "$1" --batch "$2" --order sorted 2>"$out/$arch.$1.$2.scfoundry.err") || line="{\"tool\":\"scfoundry\",\"error\":\"$(tail -1 "$out/$arch.$1.$2.scfoundry.err" | tr -d '"')\"}"
    echo "{\"shape\":\"$arch\",\"run\":$line}" | tee -a "$jsonl"
  done
  for run in "f32 file 8" "bf16 file 8" "bf16 sorted 8" "bf16 sorted 32" "bf16 sorted 64"; do
    set -- $run
    line=$("$py" bench/c2s_torch.py "${common[@]}" --dtype "$1" --order "$2" --batch "$3" 2>"$out/$arch.$1.$2.$3.torch.err") || line="{\"tool\":\"pytorch\",\"error\":\"$(tail -1 "$out/$arch.$1.$2.$3.torch.err" | tr -d '"')\"}"
    echo "{\"shape\":\"$arch\",\"run\":$line}" | tee -a "$jsonl"
  done
done
