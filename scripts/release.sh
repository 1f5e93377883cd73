#!/usr/bin/env bash
# The release archives:
#   dist/scfoundry-<version>-x86_64-linux.tar.gz             the CPU build (glibc 2.28 and newer)
#   dist/scfoundry-<version>-<flavour>-x86_64-linux.tar.gz   a GPU build (e.g. --flavour cuda12)
#   dist/scfoundry-<version>-aarch64-linux.tar.gz            the CPU build for 64-bit ARM (--arch aarch64)
# each with a .sha256 beside it (`sha256sum -c` checks it). An archive holds bin/scfoundry (the
# product alone: the benchmark binary `scfoundry-bench` stays out), a README for the archive
# (scripts/release-README.md: install and first command), LICENSE-MIT, LICENSE-APACHE,
# THIRD-PARTY-NOTICES (scripts/third_party.py: the bundled C libraries, the CUDA runtime for a
# GPU flavour, every Rust crate from `cargo metadata`), methods/, weights.toml and the Nextflow
# pipeline. Prints the archive's file list and fails if it holds anything but the one binary.
#
#   scripts/release.sh                                  # cargo zigbuild (glibc 2.28), then pack
#   scripts/release.sh --arch aarch64                   # the same, cross-compiled for aarch64
#   scripts/release.sh --binary PATH                    # pack a CPU binary built already
#   scripts/release.sh --binary dist/cuda/scfoundry --flavour cuda13
#                                                       # a GPU build (scripts/build-cuda.sh); the
#                                                       # CUDA licence comes from its PyPI runtime
#   ... --cuda-license PATH/License.txt --out DIR       # the CUDA EULA text to include; output folder
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=; OUT=dist; FLAVOUR=cpu; ARCH=; CUDA_LICENSE=
while [[ $# -gt 0 ]]; do
  case $1 in
    --binary) BIN=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --flavour) FLAVOUR=$2; shift 2 ;;
    --arch) ARCH=$2; shift 2 ;;
    --cuda-license) CUDA_LICENSE=$2; shift 2 ;;
    *) echo "release.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ $FLAVOUR =~ ^(cpu|cuda[0-9]+)$ ]] || { echo "release.sh: --flavour is cpu or cudaNN (e.g. cuda12), not $FLAVOUR" >&2; exit 2; }
if [[ -z $BIN ]]; then
  [[ $FLAVOUR == cpu ]] || { echo "release.sh: a GPU flavour needs --binary (scripts/build-cuda.sh builds it)" >&2; exit 2; }
  # shellcheck source=scripts/toolchain.sh
  source scripts/toolchain.sh
  # shellcheck source=scripts/zig.sh
  [[ ${ARCH:-x86_64} =~ ^(x86_64|aarch64)$ ]] || { echo "release.sh: --arch is x86_64 or aarch64, not $ARCH" >&2; exit 2; }
  export SCF_RELEASE_TRIPLE=${ARCH:-x86_64}-unknown-linux-gnu
  # shellcheck source=scripts/zig.sh
  source scripts/zig.sh
  cargo zigbuild --release --locked --target "$SCF_ZIG_TARGET" --bin scfoundry
  BIN=$CARGO_TARGET_DIR/$SCF_RELEASE_TRIPLE/release/scfoundry
  scripts/check-glibc.sh "$BIN" "$SCF_GLIBC_FLOOR" >/dev/null
fi
[[ -x $BIN ]] || { echo "release.sh: no binary at $BIN" >&2; exit 1; }
# the archive's architecture is the binary's own (its ELF header)
case $(readelf -h "$BIN" | sed -n 's/^ *Machine: *//p') in
  *X86-64*) BIN_ARCH=x86_64 ;;
  AArch64) BIN_ARCH=aarch64 ;;
  *) echo "release.sh: $BIN is neither an x86_64 nor an aarch64 binary" >&2; exit 1 ;;
