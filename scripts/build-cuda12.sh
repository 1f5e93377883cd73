#!/usr/bin/env bash
# The CUDA 12 flavour of the GPU build (`scripts/build-cuda.sh --cuda 12` runs this): a binary for
# NVIDIA drivers for CUDA 12.0 or newer and cards of compute capability 8.0 (Ampere) or newer.
#
#   scripts/build-cuda12.sh           # -> dist/cuda12/scfoundry (and the fatbin listing)
#   scripts/build-cuda12.sh --check   # cargo check only
#   scripts/build-cuda12.sh --zig     # linked by zig against glibc 2.28 (scripts/zig.sh), build
#                                     # folder $CARGO_TARGET_DIR_CUDA12 (default .../target-cuda12-zig)
#
# What differs from the CUDA 13 build (docs/gpu.md, "The CUDA 12 build", has the reasons):
#   1. the kernels are compiled with NVRTC 12.8 from PyPI (ci/requirements-cuda12.txt, in
#      ~/.cache/scfoundry/cuda12-venv) by cuda/nvrtc_fatbin.py into fatbins: machine code for sm_80
#      and sm_90, PTX for compute_90 (newer cards), and our Hopper kernels for sm_90a alone;
#   2. candle-kernels 0.11.1 is vendored too and patched (cuda/patches/cuda12/) to embed those
#      fatbins, without its quantized, GGUF and MoE kernels; candle-core loads module images
#      from bytes; cudarc is built for the CUDA 12.8 API and also opens cuBLAS 13;
#   3. nothing links libcudart (the CUDA 13 build needs it only for candle's MoE kernels).
# The build folder is $CARGO_TARGET_DIR_CUDA12 (default ~/.cache/scfoundry/target-cuda12).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=${SCFOUNDRY_CACHE:-$HOME/.cache/scfoundry}
MODE=build
[[ "${1:-}" == "--check" ]] && MODE=check
ZIG=; [[ "${1:-}" == "--zig" ]] && ZIG=1
# machine code for these, PTX for the last; the Hopper kernels (*_sm90.cu) for sm_90a alone
SASS=80,90
PTX=90

# shellcheck source=scripts/toolchain.sh
source scripts/toolchain.sh

VENV=$CACHE/cuda12-venv
SITE=$(ls -d "$VENV"/lib/python3*/site-packages 2>/dev/null | head -1 || true)
if [[ -z $SITE || ! -f $SITE/nvidia/cuda_nvrtc/lib/libnvrtc.so.12 || ! -x $SITE/nvidia/cu13/bin/fatbinary ]] \
   || ! cmp -s ci/requirements-cuda12.txt "$VENV/requirements.txt"; then
  echo "build-cuda12: installing NVRTC 12.8 and the fatbin tools from PyPI into $VENV" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -r ci/requirements-cuda12.txt
  cp ci/requirements-cuda12.txt "$VENV/requirements.txt"
  SITE=$(ls -d "$VENV"/lib/python3*/site-packages | head -1)
fi
NV=$SITE/nvidia
CUOBJDUMP=$(ls "$NV"/cu13/bin/cuobjdump "$NV"/cuda_cuobjdump/bin/cuobjdump 2>/dev/null | head -1 || true)

# `nvrtc-fatbin`, what build.rs calls for our kernels, as it calls nvcc in the CUDA 13 build
BIN=$CACHE/cuda12-bin
mkdir -p "$BIN"
cat > "$BIN/nvrtc-fatbin.tmp" <<EOF
#!/bin/sh
exec "$VENV/bin/python" "$ROOT/cuda/nvrtc_fatbin.py" --nvrtc "$NV/cuda_nvrtc/lib/libnvrtc.so.12" \\
  --fatbinary "$NV/cu13/bin/fatbinary" -I "$ROOT/cuda/nvrtc-include" -I "$NV/cuda_runtime/include" \\
  -I "$NV/cuda_cccl/include" "\$@"
EOF
chmod +x "$BIN/nvrtc-fatbin.tmp"
mv "$BIN/nvrtc-fatbin.tmp" "$BIN/nvrtc-fatbin"
export PATH=$BIN:$PATH

