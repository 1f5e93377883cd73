#!/usr/bin/env bash
# The transformer encoders on a GPU machine in one run: the fused attention kernel checked against the plain
# reference, geneformer's embed on the GPU in f32 and bf16 (the small parity checkpoint of
# tests/fixtures/geneformer/v1; compare the h5ad files with its reference.json afterwards), then
# bench/encoder_throughput.sh (scfoundry packed and padded, PyTorch file order and sorted).
#
#   bash bench/encoders_vs_torch_gpu.sh OUT_DIR      # needs dist/cuda/scfoundry and scfoundry-bench (scripts/build-cuda.sh) and python3 with torch
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: encoders_vs_torch_gpu.sh OUT_DIR}
mkdir -p "$OUT"
B=$PWD/${BIN:-dist/cuda/scfoundry}; BB=$PWD/${BENCH_BIN:-dist/cuda/scfoundry-bench}; L=bench/token_lengths_wu2020.txt; export SCFOUNDRY_NO_PROGRESS=1
(timeout 60 "$BB" __bench-encoder --arch bert --layers 2 --hidden 256 --heads 4 --ffn 512 --max-len 2048 --lengths $L --cells 64 --batch 16 --dtype bf16 --check --repeat 1; echo "rc=$?") > "$OUT/quick.txt" 2>&1
grep -v "^ *[0-9]*: " "$OUT/quick.txt"
grep -q '"check_attention_vs_reference":0.00' "$OUT/quick.txt" || { echo "the fused kernel disagrees with the reference (or did not run)"; exit 3; }
W=$(mktemp -d); cp tests/fixtures/geneformer/pbmc68k_50.h5ad "$W/cells.h5ad"; FX=$PWD/tests/fixtures/geneformer/v1
( cd "$W" && for p in f32 bf16; do timeout 120 "$B" embed -m geneformer -d cells.h5ad -o gf_$p.h5ad --model-dir "$FX" --device cuda --precision $p --batch-size 8; echo "rc=$?"; done
  timeout 120 "$B" embed -m geneformer -d cells.h5ad -o gf_cpu_bf16.h5ad --model-dir "$FX" --precision bf16 --batch-size 8; echo "rc=$?" ) > "$OUT/gf.log" 2>&1
cp "$W"/gf_f32.h5ad "$W"/gf_bf16.h5ad "$OUT"/ 2>/dev/null
tail -20 "$OUT/gf.log"
# the GPU embeddings against transformers' (the fixture's reference), where h5py is installed
python3 bench/geneformer_embed_vs_reference.py "$W" || echo "(h5py missing: compare $OUT/gf_*.h5ad with tests/fixtures/geneformer/reference.json)"
E=$(mktemp -d); STEP_TIMEOUT=150 bash bench/encoder_throughput.sh "$E" "$BB" > "$OUT/enc.log" 2>&1; cp "$E/encoder_throughput.jsonl" "$OUT/"
python3 -c "
import json
for l in open('$OUT/encoder_throughput.jsonl'):
    r=json.loads(l); x=r['run']
    if 'ceiling_tflops' in x: print(r['shape'], x.get('tool'), 'bf16 matrix ceiling', round(x['ceiling_tflops'],1), 'TFLOP/s, half', round(x['half_ceiling_tflops'],1), {k: round(v,1) for k, v in x['tflops_by_size'].items()}); continue
    print(r['shape'], x.get('tool'), x.get('encoder','')[:22], x.get('order'), round(x.get('cells_per_s',0),1), round(x.get('useful_tflops',0),1), x.get('check_attention_vs_reference'), x.get('error'))
"
