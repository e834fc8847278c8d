#!/usr/bin/env bash
# Parallel layouts against one GPU, losses and grad norms of every iteration (docs/benchmarks.md): GPT 345M bf16,
# dropout 0, --use-cpu-initialization (the same start in every layout), 8 iterations of 8 microbatches: DP2 (also
# with the distributed optimizer), TP2 with sequence parallelism, PP2, PP2 with a virtual pipeline, in each of MODES:
# eager, graphs (megatron-core's local CUDA graphs, --cuda-graph-impl local), full (one graph of each whole iteration,
# --cuda-graph-scope full_iteration), compiled (the layers under torch.compile, --compile-transformer-layers, graphs as
# by default). Every mode but eager runs REPEATS times (1 by default). The layouts run on GPUs 0,1 and 2,3 two at a
# time (one at a time on GPUs 0,1 where two are found). SINGLE_MODES: the one-GPU run again in these modes, against
# itself (with CHECK_LAYOUTS= empty only these run, on one GPU). For each run it also prints how long the job took to
# exit after its last iteration (a job that does not exit is stopped after EXIT_WAIT s).
#   [CHECK_LAYOUTS="dp2 dp2_distopt tp2_sp pp2 pp2_vp"] (also tp2_sp_overlap: --tp-comm-overlap) [MODES="eager graphs"]
#   [REPEATS=3] [SINGLE_MODES="eager compiled"] bash bench/gpu_layout_losses.sh
# Outputs under ${RESULTS:-bench_results}/layout_losses.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpt345m_setup.sh
OUTDIR=$RESULTS/layout_losses
mkdir -p "$OUTDIR"
ITERATIONS=8
COMMON=("${MODEL[@]}" --hidden-dropout 0 --attention-dropout 0 --use-cpu-initialization --micro-batch-size 2
        --global-batch-size 16 --train-iters "$ITERATIONS" --lr-warmup-iters 1 --log-interval 1)
declare -A LAYOUT=([dp2]="" [dp2_distopt]="--use-distributed-optimizer"
                   [tp2_sp]="--tensor-model-parallel-size 2 --sequence-parallel"
                   [tp2_sp_overlap]="--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap"
                   [pp2]="--pipeline-model-parallel-size 2"
                   [pp2_vp]="--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 6")

launch() {  # name, gpus, port, flags...: runs the job, then says how long it took to exit after its last iteration
    local name=$1 gpus=$2 port=$3; shift 3
    local log=$OUTDIR/$name.log
    CUDA_VISIBLE_DEVICES=$gpus timeout 240 torchrun --nproc_per_node "$(tr ',' '\n' <<< "$gpus" | wc -l)" \
        --master-port "$port" pretrain_gpt.py "${COMMON[@]}" "$@" > "$log" 2>&1 &
    local job=$! waited=0
    until grep -qE "iteration +$ITERATIONS/" "$log" 2>/dev/null || ! kill -0 "$job" 2>/dev/null; do sleep 0.2; done
    local last=$SECONDS
    until ! kill -0 "$job" 2>/dev/null || ((waited++ > ${EXIT_WAIT:-60} * 5)); do sleep 0.2; done
    if kill -0 "$job" 2>/dev/null; then
        pkill -f -- "--master-port $port" ; echo "$name: did not exit ${EXIT_WAIT:-60} s after its last iteration"
    fi
    wait "$job"
    echo "$name: exit $?, $((SECONDS - last)) s from the last iteration to exit;" \
         "$(grep -m1 -oE 'CUDA graphs[^;|]*' "$log")"
}

mode_flags() {  # mode: the flags that put a run in it
    case $1 in
        eager) echo "--cuda-graph-impl none" ;;
        graphs) echo "--cuda-graph-impl local" ;;
        full) echo "--cuda-graph-impl local --cuda-graph-scope full_iteration" ;;
        compiled) echo "--compile-transformer-layers" ;;
        *) echo "MODES: $1 is none of eager, graphs, full and compiled" >&2; return 2 ;;
    esac
}

named_runs() {  # name, mode, layout flags...: "name|flags" per run of the mode (REPEATS of them, but one eager run)
    local name=$1 mode=$2 flags repeats=${REPEATS:-1} k; shift 2
    flags=$(mode_flags "$mode") || return 2
    [[ $mode == eager ]] && repeats=1
    for ((k = 1; k <= repeats; k++)); do echo "$name$( ((k > 1)) && echo "_$k")|$* $flags"; done
}

runs=()  # name and flags, run two at a time (GPUs 0,1 and 2,3)
for layout in ${CHECK_LAYOUTS-dp2 dp2_distopt tp2_sp pp2 pp2_vp}; do
    [[ -v LAYOUT[$layout] ]] || { echo "CHECK_LAYOUTS: $layout is none of ${!LAYOUT[*]}" >&2; exit 2; }
    for mode in ${MODES:-eager graphs}; do
        mode_flags "$mode" > /dev/null || exit 2
        mapfile -t -O "${#runs[@]}" runs < <(named_runs "$layout$([[ $mode == eager ]] || echo "_$mode")" "$mode" \
                                              ${LAYOUT[$layout]})
    done
done
launch single 0 29600
names=()
for mode in ${SINGLE_MODES:-}; do
    mode_flags "$mode" > /dev/null || exit 2
    while IFS='|' read -r name flags; do
        launch "$name" 0 29600 $flags
        names+=("$name=$OUTDIR/$name.log")
    done < <(named_runs "single_$mode" "$mode")
done
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
slots=$((GPUS >= 4 ? 2 : 1))  # two runs at a time where four GPUs are found
for ((i = 0; i < ${#runs[@]}; i += slots)); do
    for ((slot = 0; slot < slots; slot++)); do
        [[ -n ${runs[i + slot]:-} ]] || continue
        IFS='|' read -r name flags <<< "${runs[i + slot]}"
        names+=("$name=$OUTDIR/$name.log")
        launch "$name" "$((2 * slot)),$((2 * slot + 1))" "$((29601 + slot))" $flags &
    done
    wait
done
python3 bench/layout_losses.py "$OUTDIR/single.log" "${names[@]}"
