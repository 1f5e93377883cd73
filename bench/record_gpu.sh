#!/usr/bin/env bash
# The GPU table of record, one family of methods per run: for each method of FAMILY,
#   (a) scfoundry at its default settings (`--precision auto` as methods/<name>.toml resolves it on
#       a GPU, the method's default batch): scfoundry-bench's `__bench-*` command as `embed` runs it;
#   (b) scfoundry at its fastest precision (bf16 where the model's bench path has it) and the best
#       batch of its own sweep (SF_SWEEP below: where the default batch was not the fastest; the
#       default batch elsewhere); the same run as (a) when neither differs from the default;
#   (c) upstream-style PyTorch: bench/<model>_torch.py with upstream's dtype, order and batch;
#   (d) careful PyTorch: bf16 (bf16 weights: what the torch scripts offer), SDPA where the script
#       has a choice, cells sorted by length, the best of a batch sweep (MLP / VAE encoders:
#       page-locked, non-blocking copies and large batches);
#   (e) `scfoundry embed --device cuda --embedding-only` end to end at the defaults on tiled real
#       cells (demo/wu2020_tcells.h5ad by bench/tile_h5ad.py) with a random full-size model
#       (bench/embed_pipeline_gpu.sh for geneformer, scgpt and uce; otherwise the writers of
#       bench/random_models.py, bench/fullsize_checkpoints.py, bench/random_minilm.py);
#   (f) peak GPU memory of that run (the allocator's peak from its report.json; nvidia-smi
#       sampled beside it where the run is made here);
#   (g) accuracy against f32 (bench/precision_fidelity_gpu.sh on wu2020's 200 cells) where the
#       default resolves to bf16; "f32 (exact)" where it is f32.
#   (h) with STEPS containing ncu: what bounds the bench run at the default batch (the default
#       precision, and the fastest where it differs), by Nsight Compute
#       (bench/ncu_bound.sh: each kernel group's share of the device time and its highest
#       throughput counter in % of peak), the window starting at the method's first own kernel
#       (NCU_START below) so that it covers a forward pass, not the random weights' making.
#
#   bash bench/record_gpu.sh list                     # the families, their methods, rough run times
#   bash bench/record_gpu.sh FAMILY OUT_DIR           # on the GPU machine; one family a run
#   DRY_RUN=1 bash bench/record_gpu.sh FAMILY OUT_DIR # print every command, run nothing
#   python3 bench/record_table.py OUT_DIR [OUT_DIR...]  # the markdown table from the runs
#
# Writes OUT_DIR/steps.jsonl (one line a command: its method, what it measures, the command, exit
# code, seconds, logs), OUT_DIR/record.jsonl (one object a method with every measurement above and
# the command that made it; bench/record_table.py --assemble builds it from steps.jsonl),
# OUT_DIR/commands.txt, OUT_DIR/machine-RUN.json and OUT_DIR/logs/. A failing or timed-out command
# is logged and the run goes on. Runs into the same OUT_DIR add to it (STEPS=e2e after
# STEPS=throughput, say): record.jsonl keeps each measurement's latest run.
#
# Environment (defaults in brackets):
#   BIN [dist/cuda12/scfoundry, unpacked from its .xz when only that is there]
#   BENCH_BIN [scfoundry-bench beside BIN, or its .xz]
#   PY [/opt/torch/.venv/bin/python, else python3; PYTHON is read too]: torch, numpy, h5py
#   STEPS ["throughput accuracy e2e"]: which measurements to make; "ncu" (not in the default:
#     it needs ncu and a driver that lets it read the counters) adds (h)
#   STEP_TIMEOUT [300]: seconds a throughput command may run
#   LONG_TIMEOUT [1500]: seconds an accuracy or end-to-end command may run (model writing included)
#   SF_BATCHES: scfoundry's own sweep for (b), every method [per method: SF_SWEEP]
#   BATCHES: the careful PyTorch sweep of every transformer method [per method, "8 16 32 64 128"
#     for most]; MLP_BATCHES ["1024 2048 4096 8192 16384"]: scvi's and scimilarity's;
#     NOVAE_BATCHES ["256 1024 4096"]
#   E2E_CELLS: cells of every end-to-end run [per method: 200,000 for the fast ones, fewer for
#     the slow ones]; E2E_REPEAT [2]: end-to-end runs a method, the fastest kept
#   GPU_INDEX [0]: the card nvidia-smi samples during the end-to-end runs
#   DRY_RUN=1: print the commands only
set -uo pipefail

declare -A FAMILY_METHODS=(
  [bert]="geneformer scgpt" [uce]="uce" [bert-cells]="sccello langcell" [scfoundation]="scfoundation"
  [scprint]="scprint" [c2s]="c2s" [cellfm]="cellfm" [scbert]="scbert" [cellplm]="cellplm"
  [novae]="novae" [mlp]="scimilarity scvi" [cellama]="cellama"
)
FAMILIES=(bert uce bert-cells scfoundation scprint c2s cellfm scbert cellplm novae mlp cellama)
# rough minutes a family takes on an H100 80GB with everything measured (model writing included);
# STEPS=throughput alone took 1-3 minutes a family (bert-cells and cellfm 4-6) on 2026-12-07
declare -A MINUTES=(
  [bert]=9 [uce]=10 [bert-cells]=6 [scfoundation]=4 [scprint]=4 [c2s]=5 [cellfm]=7 [scbert]=6
  [cellplm]=4 [novae]=5 [mlp]=7 [cellama]=3
)

usage() { echo "usage: record_gpu.sh list | FAMILY OUT_DIR   (FAMILY: ${FAMILIES[*]})" >&2; exit 2; }
FAMILY=${1:-}
[[ -n $FAMILY ]] || usage
if [[ $FAMILY == list ]]; then
  printf '%-13s %-22s %s\n' family methods "minutes (rough, H100 80GB)"
  for f in "${FAMILIES[@]}"; do printf '%-13s %-22s ~%s\n' "$f" "${FAMILY_METHODS[$f]}" "${MINUTES[$f]}"; done
  exit 0
