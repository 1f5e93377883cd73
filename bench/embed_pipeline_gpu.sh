#!/usr/bin/env bash
# `embed` end to end against the encoder alone: `scfoundry embed --device cuda --precision bf16`
# on CELLS real-length cells for Geneformer V1, scGPT (whole-human shape) and UCE (33 layers),
# each timed from the process's start to its output renamed into place, and `scfoundry-bench
# __bench-encoder` at the same shape over the same cells' token lengths. Prints per model:
# end-to-end cells/s, encoder-alone cells/s, their ratio (target >= 0.80), and each stage's
# share of the task's wall time from report.json (setup, read, tokenise, device, write; the
# stages overlap, so their shares can sum past 100%).
#
#   bash bench/embed_pipeline_gpu.sh OUT_DIR
#
# Data: demo/wu2020_tcells.h5ad (200 real T cells, 30,727 genes, mean 994 genes a cell) tiled
# to CELLS cells by bench/tile_h5ad.py; UCE, whose 33 layers run about 380 cells/s, takes the
# first UCE_CELLS of them. Models: random weights at the released sizes in the upstream formats,
# whose vocabularies hold every gene detected in the 200 cells (Geneformer V1:
# bench/random_geneformer.py; scGPT and UCE: bench/embed_pipeline_models.py, from
# bench/fullsize_checkpoints.py), so each cell keeps its real length.
#
# Environment (defaults in brackets):
#   CELLS [200000]  UCE_CELLS [20000]  ENC_CELLS: cells of each encoder-alone run [CELLS, UCE_CELLS for UCE]
#   MODELS ["geneformer scgpt uce"]  REPEAT: end-to-end runs per model, the best kept [2]
#   DEVICE [cuda]  PRECISION [bf16; auto runs the default]  PYTHON [/opt/torch/.venv/bin/python, else python3]
#   ENC_DTYPE: the encoder-alone run's --dtype [PRECISION; set it with PRECISION=auto]
#   BIN: scfoundry [dist/cuda13/scfoundry, or unpacked from its .xz; else dist/cuda/scfoundry]
#   BENCH_BIN: scfoundry-bench [beside BIN, or unpacked from its .xz]
#   FULL_OUTPUT=1: write the whole input with the embedding (default --embedding-only)
#   GF_LAYERS: Geneformer's layers [6, V1's]; fewer for a quick check on a CPU
# DEVICE=cpu with small CELLS checks everything but the GPU on any machine.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: embed_pipeline_gpu.sh OUT_DIR}
CELLS=${CELLS:-200000}; UCE_CELLS=${UCE_CELLS:-20000}; MODELS=${MODELS:-geneformer scgpt uce}
REPEAT=${REPEAT:-2}; DEVICE=${DEVICE:-cuda}; PRECISION=${PRECISION:-bf16}
if [[ -z ${PYTHON:-} ]]; then
  if [[ -x /opt/torch/.venv/bin/python ]]; then PYTHON=/opt/torch/.venv/bin/python; else PYTHON=python3; fi
fi
mkdir -p "$OUT"; W=$(realpath "$OUT")
export SCFOUNDRY_NO_PROGRESS=1
export LD_LIBRARY_PATH="/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
# a binary, or its .xz unpacked into the temporary folder
binary() {  # path
  if [[ -x $1 ]]; then realpath "$1"
  elif [[ -f $1.xz ]]; then xz -dc "$1.xz" > "$TMP/$(basename "$1")"; chmod +x "$TMP/$(basename "$1")"; echo "$TMP/$(basename "$1")"
  else echo "no $1 (nor $1.xz)" >&2; return 1
  fi
}
if [[ -z ${BIN:-} ]]; then
  BIN=dist/cuda13/scfoundry; [[ -e $BIN || -e $BIN.xz ]] || BIN=dist/cuda/scfoundry
