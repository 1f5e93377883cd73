#!/usr/bin/env bash
# The transformer models' `embed` on the GPU against the CPU, in one run: each model's
# committed parity fixture (small configurations, seeded random weights) embeds its fixture cells
# on the CPU in f32, then with --device cuda in f32 and in --precision bf16; the script prints the
# largest relative difference per cell (GPU vs CPU) for each. The fixtures' heads are narrower
# than 64, so the GPU runs take candle's ops (the fused encoder is measured at full shape by
# bench/fused_gpu.sh); what this checks is every model's GPU and bf16 code path end to end.
#
#   bash bench/models_gpu.sh OUT_DIR    # needs dist/cuda/scfoundry (scripts/build-cuda.sh), python3 with h5py and numpy
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: models_gpu.sh OUT_DIR}
mkdir -p "$OUT"
B=${BIN:-dist/cuda/scfoundry}; [[ $B = /* ]] || B=$PWD/$B; F=$PWD/tests/fixtures; export SCFOUNDRY_NO_PROGRESS=1
export LD_LIBRARY_PATH="/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
W=$(mktemp -d)
# scGPT and UCE read a weights folder laid out as weights.toml says
mkdir -p "$W/weights/scgpt/whole_human" "$W/weights/uce/protein_embeddings"
cp "$F"/scgpt/tiny/* "$W/weights/scgpt/whole_human/"
cp "$F/uce/tiny.torch" "$W/weights/uce/33l_8ep_1024t_1280.torch"
cp "$F"/uce/protein_embeddings/* "$W/weights/uce/protein_embeddings/"
cp "$F/uce/species_chrom.csv" "$F/uce/species_offsets.pkl" "$W/weights/uce/"
echo archive > "$W/weights/uce/protein_embeddings.tar.gz"
cp demo/pbmc68k_counts.h5ad "$W/counts.h5ad"
cp "$F/geneformer/pbmc68k_50.h5ad" "$W/cells.h5ad"
# name, data, key, extra arguments
runs=(
  "geneformer cells.h5ad X_geneformer --model-dir $F/geneformer/v1 --batch-size 8"
  "scgpt counts.h5ad X_scgpt --batch-size 16"
  "uce cells.h5ad X_uce --batch-size 8"
  "sccello cells.h5ad X_sccello --model-dir $F/sccello --batch-size 8"
  "langcell cells.h5ad X_langcell --model-dir $F/langcell --batch-size 5"
)
: > "$OUT/models_gpu.log"
for r in "${runs[@]}"; do
  read -r name data key extra <<<"$r"
  for v in "cpu f32" "cuda f32" "cuda bf16"; do
    read -r dev prec <<<"$v"
    # shellcheck disable=SC2086
    (cd "$W" && timeout 180 "$B" --weights-dir "$W/weights" embed -m "$name" -d "$data" -o "$name.$dev.$prec.h5ad" --device "$dev" --precision "$prec" $extra) > "$W/run.log" 2>&1
    rc=$?; cat "$W/run.log" >> "$OUT/models_gpu.log"
    echo "$name $dev $prec rc=$rc" | tee -a "$OUT/models_gpu.log"
    # a failed run's own last words, here rather than only in the log
    [[ $rc == 0 ]] || tail -3 "$W/run.log" | sed 's/^/    /'
  done
done
${PYTHON:-python3} - "$W" <<'PY'
import sys, h5py, numpy as np
w = sys.argv[1]
for name, key in [("geneformer", "X_geneformer"), ("scgpt", "X_scgpt"), ("uce", "X_uce"), ("sccello", "X_sccello"), ("langcell", "X_langcell")]:
    try:
        cpu = h5py.File(f"{w}/{name}.cpu.f32.h5ad", "r")[f"obsm/{key}"][()].astype(np.float64)
    except Exception as e:
        print(f"{name}: no CPU embedding ({e})"); continue
    for p in ("f32", "bf16"):
        try:
            gpu = h5py.File(f"{w}/{name}.cuda.{p}.h5ad", "r")[f"obsm/{key}"][()].astype(np.float64)
        except Exception as e:
            print(f"{name} cuda {p}: no embedding ({e})"); continue
        err = max(np.linalg.norm(g - c) / max(np.linalg.norm(c), 1e-30) for g, c in zip(gpu, cpu))
        cos = min(float(g @ c / (np.linalg.norm(g) * np.linalg.norm(c))) for g, c in zip(gpu, cpu))
        print(f"{name} cuda {p}: {len(cpu)} cells x {cpu.shape[1]}, largest relative difference to the CPU {err:.2e}, lowest cosine {cos:.6f}")
PY