fi
[[ -n ${FAMILY_METHODS[$FAMILY]:-} ]] || { echo "unknown family $FAMILY" >&2; usage; }
[[ -n ${2:-} ]] || usage
OUT=$(realpath -m -- "$2")
cd "$(dirname "$0")/.."
DRY=${DRY_RUN:-0}
STEPS=${STEPS:-throughput accuracy e2e}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
LONG_TIMEOUT=${LONG_TIMEOUT:-1500}
E2E_REPEAT=${E2E_REPEAT:-2}
MLP_BATCHES=${MLP_BATCHES:-1024 2048 4096 8192 16384}
NOVAE_BATCHES=${NOVAE_BATCHES:-256 1024 4096}
PY=${PY:-${PYTHON:-$( [[ -x /opt/torch/.venv/bin/python ]] && echo /opt/torch/.venv/bin/python || echo python3 )}}
export SCFOUNDRY_NO_PROGRESS=1
export LD_LIBRARY_PATH="/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
RUN=$(date -u +%Y%m%dT%H%M%SZ)
DATA=demo/wu2020_tcells.h5ad
L=bench/token_lengths_wu2020.txt
W=$OUT/weights                      # random full-size models (precision_fidelity_gpu.sh's CHECKPOINTS)

say() { echo "$*"; [[ $DRY == 1 ]] || echo "$*" >> "$OUT/commands.txt"; }
wants() { [[ " $STEPS " == *" $1 "* ]]; }

