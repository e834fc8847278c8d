#!/usr/bin/env bash
# MegaScan on NPROC (2) GPUs with GPT 345M bf16, or with SIZE=1.3b GPT 1.3B (hidden 2048, sequence 2048:
# large enough that the GPUs, not the host, set the pace) (docs/benchmarks.md):
#  1. tracing overhead side by side (bench/megascan_overhead.py) at the layouts in OVERHEAD (dp2 tp2 pp2;
#     on more GPUs the rest is data parallel: with NPROC=4, "dp" is DP4, "tp2_sp" TP2 x DP2 with sequence
#     parallelism, "pp2" PP2 x DP2),
#     ROUNDS rounds each (10), each layout's job stopped after LAYOUT_TIMEOUT seconds (300), with the flags
#     in EXTRA added (e.g. "--manual-gc", or "--bench-modes off,base --trace-granularity base": a base-traced job,
#     which keeps the CUDA graphs on by default) and TAG appended to the names of its outputs;
#  2. traced runs for detection at the cases in DETECT, "<layout>:<gpu under load or none>": the
#     competing workload (scripts/gpu_load.py) runs on that GPU during the whole run.
# Outputs (JSON, logs, trace directories) under ${RESULTS:-bench_results}; aggregate them with
# `python tools/aggregate.py -b $RESULTS/detect_<case> -d`, and pool several runs' JSON of one layout (different
# TAGs) with `python bench/megascan_overhead_pool.py <files>`.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpt345m_setup.sh
SIZE=${SIZE:-345m} NPROC=${NPROC:-2}
# Data for every iteration: a warm-up and ROUNDS intervals of 5 for each of up to 3 modes; at least the
# 1000 of the earlier commands in docs/benchmarks.md, so that theirs stay the same jobs.
TRAIN_ITERS=$(( (${ROUNDS:-10} + 1) * 15 ))
(( TRAIN_ITERS < 1000 )) && TRAIN_ITERS=1000
for name in ${OVERHEAD-dp2 tp2 pp2}; do
    log=$RESULTS/megascan_overhead_${SIZE}_${name}_x$NPROC${TAG:-}
    timeout "${LAYOUT_TIMEOUT:-300}" torchrun --nproc_per_node "$NPROC" bench/megascan_overhead.py "${MODEL[@]}" \
        ${SIZES[$SIZE]} ${LAYOUTS[$name]} --train-iters "$TRAIN_ITERS" --trace --trace-dir "${log}_trace" \
        --trace-interval 5 --continuous-trace-iterations 2 --bench-rounds "${ROUNDS:-10}" \
        --bench-json "$log.json" ${EXTRA:-} > "$log.log" 2>&1
    echo "overhead $SIZE $name exit $?"; grep "megascan overhead" "$log.log"
done
for case in ${DETECT-dp2:none dp2:1 tp2:1 pp2:0}; do
    layout=${case%%:*} gpu=${case##*:} load_pid=
    if [[ $gpu != none ]]; then
        python3 scripts/gpu_load.py --gpu "$gpu" --size 8192 --duration 200 > "$RESULTS/load_${layout}_$gpu.log" 2>&1 &
        load_pid=$!
        sleep 3
    fi
    timeout 200 torchrun --nproc_per_node 2 pretrain_gpt.py "${MODEL[@]}" ${LAYOUTS[$layout]} --train-iters 20 \
        --trace --trace-dir "$RESULTS/detect_${layout}_load_$gpu" --trace-interval 5 \
        --continuous-trace-iterations 2 > "$RESULTS/detect_${layout}_load_$gpu.log" 2>&1
    echo "detect $case exit $?"; grep -E "iteration +20/" "$RESULTS/detect_${layout}_load_$gpu.log" | cut -c1-120
    [[ -n $load_pid ]] && kill "$load_pid" && wait "$load_pid"
done
