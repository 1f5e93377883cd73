#!/usr/bin/env bash
# What lies between the kernels of a batch. Checks first (the fused
# product + norm harness, whose kernel takes its output map apart from its residual's; the fused
# encoder and attention against their references, with cudarc's event tracking off and on;
# geneformer's embed on the GPU against transformers), then the A/B of bench/env_ab_gpu.sh: the
# binary before (BEFORE), this binary with cudarc's event tracking on, and as it is; V1 and
# scGPT three rounds, V2 and UCE two. At commit 2de08cb the call also ran programmatic dependent
# launch and the attention kernel's carveout as variants (SCFOUNDRY_PDL, SCFOUNDRY_ATTENTION_CARVEOUT,
# removed since; BENCHMARKS.md, "GPU: transformer encoders", what we tried).
#
#   bash bench/launch_gaps_gpu.sh OUT_DIR BINARY BEFORE [HARNESS]
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: launch_gaps_gpu.sh OUT_DIR BINARY BEFORE [HARNESS]}; B=${2:?}; A=${3:?}; H=${4:-}
mkdir -p "$OUT"; export SCFOUNDRY_NO_PROGRESS=1
export LD_LIBRARY_PATH="/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv
[[ -n $H ]] && timeout 120 "$H" 2>&1 | tail -12
L=bench/token_lengths_wu2020.txt
V1="--arch bert --layers 6 --hidden 256 --heads 4 --ffn 512 --max-len 2048 --lengths $L"
SG="--arch bert --layers 12 --hidden 512 --heads 8 --ffn 512 --max-len 1200 --lengths $L"
keys='import json,sys; d=json.loads(sys.stdin.read()); print({k: d.get(k) for k in ("check_attention_vs_reference","check_fused_encoder_vs_unfused","check_embedding_kernel_vs_candle","check_readback_lagged_vs_plain","attention_kernel","useful_tflops")})'
for shape in V1 SG; do
  for envs in "" "SCFOUNDRY_EVENT_TRACKING=1"; do
    echo "check $shape [${envs:-default}]"
    # shellcheck disable=SC2086
    env $envs timeout 120 "$B" __bench-encoder ${!shape} --cells 256 --batch 64 --dtype bf16 --order sorted --activation relu --check --repeat 1 2>>"$OUT/err.txt" | python3 -c "$keys"
  done
done
# geneformer's embed on the GPU (the task path: gpu/cuda.rs start) against transformers' embeddings
W=$(mktemp -d); cp tests/fixtures/geneformer/pbmc68k_50.h5ad "$W/cells.h5ad"; FX=$PWD/tests/fixtures/geneformer/v1
( cd "$W" && for p in f32 bf16; do timeout 120 "$B" embed -m geneformer -d cells.h5ad -o gf_$p.h5ad --model-dir "$FX" --device cuda --precision $p --batch-size 8 > /dev/null 2>&1; echo "embed $p rc=$?"; done )
python3 bench/geneformer_embed_vs_reference.py "$W"
ONLY=geneformer_v1,scgpt bash bench/env_ab_gpu.sh "$OUT/ab" "$B" 3 "before:BIN=$A" "tracking:SCFOUNDRY_EVENT_TRACKING=1" "now:"
ONLY=geneformer_v2,uce_33l bash bench/env_ab_gpu.sh "$OUT/ab_big" "$B" 2 "before:BIN=$A" "now:"
