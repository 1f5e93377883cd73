#!/usr/bin/env bash
# The full-size check on a GPU machine: scGPT (whole-human shape), UCE (33 layers) and
# Geneformer V1 and V2 at their released sizes with random weights in the upstream file formats
# (bench/fullsize_checkpoints.py), each run through `scfoundry embed` on the GPU in f32 and bf16.
# Reports per run: exit code, wall time, the output's shape, host peak RSS and the GPU memory
# (the allocator's own peak from report.json, and nvidia-smi's largest reading, every 50 ms);
# then, per model, how far the bf16 embeddings are from the f32 ones (lowest cosine over cells).
#
#   bash bench/fullsize_gpu.sh OUT_DIR     # needs dist/cuda/scfoundry, python3 with torch and h5py
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: fullsize_gpu.sh OUT_DIR}
mkdir -p "$OUT"
B=$PWD/${BIN:-dist/cuda/scfoundry}; export SCFOUNDRY_NO_PROGRESS=1
export LD_LIBRARY_PATH="/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
W=$(mktemp -d); R=$(mktemp -d)
python3 bench/fullsize_checkpoints.py "$W" | tee "$OUT/checkpoints.jsonl"
cp demo/pbmc68k_counts.h5ad "$R/cells.h5ad"                  # 700 cells, gene symbols (scGPT, UCE)
cp tests/fixtures/geneformer/pbmc68k_50.h5ad "$R/gf.h5ad"     # 50 cells, Ensembl ids (Geneformer)
run() {
  local name=$1; shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 50 > "$OUT/$name.gpumem" 2>/dev/null & local smi=$!
  local t0; t0=$(date +%s.%N)
  ( cd "$R" && timeout 300 "$B" "$@" ) > "$OUT/$name.log" 2>&1; local rc=$?
  local t1; t1=$(date +%s.%N)
  kill $smi 2>/dev/null; wait $smi 2>/dev/null
  local rep; rep=$(grep -o "run folder: [^ ]*" "$OUT/$name.log" | head -1 | cut -d' ' -f3)
  [[ -n "$rep" && $rep != /* ]] && rep="$R/$rep"
  [[ -n "$rep" && -f "$rep/report.json" ]] && cp "$rep/report.json" "$OUT/$name.report.json"
  python3 - "$name" "$rc" "$t0" "$t1" "$OUT" <<'PY'
import json, sys, os
name, rc, t0, t1, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
r = {"run": name, "rc": rc, "wall_s": round(t1 - t0, 2)}
try:
    rep = json.load(open(f"{out}/{name}.report.json"))
    t = rep["tasks"][0]["result"]
    r.update(n_obs=t["n_obs"], dim=t["dim"], output=os.path.basename(t["output"]), host_peak_rss_mb=round(rep["max_peak_rss"] / 2**20), gpu=rep.get("gpu"))
except Exception as e:
    r["report"] = f"none ({e})"
try:
    r["nvidia_smi_peak_mib"] = max(int(l) for l in open(f"{out}/{name}.gpumem") if l.strip().isdigit())
except Exception:
    pass
print(json.dumps(r), flush=True)
PY
  [[ $rc == 0 ]] || tail -5 "$OUT/$name.log"
}
for p in f32 bf16; do
  run scgpt_$p --weights-dir "$W" embed -m scgpt -d cells.h5ad -o scgpt_$p.h5ad --device cuda --precision $p
  run uce_$p --weights-dir "$W" embed -m uce -d cells.h5ad -o uce_$p.h5ad --device cuda --precision $p
  run gf_v1_$p embed -m geneformer -d gf.h5ad -o gf_v1_$p.h5ad --model-dir "$W/geneformer_v1" --device cuda --precision $p
  run gf_v2_$p embed -m geneformer -d gf.h5ad -o gf_v2_$p.h5ad --model-dir "$W/geneformer_v2" --device cuda --precision $p
done | tee "$OUT/runs.jsonl"
python3 - "$R" <<'PY' | tee "$OUT/bf16_vs_f32.txt"
import sys, h5py, numpy as np
for m, key in (("scgpt", "X_scgpt"), ("uce", "X_uce"), ("gf_v1", "X_geneformer"), ("gf_v2", "X_geneformer")):
    try:
        a = h5py.File(f"{sys.argv[1]}/{m}_f32.h5ad", "r")["obsm/" + key][()].astype(np.float64)
        b = h5py.File(f"{sys.argv[1]}/{m}_bf16.h5ad", "r")["obsm/" + key][()].astype(np.float64)
    except Exception as e:
        print(m, "missing:", e); continue
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    rel = np.linalg.norm(a - b, axis=1) / np.linalg.norm(a, axis=1)
    print(f"{m}: {a.shape[0]} cells x {a.shape[1]}, finite {np.isfinite(a).all() and np.isfinite(b).all()}, bf16 vs f32: lowest cosine {cos.min():.6f}, largest relative error {rel.max():.2e}")
PY
rm -rf "$W"
