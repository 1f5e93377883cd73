#!/usr/bin/env bash
# EXPERIMENT: cuBLASLt's other heuristic answers at the fused encoder's products. For each shape,
# SCFOUNDRY_GEMM_ALGO=i (the heuristic's i-th algorithm for every product) with --profile: the
# per-step times of one layer and the pass's throughput.
#   bash bench/gemm_algos_gpu.sh OUT_DIR [ALGOS]     # needs dist/cuda/scfoundry
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: gemm_algos_gpu.sh OUT_DIR}; mkdir -p "$OUT"
B=$PWD/${BIN:-dist/cuda/scfoundry}; L=bench/token_lengths_wu2020.txt; export SCFOUNDRY_NO_PROGRESS=1
export LD_LIBRARY_PATH="/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
U="$OUT/uce_lengths.txt"; yes 1072 | head -200 > "$U"
shapes=(
  "geneformer_v1 6 256 4 512 2048 64 2048 $L"
  "scgpt 12 512 8 512 1200 64 2048 $L"
  "geneformer_v2 12 768 12 3072 4096 16 512 $L"
  "uce_33l 33 1280 20 5120 1536 16 256 $U"
)
for s in "${shapes[@]}"; do
  read -r name Ly d h f maxlen batch cells lengths <<<"$s"
  for a in ${2:-0 1 2 3 4 5 6 7}; do
    line=$(SCFOUNDRY_GEMM_ALGO=$a timeout 100 "$B" __bench-encoder --layers "$Ly" --hidden "$d" --heads "$h" --ffn "$f" --max-len "$maxlen" --lengths "$lengths" --cells "$cells" --batch "$batch" --dtype bf16 --order sorted --activation relu --profile 2>"$OUT/$name.$a.err") || line='{}'
    echo "{\"shape\":\"$name\",\"algo\":$a,\"run\":$line}" >> "$OUT/algos.jsonl"
  done
  grep -m4 "gemm plan" "$OUT/$name.0.err"
done
python3 - "$OUT/algos.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l); x = r["run"]; p = x.get("profile_ms_per_layer", {})
    print(r["shape"], r["algo"], round(x.get("cells_per_s", 0), 1), round(x.get("useful_tflops", 0), 1), " ".join("%s=%.3f" % (k, v) for k, v in p.items() if "gemm" in k))
PY
