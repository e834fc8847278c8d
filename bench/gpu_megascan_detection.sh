#!/usr/bin/env bash
# MegaScan detection on real GPUs (docs/benchmarks.md, "MegaScan: detection"): traced runs, each
# aggregated with `tools/aggregate.py -d` on the machine, and with --trace-detect on, so the log holds
# the online alerts too. Each case in CASES is "<name>:<model>:<layout>:<gpu under load|none>:<duty>:<onset>":
#   model  tiny (the quickstart's examples/gpt3/train_gpt_tiny.sh job), 345m, 1.3b or 1.3b_mb8
#          (bench/gpt345m_setup.sh)
#   layout dp<N>, tp2pp2 (with sequence parallelism), dp2pp2, tp2dp2 (sequence parallel), tp2, pp2, 1
#   onset  the iteration at which scripts/gpu_load.py starts on that GPU (clocks untouched), so the log's
#          per-iteration times before and after it say how much slower the job became; the log marks when
#          the load's GEMMs began, and the summary says which iteration that was and which window's online
#          alert came first after it
# EXTRA: flags added to every case (e.g. --trace-granularity base).
# HANG=1 adds the hang case: the quickstart's job on 4 GPUs (TP2 x PP2), every iteration traced, rank
# HANG_RANK (2) stopped with SIGSTOP from outside after iteration 30, PyTorch's flight recorder on
# (TORCH_NCCL_TRACE_BUFFER_SIZE, dump on timeout into the trace directory, a one-minute timeout);
# killed once every live rank dumped (or after HANG_WAIT seconds), then aggregated.
# Outputs under ${RESULTS:-bench_results}/detect_<name>/ (log, report.txt, report.json, trace files).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpt345m_setup.sh
ITERS=${ITERS:-40}
declare -A LAYOUT_FLAGS=([1]="" [dp2]="" [dp4]="" [tp2]="--tensor-model-parallel-size 2 --sequence-parallel"
    [pp2]="--pipeline-model-parallel-size 2" [dp2pp2]="--pipeline-model-parallel-size 2"
    [tp2dp2]="--tensor-model-parallel-size 2 --sequence-parallel"
    [tp2pp2]="--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2")
declare -A LAYOUT_PROCS=([1]=1 [dp2]=2 [dp4]=4 [tp2]=2 [pp2]=2 [dp2pp2]=4 [tp2dp2]=4 [tp2pp2]=4)
TRACE=(--trace --trace-interval 5 --continuous-trace-iterations 2 --trace-detect --log-interval 1)

# Start the competing load on GPU $1 (duty $2) once $3 (a log) shows iteration $4; mark in that log when its
# GEMMs begin (appended lines: the job's own lines stay whole).
load_from_iteration() {
    until grep -qE "iteration +$4/" "$3" 2>/dev/null; do sleep 0.2; done
    python3 scripts/gpu_load.py --gpu "$1" --duty "$2" --size 8192 --duration 600 | while IFS= read -r line; do
        echo "$line"
        [[ $line == "gpu_load: "*" GEMMs on GPU"* ]] && echo "== competing load began" >> "$3"
    done
}

# ms per iteration before and after the load began (the log's per-iteration "elapsed time per iteration"),
# the iteration it began in, and the first online alert after it.
slowdown() {
    python3 - "$1" "$2" <<'EOF'
import re, statistics, sys
text = open(sys.argv[1]).read()
marker = text.find("== competing load began")
onset = int(sys.argv[2])
if marker >= 0:  # the first iteration logged after the marker is the one the load began in
    later = re.search(r"iteration +(\d+)/", text[marker:])
    onset = int(later.group(1)) if later else onset
times = {int(m.group(1)): float(m.group(2)) for m in re.finditer(
    r"iteration +(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+)", text)}
before = [t for i, t in times.items() if 3 <= i < onset]
after = [t for i, t in times.items() if i > onset + 1]
if before and after:
    b, a = statistics.median(before), statistics.median(after)
    print(f"load began in iteration {onset}; ms/iter before {b:.1f}, after {a:.1f}: {100 * (a / b - 1):+.1f} %")
if marker < 0:  # no marker: count from the configured onset's iteration line
    line = re.search(rf"iteration +{onset}/", text)
    marker = line.start() if line else 0
alert = re.search(r"MegaScan alert: window (\d+) \(iterations (\d+)-(\d+)\): (rank \d+)", text[marker:])
if alert:
    print(f"first alert after it: window {alert.group(1)} (iterations {alert.group(2)}-{alert.group(3)}), "
          f"{alert.group(4)}: {int(alert.group(3)) - onset} iteration(s) after the onset's iteration")
EOF
}

