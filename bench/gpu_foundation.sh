#!/usr/bin/env bash
# GPT 345M bf16 from pretrain_gpt.py on two GPUs at the layouts named in NAMES (default: DP2, TP2, PP2,
# each without and with the distributed optimizer; dp2_fp16 on request; docs/benchmarks.md). The loop overhead is
# bench/gpu_loop_overhead.sh. Logs under ${RESULTS:-bench_results}.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpt345m_setup.sh
for name in ${NAMES:-dp2 dp2_distopt tp2 tp2_distopt pp2 pp2_distopt}; do
    echo "=== train $name"
    mapfile -t model < <(model_flags "$name")
    timeout 240 torchrun --nproc_per_node 2 pretrain_gpt.py "${model[@]}" ${LAYOUTS[$name]} \
        --train-iters "${ITERS:-60}" > "$RESULTS/train_$name.log" 2>&1
    echo "exit $?"; grep -E "iteration +[0-9]+/" "$RESULTS/train_$name.log" | tail -3 | cut -c1-330
done