# The registry copies of the crates we patch (cargo fetch brings them).
cargo fetch --locked >/dev/null
REG=$(cargo metadata --format-version 1 --locked --features cuda12 2>/dev/null | python3 -c '
import json,sys,os
m=json.load(sys.stdin)
for p in m["packages"]:
    if (p["name"],p["version"]) in (("cudarc","0.19.10"),("candle-core","0.11.1"),("candle-kernels","0.11.1")):
        print(p["name"]+"="+os.path.dirname(p["manifest_path"]))')
VENDOR=$CACHE/cuda12-vendor
mkdir -p "$VENDOR"
declare -A PATCHED
for line in $REG; do
  name=${line%%=*}; src=${line#*=}; base=$(basename "$src")
  # the CUDA 13 build's patch (if any), then this flavour's
  patches=()
  [[ -f $ROOT/cuda/patches/$base.patch ]] && patches+=("$ROOT/cuda/patches/$base.patch")
  patches+=("$ROOT/cuda/patches/cuda12/$base.patch")
  stamp=$VENDOR/$base.patched
  want=$(cat "${patches[@]}" | sha256sum | cut -c1-64)
  if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
    rm -rf "${VENDOR:?}/$base"
    cp -a "$src" "$VENDOR/$base"
    for p in "${patches[@]}"; do
      patch -s -p2 --no-backup-if-mismatch -d "$VENDOR/$base" < "$p"
    done
    echo "$want" > "$stamp"
  fi
  PATCHED[$name]=$VENDOR/$base
done
[[ -n ${PATCHED[cudarc]:-} && -n ${PATCHED[candle-core]:-} && -n ${PATCHED[candle-kernels]:-} ]] \
  || { echo "build-cuda12: cudarc/candle-core/candle-kernels not found in cargo metadata" >&2; exit 1; }

# candle's kernels, compiled here (the patched candle-kernels only embeds them): a module is
# compiled again when its source, a header, the compile script or the shim headers are newer.
KERNELS=$CACHE/cuda12-kernels/candle-kernels-0.11.1
mkdir -p "$KERNELS"
KSRC=${PATCHED[candle-kernels]}/src
todo=()
for m in affine binary cast conv fill indexing reduce sort ternary unary; do
  out=$KERNELS/$m.fatbin
  if [[ ! -s $out ]] || [[ -n $(find "$KSRC/$m.cu" "$KSRC"/*.cuh "$ROOT/cuda/nvrtc_fatbin.py" "$ROOT/cuda/nvrtc-include" \
       ci/requirements-cuda12.txt -newer "$out" 2>/dev/null | head -1) ]]; then
    todo+=("$KSRC/$m.cu")
  fi
done
if [[ ${#todo[@]} -gt 0 && $MODE == build ]]; then
  echo "build-cuda12: compiling ${#todo[@]} of candle's kernel modules (sm_$SASS, PTX compute_$PTX)" >&2
  nvrtc-fatbin --sass "$SASS" --ptx "$PTX" --jobs "${SCFOUNDRY_NVRTC_JOBS:-2}" --out-dir "$KERNELS" "${todo[@]}"
fi
# `cargo check` needs the files to exist, not to be right
for m in affine binary cast conv fill indexing reduce sort ternary unary; do
  [[ -f $KERNELS/$m.fatbin ]] || : > "$KERNELS/$m.fatbin"
done
export CANDLE_KERNELS_FATBIN_DIR=$KERNELS
export SCFOUNDRY_CUDA_SASS=$SASS SCFOUNDRY_CUDA_PTX=$PTX
export SCFOUNDRY_CUDA_VERSION=12.8
# The CUDA 13 build's flags, unchanged, so that a copy of its build folder is reused; nothing in
# this flavour links libcudart.
export RUSTFLAGS="-L native=$CACHE/cuda-link"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR_CUDA12:-$CACHE/target-cuda12}
OUTBIN=$CARGO_TARGET_DIR/release
CARGO_BUILD=(cargo build --release)
if [[ -n $ZIG ]]; then
  # zig compiles the C parts and links against glibc 2.28's symbol versions, as the CPU release
  # build does (scripts/test.sh); no host C++ or libcudart is linked in this flavour, so nothing
  # else needs the build machine's glibc
  # shellcheck source=scripts/zig.sh
  source scripts/zig.sh
  unset RUSTFLAGS
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR_CUDA12:-$CACHE/target-cuda12-zig}
  OUTBIN=$CARGO_TARGET_DIR/$SCF_RELEASE_TRIPLE/release
  CARGO_BUILD=(cargo zigbuild --release --target "$SCF_ZIG_TARGET")
fi

# this checkout's own copy: builds in other worktrees at the same time keep theirs
LOCK_BACKUP=$(mktemp "${TMPDIR:-/tmp}/scfoundry-Cargo.lock.XXXXXX")
cp Cargo.lock "$LOCK_BACKUP"
trap 'cp "$LOCK_BACKUP" "$ROOT/Cargo.lock" && rm -f "$LOCK_BACKUP"' EXIT
PATCH_ARGS=(--config "patch.crates-io.cudarc.path=\"${PATCHED[cudarc]}\""
            --config "patch.crates-io.candle-core.path=\"${PATCHED[candle-core]}\""
            --config "patch.crates-io.candle-kernels.path=\"${PATCHED[candle-kernels]}\"")
if [[ $MODE == check ]]; then
  cargo check --release --features cuda12 "${PATCH_ARGS[@]}" --bin scfoundry --bin scfoundry-bench
  exit 0
fi
"${CARGO_BUILD[@]}" --features cuda12 "${PATCH_ARGS[@]}" --bin scfoundry --bin scfoundry-bench
mkdir -p dist/cuda12
for b in scfoundry scfoundry-bench; do
  cp "$OUTBIN/$b" dist/cuda12/$b.tmp
  strip dist/cuda12/$b.tmp
  mv dist/cuda12/$b.tmp dist/cuda12/$b
done
echo "build-cuda12: dist/cuda12/scfoundry ($(du -h dist/cuda12/scfoundry | cut -f1)); needs: $(ldd dist/cuda12/scfoundry | awk '{print $1}' | tr '\n' ' ')"
if [[ -n $CUOBJDUMP ]]; then
  # what the binary carries: the kernels are byte arrays, not an .nv_fatbin section, so
  # cuda/list_fatbins.py cuts each fatbin out and lists its machine code (ELF) and PTX
  "$VENV/bin/python" cuda/list_fatbins.py "$CUOBJDUMP" dist/cuda12/scfoundry > dist/cuda12/fatbin-contents.txt
  echo "build-cuda12: dist/cuda12/fatbin-contents.txt: $(tail -1 dist/cuda12/fatbin-contents.txt)"
fi
