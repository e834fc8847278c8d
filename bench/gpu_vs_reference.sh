#!/usr/bin/env bash
# Our training step against the plain-PyTorch reference GPT (bench/reference_gpt.py), side by side in
# one run on one GPU (docs/benchmarks.md). For each size in SIZE_LIST (345m 1.3b): pretrain_gpt.py
# with each variant in OURS, then the reference eager and compiled; one table with ms/iteration,
# TFLOP/s and the ratio to the eager reference. Ours: the log line of iterations ITERS-9..ITERS (30);
# the reference: the mean of 20 iterations after 5 warm-up ones. Logs under ${RESULTS:-bench_results}.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpt345m_setup.sh
# default: our defaults (SDPA attention, CUDA graphs where verified, fused Adam and bias fusions);
# unfused: the attention and the eager layers of before; sdpa: SDPA without graphs.
declare -A VARIANTS=([default]="" [unfused]="--attention-backend unfused --cuda-graph-impl none"
                     [sdpa]="--cuda-graph-impl none")
ITERS=${ITERS:-30}
table=$RESULTS/vs_reference.txt
printf '%-6s %-20s %10s %8s %9s %9s\n' size run ms/iter TFLOP/s vs_eager peak_MB > "$table"
row() {  # size, name, ms, tflops, memory; ratio against this size's eager reference
    local ratio=-
    [[ -n ${eager_tflops:-} && $4 != - ]] && ratio=$(python3 -c "print(f'{$4 / $eager_tflops:.2f}x')")
    printf '%-6s %-20s %10s %8s %9s %9s\n' "$1" "$2" "$3" "$4" "$ratio" "$5" | tee -a "$table"
}
flag() {  # the value of a flag in this size's model flags (the last one given wins, as in argparse)
    local i value=
    for ((i = 0; i < ${#model[@]} - 1; i++)); do [[ ${model[i]} == "$1" ]] && value=${model[i + 1]}; done
    echo "$value"
}
for size in ${SIZE_LIST:-345m 1.3b}; do
    eager_tflops=
    model=("${MODEL[@]}" ${SIZES[$size]})
    for mode in eager compiled; do
        log=$RESULTS/reference_${size}_$mode.log
        timeout "${RUN_TIMEOUT:-300}" python3 bench/reference_gpt.py --hidden-size "$(flag --hidden-size)" \
            --seq-length "$(flag --seq-length)" $([[ $mode == compiled ]] && echo --compile) > "$log" 2>&1
        read -r ms tflops mem < <(sed -nE 's/.*: ([0-9.]+) ms\/iteration ([0-9.]+) TFLOP\/s peak memory \(MB\): ([0-9]+).*/\1 \2 \3/p' "$log")
        [[ $mode == eager ]] && eager_tflops=${tflops:-}
        row "$size" "reference $mode" "${ms:--}" "${tflops:--}" "${mem:--}"
    done
    for variant in ${OURS:-unfused sdpa default}; do
        log=$RESULTS/ours_${size}_$variant.log
        timeout "${RUN_TIMEOUT:-300}" torchrun --nproc_per_node 1 pretrain_gpt.py "${model[@]}" ${VARIANTS[$variant]} \
            --train-iters "$ITERS" > "$log" 2>&1
        line=$(grep -E "iteration +$ITERS/" "$log")
        ms=$(sed -nE 's/.*per iteration \(ms\): ([0-9.]+).*/\1/p' <<< "$line")
        tflops=$(sed -nE 's/.*TFLOP\/s\/GPU\): ([0-9.]+).*/\1/p' <<< "$line")
        mem=$(sed -nE 's/.*peak memory \(MB\): ([0-9]+).*/\1/p' <<< "$line")
        row "$size" "ours $variant" "${ms:--}" "${tflops:--}" "${mem:--}"
    done
done
