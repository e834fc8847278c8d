#!/usr/bin/env bash
# MegaScan detection on real GPUs (docs/benchmarks.md, "MegaScan: detection"): traced runs, each
# aggregated with `tools/aggregate.py --per-window` on the machine (the whole run and each window judged), and
# with --trace-detect on, so the log holds the online alerts too. Each case in CASES is
# "<name>:<model>:<layout>:<gpu under load|none>:<duty>:<onset>":
#   model  tiny (the quickstart's examples/gpt3/train_gpt_tiny.sh job), 345m, 1.3b or 1.3b_mb8
#          (bench/gpt345m_setup.sh)
#   layout dp<N>, tp2pp2 (with sequence parallelism), dp2pp2, tp2dp2 (sequence parallel), tp2, pp2, pp4, 1
#   onset  the iteration at which scripts/gpu_load.py starts on that GPU (clocks untouched), so the log's
#          per-iteration times before and after it say how much slower the job became; the log marks when
#          the load's GEMMs began, and the summary says which iteration that was and which window's online
#          alert came first after it
# EXTRA: flags added to every case (e.g. --trace-granularity base).
# HANG=1 adds the hang case: the quickstart's job on 4 GPUs (TP2 x PP2), every iteration traced, rank
# HANG_RANK (2) stopped with SIGSTOP from outside after iteration 30, PyTorch's flight recorder on
# (TORCH_NCCL_TRACE_BUFFER_SIZE, dump on timeout into the trace directory, a one-minute timeout);
# killed once every live rank dumped (or after HANG_WAIT seconds), then aggregated.
# MATRIX=1 makes the cases instead: the GPU detection matrix (docs/benchmarks.md, "MegaScan: detection") for the
# GPUS it finds (2 or 4; GPUS=N sets it): on 2, a TP2 + SP peer (GPU 1), PP2's first stage (GPU 0, with the data
# loader) and last stage (GPU 1), a DP2 replica (GPU 1); on 4, a TP2 x DP2 + SP peer (GPU 1), DP2 x PP2's stages 0
# (GPU 0) and 1 (GPU 3), a DP4 replica (GPU 2), PP4's first (GPU 0) and last (GPU 3) stage; each loaded at every
# duty in DUTIES (0.3 0.5) from iteration 8 of ITERS (30), for each size in SIZES_LIST (1.3b_mb8 345m), and each
# job healthy HEALTHY_RUNS times (2: one before its loaded cases, one after). ONLY="tp2 pp2" keeps those layouts;
# LIST=1 prints the cases and runs nothing. A case takes ~1.5 min at 1.3b_mb8 on H200 (start-up included), less
# at 345m: the 2-GPU matrix is 28 cases (~40 min), so run it in parts into one RESULTS, e.g.
# `MATRIX=1 ONLY=tp2 SIZES_LIST=1.3b_mb8` (4 cases) or `ONLY=pp2 SIZES_LIST=1.3b_mb8 DUTIES=0.5` (4), then
# `python bench/detection_matrix.py RESULTS` tabulates every case there, each judged PASS or FAIL.
# Outputs under ${RESULTS:-bench_results}/detect_<name>/ (case.json: the case and the job's exit status; log,
# report.txt, report.json with each window judged alone (--per-window), trace files).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpt345m_setup.sh --data-later
MATRIX_ONSET=8
if [[ ${MATRIX:-0} == 1 ]]; then ITERS=${ITERS:-30}; else ITERS=${ITERS:-40}; fi
declare -A LAYOUT_FLAGS=([1]="" [dp2]="" [dp4]="" [tp2]="--tensor-model-parallel-size 2 --sequence-parallel"
    [pp2]="--pipeline-model-parallel-size 2" [pp4]="--pipeline-model-parallel-size 4"
    [dp2pp2]="--pipeline-model-parallel-size 2" [tp2dp2]="--tensor-model-parallel-size 2 --sequence-parallel"
    [tp2pp2]="--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2")
declare -A LAYOUT_PROCS=([1]=1 [dp2]=2 [dp4]=4 [tp2]=2 [pp2]=2 [pp4]=4 [dp2pp2]=4 [tp2dp2]=4 [tp2pp2]=4)
# The matrix's loads by GPU count, "<layout>:<GPU under load>", in the order they run (header comment).
declare -A MATRIX_LOADS=([2]="tp2:1 pp2:0 pp2:1 dp2:1" [4]="tp2dp2:1 dp2pp2:0 dp2pp2:3 dp4:2 pp4:0 pp4:3")
TRACE=(--trace --trace-interval 5 --continuous-trace-iterations 2 --trace-detect --log-interval 1)

fail() {
    echo "gpu_megascan_detection.sh: $*" >&2
    exit 2
}

sorted_words() {
    printf '%s\n' "$@" | LC_ALL=C sort | paste -sd ' '
}

