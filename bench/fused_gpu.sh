#!/usr/bin/env bash
# The fused encoder path (src/gpu/fused_encoder.rs) on a GPU machine in one run: correctness
# against candle's ops (--check), a per-step profile of one layer (--profile) and throughput,
# fused (with each attention kernel) and unfused, at the four full-size encoder shapes (bf16,
# random weights, real token lengths). No PyTorch here: bench/encoder_throughput.sh measures the comparison.
#
#   bash bench/fused_gpu.sh OUT_DIR     # needs dist/cuda/scfoundry-bench (scripts/build-cuda.sh)
#   VARIANTS="fused sync" bash bench/fused_gpu.sh OUT_DIR   # the read-back A/B: one batch behind vs each batch
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: fused_gpu.sh OUT_DIR}
mkdir -p "$OUT"
B=$PWD/${BIN:-dist/cuda/scfoundry-bench}; L=bench/token_lengths_wu2020.txt; export SCFOUNDRY_NO_PROGRESS=1
export LD_LIBRARY_PATH="/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
U="$OUT/uce_lengths.txt"; yes 1072 | head -200 > "$U"
timeout 60 "$B" __bench-encoder --arch bert --layers 2 --hidden 256 --heads 4 --ffn 512 --max-len 2048 --lengths $L --cells 64 --batch 16 --check --repeat 1 2>&1 | tee "$OUT/quick.txt" | tail -3
# name layers hidden heads ffn max_len batch cells lengths activation (each model's own: ReLU
# for all four, see encoder_throughput.sh)
shapes=(
  "geneformer_v1 6 256 4 512 2048 64 2048 $L relu"
  "scgpt 12 512 8 512 1200 64 2048 $L relu"
  "geneformer_v2 12 768 12 3072 4096 16 512 $L relu"
  "uce_33l 33 1280 20 5120 1536 16 256 $U relu"
)
: > "$OUT/fused.jsonl"
# the bf16 matrix ceiling in this call (the target is half of it)
timeout 120 "$B" __bench-encoder --arch gemm --dtype bf16 --repeat 3 --lengths $L 2>&1 | tee "$OUT/ceiling.json" | tail -1
for s in "${shapes[@]}"; do
  read -r name Ly d h f maxlen batch cells lengths act <<<"$s"
  common=(--layers "$Ly" --hidden "$d" --heads "$h" --ffn "$f" --max-len "$maxlen" --lengths "$lengths" --cells "$cells" --batch "$batch" --dtype bf16 --order sorted --activation "$act")
  # fused: our encoder path with the best attention kernel for the GPU (wgmma on Hopper);
  # portable: the same with the mma.sync attention kernel; unfused: candle's ops
  for v in ${VARIANTS:-fused portable unfused}; do
    # sync: fused, each batch read back before the next is queued (before gpu/readback.rs)
    extra=(--check --profile); [[ $v == unfused ]] && extra=(--unfused); [[ $v == sync ]] && extra=(--sync-batches)
    kernel=; [[ $v == portable ]] && kernel=portable
    line=$(SCFOUNDRY_ATTENTION=$kernel timeout "${STEP_TIMEOUT:-150}" "$B" __bench-encoder "${common[@]}" "${extra[@]}" 2>"$OUT/$name.$v.err") || line="{\"error\":\"$(tail -1 "$OUT/$name.$v.err" | tr -d '"')\"}"
    echo "{\"shape\":\"$name\",\"variant\":\"$v\",\"run\":$line}" >> "$OUT/fused.jsonl"
  done
done
python3 - "$OUT/fused.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l); x = r["run"]
    print(r["shape"], r["variant"], round(x.get("cells_per_s", 0), 1), round(x.get("useful_tflops", 0), 1),
          x.get("check_fused_encoder_vs_unfused"), x.get("check_attention_vs_reference"), x.get("check_embedding_kernel_vs_candle"), x.get("check_readback_lagged_vs_plain"), x.get("read_back", ""), x.get("attention_kernel", ""), x.get("error", ""))
    if "profile_ms_per_layer" in x:
        p = x["profile_ms_per_layer"]; t = sum(p.values())
        print("   layer %.3f ms (%d tokens, %.0f TFLOP/s): " % (t, x["profile_tokens"], x["profile_layer_tflops"]) + ", ".join("%s %.3f (%.0f%%)" % (k, v, 100 * v / t) for k, v in p.items()))
PY
