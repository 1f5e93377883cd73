#!/usr/bin/env bash
# The CUDA 12 build (scripts/build-cuda.sh --cuda 12: fatbins for sm_80 + sm_90 + PTX 9.0)
# against the CUDA 13 build (sm_90 PTX), in one run on one card:
#   1. `--version` and `doctor` of the CUDA 12 build;
#   2. correctness: every transformer model's `embed` on the GPU (f32 and bf16) against the CPU
#      (bench/models_gpu.sh) with the CUDA 12 build, on its default kernels, on the forced portable
#      path (SCFOUNDRY_ATTENTION=portable SCFOUNDRY_FUSED_NORM=0: an A100's path) and with
#      CUDA_FORCE_PTX_JIT=1 (its PTX loads and runs); the fused encoder's own --check at the four
#      full-size shapes on both kernel paths;
#   3. speed: `__bench-encoder` at the full-size shapes, CUDA 13 (A) against CUDA 12 (B),
#      interleaved (bench/ab_encoder_gpu.sh), then the CUDA 12 build's portable path against its
#      default (bench/env_ab_gpu.sh).
#
#   bash bench/cuda_builds_gpu.sh OUT_DIR CUDA13_DIR CUDA12_DIR [PART]   # PART: checks | speed | all
# Each *_DIR holds scfoundry and scfoundry-bench. Needs python3 with numpy + h5py.
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: cuda_builds_gpu.sh OUT_DIR CUDA13_DIR CUDA12_DIR [PART]}; C13=$(realpath "${2:?}"); C12=$(realpath "${3:?}"); PART=${4:-all}
mkdir -p "$OUT"; OUT=$(realpath "$OUT")
export LD_LIBRARY_PATH="/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}" SCFOUNDRY_NO_PROGRESS=1
if [[ $PART != speed ]]; then
  echo "== versions"; "$C13/scfoundry" --version; "$C12/scfoundry" --version
  echo "== doctor (CUDA 12 build)"; "$C12/scfoundry" doctor 2>&1 | tail -25
  echo "== every embedded fatbin loaded by the driver alone, as machine code and with CUDA_FORCE_PTX_JIT=1"
  python3 bench/fatbin_jit_gpu.py "$C12/scfoundry"
  # (CUDA_FORCE_PTX_JIT=1 on a whole run fails in cuBLAS's own start-up, CUBLAS_STATUS_INTERNAL_ERROR,
  # in either build: it applies to cuBLAS's kernels too)
  for v in "default:" "portable:SCFOUNDRY_ATTENTION=portable SCFOUNDRY_FUSED_NORM=0"; do
    [[ -n ${SKIP_MODELS:-} ]] && break
    echo "== models vs CPU, CUDA 12 build, ${v%%:*}"
    # shellcheck disable=SC2086
    env ${v#*:} BIN="$C12/scfoundry" bash bench/models_gpu.sh "$OUT/models-${v%%:*}" 2>&1 | tail -12
  done
  echo "== fused encoder --check at the full-size shapes (CUDA 12 build)"
  real=bench/token_lengths_wu2020.txt; uce="$OUT/uce_lengths.txt"; yes 1072 | head -200 > "$uce"
  # shellcheck source=bench/encoder_shapes.sh
  source bench/encoder_shapes.sh
  for kernel in sm90 portable; do
    for s in "${shapes[@]}"; do
      [[ ${s%%|*} == scgpt_model ]] && continue
      args=${s#*|}; args=${args/--cells [0-9]*--batch/--batch}
      # shellcheck disable=SC2086
      SCFOUNDRY_ATTENTION=$kernel timeout 120 "$C12/scfoundry-bench" __bench-encoder $args --cells 128 --dtype bf16 --order sorted --activation relu --check --repeat 1 2>>"$OUT/err.txt" | python3 -c "
import json,sys; x=json.loads(sys.stdin.read()); print('${s%%|*}', '$kernel', x.get('attention_kernel'), {k:v for k,v in x.items() if k.startswith('check')})" || echo "${s%%|*} $kernel: failed (see $OUT/err.txt)"
    done
  done
fi
if [[ $PART != checks ]]; then
  echo "== speed: A = CUDA 13 build, B = CUDA 12 build"
  bash bench/ab_encoder_gpu.sh "$OUT/ab" "$C13/scfoundry-bench" "$C12/scfoundry-bench" 2 2>&1 | tail -12
  echo "== speed: CUDA 12 build, default against the forced portable path"
  ONLY=geneformer_v1,scgpt,geneformer_v2,uce_33l bash bench/env_ab_gpu.sh "$OUT/portable" "$C12/scfoundry-bench" 2 \
    "default:" "portable:SCFOUNDRY_ATTENTION=portable,SCFOUNDRY_FUSED_NORM=0" 2>&1 | tail -10
fi
