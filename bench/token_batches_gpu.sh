#!/usr/bin/env bash
# Batches by cells against batches by tokens (gpu/backoff.rs TokenBudget), on a GPU machine in one
# run: the fused encoder at the full-size encoder shapes whose cells differ in length (Geneformer
# V1 and V2, scGPT; UCE's cells all hold 1,024 genes), bf16, random weights, real token lengths.
# `cells`: --batch cells a batch (what every loop did before); `tokensK`: --batch cells of the
# longest length make the budget, shorter cells fill it up to K x --batch cells. Each variant runs
# twice, interleaved, so that drift in the card's speed shows.
#
#   bash bench/token_batches_gpu.sh OUT_DIR     # needs dist/cuda/scfoundry (scripts/build-cuda.sh)
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: token_batches_gpu.sh OUT_DIR}
mkdir -p "$OUT"
B=$PWD/${BIN:-dist/cuda/scfoundry}; L=bench/token_lengths_wu2020.txt; export SCFOUNDRY_NO_PROGRESS=1
export LD_LIBRARY_PATH="/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
# name layers hidden heads ffn max_len batch cells
shapes=(
  "geneformer_v1 6 256 4 512 2048 64 2048"
  "scgpt 12 512 8 512 1200 64 2048"
  "geneformer_v2 12 768 12 3072 4096 16 512"
)
: > "$OUT/token_batches.jsonl"
timeout 120 "$B" __bench-encoder --arch gemm --dtype bf16 --repeat 3 --lengths $L 2>&1 | tee "$OUT/ceiling.json" | tail -1
for s in "${shapes[@]}"; do
  read -r name Ly d h f maxlen batch cells <<<"$s"
  common=(--arch bert --layers "$Ly" --hidden "$d" --heads "$h" --ffn "$f" --max-len "$maxlen" --lengths "$L" --cells "$cells" --batch "$batch" --dtype bf16 --order sorted --activation relu --repeat 3)
  for v in ${VARIANTS:-cells tokens8 cells tokens8 tokens4 tokens16}; do
    extra=(--batching cells); [[ $v == tokens* ]] && extra=(--batching tokens --batch-growth "${v#tokens}")
    line=$(timeout "${STEP_TIMEOUT:-150}" "$B" __bench-encoder "${common[@]}" "${extra[@]}" 2>"$OUT/$name.$v.err") || line="{\"error\":\"$(tail -1 "$OUT/$name.$v.err" | tr -d '"')\"}"
    echo "{\"shape\":\"$name\",\"variant\":\"$v\",\"run\":$line}" >> "$OUT/token_batches.jsonl"
  done
done
python3 - "$OUT/token_batches.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l); x = r["run"]
    print(r["shape"], r["variant"], round(x.get("cells_per_s", 0), 1), round(x.get("useful_tflops", 0), 1),
          "batches", x.get("batches"), "largest", x.get("largest_batch"), x.get("error", ""))
PY
