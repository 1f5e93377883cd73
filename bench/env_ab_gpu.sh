#!/usr/bin/env bash
# One scfoundry binary under several environments (the switches of its GPU paths:
# SCFOUNDRY_FUSED_NORM, SCFOUNDRY_ATTENTION),
# interleaved round by round so that the card's clock, which moves between calls, moves all of
# them alike: `__bench-encoder` at the four full-size encoder shapes (bench/encoder_shapes.sh),
# the bf16 matrix ceiling before and after. Prints one line a run, then each shape's mean useful
# TFLOP/s per variant and its ratio to the first variant.
#
#   bash bench/env_ab_gpu.sh OUT_DIR BINARY ROUNDS "name:VAR=1,VAR2=0" "name2:VAR=0" ...
#   bash bench/env_ab_gpu.sh OUT_DIR BINARY 3 "before:BIN=dist/before/scfoundry" "now:"   # against another build
#   bash bench/env_ab_gpu.sh OUT_DIR BINARY 3 "b64:" "b100:--batch=100"   # another value of a shape's flag
#   ONLY=geneformer_v1,scgpt bash bench/env_ab_gpu.sh ...      # some shapes only (default: these two)
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: env_ab_gpu.sh OUT_DIR BINARY ROUNDS VARIANT...}; BIN=${2:?}; N=${3:?}; shift 3
[[ $# -ge 1 ]] || { echo "env_ab_gpu.sh: name at least one variant, name:VAR=value,..." >&2; exit 2; }
mkdir -p "$OUT"; rm -f "$OUT"/*.jsonl; export SCFOUNDRY_NO_PROGRESS=1
export LD_LIBRARY_PATH="/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
ONLY=${ONLY:-geneformer_v1,scgpt}
real=bench/token_lengths_wu2020.txt; uce="$OUT/uce_lengths.txt"; yes 1072 | head -200 > "$uce"
source bench/encoder_shapes.sh
ceiling() { timeout 120 "$BIN" __bench-encoder --arch gemm --dtype bf16 --repeat 3 --lengths $real 2>>"$OUT/err.txt" | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print('ceiling', round(d['ceiling_tflops'],1), 'half', round(d['half_ceiling_tflops'],1))"; }
# run ENVLIST ARGS...: the binary under the variant's environment (BIN=path in the list runs
# another binary, for an A/B against an earlier build; --flag=value replaces the shape's --flag,
# e.g. "b100:--batch=100")
run() {
  local envs=$1 bin=$BIN kv; shift; local e=(SCFOUNDRY_NO_PROGRESS=1) args=("$@") flags=() i
  for kv in ${envs//,/ }; do
    if [[ $kv == BIN=* ]]; then bin=${kv#BIN=}
    elif [[ $kv == --*=* ]]; then flags+=("${kv%%=*}" "${kv#*=}")
    else e+=("$kv"); fi
  done
  for ((i = 0; i < ${#flags[@]}; i += 2)); do
    local kept=() j
    for ((j = 0; j < ${#args[@]}; j++)); do
      if [[ ${args[j]} == "${flags[i]}" ]]; then j=$((j + 1)); else kept+=("${args[j]}"); fi
    done
    args=("${kept[@]}" "${flags[i]}" "${flags[i + 1]}")
  done
  env "${e[@]}" timeout "${STEP_TIMEOUT:-200}" "$bin" __bench-encoder "${args[@]}" 2>>"$OUT/err.txt"
}
ceiling
for s in "${shapes[@]}"; do
  name=${s%%|*}; args=${s#*|}
  [[ ",$ONLY," != *",$name,"* ]] && continue
  for i in $(seq "$N"); do
    for v in "$@"; do
      vname=${v%%:*}; envs=${v#*:}
      # shellcheck disable=SC2086
      line=$(run "$envs" $args --dtype bf16 --order sorted --activation relu --repeat 3) || line='{"error":"failed"}'
      echo "$line" >> "$OUT/$name.$vname.jsonl"
      echo "$line" | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print('$name', '$vname', round(d.get('cells_per_s',0),1), round(d.get('useful_tflops',0),1), 'queue', round(d.get('host_queue_s',0)*1e3,1), 'wait', round(d.get('host_wait_s',0)*1e3,1), d.get('error',''))"
    done
  done
done
ceiling
python3 - "$OUT" "$@" <<'PY'
import json, os, sys
out, variants = sys.argv[1], [v.split(":", 1)[0] for v in sys.argv[2:]]
shapes = sorted({f.rsplit(".", 2)[0] for f in os.listdir(out) if f.endswith(".jsonl")})
for name in shapes:
    mean = {}
    for v in variants:
        p = os.path.join(out, f"{name}.{v}.jsonl")
        tf = [json.loads(l).get("useful_tflops") for l in open(p) if l.strip()] if os.path.exists(p) else []
        tf = [t for t in tf if t]
        mean[v] = sum(tf) / len(tf) if tf else None
    base = mean[variants[0]]
    print(name + ": " + ", ".join(f"{v} {m:.1f}" + (f" ({m / base:.3f})" if base else "") if m else f"{v} failed" for v, m in mean.items()))
PY