fi
BENCH_BIN=$(binary "${BENCH_BIN:-$(dirname "$BIN")/scfoundry-bench}")
BIN=$(binary "$BIN")
echo "machine: $(nproc) CPUs, $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
"$BIN" --version | sed -n 1p

# data: CELLS tiled cells, the first UCE_CELLS of them for UCE, and each cell's genes
[[ -f $W/cells-$CELLS.h5ad ]] || "$PYTHON" bench/tile_h5ad.py demo/wu2020_tcells.h5ad "$CELLS" "$W/cells-$CELLS.h5ad" --genes-out "$W/genes.txt"
[[ -f $W/cells-$UCE_CELLS.h5ad ]] || "$PYTHON" bench/tile_h5ad.py demo/wu2020_tcells.h5ad "$UCE_CELLS" "$W/cells-$UCE_CELLS.h5ad"
# genes expressed per cell, in the file's order (every detected gene is in each model's
# vocabulary): the encoder bench cuts them at each model's input size as the tokenisers do
[[ -f $W/genes-per-cell.txt ]] || "$PYTHON" - "$W/cells-$CELLS.h5ad" "$W/genes-per-cell.txt" <<'PY'
import sys, h5py, numpy as np
with h5py.File(sys.argv[1], "r") as f:
    n = np.diff(f["X/indptr"][:])
np.savetxt(sys.argv[2], n, fmt="%d")
PY

# models
GF_LAYERS=${GF_LAYERS:-6}
[[ -d $W/gf-$GF_LAYERS ]] || "$PYTHON" bench/random_geneformer.py "$W/genes.txt" "$W/gf-$GF_LAYERS" --seed 0 --layers "$GF_LAYERS"
want=()
for m in scgpt uce; do [[ " $MODELS " == *" $m "* && ! -d $W/weights/$m ]] && want+=("$m"); done
if ((${#want[@]})); then "$PYTHON" bench/embed_pipeline_models.py "$W/genes.txt" "$W/weights" "${want[@]}"; fi
# pinned in the weights folder (local-pins.toml, as files brought in by hand are): the first run
# hashes them once and stamps them, later runs trust the stamps, as with released weights
if [[ -d $W/weights ]]; then "$PYTHON" - "$W/weights" <<'PY'
import datetime, hashlib, os, re, sys
w = sys.argv[1]
text = open("weights.toml").read()
pins = []
for id_, body in re.findall(r'\[weights\."([^"]+)"\]\n(.*?)(?=\n\[|\Z)', text, re.S):
    m = re.search(r'^file = "([^"]+)"', body, re.M)
    if not m or not os.path.isfile(os.path.join(w, m.group(1))):
        continue
    path = os.path.join(w, m.group(1))
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 24), b""):
            h.update(b)
    pins.append(f'[pins."{id_}"]\nsha256 = "{h.hexdigest()}"\nsize = {os.path.getsize(path)}\nsource = "{path}"\n'
                f'pinned_at = "{datetime.datetime.now(datetime.timezone.utc).isoformat()}"\n')
open(os.path.join(w, "local-pins.toml"), "w").write("\n".join(pins))
print(f"pinned {len(pins)} weights entries in {w}/local-pins.toml")
PY
fi

# UCE's sentences: 1,024 sampled genes with their chromosome tokens and <cls> (about 1,072
# tokens, as bench/encoder_checks_gpu.sh times them)
yes 1072 | head -200 > "$W/uce-lengths.txt" || true

output_flag=(--embedding-only); [[ ${FULL_OUTPUT:-0} == 1 ]] && output_flag=()
: > "$W/results.tsv"
end_to_end() {  # model, cells, rep, embed flags...
  local model=$1 n=$2 rep=$3; shift 3
  local name=$model-$rep
  rm -rf "$W/runs-$name" "$W/$name.h5ad"
  local t0 t1
  t0=$EPOCHREALTIME
  "$BIN" "$@" -d "$W/cells-$n.h5ad" -o "$W/$name.h5ad" --device "$DEVICE" --precision "$PRECISION" \
    "${output_flag[@]}" --runs-dir "$W/runs-$name" --quiet
  t1=$EPOCHREALTIME
  local report; report=$(find "$W/runs-$name" -name report.json | head -1)
  cp "$report" "$W/$name.report.json"
  printf '%s\t%s\t%s\t%s\n' "$model" "$n" "$(awk -v a="$t0" -v b="$t1" 'BEGIN{print b - a}')" "$W/$name.report.json" >> "$W/results.tsv"
}
encoder() {  # model, cells, bench flags...
  local model=$1 n=$2; shift 2
  "$BENCH_BIN" __bench-encoder "$@" --cells "$n" --dtype "${ENC_DTYPE:-$PRECISION}" --device "$DEVICE" --order sorted --repeat 2 \
    > "$W/$model.encoder.json"
}
for model in $MODELS; do
  case $model in
    geneformer)
      for rep in $(seq "$REPEAT"); do end_to_end geneformer "$CELLS" "$rep" embed -m geneformer --model-dir "$W/gf-$GF_LAYERS" --gene-column index; done
      encoder geneformer "${ENC_CELLS:-$CELLS}" --arch bert --layers "$GF_LAYERS" --hidden 256 --heads 4 --ffn 512 --max-len 2048 \
        --activation relu --lengths "$W/genes-per-cell.txt" --batch 100 --batching tokens ;;
    scgpt)
      for rep in $(seq "$REPEAT"); do end_to_end scgpt "$CELLS" "$rep" --weights-dir "$W/weights" embed -m scgpt; done
      encoder scgpt "${ENC_CELLS:-$CELLS}" --arch scgpt --max-len 1200 --lengths "$W/genes-per-cell.txt" --batch 64 --batching tokens ;;
    uce)
      for rep in $(seq "$REPEAT"); do end_to_end uce "$UCE_CELLS" "$rep" --weights-dir "$W/weights" embed -m uce; done
      encoder uce "${ENC_CELLS:-$UCE_CELLS}" --arch bert --layers 33 --hidden 1280 --heads 20 --ffn 5120 --max-len 1536 \
        --activation relu --lengths "$W/uce-lengths.txt" --batch 16 --batching cells ;;
    *) echo "unknown model $model" >&2; exit 2 ;;
  esac
