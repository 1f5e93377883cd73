#!/usr/bin/env bash
# Every kernel of one `__bench-encoder` pass under Nsight Compute (device time of each launch,
# from gpu__time_duration, at the card's own clocks and with warm caches: --clock-control none
# --cache-control none), summed by kernel name and by batch, so a pass's GPU time can be set
# against its wall time (run the same arguments without ncu for that). ncu serialises the
# launches, so only the per-kernel times are meaningful, not the wall time of this run.
#
#   bash bench/ncu_kernels.sh OUT_DIR NAME [__bench-encoder args...]   # needs dist/cuda/scfoundry-bench and ncu
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: ncu_kernels.sh OUT_DIR NAME ARGS...}; NAME=${2:?}; shift 2
mkdir -p "$OUT"
export LD_LIBRARY_PATH="/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}" SCFOUNDRY_NO_PROGRESS=1
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
"$NCU" --metrics gpu__time_duration.sum --clock-control none --cache-control none --csv --print-units base --log-file "$OUT/$NAME.csv" \
  dist/cuda/scfoundry-bench __bench-encoder "$@" --repeat 1 > "$OUT/$NAME.json" 2> "$OUT/$NAME.err"
echo "ncu rc $? for $NAME"
python3 - "$OUT/$NAME.csv" <<'PY'
import csv, sys, collections, re
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]; rows = rows[1:]
ki, vi = head.index("Kernel Name"), head.index("Metric Value")
seq = [(re.sub(r"\(.*", "", r[ki])[:60], float(r[vi].replace(",", "")) / 1e3) for r in rows]
# a batch starts at its embedding: the embedding kernel (scGPT's own: norm_add), or candle's first gather
first = lambda n: n.startswith("embed_layer_norm") or n.startswith("norm_add_bf16") or n == "is_u32_bf16"
starts = [i for i, (n, _) in enumerate(seq) if first(n) and not (i > 0 and first(seq[i - 1][0]))]
if len(starts) < 2:
    sys.exit("no batches found")
# the warm-up batch (the first) left out: the timed pass is from the second batch on
pass_ = seq[starts[1]:]
per = [sum(t for _, t in seq[a:b]) for a, b in zip(starts[1:], starts[2:] + [len(seq)])]
tot = sum(t for _, t in pass_)
print("kernels in the pass %d (%d batches), device time %.3f ms; per batch ms: %s" % (len(pass_), len(per), tot / 1e3, " ".join("%.2f" % (x / 1e3) for x in per)))
by = collections.Counter(); n = collections.Counter()
for k, t in pass_:
    k = "cuBLASLt GEMMs (nvjet)" if k.startswith("nvjet") else k
    by[k] += t; n[k] += 1
for k, v in by.most_common():
    print("  %9.3f ms %5.1f%% %6d x  %s" % (v / 1e3, 100 * v / tot, n[k], k))
PY
