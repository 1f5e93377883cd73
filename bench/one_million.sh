#!/usr/bin/env bash
# Score one million synthetic cells x 50 dimensions with `scfoundry benchmark`, the whole default
# metric set including PCR comparison (against obsm['X_pre'], the cells before integration, via
# --pre-integrated), no --batch-max-cells cap; report wall time, peak memory and each step's time.
# Targets on a 16-core node: under 120 s and under 8 GB. Needs python3 with numpy + h5py.
#
#   bench/one_million.sh SCFOUNDRY_BINARY [WORKDIR] [CELLS] [EXTRA BENCHMARK ARGS...]
#
# Neighbours: --neighbors auto (NN-descent, seed 0, above 150,000 cells; exact with --device
# cuda). KMeans: the one-run value plus the default 5-seed spread; add `--kmeans-seeds 1` as an
# extra argument to time the run without the spread. `--device cuda` as an extra argument puts
# the O(n²) passes on the GPU (a CUDA build); results.json's dense_passes then lists them.
set -euo pipefail
exe=${1:?usage: bench/one_million.sh SCFOUNDRY_BINARY [WORKDIR] [CELLS] [EXTRA ARGS...]}
work=${2:-/tmp/onem}
cells=${3:-1000000}
shift $(( $# < 3 ? $# : 3 ))
mkdir -p "$work"
data="$work/emb_${cells}.h5ad"
if [ ! -f "$data" ] || ! python3 -c "import h5py,sys; sys.exit(0 if 'X_pre' in h5py.File('$data','r')['obsm'] else 1)"; then
  t=$(date +%s.%N)
  python3 "$(dirname "$0")/../scripts/make_synthetic_embedding.py" --cells "$cells" --dims 50 --out "$data"
  echo "generated $data in $(awk -v a="$t" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s ($(du -h "$data" | cut -f1))"
fi
echo "machine: $(nproc) CPUs, $(free -g | awk '/Mem:/{print $2}') GiB; load $(cut -d' ' -f1-3 /proc/loadavg)"
rm -rf "$work/out"
/usr/bin/time -v "$exe" benchmark --data "$data" --embedding X_emb --label-key cell_type --batch-key batch \
  --pre-integrated X_pre --seed 0 "$@" \
  --out "$work/out" --runs-dir "$work/runs" --quiet 2> "$work/time.txt"
grep -E "Elapsed|Maximum resident|User time|System time|Percent of CPU" "$work/time.txt"
python3 - "$work/out/results.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
r = d["results"][0]
print(f"neighbours: {d['neighbors']['search']} (asked: {d['neighbors'].get('requested')}); PCR against {d['x_pre'].get('source')}")
print("| step | seconds |\n|---|---:|")
for s in r.get("step_seconds", []):
    print(f"| {s['step']} | {s['seconds']:.1f} |")
print("| metric | value |\n|---|---:|")
for k, v in r["metrics"].items():
    print(f"| {k} | {v['value'] if v['value'] is None else round(v['value'], 4)} |")
sp = r.get("kmeans_seed_spread")
if sp:
    print(f"KMeans seeds {sp['seeds']}: NMI {sp['nmi_summary']}, ARI {sp['ari_summary']}")
PY