run_case() {
    local name=$1 model=$2 layout=$3 gpu=$4 duty=$5 onset=$6
    local dir=$RESULTS/detect_$name nproc=${LAYOUT_PROCS[$layout]} load_pid=
    rm -rf "$dir" && mkdir -p "$dir"
    local log=$dir/log
    : > "$log"  # the job appends (O_APPEND), so the load's marker line is not overwritten
    if [[ $gpu != none ]]; then
        load_from_iteration "$gpu" "$duty" "$log" "$onset" > "$dir/load.log" 2>&1 &
        load_pid=$!
    fi
    if [[ $model == tiny ]]; then
        local tp=1 pp=1
        [[ $layout == *tp2* ]] && tp=2
        [[ $layout == *pp2* ]] && pp=2
        NPROC=$nproc TP=$tp PP=$pp DEVICE=${DEVICE:-cuda} TRAIN_ITERS=$ITERS DATA_PATH=$RESULTS/data/gpt_text_document \
            CHECKPOINT_DIR=$dir/checkpoints timeout 240 bash examples/gpt3/train_gpt_tiny.sh \
            "${TRACE[@]}" ${EXTRA:-} --trace-dir "$dir/trace" >> "$log" 2>&1
    else
        timeout 240 torchrun --nproc_per_node "$nproc" pretrain_gpt.py "${MODEL[@]}" ${SIZES[$model]} \
            ${LAYOUT_FLAGS[$layout]} --train-iters "$ITERS" "${TRACE[@]}" ${EXTRA:-} --trace-dir "$dir/trace" \
            >> "$log" 2>&1
    fi
    echo "== $name ($model, $layout, load on GPU $gpu duty $duty from iteration $onset): exit $?"
    # SIGTERM: the load stops and prints its summary through the marking loop, which then ends
    [[ -n $load_pid ]] && { pkill -TERM -f "scripts/gpu_load.py --gpu $gpu " 2>/dev/null; wait "$load_pid"; }
    [[ $gpu != none ]] && slowdown "$log" "$onset"
    grep "MegaScan alert" "$log" | head -3
    python3 tools/aggregate.py -b "$dir/trace" -o "$dir/merged.json" -d --report-json "$dir/report.json" \
        > "$dir/report.txt" 2>&1
    grep -vE "^  (Chrome|detection report|done)" "$dir/report.txt" | head -25
    rm -rf "$dir/checkpoints" "$dir/merged.json"
}

for case in ${CASES-}; do
    IFS=: read -r name model layout gpu duty onset <<< "$case"
    run_case "$name" "$model" "$layout" "$gpu" "${duty:-1}" "${onset:-10}"
done

if [[ ${HANG:-0} == 1 ]]; then
    dir=$RESULTS/detect_hang && rm -rf "$dir" && mkdir -p "$dir/trace"
    TORCH_NCCL_TRACE_BUFFER_SIZE=${FR_BUFFER:-200} TORCH_NCCL_DUMP_ON_TIMEOUT=1 \
    TORCH_NCCL_DEBUG_INFO_TEMP_FILE=$dir/trace/nccl_trace_rank_ \
    NPROC=4 TP=2 PP=2 DEVICE=${DEVICE:-cuda} TRAIN_ITERS=100000 DATA_PATH=$RESULTS/data/gpt_text_document \
        CHECKPOINT_DIR=$dir/checkpoints setsid bash examples/gpt3/train_gpt_tiny.sh --trace --trace-dir "$dir/trace" \
        --trace-interval 2 --continuous-trace-iterations 2 --distributed-timeout-minutes 1 --log-interval 10 \
        --save-interval 100000 > "$dir/log" 2>&1 &
    job=$!
    until grep -qE "iteration +30/" "$dir/log" 2>/dev/null; do sleep 0.2; done
    victim=$(for pid in $(pgrep -f "pretrain_gpt.py.*$dir"); do
        tr '\0' '\n' < /proc/$pid/environ 2>/dev/null | grep -qx "RANK=${HANG_RANK:-2}" && echo "$pid"; done | head -1)
    kill -STOP "$victim"
    echo "== hang: rank ${HANG_RANK:-2} (pid $victim) stopped at $(date +%T) after iteration 30"
    for _ in $(seq "${HANG_WAIT:-100}"); do
        sleep 1
        [[ $(ls "$dir"/trace/nccl_trace_rank_* 2>/dev/null | wc -l) -ge 3 ]] && break
    done
    ls -la "$dir/trace" | grep -E "flight|nccl_trace" ; echo "killed at $(date +%T)"
    pkill -KILL -f "pretrain_gpt.py.*$dir"; kill -KILL -- -"$job" 2>/dev/null; wait "$job"
    python3 tools/aggregate.py -b "$dir/trace" -o "$dir/merged.json" -d --report-json "$dir/report.json" \
        > "$dir/report.txt" 2>&1
    cat "$dir/report.txt"; grep -iE "watchdog|timeout|flight" "$dir/log" | head -8
    rm -rf "$dir/checkpoints" "$dir/merged.json"
fi
