#!/usr/bin/env bash
# Pretrained-scVI embedding throughput on a GPU: scfoundry's path (`__bench-scvi`:
# PretrainedScvi::embed, batch copied to the GPU, log1p, encoder, q_m back) against the same
# encoder in plain PyTorch (bench/scvi_torch.py), float32, random weights, 100,000 synthetic
# cells of raw counts.
#
#   bash bench/scvi_throughput.sh OUT_DIR [scfoundry-bench binary]
# Prints one JSON line per run and writes them to OUT_DIR/scvi_throughput.jsonl.
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
