#!/usr/bin/env bash
# Hugging Face -> megatron-core conversion on one GPU: a tiny random Llama 3 and one of Llama 3 8B's shape
# with 4 layers (about 3.9 GB in bf16), each converted with tools/checkpoint/convert.py --bf16 (time, GB/s,
# peak host memory beside one shard plus one layer) and checked against transformers (fp32 logits of
# 4 prompts, 16 greedy tokens).
# Results (summary.txt, <shape>.json, the logs) go to RESULTS_DIR (relative: to the repository); no network
# needed; every step bounded so that the whole script ends within 570 s on one H200.
#   bash bench/convert_llama_gpu.sh RESULTS_DIR            # on the GPU machine
#   bash bench/convert_llama_gpu.sh RESULTS_DIR --cpu-tiny  # the tiny shape on the CPU: checks the script
set -euo pipefail
cd "$(dirname "$0")/.."
results=${1:?usage: bash bench/convert_llama_gpu.sh RESULTS_DIR [--cpu-tiny]}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} PYTHONUNBUFFERED=1
if [[ "${2:-}" == "--cpu-tiny" ]]; then
    exec timeout 540 python3 bench/convert_llama_gpu.py "$results" --shapes tiny --device cpu
fi
exec timeout 570 python3 bench/convert_llama_gpu.py "$results" --shapes tiny,llama3-8b-4l --device cuda
