#!/usr/bin/env bash
# Build scfoundry and run the main job on the demo data: PCA embedding of real PBMCs.
# Extra arguments go to `scfoundry embed` (e.g. --n-comps 30).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/toolchain.sh
cargo run --release --quiet -- embed --method pca --data demo/pbmc68k_counts.h5ad --out demo/out/pbmc68k_counts.pca.h5ad "$@"
