#!/usr/bin/env bash
# MegaFBD on one GPU (docs/benchmarks.md): a GPT of 12 layers, hidden 768, sequence 1024, bf16, micro-batch 8,
# global batch 64 on mock data, 20 iterations per case:
#   normal runs on the GPU (without and with full recomputation)  vs  FBD with the backward instance on the GPU and the forward
#   instance on the CPU (--fbd-forward-device cpu), staleness 0 and 1.
# Prints a table: median ms per iteration, and per process the peak host RSS and peak GPU memory. Arguments go to
# bench/megafbd_bench.py (--model 1.3b, --rounds N, --only, --load-duty).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
python3 bench/megafbd_bench.py --device cuda --cases gpu --iterations "${ITERS:-20}" --timeout 170 "$@"
