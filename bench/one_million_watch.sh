#!/usr/bin/env bash
# bench/one_million.sh under a wall-clock cap: prints the progress and the process tree's
# resident memory every 15 s, and the peak seen, so a run cut by a time limit still reports
# how far it got and how much memory it had taken.   bench/one_million_watch.sh BIN SECONDS
set -uo pipefail
exe=${1:?BIN}; cap=${2:-560}; work=/tmp/onem
mkdir -p "$work"
[ -f "$work/emb_1000000.h5ad" ] || python3 scripts/make_synthetic_embedding.py --cells 1000000 --dims 50 --out "$work/emb_1000000.h5ad"
"$exe" benchmark --data "$work/emb_1000000.h5ad" --embedding X_emb --label-key cell_type --batch-key batch \
  --neighbors approx --batch-max-cells 200000 --seed 0 \
  --metrics isolated_labels,kmeans,silhouette_label,clisi,bras,ilisi,kbet,graph_connectivity \
  --out "$work/out" --runs-dir "$work/runs" > "$work/log.txt" 2>&1 &
pid=$!; t0=$(date +%s); peak=0
while kill -0 $pid 2>/dev/null; do
  rss=$(ps -o rss= --ppid $pid -p $pid | awk '{s+=$1} END {print s+0}')
  [ "$rss" -gt "$peak" ] && peak=$rss
  el=$(( $(date +%s) - t0 ))
  echo "t=${el}s rss=$((rss/1024))MB peak=$((peak/1024))MB | $(tr '\r' '\n' < "$work/log.txt" | grep -v '^\s*$' | tail -1 | cut -c1-150)"
  [ $el -ge "$cap" ] && { kill $pid; echo "stopped at the ${cap}s cap"; break; }
  sleep 15
done
echo "peak RSS seen: $((peak/1024)) MB"; tr '\r' '\n' < "$work/log.txt" | grep -v '^\s*$' | tail -5
