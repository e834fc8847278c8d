#!/usr/bin/env bash
# MegaDPP on the GPUs of one host (docs/benchmarks.md, docs/megadpp.md). Phases, in the order given
# (default: all but speed):
#   transport           CUDA IPC against NCCL send/recv between GPUs 0 and 1, 4 KiB to 1 GiB
#                       (bench/transport_bandwidth.py)
#   stress              DPP against the static schedule (bench/dpp_stress.py), REPS repetitions per policy of
#                       10 iterations with random transfer delays and deterministic kernels (so that the static
#                       schedule equals itself): PP4 and PP4 with a virtual pipeline (GPUs 0-3), PP2 (GPUs 0,1)
#   fallback_and_stall  a copy of the repository without the CUDA IPC module starts PP2 on GPUs 2,3 (it must stop
#                       at start-up with one line saying how to build it), beside PP2 with --dpp-timeout 10 on
#                       GPUs 0,1 whose stage 1 is stopped (SIGSTOP) after iteration 3: the job must end naming it
#   fallback, stall     either half of fallback_and_stall alone
#   trace               GPT 1.3B at PP4 traced (--trace) with scripts/gpu_load.py on GPU 2; tools/aggregate.py -d on
#                       its traces
#   speed               GPT 1.3B bf16 side by side (bench/dpp_side_by_side.py --predict: the simulator's prediction
#                       beside each): PP4 (1F1B vs DPP) healthy, with a slow link, with uneven stages (9/6/6/6
#                       layers), with GPU 2 under load and with GPU 2 loaded for iterations 3-4 of each run only;
#                       PP2 with a virtual pipeline on GPUs 0,1 (interleaved 1F1B vs DPP), healthy, with a slow link
#                       and with GPU 1 loaded for iterations 3-4. A slow link's prediction takes the healthy run's
#                       forward time and solves how much of each delay the static schedule hides
# Stress, fallback and stall: GPT 345M's shape at 16 layers (PP4: 4 a stage; 2 chunks of 2 with a virtual
# pipeline), 8 microbatches.
# Needs megatron-core importable and the transport built in place (python3 setup.py build_ext --inplace).
#   bash bench/gpu_megadpp.sh [phase ...]        outputs under ${RESULTS:-bench_results}
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpt345m_setup.sh
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=8  # CPU initialization
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the repository's packages where it is built in place
REPS=${REPS:-10}
DROPOUT=(--hidden-dropout 0 --attention-dropout 0 --use-cpu-initialization)
JOB=("${MODEL[@]}" --num-layers 16 "${DROPOUT[@]}" --global-batch-size 32 --train-iters 10 --use-dpp)
# DETERMINISTIC=0: the default kernels (SDPA attention), whose runs differ from each other already
STRESS=("${JOB[@]}" --dpp-jitter-ms "${JITTER_MS:-2}")
[[ ${DETERMINISTIC:-1} == 1 ]] && STRESS+=(--deterministic-mode --attention-backend local)
declare -A STRESS_LAYOUTS=([pp2]="--pipeline-model-parallel-size 2" [pp4]="--pipeline-model-parallel-size 4"
                           [pp4_vp2]="--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 2")
declare -A STRESS_GPUS=([pp2]=0,1 [pp4]=0,1,2,3 [pp4_vp2]=0,1,2,3)
# GPT 1.3B, GPU-bound (the speed and trace phases): 16 microbatches, GPU initialization (speed only; the stress
# phase checks equality)
BIG=("${MODEL[@]}" ${SIZES[1.3b]} --hidden-dropout 0 --attention-dropout 0 --micro-batch-size 2
     --global-batch-size 32 --train-iters 100 --use-dpp)

run_stress() {  # name, gpus, extra flags...
    local name=$1 gpus=$2; shift 2
    CUDA_VISIBLE_DEVICES=$gpus timeout 420 torchrun --nproc_per_node "$(tr ',' '\n' <<< "$gpus" | wc -l)" \
        --master-port "${PORT:-29500}" bench/dpp_stress.py --repetitions "$REPS" --iterations 10 "${STRESS[@]}" "$@" \
        > "$RESULTS/stress_$name.log" 2>&1
    echo "stress $name exit $?: $(grep -h DPP-STRESS "$RESULTS/stress_$name.log")"
}

pid_of_rank() {  # rank, a pattern of the job's command line: the process torchrun gave that RANK
    local p
    for p in $(pgrep -f -- "$2"); do
        if tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "RANK=$1"; then echo "$p"; return; fi
    done
}

phase_transport() {
    CUDA_VISIBLE_DEVICES=0,1 timeout 300 torchrun --nproc_per_node 2 bench/transport_bandwidth.py --device cuda \
        --min-bytes 1K --max-bytes 1G > "$RESULTS/transport.log" 2>&1
    echo "transport exit $?"; sed -n '/^| message/,$p' "$RESULTS/transport.log"
}

phase_stress() {
    for name in ${STRESS_CASES:-pp4 pp4_vp2 pp2}; do
        run_stress "$name" "${STRESS_GPUS[$name]}" ${STRESS_LAYOUTS[$name]}
    done
}

phase_fallback() {
    local copy=/tmp/megadpp_without_cuda_ipc
    rm -rf "$copy" && mkdir -p "$copy"
    cp -r pretrain_gpt.py datasets megatron megadpp megascan megafbd megascope "$copy"/
    rm -f "$copy"/megadpp/transport/_cuda_ipc*.so
    (cd "$copy" && CUDA_VISIBLE_DEVICES=2,3 timeout 300 torchrun --nproc_per_node 2 --master-port 29520 pretrain_gpt.py \
        "${JOB[@]}" --train-iters 6 --log-interval 1 ${STRESS_LAYOUTS[pp2]}) > "$RESULTS/fallback_unbuilt.log" 2>&1
    echo "without the CUDA IPC module exit $?:"
    grep -E "megadpp transport|MegaDPP|error" "$RESULTS/fallback_unbuilt.log" | cut -c1-300
}

