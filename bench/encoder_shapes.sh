# The four full-size encoder shapes as `__bench-encoder` arguments, "name|arguments", as
# bench/encoder_throughput.sh runs them; sourced by bench/env_ab_gpu.sh (which bench/ab_encoder_gpu.sh runs)
# (set $real and $uce, the token-length files, first).
# shellcheck shell=bash disable=SC2034
shapes=(
  "geneformer_v1|--arch bert --layers 6 --hidden 256 --heads 4 --ffn 512 --max-len 2048 --lengths $real --cells 2048 --batch 100"
  "scgpt|--arch bert --layers 12 --hidden 512 --heads 8 --ffn 512 --max-len 1200 --lengths $real --cells 2048 --batch 64"
  "scgpt_model|--arch scgpt --lengths $real --cells 2048 --batch 64"
  "geneformer_v2|--arch bert --layers 12 --hidden 768 --heads 12 --ffn 3072 --max-len 4096 --lengths $real --cells 512 --batch 16"
  "uce_33l|--arch bert --layers 33 --hidden 1280 --heads 20 --ffn 5120 --max-len 1536 --lengths $uce --cells 256 --batch 16"
)
