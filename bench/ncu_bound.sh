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
#   START: a Python regex on kernel names; the window then starts START_OFFSET [0] launches from
#     the first launch that matches it (found by a first pass that times the first LIST_COUNT
#     [4000] launches), so it lands on the model's forward pass, not on the random weights'
#     initialisation; LAUNCH_SKIP is then ignored
#
# On Hopper the warpgroup products (wgmma: cuBLASLt's nvjet kernels, our sm90 attention) run on
# the tensor pipe that sm__pipe_tensor_op_gmma_cycles_active counts, not the HMMA one: both are
# read where this ncu knows them.
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
skip=${LAUNCH_SKIP:-0}
if [[ -n ${START:-} ]]; then
  "$NCU" --metrics gpu__time_duration.sum --csv --print-units base --launch-count "${LIST_COUNT:-4000}" \
    --log-file "$OUT/$NAME.list.csv" "$@" > "$OUT/$NAME.list.out" 2> "$OUT/$NAME.list.err"
  skip=$(python3 bench/ncu_bound.py --first "$START" "$OUT/$NAME.list.csv") || {
    echo "ncu_bound: no launch of the first ${LIST_COUNT:-4000} matches START=$START" >&2
    grep -h '==ERROR==' "$OUT/$NAME.list.out" "$OUT/$NAME.list.err" 2>/dev/null | head -3 >&2
    exit 1
  }
  skip=$(( skip + ${START_OFFSET:-0} )); (( skip < 0 )) && skip=0
  echo "ncu_bound: $NAME's window starts at launch $skip (START=$START)" >&2
fi
gmma=""
"$NCU" --query-metrics 2>/dev/null | grep -q '^sm__pipe_tensor_op_gmma_cycles_active' && gmma=,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
METRICS=gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_issued.avg.pct_of_peak_sustained_active,${PIPE_METRICS:-sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active}$gmma
"$NCU" --metrics "$METRICS" --clock-control none --csv --print-units base --launch-skip "$skip" \
  --launch-count "${LAUNCH_COUNT:-60}" "${filter[@]}" --log-file "$OUT/$NAME.csv" "$@" > "$OUT/$NAME.out" 2> "$OUT/$NAME.err"
rc=$?
echo "ncu rc $rc for $NAME" >&2
# ncu's own errors (no permission for the counters: ERR_NVGPUCTRPERM, an unknown metric, ...)
grep -h '==ERROR==' "$OUT/$NAME.out" "$OUT/$NAME.err" 2>/dev/null | head -3 >&2
python3 bench/ncu_bound.py "$OUT/$NAME.csv" | tee "$OUT/$NAME.txt"