# The matrix's cases (header comment), one "name:model:layout:gpu:duty:onset" a line: each job's first healthy
# run before its loaded ones and the others after, so that a drift of the machine shows between them.
matrix_cases() {
    local gpus=${GPUS:-$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU')} layouts size layout load duty run
    [[ -n ${MATRIX_LOADS[$gpus]+set} ]] || fail "MATRIX=1: the matrix is for 2 or 4 GPUs and GPUS is $gpus" \
        "(nvidia-smi's count unless set); set GPUS=2 or GPUS=4 (the first GPUS GPUs are used)"
    layouts=$(for load in ${MATRIX_LOADS[$gpus]}; do echo "${load%%:*}"; done | uniq | tr '\n' ' ')
    for layout in ${ONLY-}; do
        [[ " $layouts" == *" $layout "* ]] || fail "ONLY: no layout '$layout' in the $gpus-GPU matrix;" \
            "its layouts are ${layouts% }"
    done
    [[ ${HEALTHY_RUNS:-2} =~ ^[0-9]+$ ]] || fail "HEALTHY_RUNS: '$HEALTHY_RUNS' is not a number of runs"
    for size in ${SIZES_LIST-1.3b_mb8 345m}; do
        [[ $size == tiny || -n ${SIZES[$size]+set} ]] || fail "SIZES_LIST: no size '$size'; the sizes are tiny" \
            "$(sorted_words "${!SIZES[@]}")"
        for layout in $layouts; do
            [[ -z ${ONLY-} || " $ONLY " == *" $layout "* ]] || continue
            (( ${HEALTHY_RUNS:-2} > 0 )) && echo "$size-$layout-healthy-1:$size:$layout:none::$MATRIX_ONSET"
            for load in ${MATRIX_LOADS[$gpus]}; do
                [[ ${load%%:*} == "$layout" ]] || continue
                for duty in ${DUTIES-0.3 0.5}; do
                    echo "$size-$layout-gpu${load#*:}-d$duty:$size:$layout:${load#*:}:$duty:$MATRIX_ONSET"
                done
            done
            for (( run = 2; run <= ${HEALTHY_RUNS:-2}; run++ )); do
                echo "$size-$layout-healthy-$run:$size:$layout:none::$MATRIX_ONSET"
            done
        done
    done
}

# One line naming the case's bad field, before any case runs.
check_case() {
    local name=$1 model=$2 layout=$3 gpu=$4 duty=$5 onset=$6
    [[ $name =~ ^[A-Za-z0-9._-]+$ ]] || fail "case '$name': name it with letters, digits, '.', '_' or '-'"
    [[ $model == tiny || ( -n $model && -n ${SIZES[$model]+set} ) ]] || fail "case $name: no model '$model';" \
        "the models are tiny $(sorted_words "${!SIZES[@]}")"
    [[ -n $layout && -n ${LAYOUT_PROCS[$layout]+set} ]] || fail "case $name: no layout '$layout'; the layouts are" \
        "$(sorted_words "${!LAYOUT_PROCS[@]}")"
    [[ $gpu == none || $gpu =~ ^[0-9]+$ ]] || fail "case $name: GPU '$gpu' is neither a GPU index nor none"
    [[ $gpu == none || $duty =~ ^(0?\.[0-9]*[1-9][0-9]*|1(\.0*)?)$ ]] || fail "case $name: duty '$duty' is" \
        "not a number in (0, 1]"
    [[ $onset =~ ^[0-9]+$ ]] || fail "case $name: onset '$onset' is not an iteration number"
}

# case.json, which bench/detection_matrix.py reads: the case, the rank under load (on one host, the GPU's
# index) and the job's exit status (null until the job ended: a case cut off by a time limit keeps it null).
write_case_spec() {  # directory name model layout gpu duty onset exit-status
    python3 - "$@" "$ITERS" <<'EOF'
import json, os, sys
directory, name, model, layout, gpu, duty, onset, status, iterations = sys.argv[1:]
loaded = gpu != "none"
spec = {"name": name, "model": model, "layout": layout, "gpu": int(gpu) if loaded else None,
        "loaded_rank": int(gpu) if loaded else None, "duty": float(duty) if loaded else None,
        "onset": int(onset), "iterations": int(iterations), "exit": int(status) if status else None}
path = os.path.join(directory, "case.json")
with open(path + ".partial", "w") as out:
    json.dump(spec, out, indent=1)
os.replace(path + ".partial", path)  # a reader never sees half a spec
EOF
}

# Start the competing load on GPU $1 (duty $2) once $3 (a log) shows iteration $4, unless the job ($5) ended
# first; mark in that log when its GEMMs begin (appended lines: the job's own lines stay whole). Its pid: file $6.
load_from_iteration() {
    until grep -qE "iteration +$4/" "$3" 2>/dev/null; do
        kill -0 "$5" 2>/dev/null || return 0
        sleep 0.2
    done
    python3 scripts/gpu_load.py --gpu "$1" --duty "$2" --size 8192 --duration 600 --pid-file "$6" |
        while IFS= read -r line; do
            echo "$line"
            [[ $line == "gpu_load: "*" GEMMs on GPU"* ]] && echo "== competing load began" >> "$3"
        done
}

# Stop the load that the subshell $1 started: it may still be importing torch when the job ends, so wait for its
# pid file $2 (or for the subshell's end: a load that failed, or never began), then SIGTERM it by that pid; it
# prints its summary through the marking loop, which then ends.
stop_load() {
    while kill -0 "$1" 2>/dev/null && [[ ! -s $2 ]]; do sleep 0.2; done
    [[ -s $2 ]] && kill -TERM "$(cat "$2")" 2>/dev/null
    wait "$1" 2>/dev/null
}

# The case's training job, into the caller's redirection.
train() {
    local model=$1 layout=$2 dir=$3 nproc=${LAYOUT_PROCS[$2]}
    if [[ $model == tiny ]]; then
        local tp=1 pp=1
        [[ $layout == *tp2* ]] && tp=2
        [[ $layout == *pp2* ]] && pp=2
        [[ $layout == *pp4* ]] && pp=4
        NPROC=$nproc TP=$tp PP=$pp DEVICE=${DEVICE:-cuda} TRAIN_ITERS=$ITERS DATA_PATH=$RESULTS/data/gpt_text_document \
            CHECKPOINT_DIR=$dir/checkpoints timeout 240 bash examples/gpt3/train_gpt_tiny.sh \
            "${TRACE[@]}" ${EXTRA:-} --trace-dir "$dir/trace"
    else
        timeout 240 torchrun --nproc_per_node "$nproc" pretrain_gpt.py "${MODEL[@]}" ${SIZES[$model]} \
            ${LAYOUT_FLAGS[$layout]} --train-iters "$ITERS" "${TRACE[@]}" ${EXTRA:-} --trace-dir "$dir/trace"
    fi
}

run_case() {
    local name=$1 model=$2 layout=$3 gpu=$4 duty=$5 onset=$6
    local dir=$RESULTS/detect_$name load_pid= job_pid status
    rm -rf "$dir" && mkdir -p "$dir"
    local log=$dir/log
    write_case_spec "$dir" "$name" "$model" "$layout" "$gpu" "$duty" "$onset" ""
    : > "$log"  # the job appends (O_APPEND), so the load's marker line is not overwritten
    train "$model" "$layout" "$dir" >> "$log" 2>&1 &
    job_pid=$!
    if [[ $gpu != none ]]; then
        load_from_iteration "$gpu" "$duty" "$log" "$onset" "$job_pid" "$dir/load.pid" > "$dir/load.log" 2>&1 &
        load_pid=$!
    fi
    wait "$job_pid"
    status=$?
    write_case_spec "$dir" "$name" "$model" "$layout" "$gpu" "$duty" "$onset" "$status"
    echo "== $name ($model, $layout, load on GPU $gpu duty $duty from iteration $onset): exit $status"
    [[ -n $load_pid ]] && stop_load "$load_pid" "$dir/load.pid"
    [[ $gpu != none ]] && python3 bench/detection_case.py "$dir"
    grep "MegaScan alert" "$log" | head -3
    python3 tools/aggregate.py -b "$dir/trace" -o "$dir/merged.json" --per-window --report-json "$dir/report.json" \
        > "$dir/report.txt" 2>&1
    grep -vE "^  (Chrome|detection report|done)" "$dir/report.txt" | head -25
    rm -rf "$dir/checkpoints" "$dir/merged.json"
}

# Interrupted (Ctrl-C, a time limit's SIGTERM): the running case's job (timeout passes the signal on to torchrun)
# and load are stopped before the script ends; that case's case.json keeps "exit": null.
interrupted() {
    if [[ -n ${job_pid-} ]]; then
        pkill -TERM -P "$job_pid"
        wait "$job_pid" 2>/dev/null  # (not a child any more when the job had ended)
    fi
    [[ -n ${load_pid-} ]] && stop_load "$load_pid" "$dir/load.pid"
    exit 130
}

if [[ ${MATRIX:-0} == 1 ]]; then
    [[ -z ${CASES-} ]] || fail "MATRIX=1 makes its own cases: leave CASES unset (ONLY, SIZES_LIST, DUTIES and" \
        "HEALTHY_RUNS choose among them)"
    cases=$(matrix_cases) || exit 2
else
    cases=${CASES-}
fi
for case in $cases; do
    IFS=: read -r name model layout gpu duty onset <<< "$case"
    check_case "$name" "$model" "$layout" "$gpu" "${duty:-1}" "${onset:-10}"
done
if [[ ${LIST:-0} == 1 ]]; then
    [[ -z $cases ]] || printf '%s\n' $cases
    echo "$(wc -w <<< "$cases") case(s) of $ITERS iterations"
    exit 0
fi
prepare_gpt_data
trap interrupted INT TERM
for case in $cases; do
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
