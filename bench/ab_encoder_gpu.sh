#!/usr/bin/env bash
# Two scfoundry binaries against each other on the device, interleaved (A B A B) so that the
# card's clock, which moves between calls, moves both alike: `__bench-encoder` at issue #5's four
# full shapes (packed, bf16, random weights with layer norms at 1 and 0, real token lengths) and
# scGPT's own model, with the bf16 matrix ceiling before and after. Prints one line a run, then
# each shape's mean useful TFLOP/s per binary and B/A.
#
#   bash bench/ab_encoder_gpu.sh OUT_DIR BINARY_A BINARY_B [REPEATS]
#   ONLY=geneformer_v1,scgpt bash bench/ab_encoder_gpu.sh ...      # some shapes only
# A binary may be a script that sets an environment variable and execs scfoundry, for an A/B of
# one binary's two paths (SCFOUNDRY_FUSED_NORM=0, SCFOUNDRY_GEMM_TUNE=0).
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: ab_encoder_gpu.sh OUT_DIR BINARY_A BINARY_B [REPEATS]}; A=${2:?}; B=${3:?}; N=${4:-2}
mkdir -p "$OUT"; rm -f "$OUT"/*.A.jsonl "$OUT"/*.B.jsonl; export SCFOUNDRY_NO_PROGRESS=1
real=bench/token_lengths_wu2020.txt; uce="$OUT/uce_lengths.txt"; yes 1072 | head -200 > "$uce"
source bench/issue5_shapes.sh
ceiling() { timeout 120 "$1" __bench-encoder --arch gemm --dtype bf16 --repeat 3 --lengths $real 2>>"$OUT/err.txt" | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print('ceiling', round(d['ceiling_tflops'],1), 'half', round(d['half_ceiling_tflops'],1))"; }
ceiling "$A"
for s in "${shapes[@]}"; do
  name=${s%%|*}; args=${s#*|}
  [[ -n ${ONLY:-} && ",$ONLY," != *",$name,"* ]] && continue
  for i in $(seq "$N"); do
    for which in A B; do
      bin=$A; [[ $which == B ]] && bin=$B
      # shellcheck disable=SC2086
      line=$(timeout 200 "$bin" __bench-encoder $args --dtype bf16 --order sorted --activation relu --repeat 3 2>>"$OUT/err.txt") || line='{"error":"failed"}'
      echo "$line" >> "$OUT/$name.$which.jsonl"
      echo "$line" | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print('$name', '$which', round(d.get('cells_per_s',0),1), round(d.get('useful_tflops',0),1), d.get('error',''))"
    done
  done
done
ceiling "$A"
# per shape: each binary's mean useful TFLOP/s over its runs, and B against A
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
for a in sorted(glob.glob(os.path.join(out, "*.A.jsonl"))):
    name = os.path.basename(a)[: -len(".A.jsonl")]
    mean = {}
    for side in "AB":
        runs = [json.loads(l) for l in open(os.path.join(out, f"{name}.{side}.jsonl")) if l.strip()]
        tf = [r["useful_tflops"] for r in runs if "useful_tflops" in r]
        mean[side] = sum(tf) / len(tf) if tf else None
    if mean["A"] and mean["B"]:
        print(f"{name}: A {mean['A']:.1f}, B {mean['B']:.1f} useful TFLOP/s, B/A {mean['B'] / mean['A']:.3f}")
    else:
        print(f"{name}: a side has no successful run (see {out}/err.txt)")
PY
