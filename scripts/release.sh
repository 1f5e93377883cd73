#!/usr/bin/env bash
# The release artifact: dist/scfoundry-<version>-<target>.tar.gz holding the `scfoundry` binary
# (the product alone: the benchmark binary `scfoundry-bench` stays out), README.md,
# CONTRIBUTING.md, methods/, weights.toml and the Nextflow pipeline. Prints the archive's file
# list and fails if it holds anything but the one binary.
#
#   scripts/release.sh                                  # cargo build --release --bin scfoundry, then pack
#   scripts/release.sh --binary dist/cuda/scfoundry     # pack the GPU build (scripts/build-cuda.sh)
#   scripts/release.sh --binary PATH --out DIR          # pack a built binary into DIR
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=; OUT=dist; TARGET=x86_64-linux
while [[ $# -gt 0 ]]; do
  case $1 in
    --binary) BIN=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --target) TARGET=$2; shift 2 ;;
    *) echo "release.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [[ -z $BIN ]]; then
  # shellcheck source=scripts/toolchain.sh
  source scripts/toolchain.sh
  cargo build --release --locked --bin scfoundry
  BIN=$CARGO_TARGET_DIR/release/scfoundry
fi
[[ -x $BIN ]] || { echo "release.sh: no binary at $BIN" >&2; exit 1; }
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
NAME=scfoundry-$VERSION-$TARGET
STAGE=$(mktemp -d); trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/$NAME/bin" "$OUT"
cp "$BIN" "$STAGE/$NAME/bin/scfoundry"
cp README.md CONTRIBUTING.md weights.toml main.nf nextflow.config nextflow_schema.json "$STAGE/$NAME/"
cp -r methods conf modules workflows "$STAGE/$NAME/"
tar -C "$STAGE" -czf "$OUT/$NAME.tar.gz.tmp" "$NAME"
mv "$OUT/$NAME.tar.gz.tmp" "$OUT/$NAME.tar.gz"
LIST=$(tar -tzf "$OUT/$NAME.tar.gz")
echo "$LIST"
# the product binary only: no benchmark binary, no second executable under bin/
bins=$(grep -c "^$NAME/bin/." <<<"$LIST" || true)
if grep -q "scfoundry-bench" <<<"$LIST" || [[ $bins != 1 ]] || ! grep -qx "$NAME/bin/scfoundry" <<<"$LIST"; then
  echo "release.sh: $OUT/$NAME.tar.gz must hold bin/scfoundry alone" >&2
  exit 1
fi
echo "release.sh: $OUT/$NAME.tar.gz"
