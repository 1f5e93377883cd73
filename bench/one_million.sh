#!/usr/bin/env bash
# Score one million synthetic cells x 50 dimensions with `scfoundry benchmark` and report the
# peak memory (the target: within 24 GB). Needs python3 with numpy + h5py for the generator.
#
#   bench/one_million.sh SCFOUNDRY_BINARY [WORKDIR] [CELLS]
#
# Metrics: the Benchmarker's defaults except PCR comparison (the file has no counts), approximate
# 90-NN (NN-descent, seed 0), batch metrics on a seeded 200,000-cell subsample.
set -euo pipefail
exe=${1:?usage: bench/one_million.sh SCFOUNDRY_BINARY [WORKDIR] [CELLS]}
work=${2:-/tmp/onem}
cells=${3:-1000000}
mkdir -p "$work"
data="$work/emb_${cells}.h5ad"
if [ ! -f "$data" ]; then
  t=$(date +%s.%N)
  python3 "$(dirname "$0")/../scripts/make_synthetic_embedding.py" --cells "$cells" --dims 50 --out "$data"
  echo "generated $data in $(echo "$(date +%s.%N) - $t" | bc) s ($(du -h "$data" | cut -f1))"
fi
echo "machine: $(nproc) CPUs, $(free -g | awk '/Mem:/{print $2}') GiB; load $(cut -d' ' -f1-3 /proc/loadavg)"
/usr/bin/time -v "$exe" benchmark --data "$data" --embedding X_emb --label-key cell_type --batch-key batch \
  --neighbors approx --batch-max-cells 200000 --seed 0 \
  --metrics isolated_labels,kmeans,silhouette_label,clisi,bras,ilisi,kbet,graph_connectivity \
  --out "$work/out" --runs-dir "$work/runs" --quiet 2> "$work/time.txt"
grep -E "Elapsed|Maximum resident|User time|System time|Percent of CPU" "$work/time.txt"
python3 - "$work/out/results.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
r = d["results"][0]
for s in r.get("step_seconds", []):
    print(f"  {s['step']:<40} {s['seconds']:9.1f} s")
for k, v in r["metrics"].items():
    print(f"  {k:<40} {v['value']:.4f}")
PY