esac
[[ -z $ARCH || $ARCH == "$BIN_ARCH" ]] || { echo "release.sh: --arch $ARCH but $BIN is $BIN_ARCH" >&2; exit 1; }
ARCH=$BIN_ARCH-linux
if [[ $FLAVOUR != cpu && -z $CUDA_LICENSE ]]; then
  CUDA_LICENSE=$(ls "${SCFOUNDRY_CACHE:-$HOME/.cache/scfoundry}"/cuda-venv/lib/python3*/site-packages/nvidia_cuda_runtime-*.dist-info/licenses/License.txt 2>/dev/null | head -1 || true)
  [[ -n $CUDA_LICENSE ]] || { echo "release.sh: --flavour $FLAVOUR needs --cuda-license PATH (License.txt of the nvidia-cuda-runtime wheel the binary was built with)" >&2; exit 1; }
fi
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
TAG=$ARCH; [[ $FLAVOUR == cpu ]] || TAG=$FLAVOUR-$ARCH
NAME=scfoundry-$VERSION-$TAG
GLIBC=$(scripts/check-glibc.sh "$BIN" | sed 's/^GLIBC_//')
if [[ $FLAVOUR == cpu ]]; then
  FLAVOUR_NAME="CPU build"; GPU_LINE="It runs on the CPU; the GPU builds are separate archives."
else
  FLAVOUR_NAME="GPU build, CUDA ${FLAVOUR#cuda}"
  GPU_LINE="It runs on the CPU anywhere and on NVIDIA GPUs whose driver supports CUDA ${FLAVOUR#cuda} (the support table is in the source's docs/install.md); \`scfoundry doctor\` reports the driver, cuBLAS and each GPU."
fi
STAGE=$(mktemp -d); trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/$NAME/bin" "$OUT"
cp "$BIN" "$STAGE/$NAME/bin/scfoundry"
sed -e "s/@VERSION@/$VERSION/g" -e "s/@ARCHIVE_TAG@/$TAG/g" -e "s/@FLAVOUR_NAME@/$FLAVOUR_NAME/g" \
    -e "s/@GLIBC@/$GLIBC/g" -e "s/@ARCH@/$BIN_ARCH/g" -e "s|@GPU_LINE@|$GPU_LINE|g" scripts/release-README.md > "$STAGE/$NAME/README.md"
cp LICENSE-MIT LICENSE-APACHE weights.toml main.nf nextflow.config nextflow_schema.json "$STAGE/$NAME/"
python3 scripts/third_party.py --flavour "$FLAVOUR" --triple "$BIN_ARCH-unknown-linux-gnu" ${CUDA_LICENSE:+--cuda-license "$CUDA_LICENSE"} "$STAGE/$NAME/THIRD-PARTY-NOTICES"
cp -r methods conf modules workflows "$STAGE/$NAME/"
tar -C "$STAGE" --owner=0 --group=0 --numeric-owner -czf "$OUT/$NAME.tar.gz.tmp" "$NAME"
mv "$OUT/$NAME.tar.gz.tmp" "$OUT/$NAME.tar.gz"
(cd "$OUT" && sha256sum "$NAME.tar.gz" > "$NAME.tar.gz.sha256")
LIST=$(tar -tzf "$OUT/$NAME.tar.gz")
echo "$LIST"
# the product binary only: no benchmark binary, no second executable under bin/
bins=$(grep -c "^$NAME/bin/." <<<"$LIST" || true)
if grep -q "scfoundry-bench" <<<"$LIST" || [[ $bins != 1 ]] || ! grep -qx "$NAME/bin/scfoundry" <<<"$LIST"; then
  echo "release.sh: $OUT/$NAME.tar.gz must hold bin/scfoundry alone" >&2
  exit 1
fi
echo "release.sh: $OUT/$NAME.tar.gz (needs GLIBC_$GLIBC), $OUT/$NAME.tar.gz.sha256"