done

"$PYTHON" - "$W" <<'PY' | tee "$W/summary.txt"
import json, sys
w = sys.argv[1]
best = {}
for line in open(f"{w}/results.tsv"):
    model, n, wall, report = line.rstrip("\n").split("\t")
    if model not in best or float(wall) < best[model][1]:
        best[model] = (int(n), float(wall), report)
print(f"{'model':<11}{'cells':>8}{'wall s':>9}{'e2e c/s':>10}{'encoder c/s':>13}{'ratio':>7}  stage shares of the task's wall (setup, read, tokenise, device, write)")
for model, (n, wall, report) in best.items():
    enc = json.load(open(f"{w}/{model}.encoder.json"))
    e2e = n / wall
    ratio = e2e / enc["cells_per_s"]
    rep = json.load(open(report))
    phases = dict(rep["tasks"][0]["result"]["phases"])
    task_wall = phases.get("wall") or rep["tasks"][0]["duration_ms"] / 1e3
    shares = ", ".join(f"{k} {phases.get(k, 0) / task_wall:.0%}" for k in ("setup", "read", "tokenise", "device", "write"))
    print(f"{model:<11}{n:>8}{wall:>9.1f}{e2e:>10.0f}{enc['cells_per_s']:>13.0f}{ratio:>7.2f}  {shares} "
          f"(task {task_wall:.1f} s, blocks {phases.get('blocks wall', 0):.1f} s){'' if ratio >= 0.8 else '  below 0.80'}")
PY
