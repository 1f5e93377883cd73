#!/usr/bin/env bash
# bf16 against f32 on real cells, for the methods whose `--precision auto` (the default) runs
# bf16 on a GPU: Geneformer V1, scGPT, UCE, scCello, LangCell, scFoundation, scPRINT, C2S, CellFM, CellPLM, CELLama and scBERT at their
# released sizes with random weights in the upstream file formats (bench/fullsize_checkpoints.py;
# scFoundation's, scPRINT's, C2S-Pythia-410M's, CellFM's, CellPLM's and scBERT's: bench/random_models.py; the
# CELLama's all-MiniLM-L6-v2: its real config and tokenizer with seeded random weights,
# bench/random_minilm.py, from .devcarry/minilm (scripts/devcarry.sh); the
# Geneformer-family dictionaries and scGPT's vocabulary rebuilt over the data's genes, so every
# cell is tokenised at its real length). Each method embeds demo/wu2020_tcells.h5ad (200 T cells,
# 14 batches, 16 cell types; var['gene_ids'] as the gene ids, var_names as the symbols) twice:
# `--precision f32` and the default (`--precision bf16` where methods/<name>.toml keeps f32 as
# the GPU default and offers bf16: CellFM, scBERT). Per method, one TSV row: the precision the default
# resolved to (from the output's uns['scfoundry']['parameters']), the lowest cosine and the
# largest relative error (||a - b|| / ||a||) of a cell's embedding, the scIB totals of both
# embeddings (`scfoundry benchmark --batch-key batch --label-key cell_type`), and each run's
# wall seconds (whole processes: CUDA context, checkpoint read, output written).
#
#   bash bench/precision_fidelity_gpu.sh OUT_DIR
#
# Environment: BIN (default dist/cuda13/scfoundry; when only dist/cuda13/scfoundry.xz is there it
# is unpacked into a temporary folder), PY (default /opt/torch/.venv/bin/python, else python3;
# needs torch, h5py, numpy), MODELS (default "geneformer scgpt uce sccello langcell"),
# CHECKPOINTS (a folder kept between runs: models already in it are not written again, so the
# models can be split over several runs, e.g. MODELS=uce alone), DEVICE (default
# cuda; `DEVICE=cpu BIN=<cpu build>` runs every step on the CPU, where auto resolves to f32:
# for checking the script, not for figures).
# Writes OUT_DIR/fidelity.tsv, and the logs, outputs' reports and benchmark folders beside it.
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: precision_fidelity_gpu.sh OUT_DIR}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
DEVICE=${DEVICE:-cuda}
MODELS=${MODELS:-geneformer scgpt uce sccello langcell}
PY=${PY:-$( [[ -x /opt/torch/.venv/bin/python ]] && echo /opt/torch/.venv/bin/python || echo python3 )}
export SCFOUNDRY_NO_PROGRESS=1
export LD_LIBRARY_PATH="/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
if [[ -n "${BIN:-}" ]]; then B=$(realpath "$BIN")
elif [[ -x dist/cuda13/scfoundry ]]; then B=$PWD/dist/cuda13/scfoundry
elif [[ -f dist/cuda13/scfoundry.xz ]]; then xz -dc dist/cuda13/scfoundry.xz > "$TMP/scfoundry" && chmod +x "$TMP/scfoundry"; B=$TMP/scfoundry
else echo "no binary: set BIN, or build dist/cuda13/scfoundry (scripts/build-cuda.sh)" >&2; exit 1; fi
"$B" --version | head -1 | tee "$OUT/version.txt"
[[ $DEVICE == cuda ]] && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/nvidia-smi.txt"

