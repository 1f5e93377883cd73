#!/usr/bin/env bash
# Two scfoundry binaries against each other on a GPU machine, interleaved (A B A B) so that the
# card's clock, which moves between calls, moves both alike: `__bench-encoder` at the four
# full-size encoder shapes (packed, bf16, random weights with layer norms at 1 and 0, real token lengths) and
# scGPT's own model, with the bf16 matrix ceiling before and after. Prints one line a run, then
# each shape's mean useful TFLOP/s per binary and B/A (bench/env_ab_gpu.sh does the work).
#
#   bash bench/ab_encoder_gpu.sh OUT_DIR BINARY_A BINARY_B [REPEATS]
#   ONLY=geneformer_v1,scgpt bash bench/ab_encoder_gpu.sh ...      # some shapes only
# A binary may be a script that sets an environment variable and execs scfoundry, for an A/B of
# one binary's two paths (SCFOUNDRY_FUSED_NORM=0, SCFOUNDRY_ATTENTION=portable).
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: ab_encoder_gpu.sh OUT_DIR BINARY_A BINARY_B [REPEATS]}; A=${2:?}; B=${3:?}; N=${4:-2}
# bench/env_ab_gpu.sh with the two binaries as its variants (all four encoder shapes unless ONLY)
ONLY=${ONLY:-geneformer_v1,scgpt,scgpt_model,geneformer_v2,uce_33l} exec bash bench/env_ab_gpu.sh "$OUT" "$A" "$N" "A:" "B:BIN=$B"
