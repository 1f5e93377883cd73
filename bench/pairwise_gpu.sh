#!/usr/bin/env bash
# The benchmark's O(n²) passes on a GPU (`scfoundry benchmark --device cuda`): agreement with the
# CPU and each side's seconds on synthetic cells (`scfoundry-bench __bench-pairwise`), then the
# whole default metric set on CPU and GPU at SMALL cells (values side by side), then one million
# cells on the GPU (bench/one_million.sh with --device cuda). Needs a CUDA build of both binaries
# and python3 with numpy + h5py.
#
#   bench/pairwise_gpu.sh SCFOUNDRY SCFOUNDRY_BENCH [WORKDIR] [SMALL] [LARGE]
set -euo pipefail
exe=${1:?usage: bench/pairwise_gpu.sh SCFOUNDRY SCFOUNDRY_BENCH [WORKDIR] [SMALL] [LARGE]}
bench=${2:?usage: bench/pairwise_gpu.sh SCFOUNDRY SCFOUNDRY_BENCH [WORKDIR] [SMALL] [LARGE]}
work=${3:-/tmp/pairwise}
small=${4:-100000}
large=${5:-1000000}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
echo "machine: $(nproc) CPUs, $(free -g | awk '/Mem:/{print $2}') GiB; $("$exe" --version | head -1)"
for cells in 20000 "$small"; do
  "$bench" __bench-pairwise --cells "$cells" --dims 50 --k 90 --labels 10 --seed 0
done
"$bench" __bench-pairwise --cells "$large" --dims 50 --k 90 --labels 10 --seed 0 --gpu-only
data="$work/emb_${small}.h5ad"
[ -f "$data" ] || python3 "$here/../scripts/make_synthetic_embedding.py" --cells "$small" --dims 50 --seed 0 --out "$data"
for dev in cuda cpu; do
  rm -rf "$work/out_$dev"
  /usr/bin/time -v "$exe" benchmark --data "$data" --embedding X_emb --label-key cell_type --batch-key batch \
    --pre-integrated X_pre --neighbors exact --seed 0 --device "$dev" --out "$work/out_$dev" --runs-dir "$work/runs" --quiet 2> "$work/time_$dev.txt"
  echo "$dev: $(grep -E "Elapsed" "$work/time_$dev.txt" | awk '{print $NF}') wall, $(grep -E "Maximum resident" "$work/time_$dev.txt" | awk '{print $NF}') KB peak"
done
python3 - "$work/out_cuda/results.json" "$work/out_cpu/results.json" <<'PY'
import json, sys
g, c = (json.load(open(p)) for p in sys.argv[1:3])
print("| metric | GPU passes | CPU | difference |\n|---|---:|---:|---:|")
for k, v in g["results"][0]["metrics"].items():
    a, b = v["value"], c["results"][0]["metrics"][k]["value"]
    print(f"| {v['name']} | {a:.6f} | {b:.6f} | {abs(a - b):.2g} |")
for k in ("Batch correction", "Bio conservation", "Total"):
    a, b = g["results"][0]["aggregates"][k]["value"], c["results"][0]["aggregates"][k]["value"]
    print(f"| {k} | {a:.6f} | {b:.6f} | {abs(a - b):.2g} |")
for name, d in (("GPU", g), ("CPU", c)):
    steps = ", ".join(f"{s['step']} {s['seconds']:.1f}" for s in d["results"][0]["step_seconds"])
    print(f"{name} steps (s): {steps}")
PY
bash "$here/one_million.sh" "$exe" "$work/onem" "$large" --device cuda
python3 - "$work/onem/out/results.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
tot = {}
for p in d["dense_passes"]["passes"]:
    k = (p["what"], p["device"]); tot[k] = tot.get(k, 0) + p["seconds"]
print("dense passes (summed seconds):", {f"{w} [{dv}]": round(s, 1) for (w, dv), s in tot.items()}, "fallbacks:", d["dense_passes"]["fallbacks"])
PY
