#!/usr/bin/env bash
# One GPU: where a step's time goes, and what looking costs (docs/benchmarks.md).
#  1. torch.profiler windows (--profile --use-pytorch-profiler, --log-interval 1) of GPT 345M with the
#     old default (unfused attention, no CUDA graphs) and the new one, and of GPT 1.3B with the new
#     one; each writes its top operators by GPU time (*.summary.txt), and bench/profiled_iteration_cost.py
#     prints what the profiled iterations cost against the others of the same job;
#  2. MegaScan's cost on the same jobs: bench/megascan_overhead.py (modes off, base, full side by side),
#     ROUNDS rounds (4) per size.
# Outputs under ${RESULTS:-bench_results}.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpt345m_setup.sh
declare -A PROFILED=([345m_unfused]="345m --attention-backend unfused --cuda-graph-impl none"
                     [345m_default]="345m" [1.3b_default]="1.3b")
for name in ${PROFILES-345m_unfused 345m_default 1.3b_default}; do
    read -r size flags <<< "${PROFILED[$name]}"
    log=$RESULTS/profile_$name.log
    timeout "${RUN_TIMEOUT:-200}" torchrun --nproc_per_node 1 pretrain_gpt.py "${MODEL[@]}" ${SIZES[$size]} $flags \
        --train-iters 14 --log-interval 1 --profile --use-pytorch-profiler --profile-step-start 10 \
        --profile-step-end 12 --tensorboard-dir "$RESULTS/profile_$name" > "$log" 2>&1
    echo "profile $name exit $?"
    python3 bench/profiled_iteration_cost.py "$log" --profile-step-start 10 --profile-step-end 12
    head -n 16 "$RESULTS"/profile_"$name"/*.summary.txt | cut -c1-160
done
for size in ${OVERHEAD_SIZES-345m 1.3b}; do
    log=$RESULTS/megascan_overhead_1gpu_$size
    timeout "${RUN_TIMEOUT:-200}" torchrun --nproc_per_node 1 bench/megascan_overhead.py "${MODEL[@]}" ${SIZES[$size]} \
        --train-iters 1000 --trace --trace-dir "${log}_trace" --trace-interval 5 --continuous-trace-iterations 2 \
        --bench-rounds "${ROUNDS:-4}" --bench-json "$log.json" > "$log.log" 2>&1
    echo "megascan overhead $size exit $?"; grep -E "megascan overhead|CUDA graphs" "$log.log" | cut -c1-400
done
