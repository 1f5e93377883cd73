#!/usr/bin/env bash
# Encoder throughput on a GPU: scfoundry's encoder (packed cells with variable-length
# attention, methods/packed_bert.rs; and, for comparison, candle-transformers' BERT over padded
# batches sorted by length, `--padded`) against PyTorch's nn.TransformerEncoder run as upstream code runs it
# (batches padded to their longest cell with a key-padding mask; file order and sorted), bf16,
# random weights, full-size shapes, token lengths of real cells (bench/token_lengths_*.txt).
#
#   bash bench/encoder_throughput.sh OUT_DIR [scfoundry-bench binary]
#   ONLY=geneformer_v1 bash bench/encoder_throughput.sh ...      # some shapes only (the ceilings still)
# Prints one JSON line per run and writes them to OUT_DIR/encoder_throughput.jsonl (the table in
# BENCHMARKS.md is written from that file by hand). Each command is stopped after STEP_TIMEOUT
# seconds (default 240).
set -uo pipefail
out="${1:?usage: encoder_throughput.sh OUT_DIR [binary]}"
bin="${2:-dist/cuda/scfoundry-bench}"
py="${PYTHON:-python3}"
mkdir -p "$out"
export LD_LIBRARY_PATH="/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
jsonl="$out/encoder_throughput.jsonl"
: > "$jsonl"
real=bench/token_lengths_wu2020.txt
# UCE: 1024 sampled genes plus chromosome markers and <cls> (about 1,072 real tokens), padded
# to 1536 by upstream's design
uce="$out/uce_lengths.txt"
yes 1072 | head -200 > "$uce"
# name layers hidden heads ffn max_len batch cells lengths torch-pad-to activation (each
# model's own, ReLU for all four: Geneformer's pretraining config sets hidden_act "relu", as our
# parity fixtures do; scGPT and UCE use nn.TransformerEncoderLayer's default). Geneformer V1
# runs 100 cells a batch on both sides: its method default (methods/geneformer.toml, upstream's
# forward_batch_size); 64 before 2026-12-03.
shapes=(
  "geneformer_v1 6 256 4 512 2048 100 2048 $real 0 relu"
  "scgpt 12 512 8 512 1200 64 2048 $real 0 relu"
  "geneformer_v2 12 768 12 3072 4096 16 512 $real 0 relu"
  "uce_33l 33 1280 20 5120 1536 16 256 $uce 1536 relu"
)
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv | tee "$out/nvidia-smi.txt"
# the bf16 matrix ceiling the useful TFLOP/s are held against, ours and PyTorch's, measured in
# this call before and after the encoders (the target is half of it)
ceiling() {
  local line
  line=$(timeout 120 "$bin" __bench-encoder --arch gemm --dtype bf16 --repeat 3 --lengths "$real" 2>"$out/ceiling.err") || line="{\"tool\":\"scfoundry\",\"error\":\"$(tail -1 "$out/ceiling.err" | tr -d '"')\"}"
  echo "{\"shape\":\"ceiling_$1\",\"run\":$line}" | tee -a "$jsonl"
  line=$(timeout 120 "$py" bench/ceiling_torch.py 2>"$out/ceiling_torch.err") || line="{\"tool\":\"pytorch\",\"error\":\"$(tail -1 "$out/ceiling_torch.err" | tr -d '"')\"}"
  echo "{\"shape\":\"ceiling_$1\",\"run\":$line}" | tee -a "$jsonl"
}
ceiling before
for s in "${shapes[@]}"; do
  read -r name L d h f maxlen batch cells lengths padto act <<<"$s"
  [[ -n ${ONLY:-} && ",$ONLY," != *",$name,"* ]] && continue
  common=(--layers "$L" --hidden "$d" --heads "$h" --ffn "$f" --max-len "$maxlen" --lengths "$lengths" --cells "$cells" --batch "$batch" --dtype bf16 --activation "$act")
  for variant in packed padded; do
    extra=(--check); [[ $variant == padded ]] && extra=(--padded --batching cells)
    line=$(timeout "${STEP_TIMEOUT:-240}" "$bin" __bench-encoder "${common[@]}" --order sorted "${extra[@]}" 2>"$out/$name.scfoundry.$variant.err") || line="{\"tool\":\"scfoundry\",\"variant\":\"$variant\",\"error\":\"$(tail -1 "$out/$name.scfoundry.$variant.err" | tr -d '"')\"}"
    echo "{\"shape\":\"$name\",\"run\":$line}" | tee -a "$jsonl"
  done
  for order in file sorted; do
    line=$(timeout "${STEP_TIMEOUT:-240}" "$py" bench/encoder_torch.py "${common[@]}" --order "$order" --pad-to "$padto" 2>"$out/$name.torch.$order.err") || line="{\"tool\":\"pytorch\",\"error\":\"$(tail -1 "$out/$name.torch.$order.err" | tr -d '"')\"}"
    echo "{\"shape\":\"$name\",\"run\":$line}" | tee -a "$jsonl"
  done
done
ceiling after
