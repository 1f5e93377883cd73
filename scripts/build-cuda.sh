#!/usr/bin/env bash
# Build scfoundry with the `cuda` feature on a machine without a CUDA toolkit, and leave a binary
# that runs on any Linux x86_64 machine with an NVIDIA driver for CUDA 13.0 or newer.
#
#   scripts/build-cuda.sh            # -> dist/cuda/scfoundry
#   scripts/build-cuda.sh --check    # cargo check only (what CI runs when SCFOUNDRY_CI_CUDA=1)
#   scripts/build-cuda.sh --cuda 12  # -> dist/cuda12/scfoundry: CUDA 12 drivers, Ampere and newer
#   scripts/build-cuda.sh --cuda 12 --zig   # the same, linked by zig against glibc 2.28
#                                    #    (scripts/build-cuda12.sh does it; docs/gpu.md, "The CUDA 12 build")
#
# How (docs/gpu.md has the reasons):
#   1. the CUDA 13.0 compiler and runtime come from PyPI wheels (ci/requirements-cuda.txt) in
#      ~/.cache/scfoundry/cuda-venv; 13.0 exactly, since a 13.0 driver cannot JIT newer PTX;
#   2. candle-core 0.11.1 and cudarc 0.19.10 are copied from cargo's registry into
#      ~/.cache/scfoundry/cuda-vendor and patched with cuda/patches/*.patch (our changes: dynamic
#      loading of the driver and cuBLAS, and the allocation hook behind `--allocator`), then used
#      through `[patch.crates-io]` given on the command line; Cargo.lock is restored afterwards;
#   3. libcudart is linked statically through a linker script, so the binary needs no CUDA library
#      to start; the driver, cuBLAS and cuRAND are opened at run time.
# Kernels are compiled for CUDA_COMPUTE_CAP (default 90, Hopper). The build folder is
# $CARGO_TARGET_DIR (default ~/.cache/scfoundry/target-cuda): keep it, a cold build of candle's
# CUDA kernels takes tens of minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=${SCFOUNDRY_CACHE:-$HOME/.cache/scfoundry}
MODE=build
CUDA_MAJOR=13
ZIG=
while [[ $# -gt 0 ]]; do
  case $1 in
    --check) MODE=check ;;
    --cuda) CUDA_MAJOR=${2:?--cuda takes 12 or 13}; shift ;;
    --zig) ZIG=1 ;;
    *) echo "build-cuda: unknown argument $1 (--check, --cuda 12|13, --zig)" >&2; exit 2 ;;
  esac
  shift
done
if [[ $CUDA_MAJOR == 12 ]]; then
  if [[ $MODE == check ]]; then exec scripts/build-cuda12.sh --check
  elif [[ -n $ZIG ]]; then exec scripts/build-cuda12.sh --zig
  else exec scripts/build-cuda12.sh; fi
fi
[[ -z $ZIG ]] || { echo "build-cuda: --zig applies to --cuda 12 (the CUDA 13 build links nvcc-compiled host code and libcudart)" >&2; exit 2; }
[[ $CUDA_MAJOR == 13 ]] || { echo "build-cuda: --cuda takes 12 or 13" >&2; exit 2; }

# shellcheck source=scripts/toolchain.sh
source scripts/toolchain.sh

VENV=$CACHE/cuda-venv
if ! "$VENV/bin/python" -c "import nvidia" 2>/dev/null || [[ ! -x $(ls -d "$VENV"/lib/python3*/site-packages 2>/dev/null | head -1)/nvidia/cu13/bin/nvcc ]]; then
  echo "build-cuda: installing the CUDA 13.0 compiler from PyPI into $VENV" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -r ci/requirements-cuda.txt
fi
SITE=$(ls -d "$VENV"/lib/python3*/site-packages | head -1)
CU=$SITE/nvidia/cu13
[[ -x $CU/bin/nvcc ]] || { echo "build-cuda: no nvcc under $CU/bin (ci/requirements-cuda.txt)" >&2; exit 1; }