DATA=demo/wu2020_tcells.h5ad
# the models not in the checkpoint folder yet are written (a CHECKPOINTS folder keeps them for the next run)
W=${CHECKPOINTS:-$TMP/weights}; mkdir -p "$W"; W=$(realpath "$W")
only=()
for m in $MODELS; do
  case $m in
    geneformer) f=geneformer_v1/pytorch_model.bin ;; scgpt) f=scgpt/whole_human/best_model.pt ;;
    uce) f=uce/33l_8ep_1024t_1280.torch ;; sccello) f=sccello/pytorch_model.bin ;; langcell) f=langcell/cell_proj.bin ;;
    scfoundation) f=scfoundation/models/models.ckpt ;; scprint) f=scprint/medium-v1.5.ckpt ;; c2s) f=c2s/model.safetensors ;;
    cellfm) f=cellfm/cellfm_torch.pt ;; cellplm) f=cellplm/20231027_85M.best.ckpt ;; cellama) f=cellama/manifest.toml ;;
    scbert) f=scbert/panglao_pretrained.pth ;;
    *) echo "unknown model $m (MODELS: geneformer scgpt uce sccello langcell scfoundation scprint c2s cellfm cellplm cellama scbert)" >&2; exit 1 ;;
  esac
  [[ -f $W/$f ]] && continue
  if [[ $m == cellama ]]; then
    [[ -f .devcarry/minilm/safetensors_header.json ]] || { echo "cellama needs .devcarry/minilm (bash scripts/devcarry.sh)" >&2; exit 1; }
    "$PY" bench/random_minilm.py .devcarry/minilm "$W/cellama/weights" "$W/cellama/manifest.toml" --seed 0 | tee -a "$OUT/checkpoints.jsonl"
    [[ ${PIPESTATUS[0]} == 0 ]] || exit 1
    continue
  fi
  # scFoundation's, scPRINT's, C2S's, CellFM's, CellPLM's and scBERT's random models need no torch (bench/random_models.py)
  if [[ $m == scfoundation || $m == scprint || $m == c2s || $m == cellfm || $m == cellplm || $m == scbert ]]; then
    "$PY" bench/random_models.py "$m" "$DATA" "$W/$m" | tee -a "$OUT/checkpoints.jsonl"
    [[ ${PIPESTATUS[0]} == 0 ]] || exit 1
  else
    only+=("$m")
  fi
done
if [[ ${#only[@]} -gt 0 ]]; then
  "$PY" bench/fullsize_checkpoints.py "$W" --only "$(IFS=,; echo "${only[*]}")" --genes-from "$DATA:gene_ids" --symbols-from "$DATA" \
    | tee -a "$OUT/checkpoints.jsonl"
  [[ ${PIPESTATUS[0]} == 0 ]] || exit 1
fi
R=$TMP/runs; mkdir -p "$R"; cp "$DATA" "$R/cells.h5ad"

# method -> the arguments that point it at its model and genes
args_of() {
  case $1 in
    geneformer) echo "embed -m geneformer --model-dir $W/geneformer_v1 --gene-column gene_ids" ;;
    sccello) echo "embed -m sccello --model-dir $W/sccello --gene-column gene_ids" ;;
    langcell) echo "embed -m langcell --model-dir $W/langcell --gene-column gene_ids" ;;
    scgpt|uce) echo "--weights-dir $W embed -m $1" ;;
    scfoundation) echo "embed -m scfoundation --model-dir $W/scfoundation" ;;
    scprint) echo "embed -m scprint --model-dir $W/scprint --gene-column gene_ids" ;;
    c2s) echo "embed -m c2s --model-dir $W/c2s" ;;
    cellfm) echo "embed -m cellfm --model-dir $W/cellfm" ;;
    cellplm) echo "embed -m cellplm --model-dir $W/cellplm --gene-column gene_ids" ;;
    scbert) echo "embed -m scbert --model-dir $W/scbert" ;;
    cellama) echo "--weights-dir $W/cellama/weights embed -m cellama" ;;
  esac
}

