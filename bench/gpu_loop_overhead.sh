#!/usr/bin/env bash
# Loop overhead (bench/loop_overhead.py) for GPT 345M bf16 at DP2, PP2 and TP2 on two GPUs.
# Writes JSON and logs under ${RESULTS:-bench_results}; PAIRS (30) pairs of iterations per layout.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpt345m_setup.sh
PAIRS=${PAIRS:-30}
for name in ${NAMES:-dp2 pp2 tp2}; do
    timeout 200 torchrun --nproc_per_node 2 bench/loop_overhead.py "${MODEL[@]}" ${LAYOUTS[$name]} \
        --train-iters $(( 2 * PAIRS + 5 )) --bench-pairs "$PAIRS" \
        --bench-json "$RESULTS/overhead_$name.json" > "$RESULTS/overhead_$name.log" 2>&1
    echo "$name exit $?"; grep "loop overhead" "$RESULTS/overhead_$name.log"
done