phase_stall() {
    local log=$RESULTS/stall.log
    CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc_per_node 2 pretrain_gpt.py "${JOB[@]}" --train-iters 100000 \
        --log-interval 1 ${STRESS_LAYOUTS[pp2]} --dpp-timeout 10 > "$log" 2>&1 &
    local job=$! waited=0
    until grep -qE "iteration +3/" "$log" || ((waited++ > 240)); do sleep 0.5; done
    local victim
    victim=$(pid_of_rank 1 "pretrain_gpt.py.*--dpp-timeout")
    if [[ -z $victim ]]; then
        echo "stall: the job did not reach iteration 3 within 120 s (see $log)"; kill "$job"; return 1
    fi
    # Stopped while it sleeps in DPP's wait for an input (not inside the optimizer's collectives, whose hang
    # torch.distributed's timeout reports): tests/test_megadpp_stall.py does the same on CPU.
    until grep -q nanosleep "/proc/$victim/wchan" 2>/dev/null || ! kill -0 "$victim" 2>/dev/null; do :; done
    local start=$SECONDS
    kill -STOP "$victim"
    timeout 180 tail --pid=$job -f /dev/null
    echo "stall: rank 1 (pid $victim) stopped; the job ended after $((SECONDS - start)) s"
    grep -E "error: MegaDPP" "$log" | head -3 | cut -c1-300
    kill -9 "$victim" 2>/dev/null
}

phase_fallback_and_stall() {  # on GPUs 2,3 and 0,1
    phase_fallback &
    phase_stall
    wait
}

phase_trace() {
    python3 scripts/gpu_load.py --gpu 2 --duty 0.5 --duration 240 > "$RESULTS/trace_load.log" 2>&1 &
    local load=$!
    sleep 3
    timeout 300 torchrun --nproc_per_node 4 pretrain_gpt.py "${BIG[@]}" --train-iters 20 --log-interval 5 \
        ${STRESS_LAYOUTS[pp4]} --trace --trace-dir "$RESULTS/trace" --trace-interval 5 \
        --continuous-trace-iterations 2 > "$RESULTS/trace_run.log" 2>&1
    echo "traced run exit $?"; grep -E "MegaDPP|iteration +20/" "$RESULTS/trace_run.log" | cut -c1-200
    kill "$load"; wait "$load"
    python3 tools/aggregate.py -b "$RESULTS/trace" -d > "$RESULTS/trace_report.log" 2>&1
    echo "aggregate exit $?"; head -40 "$RESULTS/trace_report.log" | cut -c1-250
}

phase_speed() {
    local pp4=(--pipeline-model-parallel-size 4)
    local vp=(--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 6)
    local delay=(--dpp-delay-ms 20 --dpp-delay-probability 0.3)
    side() {  # name, gpus, port, flags...
        local name=$1 gpus=$2 port=$3; shift 3
        CUDA_VISIBLE_DEVICES=$gpus timeout 300 torchrun --nproc_per_node "$(tr ',' '\n' <<< "$gpus" | wc -l)" \
            --master-port "$port" bench/dpp_side_by_side.py --rounds 2 --iterations 6 --predict "${BIG[@]}" "$@" \
            > "$RESULTS/speed_$name.log" 2>&1
        echo "== speed $name exit $?"; sed -n '/^simulator:/,$p' "$RESULTS/speed_$name.log"
    }
    healthy_forward() {  # the forward time a healthy case's prediction solved (1 if it printed none)
        grep -oP 'simulator: forward_ms=\K[0-9.]+' "$RESULTS/speed_$1.log" || echo 1
    }
    speed_pp4() {
        side pp4_healthy 0,1,2,3 29500 "${pp4[@]}"
        local forward
        forward=$(healthy_forward pp4_healthy)
        side pp4_link 0,1,2,3 29500 "${pp4[@]}" --dpp-delay-link 1 "${delay[@]}" --prediction-forward-ms "$forward"
        side pp4_uneven 0,1,2,3 29500 "${pp4[@]}" --num-layers 27 --decoder-first-pipeline-num-layers 9
        python3 scripts/gpu_load.py --gpu 2 --duty 0.5 --duration 300 > "$RESULTS/speed_load.log" 2>&1 &
        local load=$!
        sleep 3
        side pp4_gpu2_loaded 0,1,2,3 29500 "${pp4[@]}" --prediction-forward-ms "$forward" --prediction-slow-stage 2
        kill "$load"; wait "$load"
        side pp4_gpu2_transient 0,1,2,3 29500 "${pp4[@]}" --load-gpu 2 --load-iterations 3:5
    }
    speed_vp() {  # the slow link's prediction takes the healthy run's forward time: one after the other
        side vp_healthy 0,1 29501 "${vp[@]}"
        local forward
        forward=$(healthy_forward vp_healthy)
        side vp_link 0,1 29501 "${vp[@]}" --dpp-delay-link 0 "${delay[@]}" --prediction-forward-ms "$forward"
        side vp_gpu1_transient 0,1 29501 "${vp[@]}" --load-gpu 1 --load-iterations 3:5
    }
    for part in ${SPEED_PARTS:-pp4 vp}; do "speed_$part"; done
}

for phase in ${@:-transport stress fallback_and_stall trace}; do
    echo "=== $phase ($(date +%T))"
    "phase_$phase"
done