# run NAME ARGS...: one scfoundry process in $R, its wall seconds in $OUT/NAME.wall
run() {
  local name=$1; shift
  local t0 t1; t0=$(date +%s.%N)
  ( cd "$R" && ${MANIFEST:+env SCFOUNDRY_MANIFEST="$MANIFEST"} timeout 600 "$B" "$@" ) > "$OUT/$name.log" 2>&1; local rc=$?
  t1=$(date +%s.%N)
  echo "$rc $(awk "BEGIN { print $t1 - $t0 }")" > "$OUT/$name.wall"
  local rep; rep=$(grep -o "run folder: [^ ]*" "$OUT/$name.log" | head -1 | cut -d' ' -f3)
  [[ -n "$rep" && $rep != /* ]] && rep="$R/$rep"
  [[ -n "$rep" && -f "$rep/report.json" ]] && cp "$rep/report.json" "$OUT/$name.report.json"
  [[ -n "$rep" && -f "$rep/gpu.tsv" ]] && cp "$rep/gpu.tsv" "$OUT/$name.gpu.tsv"
  [[ $rc == 0 ]] || { echo "$name: exit $rc" >&2; tail -5 "$OUT/$name.log" >&2; }
  return 0
}

for m in $MODELS; do
  MANIFEST=; [[ $m == cellama ]] && MANIFEST=$W/cellama/manifest.toml   # the random model's pins
  # shellcheck disable=SC2046
  run "${m}_f32" $(args_of "$m") -d cells.h5ad -o "${m}_f32.h5ad" --device "$DEVICE" --precision f32
  # the default; where methods/<m>.toml keeps f32 as the GPU default, bf16 asked for (its opt-in)
  alt=()
  grep -q '^gpu_default = "f32"' "methods/$m.toml" && alt=(--precision bf16)
  # shellcheck disable=SC2046
  run "${m}_default" $(args_of "$m") -d cells.h5ad -o "${m}_default.h5ad" --device "$DEVICE" "${alt[@]}"
  for p in f32 default; do
    [[ -f "$R/${m}_$p.h5ad" ]] || continue
    run "${m}_${p}_scib" benchmark -d "${m}_$p.h5ad" -e "X_$m" --batch-key batch --label-key cell_type -o "$OUT/${m}_${p}_scib"
  done
done

"$PY" - "$R" "$OUT" "$MODELS" "$DEVICE" <<'PY' | tee "$OUT/fidelity.tsv"
import csv, glob, json, os, sys
import h5py
import numpy as np

runs, out, models, device = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4]


def text(v):
    v = v[()]
    return v.decode() if isinstance(v, bytes) else str(v)


def wall(name):
    try:
        rc, s = open(f"{out}/{name}.wall").read().split()
        return f"{float(s):.1f}" if rc == "0" else f"exit {rc}"
    except OSError:
        return "-"


def scib_total(name):
    """The Total column of the benchmark folder's results table."""
    for f in sorted(glob.glob(f"{out}/{name}_scib/*.tsv")) + sorted(glob.glob(f"{out}/{name}_scib/*.csv")):
        with open(f) as fh:
            rows = list(csv.reader(fh, delimiter="\t" if f.endswith(".tsv") else ","))
        if not rows:
            continue
        head = [h.strip().lower() for h in rows[0]]
        if "total" in head:
            i = head.index("total")
            vals = [r[i] for r in rows[1:] if len(r) > i and r[i] not in ("", "Aggregate score")]
            for v in vals:
                try:
                    return f"{float(v):.4f}"
                except ValueError:
                    continue
    return "-"


cols = ["method", "device", "cells", "dim", "default_requested", "default_resolved", "lowest_cosine", "largest_rel_error",
        "scib_total_f32", "scib_total_default", "wall_s_f32", "wall_s_default", "finite"]
print("\t".join(cols))
for m in models:
    row = dict.fromkeys(cols, "-")
    row.update(method=m, device=device, wall_s_f32=wall(f"{m}_f32"), wall_s_default=wall(f"{m}_default"),
               scib_total_f32=scib_total(f"{m}_f32"), scib_total_default=scib_total(f"{m}_default"))
    try:
        fa, fb = h5py.File(f"{runs}/{m}_f32.h5ad", "r"), h5py.File(f"{runs}/{m}_default.h5ad", "r")
        a = fa[f"obsm/X_{m}"][()].astype(np.float64)
        b = fb[f"obsm/X_{m}"][()].astype(np.float64)
        pa, pb = fa["uns/scfoundry/parameters"], fb["uns/scfoundry/parameters"]
        assert text(pa["precision"]) == "f32", f"the f32 run recorded precision {text(pa['precision'])}"
        row.update(default_requested=text(pb["precision_requested"]), default_resolved=text(pb["precision"]))
        ok = np.isfinite(a).all(1) & np.isfinite(b).all(1)
        a, b = a[ok], b[ok]
        cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        rel = np.linalg.norm(a - b, axis=1) / np.linalg.norm(a, axis=1)
        row.update(cells=str(len(a)), dim=str(a.shape[1]), lowest_cosine=f"{cos.min():.6f}", largest_rel_error=f"{rel.max():.1e}",
                   finite=str(bool(ok.all())).lower())
    except Exception as e:  # a run that failed: its row says so
        print(f"{m}: {e}", file=sys.stderr)
    print("\t".join(row[c] for c in cols), flush=True)
PY