# --- JSON lines -----------------------------------------------------------------------------------
jstr() {  # a JSON string
  local s=$1
  s=${s//\\/\\\\}; s=${s//\"/\\\"}; s=${s//$'\t'/\\t}; s=${s//$'\n'/\\n}; s=${s//$'\r'/\\r}
  printf '"%s"' "$s"
}
jmeta() {  # k=v ... -> {"k": "v", ...}
  local out="" kv
  for kv in "$@"; do out+="${out:+, }$(jstr "${kv%%=*}"): $(jstr "${kv#*=}")"; done
  printf '{%s}' "$out"
}
N=0
# the throughput functions also run for STEPS=ncu alone (they hold each method's bench command),
# their throughput measurements then skipped
skipped() { case $1 in sf_default|sf_fastest|torch_upstream|torch_careful|ceiling) ! wants throughput ;; *) return 1 ;; esac; }
# record METHOD FIELD k=v...: a line with no command (what a method is, or "the same as ...")
record() {
  local method=$1 field=$2; shift 2
  skipped "$field" && return 0
  N=$((N + 1))
  say "# $method $field: $*"
  [[ $DRY == 1 ]] && return 0
  printf '{"run": %s, "n": %d, "family": %s, "method": %s, "field": %s, "meta": %s, "command": null}\n' \
    "$(jstr "$RUN")" "$N" "$(jstr "$FAMILY")" "$(jstr "$method")" "$(jstr "$field")" "$(jmeta "$@")" >> "$OUT/steps.jsonl"
}
# step METHOD FIELD LIMIT_S [k=v...] -- COMMAND...: run (or print) one command under `timeout`,
# its output in logs/, one line in steps.jsonl. `sample_gpu=1` samples nvidia-smi's memory.used
# beside it (meta smi= the samples' file).
step() {
  local method=$1 field=$2 limit=$3; shift 3
  skipped "$field" && return 0
  local meta=()
  while [[ $# -gt 0 && $1 != -- ]]; do meta+=("$1"); shift; done
  shift
  N=$((N + 1))
  local tag; tag=$(printf '%s-%03d-%s-%s' "$RUN" "$N" "$method" "$field")
  local cmd; cmd=$(printf '%q ' "$@"); cmd=${cmd% }
  local sample=0
  [[ " ${meta[*]} " == *" sample_gpu=1 "* ]] && sample=1 && meta+=("smi=logs/$tag.smi")
  say "# $method $field (timeout ${limit}s): ${meta[*]}"
  say "\$ $cmd"
  [[ $DRY == 1 ]] && return 0
  local smi_pid=""
  if [[ $sample == 1 ]] && command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i "${GPU_INDEX:-0}" -lms 200 > "$OUT/logs/$tag.smi" 2> /dev/null &
    smi_pid=$!
  fi
  local t0=$EPOCHREALTIME
  timeout -k 30 "$limit" "$@" > "$OUT/logs/$tag.out" 2> "$OUT/logs/$tag.err"
  local rc=$?
  local t1=$EPOCHREALTIME
  if [[ -n $smi_pid ]]; then kill "$smi_pid" 2> /dev/null; wait "$smi_pid" 2> /dev/null; fi
  local secs; secs=$(awk -v a="${t0/,/.}" -v b="${t1/,/.}" 'BEGIN { printf "%.3f", b - a }')
  printf '{"run": %s, "n": %d, "family": %s, "method": %s, "field": %s, "meta": %s, "command": %s, "rc": %d, "seconds": %s, "timeout_s": %d, "out": %s, "err": %s}\n' \
    "$(jstr "$RUN")" "$N" "$(jstr "$FAMILY")" "$(jstr "$method")" "$(jstr "$field")" "$(jmeta "${meta[@]}")" "$(jstr "$cmd")" \
    "$rc" "$secs" "$limit" "$(jstr "logs/$tag.out")" "$(jstr "logs/$tag.err")" >> "$OUT/steps.jsonl"
  if [[ $rc == 0 ]]; then
    echo "  ok, ${secs} s: $(grep '^{' "$OUT/logs/$tag.out" | tail -1 | cut -c1-240)"
  else
    echo "  FAILED (exit $rc$([[ $rc == 124 || $rc == 137 ]] && echo ", timed out after ${limit} s")), see logs/$tag.err:"
    tail -3 "$OUT/logs/$tag.err" | sed 's/^/    /'
  fi
  return 0
}
# prep WHAT LIMIT_S -- COMMAND...: a command whose output is not a measurement (data, models)
prep() { local what=$1 limit=$2; shift 2; step _prep prep "$limit" what="$what" "$@"; }

# --- what methods/<name>.toml says ----------------------------------------------------------------
toml_get() {  # FILE SECTION KEY -> the value, quotes removed
  awk -v sec="[$2]" -v key="$3" '
    /^\[/ { insec = ($0 == sec); next }
    insec && $1 == key && $2 == "=" { v = $3; gsub(/"/, "", v); print v; exit }' "$1"
}
default_precision() { local v; v=$(toml_get "methods/$1.toml" precision gpu_default); echo "${v:-f32}"; }
default_batch() {  # METHOD FALLBACK: [batch] gpu_default, else default, else FALLBACK
  local v; v=$(toml_get "methods/$1.toml" batch gpu_default)
  [[ -n $v ]] || v=$(toml_get "methods/$1.toml" batch default)
  echo "${v:-$2}"
}
has_precision_knob() { grep -q '^flag = "--precision"' "methods/$1.toml"; }

# --- binaries ---------------------------------------------------------------------------------------
binary() {  # PATH -> a runnable path (its .xz unpacked into OUT/bin)
  local p=$1 name; name=$(basename "$1")
  if [[ -x $p ]]; then realpath "$p"
  elif [[ -f $p.xz ]]; then
    if [[ $DRY == 1 ]]; then echo "# xz -dc $p.xz > $OUT/bin/$name" >&2
    else mkdir -p "$OUT/bin"; xz -dc "$p.xz" > "$OUT/bin/$name" && chmod +x "$OUT/bin/$name" || return 1; fi
    echo "$OUT/bin/$name"
  elif [[ $DRY == 1 ]]; then echo "# (no $p nor $p.xz here)" >&2; echo "$p"
  else echo "no $p (nor $p.xz): set BIN / BENCH_BIN" >&2; return 1
  fi
}
[[ $DRY == 1 ]] || mkdir -p "$OUT/logs"
BIN=${BIN:-dist/cuda12/scfoundry}
B=$(binary "$BIN") || exit 1
BB=$(binary "${BENCH_BIN:-$(dirname "$BIN")/scfoundry-bench}") || exit 1
say "# record_gpu.sh $FAMILY $OUT: run $RUN, methods ${FAMILY_METHODS[$FAMILY]}, steps: $STEPS"

# --- the machine and the binary ---------------------------------------------------------------------
if [[ $DRY != 1 ]]; then
  smi=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2> /dev/null | head -1)
  IFS=, read -r gpu driver memory <<< "${smi:-,,}"
  version=$("$B" --version 2> /dev/null)
  bench_version=$("$BB" --version 2> /dev/null)
  torch=$("$PY" -c 'import torch; print(torch.__version__)' 2> /dev/null || echo -)
  printf '{"run": %s, "family": %s, "date": %s, "gpu": %s, "driver": %s, "memory_total": %s, "cpus": %d, "version": %s, "bench_version": %s, "bin": %s, "bench_bin": %s, "python": %s, "torch": %s}\n' \
    "$(jstr "$RUN")" "$(jstr "$FAMILY")" "$(jstr "$(date -u +%Y-%m-%d)")" "$(jstr "$(echo "$gpu" | xargs)")" "$(jstr "$(echo "$driver" | xargs)")" \
    "$(jstr "$(echo "$memory" | xargs)")" "$(nproc)" "$(jstr "$version")" "$(jstr "$bench_version")" \
    "$(jstr "$B")" "$(jstr "$BB")" "$(jstr "$PY")" "$(jstr "$torch")" > "$OUT/machine-$RUN.json"
  cat "$OUT/machine-$RUN.json"
fi

# --- throughput rows ------------------------------------------------------------------------------
sweep() {  # METHOD DEFAULT_LIST: the careful sweep's batches (BATCHES overrides)
  echo "${BATCHES:-$2}"
}
# scfoundry's own batch sweep for (b), where the default batch is not the fastest one measured
# (SF_BATCHES overrides; the default batch alone elsewhere): each side at its best batch
declare -A SF_SWEEP=(
  [scbert]="3 8 32" [cellfm]="4 16 32" [scimilarity]="2048 8192 16384" [scvi]="8192 16384 65536"
)
# dtype_arg BF16_IN_BENCH PRECISION: --dtype PRECISION, nothing for the benches with no --dtype (f32 only)
dtype_arg() { [[ $1 == none ]] || echo "--dtype $2"; }
# scfoundry (a) and (b): sf METHOD METRIC BF16_IN_BENCH BATCH -- COMMAND (without --dtype / --batch).
# (b) is the fastest precision (bf16 where the bench has it) at each batch of the method's sweep;
# bench/record_table.py keeps the fastest of (a) and (b)'s runs
sf() {
  local m=$1 metric=$2 bf=$3 b=$4; shift 5
  local p; p=$(default_precision "$m")
  # shellcheck disable=SC2046
  step "$m" sf_default "$STEP_TIMEOUT" precision="$p" batch="$b" metric="$metric" -- "$@" --batch "$b" $(dtype_arg "$bf" "$p")
  local fp=$p note="" ran=0 x
  [[ $bf == yes ]] && fp=bf16
  if [[ $fp == bf16 && $p != bf16 ]]; then
    note="bf16"; has_precision_knob "$m" || note="bf16 in the bench only: methods/$m.toml has no --precision for embed"
  fi
  for x in ${SF_BATCHES:-${SF_SWEEP[$m]:-$b}}; do
    [[ $x == "$b" && $fp == "$p" ]] && continue   # the default's own run
    # shellcheck disable=SC2046
    step "$m" sf_fastest "$STEP_TIMEOUT" precision="$fp" batch="$x" metric="$metric" ${note:+note="$note"} -- "$@" --batch "$x" $(dtype_arg "$bf" "$fp")
    ran=1
  done
  if (( ! ran )); then
    record "$m" sf_fastest same_as=sf_default precision="$p" \
      why="$([[ $p == bf16 ]] && echo "the default already runs bf16" || echo "f32 is the only precision of this method's path")"
  fi
  # (h) for the default precision and the fastest where it differs, both at the default batch
  local q
  for q in $p $([[ $fp != "$p" ]] && echo "$fp"); do
    # shellcheck disable=SC2046
    wants ncu && ncu_bound "$m" "$q" "$b" -- "$@" --batch "$b" $(dtype_arg "$bf" "$q")
  done
}

# (h): ncu_bound METHOD PRECISION BATCH -- COMMAND. The window: from NCU_START's first launch
# (a regex on kernel names; {dtype} is the precision) plus NCU_OFFSET, NCU_COUNT launches
declare -A NCU_START=(
  [cellfm]='retention_split_{dtype}' [scbert]='favor_features_{dtype}' [novae]=gatv2_attention
  [scimilarity]=csr_to_dense [scvi]=csr_to_dense [cellplm]='nvjet|gemm|cutlass|sm90_xmma'
)
declare -A NCU_OFFSET=([cellfm]=-3 [scbert]=-4 [novae]=-4 [scimilarity]=0 [scvi]=0 [cellplm]=-2)
declare -A NCU_COUNT=([geneformer]=120 [scimilarity]=40 [scvi]=40)
ncu_bound() {
  local m=$1 p=$2 b=$3; shift 4
  local st=${NCU_START[$m]:-varlen_attention}   # the fused encoders' attention
  st=${st//\{dtype\}/$p}
  step "$m" ncu "$STEP_TIMEOUT" precision="$p" batch="$b" start="$st" -- \
    env START="$st" START_OFFSET="${NCU_OFFSET[$m]:--6}" LAUNCH_COUNT="${NCU_COUNT[$m]:-150}" LIST_COUNT="${NCU_LIST:-8000}" \
    bash bench/ncu_bound.sh "$OUT/ncu" "$m-$p-$RUN" -- "$@"
}

# careful METHOD BATCHES ATTENTION -- COMMAND...: the careful PyTorch sweep (bf16, cells sorted),
# COMMAND --batch B for each batch B of BATCHES (or $BATCHES)
careful() {
  local m=$1 batches=$2 attn=$3 x; shift 4
  for x in $(sweep "$m" "$batches"); do
    step "$m" torch_careful "$STEP_TIMEOUT" dtype=bf16 order=sorted batch="$x" ${attn:+attention="$attn"} metric=cells_per_s -- "$@" --batch "$x"
  done
}

tput_geneformer() {
  local b; b=$(default_batch geneformer 100)
  local shape=(--layers 6 --hidden 256 --heads 4 --ffn 512 --max-len 2048 --activation relu --lengths "$L" --cells 2048)
  record geneformer info shape="V1: 6 x 256, 4 heads, FFN 512, 2,048 positions; 2,048 cells of wu2020's lengths" \
    note_upstream="upstream-style: float32 (EmbExtractor loads the model in float32), cells sorted longest first (emb_extractor.py sorts them: perturber_utils.downsample_and_sort), forward_batch_size 100"
  sf geneformer cells_per_s yes "$b" -- "$BB" __bench-encoder --arch bert "${shape[@]}" --order sorted
  step geneformer torch_upstream "$STEP_TIMEOUT" dtype=f32 order=sorted batch=100 metric=cells_per_s -- \
    "$PY" bench/encoder_torch.py "${shape[@]}" --dtype f32 --order sorted --batch 100
  careful geneformer "8 16 32 64 128" "nn.TransformerEncoder" -- "$PY" bench/encoder_torch.py "${shape[@]}" --dtype bf16 --order sorted
}
tput_scgpt() {
  local b; b=$(default_batch scgpt 64)
  record scgpt info shape="whole-human: 12 x 512, 8 heads, d_hid 512, 1,200 tokens; 2,048 cells of wu2020's lengths" \
    note_upstream="upstream-style: fp16 (cell_emb.py embeds under CUDA fp16 autocast; here fp16 weights), file order, batch 64; PyTorch runs the encoder stack alone, scfoundry's bench the whole model as embed runs it"
  sf scgpt cells_per_s yes "$b" -- "$BB" __bench-encoder --arch scgpt --max-len 1200 --lengths "$L" --cells 2048 --order sorted
  local shape=(--layers 12 --hidden 512 --heads 8 --ffn 512 --max-len 1200 --activation relu --lengths "$L" --cells 2048)
  step scgpt torch_upstream "$STEP_TIMEOUT" dtype=f16 order=file batch=64 metric=cells_per_s -- \
    "$PY" bench/encoder_torch.py "${shape[@]}" --dtype f16 --order file --batch 64
  careful scgpt "8 16 32 64 128" "nn.TransformerEncoder" -- "$PY" bench/encoder_torch.py "${shape[@]}" --dtype bf16 --order sorted
}
tput_uce() {
  local b; b=$(default_batch uce 16)
  local lens=$OUT/uce_lengths.txt
  [[ $DRY == 1 ]] || yes 1072 | head -200 > "$lens"
  say "# yes 1072 | head -200 > $lens   (UCE's sentences: 1,024 sampled genes, chromosome tokens, <cls>)"
  local shape=(--layers 33 --hidden 1280 --heads 20 --ffn 5120 --max-len 1536 --activation relu --lengths "$lens" --cells 256)
  record uce info shape="33 layers: 33 x 1280, 20 heads, FFN 5,120, 1,072 tokens a cell; 256 cells" \
    note_upstream="upstream-style: float32, every sentence padded to 1,536 (eval_single_anndata.py), file order, batch 25 (its --batch_size default); careful: no padding to 1,536"
  sf uce cells_per_s yes "$b" -- "$BB" __bench-encoder --arch bert "${shape[@]}" --order sorted
  step uce torch_upstream "$STEP_TIMEOUT" dtype=f32 order=file batch=25 pad_to=1536 metric=cells_per_s -- \
    "$PY" bench/encoder_torch.py "${shape[@]}" --dtype f32 --order file --batch 25 --pad-to 1536
  careful uce "8 16 32 64 128" "nn.TransformerEncoder" -- "$PY" bench/encoder_torch.py "${shape[@]}" --dtype bf16 --order sorted
}
tput_bert_cell() {  # sccello | langcell
  local m=$1 shape_text=$2 up_batch=$3
  local b; b=$(default_batch "$m" "$up_batch")
  local common=(--lengths "$L" --cells 2048 --device cuda)
  record "$m" info shape="$shape_text; 2,048 cells of wu2020's lengths + <cls>" \
    note_upstream="upstream-style: float32 (transformers' default load dtype; assumed), file order, batch $up_batch"
  sf "$m" cells_per_s yes "$b" -- "$BB" __bench-encoder --arch "$m" "${common[@]}" --order sorted
  step "$m" torch_upstream "$STEP_TIMEOUT" dtype=f32 order=file batch="$up_batch" metric=cells_per_s -- \
    "$PY" "bench/${m}_torch.py" "${common[@]}" --dtype f32 --order file --batch "$up_batch"
  careful "$m" "8 16 32 64 128" "nn.TransformerEncoder" -- "$PY" "bench/${m}_torch.py" "${common[@]}" --dtype bf16 --order sorted
}
tput_sccello() { tput_bert_cell sccello "6 x 256, 4 heads, FFN 512, 2,048 positions" 24; }
tput_langcell() { tput_bert_cell langcell "12 x 512, 8 heads, FFN 1,024 (Geneformer 12L-30M's shape, assumed), cell_proj 512 -> 256" 32; }
tput_scfoundation() {
  local b; b=$(default_batch scfoundation 8)   # no [batch]: embed batches 8 of the longest cells' tokens
  local common=(--lengths "$L" --cells 512 --device cuda)
  record scfoundation info shape="0.1B: 12 x 768, 12 heads, 19,266 positions; 512 cells of wu2020's lengths" \
    note_upstream="upstream-style: float32, one cell at a time in file order (get_embedding.py)"
  sf scfoundation cells_per_s yes "$b" -- "$BB" __bench-encoder --arch scfoundation "${common[@]}" --order sorted
  step scfoundation torch_upstream "$STEP_TIMEOUT" dtype=f32 order=file batch=1 metric=cells_per_s -- \
    "$PY" bench/scfoundation_torch.py "${common[@]}" --dtype f32 --order file --batch 1
  careful scfoundation "8 16 32 64 128" "nn.TransformerEncoderLayer" -- "$PY" bench/scfoundation_torch.py "${common[@]}" --dtype bf16 --order sorted
}
tput_scprint() {
  local b; b=$(default_batch scprint 64)
  local common=(--lengths "$L" --cells 1024 --max-len 4000 --device cuda)
  record scprint info shape="medium-v1.5: 8 x 256, 4 heads; 4,000 genes + 10 cell tokens a cell; 1,024 cells" \
    note_upstream="upstream-style: fp16 with torch's SDPA standing in for flash-attn (upstream's GPU path: flash attention, fp16), file order, batch 64; the einsum float32 row of earlier tables is upstream without flash-attn"
  sf scprint cells_per_s yes "$b" -- "$BB" __bench-encoder --arch scprint "${common[@]}"
  step scprint torch_upstream "$STEP_TIMEOUT" dtype=f16 order=file batch=64 attention=sdpa metric=cells_per_s -- \
    "$PY" bench/scprint_torch.py "${common[@]}" --dtype f16 --attention sdpa --order file --batch 64
  careful scprint "8 16 32 64 128" "sdpa" -- "$PY" bench/scprint_torch.py "${common[@]}" --dtype bf16 --attention sdpa --order sorted
}
tput_c2s() {
  local b; b=$(default_batch c2s 64)
  local common=(--arch c2s-410m --max-len 2048 --lengths bench/c2s_prompt_lengths.txt --cells 1024)
  record c2s info shape="C2S-Pythia-410M: 24 x 1024, 16 heads, FFN 4,096; 1,024 prompts of 468-517 tokens" \
    note_upstream="upstream-style: float32 (the dtype the model loads in), file order, batch 8 (embed_cells), left padding; both sides attend through SDPA (c2s_torch.py as transformers' sdpa path)"
  sf c2s cells_per_s yes "$b" -- "$BB" __bench-encoder "${common[@]}" --order sorted
  step c2s torch_upstream "$STEP_TIMEOUT" dtype=f32 order=file batch=8 attention=sdpa metric=cells_per_s -- \
    "$PY" bench/c2s_torch.py "${common[@]}" --device cuda --dtype f32 --order file --batch 8
  careful c2s "8 16 32 64 128" "sdpa" -- "$PY" bench/c2s_torch.py "${common[@]}" --device cuda --dtype bf16 --order sorted
}
tput_cellfm() {
  local b; b=$(default_batch cellfm 4)
  local common=(--lengths "$L" --cells 256 --device cuda)
  record cellfm info shape="800M: 40 x 1536, 48 heads, linear retention; 256 cells of wu2020's lengths (at most 2,048 genes)" \
    note_upstream="upstream-style: float32, every cell padded to 2,048 genes (the port's collate), file order, batch 4 (train.py --batch)"
  # both with gpu/retention.rs's kernels, the GPU default (the bench checks them against candle's ops)
  sf cellfm cells_per_s yes "$b" -- "$BB" __bench-encoder --arch cellfm "${common[@]}" --order sorted
  step cellfm torch_upstream "$STEP_TIMEOUT" dtype=f32 order=file batch=4 pad_to=2048 metric=cells_per_s -- \
    "$PY" bench/cellfm_torch.py "${common[@]}" --dtype f32 --order file --batch 4 --pad-to-nonz-len
  careful cellfm "8 16 32 64 128" "" -- "$PY" bench/cellfm_torch.py "${common[@]}" --dtype bf16 --order sorted
}
tput_scbert() {
  local b; b=$(default_batch scbert 3)
  record scbert info shape="Performer: 6 x 200, 10 heads, 16,907 tokens a cell; 60 cells" \
    note_upstream="upstream-style: float32 without TF32, one cell at a time (predict.py); careful: TF32 products or bf16 autocast, the faster, every cell has the same length (nothing to sort)"
  # its one-kernel FAVOR+ features, the GPU default (the bench checks them against candle's ops);
  # the fastest: the same weights in bf16 (the bench only: embed runs f32), checked against f32
  sf scbert cells_per_s yes "$b" -- "$BB" __bench-encoder --arch scbert --lengths bench/pbmc68k_genes.txt --device cuda --cells 60 --repeat 2
  step scbert torch_upstream "$STEP_TIMEOUT" dtype=f32 order=file batch=1 metric=cells_per_s -- \
    "$PY" bench/scbert_torch.py --device cuda --cells 60 --repeat 2 --batch 1
  for x in $(sweep scbert "1 3 8 16 32"); do
    step scbert torch_careful "$STEP_TIMEOUT" dtype=tf32 order=file batch="$x" metric=cells_per_s -- \
      "$PY" bench/scbert_torch.py --device cuda --cells 60 --repeat 2 --tf32 --batch "$x"
    step scbert torch_careful "$STEP_TIMEOUT" dtype=bf16 order=file batch="$x" metric=cells_per_s -- \
      "$PY" bench/scbert_torch.py --device cuda --cells 60 --repeat 2 --bf16 --batch "$x"
  done
}
tput_cellplm() {
  local b; b=$(default_batch cellplm 50000)
  record cellplm info shape="19,374 genes, 4 x 1024 Flowformer, latent 512; 100,000 synthetic cells of 1,000 genes" \
    note_upstream="upstream-style: float32, passes of 50,000 cells (the tutorial's inference batch); careful: bf16 autocast and page-locked, non-blocking copies at the same passes (cells attend to each other, so the batch is part of the model: no sweep)"
  sf cellplm cells_per_s yes "$b" -- "$BB" __bench-cellplm --device cuda --cells 100000
  step cellplm torch_upstream "$STEP_TIMEOUT" dtype=f32 order=file batch=50000 metric=cells_per_s -- \
    "$PY" bench/cellplm_torch.py --device cuda --cells 100000 --batch 50000
  step cellplm torch_careful "$STEP_TIMEOUT" dtype=bf16 order=file batch=50000 pinned=1 metric=cells_per_s -- \
    "$PY" bench/cellplm_torch.py --device cuda --cells 100000 --batch 50000 --dtype bf16 --pin
}
tput_novae() {
  local b; b=$(default_batch novae 256)
  local graph=$OUT/novae_graph.json
  record novae info shape="GATv2 10 x 128, 8 heads, 2-hop subgraphs; a synthetic slide of 20,000 cells, 500 genes" \
    note_upstream="upstream-style: float32, 256 subgraphs a batch (Novae(batch_size=256)); careful: the best batch (novae_torch.py offers no other precision)"
  # its one-kernel GATv2 attention, the GPU default (checked against candle's ops); no --dtype
  sf novae cells_per_s none "$b" -- "$BB" __bench-encoder --arch novae --cells 20000 --device cuda --repeat 3 --lengths "$L" --graph-out "$graph"
  step novae torch_upstream "$STEP_TIMEOUT" dtype=f32 order=file batch=256 metric=cells_per_s -- \
    "$PY" bench/novae_torch.py --graph "$graph" --genes 500 --device cuda --repeat 3 --batch 256
  for x in $NOVAE_BATCHES; do
    step novae torch_careful "$STEP_TIMEOUT" dtype=f32 order=file batch="$x" metric=cells_per_s -- \
      "$PY" bench/novae_torch.py --graph "$graph" --genes 500 --device cuda --repeat 3 --batch "$x"
  done
}
tput_scimilarity() {
  local b; b=$(default_batch scimilarity 2048)
  record scimilarity info shape="28,231 -> 1024 -> 1024 -> 128; 20,480 synthetic cells" \
    note_upstream="scfoundry: sparse host rows as embed sends them (sparse_cells_per_s); upstream-style: get_embeddings' loop, pageable dense batches of 10,000 (buffer_size) read back each; careful: page-locked non-blocking batches (dense, or CSR made dense on the device), read once, the best batch"
  sf scimilarity sparse_cells_per_s none "$b" -- "$BB" __bench-scimilarity --device cuda --repeat 3 --cells 20480
  step scimilarity torch_upstream "$STEP_TIMEOUT" dtype=f32 order=file batch=10000 metric=upstream_cells_per_s -- \
    "$PY" bench/scimilarity_torch.py --device cuda --repeat 3 --cells 20480 --batch 10000
  for x in $MLP_BATCHES; do
    step scimilarity torch_careful "$STEP_TIMEOUT" dtype=f32 order=file batch="$x" copies=page-locked metric=careful_cells_per_s -- \
      "$PY" bench/scimilarity_torch.py --device cuda --repeat 3 --cells 20480 --batch "$x"
  done
}
tput_scvi() {
  local b; b=$(default_batch scvi 8192)
  local shape=(--genes 2000 --hidden 128 --latent 10 --layers 1 --cells 100000 --device cuda)
  record scvi info shape="scvi-tools defaults: 2,000 genes -> 128 -> 10; 100,000 synthetic cells" \
    note_upstream="scfoundry: sparse rows as embed sends them (sparse_cells_per_s), its GPU default batch; upstream-style: batch 128 (scvi-tools' settings.batch_size; scvi_torch.py always copies page-locked, non-blocking); careful: the best of large batches"
  sf scvi sparse_cells_per_s none "$b" -- "$BB" __bench-scvi "${shape[@]}"
  step scvi torch_upstream "$STEP_TIMEOUT" dtype=f32 order=file batch=128 copies=page-locked metric=cells_per_s -- \
    "$PY" bench/scvi_torch.py "${shape[@]}" --batch 128
  for x in $MLP_BATCHES; do
    step scvi torch_careful "$STEP_TIMEOUT" dtype=f32 order=file batch="$x" copies=page-locked metric=cells_per_s -- \
      "$PY" bench/scvi_torch.py "${shape[@]}" --batch "$x"
  done
}
tput_cellama() {
  local b; b=$(default_batch cellama 256)
  local lens=$OUT/cellama_lengths.txt
  [[ $DRY == 1 ]] || seq 121 158 > "$lens"
  say "# seq 121 158 > $lens   (the token range of tests/fixtures/cellama's 64 sentences, spread evenly)"
  local shape=(--layers 6 --hidden 384 --heads 12 --ffn 1536 --max-len 256 --activation gelu --lengths "$lens" --cells 8192)
  record cellama info shape="all-MiniLM-L6-v2: 6 x 384, 12 heads, FFN 1,536; 8,192 sentences of 121-158 tokens" \
    note_upstream="scfoundry: PackedBert, sentences packed without padding, longest first (what embed runs; in bf16 the fused encoder, the 32-wide heads widened to 64); upstream-style: float32, batch 32, sorted by length (SentenceTransformer.encode sorts)"
  sf cellama cells_per_s yes "$b" -- "$BB" __bench-encoder --arch bert "${shape[@]}" --order sorted --batching cells
  step cellama torch_upstream "$STEP_TIMEOUT" dtype=f32 order=sorted batch=32 metric=cells_per_s -- \
    "$PY" bench/encoder_torch.py "${shape[@]}" --dtype f32 --order sorted --batch 32
  careful cellama "8 16 32 64 128" "nn.TransformerEncoder" -- "$PY" bench/encoder_torch.py "${shape[@]}" --dtype bf16 --order sorted
}

# --- accuracy against f32 -------------------------------------------------------------------------
accuracy() {
  local bf=() m
  for m in ${FAMILY_METHODS[$FAMILY]}; do
    if [[ $(default_precision "$m") == f32 ]]; then
      record "$m" accuracy exact=1 why="the default is f32 on a GPU (methods/$m.toml has no bf16 gpu_default)"
    else
      bf+=("$m")
    fi
  done
  ((${#bf[@]})) || return 0
  step _family accuracy "$LONG_TIMEOUT" models="${bf[*]}" tsv=fidelity/fidelity.tsv -- \
    env MODELS="${bf[*]}" CHECKPOINTS="$W" BIN="$B" PY="$PY" bash bench/precision_fidelity_gpu.sh "$OUT/fidelity"
}

# --- end to end -----------------------------------------------------------------------------------
e2e_cells() {  # METHOD DEFAULT
  echo "${E2E_CELLS:-$2}"
}
tile() {  # N [spatial]: TILED = N tiled wu2020 cells (made once); `spatial` adds obsm['spatial']
  # and var['highly_variable'] (the 2,000 genes detected in the most cells), for Novae
  local n=$1 extra=() name=cells-$1
  [[ ${2:-} == spatial ]] && extra=(--spatial --hvg 2000) && name=cells-$1-spatial
  TILED=$OUT/data/$name.h5ad
  if [[ $DRY == 1 || ! -f $TILED ]]; then
    [[ $DRY == 1 ]] || mkdir -p "$OUT/data"
    prep "$name.h5ad" "$LONG_TIMEOUT" -- "$PY" bench/tile_h5ad.py "$DATA" "$n" "$TILED" "${extra[@]}"
  fi
}
# a model in OUT/weights written once (the layout precision_fidelity_gpu.sh writes and reads)
model() {  # METHOD
  local m=$1 f
  case $m in
    sccello) f=sccello/pytorch_model.bin ;; langcell) f=langcell/cell_proj.bin ;;
    scfoundation) f=scfoundation/models/models.ckpt ;; scprint) f=scprint/medium-v1.5.ckpt ;;
    c2s) f=c2s/model.safetensors ;; cellfm) f=cellfm/cellfm_torch.pt ;; cellplm) f=cellplm/20231027_85M.best.ckpt ;;
    novae) f=novae/model.safetensors ;; scbert) f=scbert/panglao_pretrained.pth ;;
    scimilarity) f=scimilarity/encoder.ckpt ;; scvi) f=scvi/model.pt ;; cellama) f=cellama/manifest.toml ;;
  esac
  [[ $DRY != 1 && -f $W/$f ]] && return 0
  case $m in
    sccello|langcell) prep "model $m" "$LONG_TIMEOUT" -- "$PY" bench/fullsize_checkpoints.py "$W" --only "$m" --genes-from "$DATA:gene_ids" --symbols-from "$DATA" ;;
    scfoundation|scprint|c2s|cellfm|cellplm|novae|scbert) prep "model $m" "$LONG_TIMEOUT" -- "$PY" bench/random_models.py "$m" "$DATA" "$W/$m" ;;
    scimilarity) prep "model $m" "$LONG_TIMEOUT" -- "$PY" bench/random_models.py scimilarity "$DATA" "$W/scimilarity" --genes 28231 --hidden 1024,1024 --latent 128 --seed 0 ;;
    scvi) prep "model $m" "$LONG_TIMEOUT" -- "$PY" bench/random_models.py scvi "$DATA" "$W/scvi" --genes 2000 --seed 0 ;;
    cellama) prep "model $m" "$LONG_TIMEOUT" -- "$PY" bench/random_minilm.py .devcarry/minilm "$W/cellama/weights" "$W/cellama/manifest.toml" --seed 0 ;;
  esac
}
# embed METHOD CELLS EMBED_ARGS...: `embed` end to end, E2E_REPEAT times, nvidia-smi sampled
embed_e2e() {  # METHOD CELLS[:spatial] EMBED_ARGS...
  local m=$1 n=${2%%:*} how=; [[ $2 == *:spatial ]] && how=spatial; shift 2
  tile "$n" $how
  local r
  for r in $(seq "$E2E_REPEAT"); do
    local o=$OUT/e2e/$m-$RUN-$r
    [[ $DRY == 1 ]] || mkdir -p "$OUT/e2e"
    step "$m" e2e "$LONG_TIMEOUT" cells="$n" precision=auto runs_dir="e2e/runs-$m-$RUN-$r" sample_gpu=1 -- \
      "$@" -d "$TILED" -o "$o.h5ad" --device cuda --embedding-only --runs-dir "$OUT/e2e/runs-$m-$RUN-$r" --quiet
    [[ $DRY == 1 ]] || rm -f "$o.h5ad"
  done
}
# bench/embed_pipeline_gpu.sh: geneformer, scgpt, uce (its own data and models, the encoder alone beside)
pipeline_e2e() {  # METHOD CELLS ENCODER_CELLS (of its encoder-alone run, which the table does not show)
  local m=$1 n=$2 enc=$3 p; p=$(default_precision "$m")
  local keep=logs/$RUN-$m-pipeline-results.tsv
  step "$m" e2e "$LONG_TIMEOUT" cells="$n" precision=auto pipeline_results="$keep" -- \
    env MODELS="$m" CELLS="$n" UCE_CELLS="$n" ENC_CELLS="$enc" REPEAT="$E2E_REPEAT" PRECISION=auto ENC_DTYPE="$p" \
    BIN="$B" BENCH_BIN="$BB" PYTHON="$PY" bash bench/embed_pipeline_gpu.sh "$OUT/e2e-pipeline"
  [[ $DRY == 1 ]] || cp "$OUT/e2e-pipeline/results.tsv" "$OUT/$keep" 2> /dev/null
}
e2e() {  # METHOD
  local m=$1
  case $m in
    geneformer|scgpt) pipeline_e2e "$m" "$(e2e_cells "$m" 200000)" 20000 ;;
    uce) pipeline_e2e uce "$(e2e_cells uce 10000)" 1000 ;;
    sccello|langcell) model "$m"; embed_e2e "$m" "$(e2e_cells "$m" 200000)" "$B" embed -m "$m" --model-dir "$W/$m" --gene-column gene_ids ;;
    scfoundation) model "$m"; embed_e2e "$m" "$(e2e_cells "$m" 50000)" "$B" embed -m "$m" --model-dir "$W/$m" ;;
    scprint) model "$m"; embed_e2e "$m" "$(e2e_cells "$m" 50000)" "$B" embed -m "$m" --model-dir "$W/$m" --gene-column gene_ids ;;
    c2s) model "$m"; embed_e2e "$m" "$(e2e_cells "$m" 20000)" "$B" embed -m "$m" --model-dir "$W/$m" ;;
    cellfm) model "$m"; embed_e2e "$m" "$(e2e_cells "$m" "$([[ $(default_precision cellfm) == bf16 ]] && echo 20000 || echo 1000)")" "$B" embed -m "$m" --model-dir "$W/$m" ;;
    scimilarity|scvi) model "$m"; embed_e2e "$m" "$(e2e_cells "$m" 200000)" "$B" embed -m "$m" --model-dir "$W/$m" ;;
    cellama)
      if [[ $DRY != 1 && ! -f .devcarry/minilm/tokenizer.json ]]; then
        record cellama e2e not_wired="needs .devcarry/minilm (all-MiniLM-L6-v2's config.json, tokenizer.json and safetensors header: scripts/devcarry.sh) in the checkout"
        return 0
      fi
      model cellama
      embed_e2e cellama "$(e2e_cells cellama 50000)" env SCFOUNDRY_MANIFEST="$W/cellama/manifest.toml" SCFOUNDRY_WEIGHTS_DIR="$W/cellama/weights" "$B" embed -m cellama ;;
    scbert) model "$m"; embed_e2e "$m" "$(e2e_cells "$m" 2000)" "$B" embed -m "$m" --model-dir "$W/$m" ;;
    cellplm) model "$m"; embed_e2e "$m" "$(e2e_cells "$m" 200000)" "$B" embed -m "$m" --model-dir "$W/$m" --gene-column gene_ids ;;
    novae) model "$m"; embed_e2e "$m" "$(e2e_cells "$m" 200000):spatial" "$B" embed -m "$m" --model-dir "$W/$m" ;;
  esac
}

# --- the run --------------------------------------------------------------------------------------
if wants throughput || wants ncu; then
  # the bf16 matrix ceiling of the card (and a first CUDA process before anything is timed)
  step _family ceiling "$STEP_TIMEOUT" metric=ceiling_tflops -- "$BB" __bench-encoder --arch gemm --dtype bf16 --repeat 3 --lengths "$L"
  for m in ${FAMILY_METHODS[$FAMILY]}; do "tput_$m"; done
fi
wants accuracy && accuracy
if wants e2e; then
  for m in ${FAMILY_METHODS[$FAMILY]}; do e2e "$m"; done
fi
if [[ $DRY == 1 ]]; then
  echo "\$ $PY bench/record_table.py --assemble $OUT"
else
  "$PY" bench/record_table.py --assemble "$OUT" || python3 bench/record_table.py --assemble "$OUT"
  "$PY" bench/record_table.py "$OUT" 2> /dev/null || python3 bench/record_table.py "$OUT"
fi
