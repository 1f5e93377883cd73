#!/usr/bin/env bash
# The fused product + residual + layer norm for 256-wide layers (gpu/gemm_layer_norm.rs) on the
# device: the kernel alone (dist/cuda/gemm_layer_norm_kernels), Geneformer V1's shape with
# --check --profile on both paths, then an A/B of the same binary with and without it
# (SCFOUNDRY_FUSED_NORM=0), V1 through bench/ab_encoder_gpu.sh and scCello interleaved.
#
#   bash bench/fused_norm_gpu.sh OUT_DIR          # needs dist/cuda/scfoundry and the harness
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: fused_norm_gpu.sh OUT_DIR}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-} SCFOUNDRY_NO_PROGRESS=1
echo "== harness"; dist/cuda/gemm_layer_norm_kernels
unfused="$OUT/scfoundry-unfused-norm"
printf '#!/bin/sh\nSCFOUNDRY_FUSED_NORM=0 exec %s/dist/cuda/scfoundry "$@"\n' "$PWD" > "$unfused"; chmod +x "$unfused"
L=bench/token_lengths_wu2020.txt
V1="--arch bert --layers 6 --hidden 256 --heads 4 --ffn 512 --max-len 2048 --lengths $L --cells 2048 --batch 64 --dtype bf16 --order sorted --activation relu"
echo "== check + profile (fused, then unfused)"
for b in dist/cuda/scfoundry "$unfused"; do
  # shellcheck disable=SC2086
  timeout 120 "$b" __bench-encoder $V1 --check --profile --repeat 1 2>>"$OUT/err.txt" | python3 -c "
import json,sys; x=json.loads(sys.stdin.read()); print({k:v for k,v in x.items() if k.startswith('check') or k.startswith('profile') or k in ('cells_per_s','useful_tflops')})"
done
echo "== A/B (A: without the kernel, B: with it)"
ONLY=geneformer_v1 bash bench/ab_encoder_gpu.sh "$OUT/ab" "$unfused" dist/cuda/scfoundry 3
for i in 1 2; do for b in "$unfused" dist/cuda/scfoundry; do
  timeout 120 "$b" __bench-encoder --arch sccello --lengths $L --cells 2048 --batch 64 --dtype bf16 --order sorted --repeat 3 2>>"$OUT/err.txt" | python3 -c "
import json,sys; x=json.loads(sys.stdin.read()); print('sccello $(basename "$b")', round(x['cells_per_s'],1), round(x['useful_tflops'],1))"
done; done
