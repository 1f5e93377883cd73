#!/usr/bin/env bash
# Embedding memory does not grow with the cell count: embed the first 0.2M, 1M and all 2M rows
# of one synthetic file (2,000,000 cells x 6,000 genes, ~1,100 stored values a cell: 2.2 billion
# values, int64 indptr and indices, 26.6 GB; 22 min to generate on 2 loaded cores) with genept
# and scimilarity, and report wall time and peak RSS (`/usr/bin/time -v`) of each. Needs python3
# with numpy + h5py (the generator, the models) and ~45 GB free under WORKDIR while generating.
#
#   bench/bounded_memory.sh SCFOUNDRY_BINARY [WORKDIR] [CELLS] [ROWS,ROWS,...]
#   (defaults: /tmp/bigbench, 2000000, 200000,1000000,<CELLS>; BOUNDED_PCA=1 adds pca on all rows)
#
# "The first N rows" of the same file: each run is one shard task run directly,
# `scfoundry __task SPEC`, with the spec `embed --shards` writes into runs/<id>/tasks/<n>/task.json
# and step {"kind":"project","shard":0,"start":0,"end":N}: what each shard process of a sharded
# run does (read its rows block by block, embed, write work/shard0.f32 and a checksum), without
# the merge; its rows equal an unsharded `embed`'s byte for byte. Shards are whole blocks of the
# grid laid over the file, so SCFOUNDRY_BLOCK_ROWS=1000 (~1.1M stored values a block, about the
# default's ~1M) puts a block boundary at every N.
# Models: seeded random ones over the file's genes (bench/random_models.py): a GenePT table of
# 64-d float64 vectors over all 6,000 genes, and a SCimilarity encoder 2,000 genes -> 128 -> 64
# -> 32 (the first 2,000 var_names; a model's genes are matched by name, the others dropped).
set -euo pipefail
exe=$(realpath "${1:?usage: bench/bounded_memory.sh SCFOUNDRY_BINARY [WORKDIR] [CELLS] [ROWS,...]}")
work=${2:-/tmp/bigbench}
cells=${3:-2000000}
rows=${4:-200000,1000000,$cells}
py=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work"
data="$work/counts_${cells}x6000.h5ad"
if [ ! -f "$data" ]; then
  df -h "$work"
  t=$(date +%s.%N)
  "$py" "$here/../scripts/make_synthetic.py" --cells "$cells" --genes 6000 --depth 3100 --seed 0 --out "$data"
  echo "generated $data in $(echo "$(date +%s.%N) - $t" | bc) s ($(du -h "$data" | cut -f1))"
fi
[ -d "$work/genept" ] || "$py" "$here/random_models.py" genept "$data" "$work/genept" --dim 64
[ -d "$work/scimilarity" ] || "$py" "$here/random_models.py" scimilarity "$data" "$work/scimilarity" --genes 2000 --hidden 128,64 --latent 32
echo "machine: $(nproc) CPUs, $(free -g | awk '/Mem:/{print $2}') GiB, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load $(cut -d' ' -f1-3 /proc/loadavg)"
export SCFOUNDRY_BLOCK_ROWS=1000

# one shard task: rows 0..N of $data with METHOD; prints method, rows, stored values, wall, peak RSS
shard() {
  local method=$1 n=$2 dir="$work/tasks/$1-$2"
  rm -rf "$dir" && mkdir -p "$dir/work"
  "$py" - "$dir" "$method" "$data" "$work/$method" "$n" "$here/../methods/$method.toml" <<'PY'
import json, sys, tomllib
d, method, data, model, n, toml = sys.argv[1:]
params = {"model_dir": model}
batch = tomllib.load(open(toml, "rb")).get("batch")
if batch:  # the method's default --batch-size, as the planner writes it
    params["batch_size"] = batch["default"]
spec = {"task_id": 1, "name": f"bounded memory {method} {n}", "command": "embed", "method": method,
        "data": data, "out": f"{d}/out.h5ad", "layer": None, "seed": 0, "params": params,
        "quiet": True, "progress": False, "command_line": "bench/bounded_memory.sh",
        "weights_dir": f"{d}/weights", "run_id": "bounded-memory",
        "step": {"kind": "project", "shard": 0, "start": 0, "end": int(n)}, "work": f"{d}/work",
        "gpu": None, "device": {"kind": "cpu", "ordinal": 0, "allocator": {"kind": "async"}},
        "embedding_only": True}
json.dump(spec, open(f"{d}/task.json", "w"), indent=1)
PY
  /usr/bin/time -v "$exe" __task "$dir/task.json" 2> "$dir/time.txt" > "$dir/stdout.txt" || { cat "$dir/time.txt"; return 1; }
  local nnz
  nnz=$("$py" -c "import h5py,sys; print(int(h5py.File(sys.argv[1],'r')['X/indptr'][int(sys.argv[2])]))" "$data" "$n")
  printf '%-12s %9s rows %14s values  wall %-9s peak RSS %s KB  (user %s s, sys %s s)\n' "$method" "$n" "$nnz" \
    "$(grep -F 'Elapsed (wall' "$dir/time.txt" | awk '{print $NF}')" \
    "$(grep -F 'Maximum resident' "$dir/time.txt" | awk '{print $NF}')" \
    "$(grep -F 'User time' "$dir/time.txt" | awk '{print $NF}')" \
    "$(grep -F 'System time' "$dir/time.txt" | awk '{print $NF}')"
}

for method in genept scimilarity; do
  for n in ${rows//,/ }; do shard "$method" "$n"; done
done

if [ "${BOUNDED_PCA:-0}" = 1 ]; then
  unset SCFOUNDRY_BLOCK_ROWS
  /usr/bin/time -v "$exe" embed -m pca -d "$data" -o "$work/pca.h5ad" --embedding-only --runs-dir "$work/runs" --quiet 2> "$work/pca_time.txt"
  echo "pca (whole command, all $cells rows): wall $(grep -F 'Elapsed (wall' "$work/pca_time.txt" | awk '{print $NF}')," \
    "peak RSS $(grep -F 'Maximum resident' "$work/pca_time.txt" | awk '{print $NF}') KB"
fi
