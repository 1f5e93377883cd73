#!/usr/bin/env bash
# The kept kernels in the encoder, on a GPU: the fused encoder checked against candle's ops
# and the attention against the plain reference at the four encoder shapes (--check, first
# batch), with the Hopper attention kernel and with the portable one
# (SCFOUNDRY_ATTENTION=portable), then, given the binary before, an A/B of it (A) and the binary
# after (B) through bench/ab_encoder_gpu.sh. (Formerly bench/fixed_max_gpu.sh, for
# the attention with maxima fixed by the first key tile.)
#
#   bash bench/encoder_checks_gpu.sh OUT_DIR [BINARY_BEFORE]      # needs dist/cuda/scfoundry (after)
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: encoder_checks_gpu.sh OUT_DIR [BINARY_BEFORE]}; A=${2:-}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-} SCFOUNDRY_NO_PROGRESS=1
L=bench/token_lengths_wu2020.txt; U="$OUT/uce_lengths.txt"; yes 1072 | head -200 > "$U"
for kernel in sm90 portable; do
echo "== checks (after), attention kernel $kernel"
for s in "geneformer_v1|--layers 6 --hidden 256 --heads 4 --ffn 512 --max-len 2048 --lengths $L --batch 64" \
         "scgpt|--layers 12 --hidden 512 --heads 8 --ffn 512 --max-len 1200 --lengths $L --batch 64" \
         "geneformer_v2|--layers 12 --hidden 768 --heads 12 --ffn 3072 --max-len 4096 --lengths $L --batch 16" \
         "uce_33l|--layers 33 --hidden 1280 --heads 20 --ffn 5120 --max-len 1536 --lengths $U --batch 16"; do
  # shellcheck disable=SC2086
  SCFOUNDRY_ATTENTION=$kernel timeout 120 dist/cuda/scfoundry-bench __bench-encoder --arch bert ${s#*|} --cells 128 --dtype bf16 --order sorted --activation relu --check --repeat 1 2>>"$OUT/err.txt" | python3 -c "
import json,sys; x=json.loads(sys.stdin.read()); print('${s%%|*}', x.get('attention_kernel'), round(x.get('useful_tflops', 0), 1), {k:v for k,v in x.items() if k.startswith('check')})"
done
done
[[ -z $A ]] && exit 0
echo "== A/B (A: before, B: after)"
bash bench/ab_encoder_gpu.sh "$OUT/ab" "$A" dist/cuda/scfoundry 2
