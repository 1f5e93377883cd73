#!/usr/bin/env bash
# What bounds each kernel of a GPU command: Nsight Compute's speed-of-light and pipe counters
# for LAUNCH_COUNT launches after LAUNCH_SKIP, summed by kernel (cuBLASLt's nvjet kernels as one
# group), each counter weighted by the kernel's device time. Prints, per kernel group: its share
# of the device time, SM throughput, memory throughput, DRAM throughput, issue slots busy, and
# the tensor (HMMA/GMMA) and FMA pipes' utilisation, all in % of peak (ncu's definitions), and
# the group whose counter is highest. A kernel whose highest counter is 70% or more is bound by
# that resource; below, by latency or occupancy (ncu's own reading of speed of light).
#
#   bash bench/ncu_bound.sh OUT_DIR NAME -- COMMAND [ARGS...]
#   LAUNCH_SKIP [0]  LAUNCH_COUNT [60]  NCU [ncu on PATH, else /usr/local/cuda*/bin/ncu]
#   KERNELS: an ncu --kernel-name filter (regex:...), default all
#
# ncu replays each launch once a counter pass, so the command runs far slower under it: time the
# command without ncu for its figures. --clock-control none leaves the card at its own clocks.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: ncu_bound.sh OUT_DIR NAME -- COMMAND...}; NAME=${2:?}; shift 2
[[ ${1:-} == -- ]] && shift
mkdir -p "$OUT"
NCU=${NCU:-$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)}
[[ -x $NCU ]] || { echo "ncu_bound: no ncu (set NCU)" >&2; exit 1; }
filter=(); [[ -n ${KERNELS:-} ]] && filter=(--kernel-name "$KERNELS")
METRICS=gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_issued.avg.pct_of_peak_sustained_active,${PIPE_METRICS:-sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active}
"$NCU" --metrics "$METRICS" --clock-control none --csv --print-units base --launch-skip "${LAUNCH_SKIP:-0}" \
  --launch-count "${LAUNCH_COUNT:-60}" "${filter[@]}" --log-file "$OUT/$NAME.csv" "$@" > "$OUT/$NAME.out" 2> "$OUT/$NAME.err"
echo "ncu rc $? for $NAME" >&2
python3 bench/ncu_bound.py "$OUT/$NAME.csv" | tee "$OUT/$NAME.txt"