# The registry copies of the two crates we patch (cargo fetch brings them).
cargo fetch --locked >/dev/null
REG=$(cargo metadata --format-version 1 --locked --features cuda 2>/dev/null | python3 -c '
import json,sys,os
m=json.load(sys.stdin)
for p in m["packages"]:
    if (p["name"],p["version"]) in (("cudarc","0.19.10"),("candle-core","0.11.1")):
        print(p["name"]+"="+os.path.dirname(p["manifest_path"]))')
VENDOR=$CACHE/cuda-vendor
mkdir -p "$VENDOR"
declare -A PATCHED
for line in $REG; do
  name=${line%%=*}; src=${line#*=}; base=$(basename "$src")
  patch_file=$ROOT/cuda/patches/$base.patch
  stamp=$VENDOR/$base.patched
  want=$(sha256sum "$patch_file" | cut -c1-64)
  if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
    rm -rf "${VENDOR:?}/$base"
    cp -a "$src" "$VENDOR/$base"
    patch -s -p2 --no-backup-if-mismatch -d "$VENDOR/$base" < "$patch_file"
    echo "$want" > "$stamp"
  fi
  PATCHED[$name]=$VENDOR/$base
done
[[ -n ${PATCHED[cudarc]:-} && -n ${PATCHED[candle-core]:-} ]] || { echo "build-cuda: cudarc/candle-core not found in cargo metadata" >&2; exit 1; }

# Static libcudart through a linker script named libcudart.so.
LINKDIR=$CACHE/cuda-link
mkdir -p "$LINKDIR"
echo "INPUT($CU/lib/libcudart_static.a -lrt -ldl -lpthread)" > "$LINKDIR/libcudart.so"

export PATH=$CU/bin:$PATH
export CUDA_HOME=$CU CUDA_PATH=$CU CUDA_ROOT=$CU
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export RUSTFLAGS="-L native=$LINKDIR"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR_CUDA:-$CACHE/target-cuda}

# this checkout's own copy: builds in other worktrees at the same time keep theirs
LOCK_BACKUP=$(mktemp "${TMPDIR:-/tmp}/scfoundry-Cargo.lock.XXXXXX")
cp Cargo.lock "$LOCK_BACKUP"
trap 'cp "$LOCK_BACKUP" "$ROOT/Cargo.lock" && rm -f "$LOCK_BACKUP"' EXIT
PATCH_ARGS=(--config "patch.crates-io.cudarc.path=\"${PATCHED[cudarc]}\""
            --config "patch.crates-io.candle-core.path=\"${PATCHED[candle-core]}\"")
if [[ $MODE == check ]]; then
  cargo check --release --features cuda "${PATCH_ARGS[@]}" --bin scfoundry --bin scfoundry-bench
  exit 0
fi
cargo build --release --features cuda "${PATCH_ARGS[@]}" --bin scfoundry --bin scfoundry-bench
mkdir -p dist/cuda
# scfoundry-bench: the encoder benchmarks (`__bench-*`), built with the same flags
for b in scfoundry scfoundry-bench; do
  cp "$CARGO_TARGET_DIR/release/$b" dist/cuda/$b.tmp
  strip dist/cuda/$b.tmp
  mv dist/cuda/$b.tmp dist/cuda/$b
done
echo "build-cuda: dist/cuda/scfoundry ($(du -h dist/cuda/scfoundry | cut -f1)); needs: $(ldd dist/cuda/scfoundry | awk '{print $1}' | tr '\n' ' ')"
# The attention kernels, the layer norm and the fused product + layer norm alone
# (bench/attention_kernels.cu, bench/layer_norm_kernels.cu, bench/gemm_layer_norm_kernels.cu,
# and bench/pdl_check.cu:
# checked and timed on a GPU machine); built here so that they keep compiling. Hopper only: the
# wgmma kernels need sm_90a.
if [[ $CUDA_COMPUTE_CAP == 90 ]]; then
  nvcc -gencode arch=compute_90a,code=sm_90a -O3 -L"$CU/lib" -o dist/cuda/attention_kernels bench/attention_kernels.cu
  echo "build-cuda: dist/cuda/attention_kernels"
  nvcc -gencode arch=compute_90a,code=sm_90a -O3 -L"$CU/lib" -o dist/cuda/layer_norm_kernels bench/layer_norm_kernels.cu
  echo "build-cuda: dist/cuda/layer_norm_kernels"
  nvcc -gencode arch=compute_90a,code=sm_90a -O3 -L"$CU/lib" -o dist/cuda/gemm_layer_norm_kernels bench/gemm_layer_norm_kernels.cu
  echo "build-cuda: dist/cuda/gemm_layer_norm_kernels"
  # programmatic dependent launch alone (bench/README.md, "Kernel harnesses"): as machine code, and as PTX
  # the driver compiles at load, as scfoundry's own kernels are loaded
  nvcc -gencode arch=compute_90a,code=sm_90a -O3 -L"$CU/lib" -o dist/cuda/pdl_check bench/pdl_check.cu
  nvcc -gencode arch=compute_90a,code=compute_90a -O3 -L"$CU/lib" -o dist/cuda/pdl_check_ptx bench/pdl_check.cu
  echo "build-cuda: dist/cuda/pdl_check, dist/cuda/pdl_check_ptx"
fi
