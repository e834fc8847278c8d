#!/usr/bin/env bash
# The parallel layouts against plain-PyTorch DDP, side by side on the GPUs of this machine (docs/benchmarks.md).
# GPT 1.3B (24 layers, hidden 2048, 16 heads, sequence 2048), bf16, dropout 0, micro batch 4, global batch 64:
# first the reference, bench/reference_gpt.py under torchrun (DDP on every GPU, flash attention, fused AdamW),
# then pretrain_gpt.py at each layout with its defaults; GPT 345M at PP2 x DP against 345M DP; a
# Llama-3-8B-shaped model (32 layers, hidden 4096, GQA with 8 groups, SwiGLU 14336, RMSNorm, RoPE, vocabulary
# 128256, sequence 4096, mock data) with its model FLOP utilization against the H200's 989 dense bf16 TFLOP/s.
# Each row: ms per iteration (the mean of iterations ITERS/2+1..ITERS), TFLOP/s per GPU, the largest peak memory
# of the ranks that log, the ratio to its reference row, and the seconds from the last iteration to the exit.
#   [ROWS="ref tp2_dp2_sp ..."] [EXTRA_ROWS="name|gpus|reference|ENV=value ...|flags;..."] [ITERS=20]
#   [RESULTS=dir] bash bench/layouts.sh
# ROWS defaults to the rows made for the number of GPUs found (2 or 4); EXTRA_ROWS adds variants (a lever measured alone,
# e.g. "tp2_dp2_sp_cdmc8|4|ref|CUDA_DEVICE_MAX_CONNECTIONS=8|--tensor-model-parallel-size 2 --sequence-parallel").
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpt345m_setup.sh
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
ITERS=${ITERS:-20}
OUTDIR=$RESULTS/layouts
mkdir -p "$OUTDIR"
GPT13B=(${SIZES[1.3b]} --micro-batch-size 4 --global-batch-size 64)
LLAMA8B=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8
         --ffn-hidden-size 14336 --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope
         --untie-embeddings-and-output-weights --seq-length 4096 --max-position-embeddings 4096
         --micro-batch-size 1 --global-batch-size 16 --mock-data --tokenizer-type NullTokenizer --vocab-size 128256)
# name|GPUs|reference row (or mfu)|environment|flags after the model's
ROW_LIST=(
    "ref|$GPUS|-||"
    "dp$GPUS|$GPUS|ref||"
    "tp2_sp|2|ref||--tensor-model-parallel-size 2 --sequence-parallel"
    "pp2|2|ref||--pipeline-model-parallel-size 2"
    "tp2_dp2_sp|4|ref||--tensor-model-parallel-size 2 --sequence-parallel"
    "tp4_sp|4|ref||--tensor-model-parallel-size 4 --sequence-parallel"
    "pp2_dp2|4|ref||--pipeline-model-parallel-size 2"
    "pp4|4|ref||--pipeline-model-parallel-size 4"
    "345m_dp4|4|-||"
    "345m_pp2_dp2|4|345m_dp4||--pipeline-model-parallel-size 2"
    "llama8b_tp2_pp2|4|mfu||--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2"
    "llama8b_tp4|4|mfu||--tensor-model-parallel-size 4 --sequence-parallel"
)
IFS=';' read -ra extra <<< "${EXTRA_ROWS:-}"
declare -A ROW
order=() default_rows=()
for row in "${ROW_LIST[@]}" "${extra[@]}"; do
    [[ -n $row ]] || continue
    IFS='|' read -r name gpus _ <<< "$row"
    ROW[$name]=$row
    order+=("$name")
    ((gpus == GPUS)) && default_rows+=("$name")
done

model_of() {  # the model flags of a row: GPT 345M and 1.3B take the shared data and optimizer flags
    case $1 in
        345m_*) model_flags dp ;;
        llama8b_*) model_flags dp | sed -e '/^--data-path$/,+1d' -e '/^--tokenizer-type$/,+1d' \
                       -e '/^--vocab-file$/,+1d' -e '/^--merge-file$/,+1d'; printf '%s\n' "${LLAMA8B[@]}" ;;
        *) model_flags dp; printf '%s\n' "${GPT13B[@]}" ;;
    esac
}
iters_of() { [[ $1 == llama8b_* ]] && echo $((ITERS / 2)) || echo "$ITERS"; }

run_row() {  # name: the job, then ms, TFLOP/s, peak MB and exit seconds into $OUTDIR/NAME.row
    local name=$1 gpus env flags iters log job last
    IFS='|' read -r _ gpus _ env flags <<< "${ROW[$name]}"
    log=$OUTDIR/$name.log
    iters=$(iters_of "$name")
    if [[ $name == ref ]]; then
        timeout "${ROW_TIMEOUT:-300}" torchrun --standalone --nproc_per_node "$gpus" bench/reference_gpt.py \
            --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --vocab-size 50304 \
            --micro-batch-size 4 --global-batch-size 64 --dropout 0 > "$log" 2>&1
        sed -nE 's/.*: ([0-9.]+) ms\/iteration ([0-9.]+) TFLOP\/s peak memory \(MB\): ([0-9]+).*/\1 \2 \3 -/p' \
            "$log" > "$OUTDIR/$name.row"
        return
    fi
    mapfile -t model < <(model_of "$name")
    env $env timeout "${ROW_TIMEOUT:-300}" torchrun --standalone --nproc_per_node "$gpus" pretrain_gpt.py \
        "${model[@]}" --hidden-dropout 0 --attention-dropout 0 --train-iters "$iters" --log-interval $((iters / 2)) \
        $flags > "$log" 2>&1 &
    job=$!
    until grep -qE "iteration +$iters/" "$log" 2>/dev/null || ! kill -0 "$job" 2>/dev/null; do sleep 0.2; done
    last=$SECONDS
    local waited=0 exit_s
    until ! kill -0 "$job" 2>/dev/null || ((waited++ > ${EXIT_WAIT:-30} * 5)); do sleep 0.2; done
    exit_s=$((SECONDS - last))
    if kill -0 "$job" 2>/dev/null; then  # rows run one at a time: every pretrain_gpt.py process is this row's
        pkill -f pretrain_gpt.py; exit_s="hung>${EXIT_WAIT:-30}"
    fi
    wait "$job"
    local line ms tflops peak
    line=$(grep -E "iteration +$iters/" "$log" | tail -1)
    ms=$(sed -nE 's/.*per iteration \(ms\): ([0-9.]+).*/\1/p' <<< "$line")
    tflops=$(sed -nE 's/.*TFLOP\/s\/GPU\): ([0-9.]+).*/\1/p' <<< "$line")
    peak=$(grep -E "iteration +$iters/" "$log" | sed -nE 's/.*peak memory \(MB\): ([0-9]+).*/\1/p' | sort -n | tail -1)
    [[ -n $line ]] && echo "${ms:--} ${tflops:--} ${peak:--} $exit_s" > "$OUTDIR/$name.row"
}

table=$OUTDIR/table.txt
printf '%-22s %5s %9s %9s %9s %14s %6s  %s\n' layout GPUs ms/iter TFLOP/s peak_MB "ratio" exit_s graphs > "$table"
for name in ${ROWS:-${default_rows[*]}}; do
    [[ -v ROW[$name] ]] || { echo "ROWS: $name is none of ${order[*]}" >&2; exit 2; }
    IFS='|' read -r _ gpus reference _ _ <<< "${ROW[$name]}"
    ((gpus <= GPUS)) || { echo "$name: needs $gpus GPUs, $GPUS found; skipped" | tee -a "$table"; continue; }
    rm -f "$OUTDIR/$name.row"
    run_row "$name"
    read -r ms tflops peak exit_s < "$OUTDIR/$name.row" 2>/dev/null || { ms=failed tflops=- peak=- exit_s=-; }
    ratio=-
    if [[ $reference == mfu && $tflops != - ]]; then
        ratio=$(python3 -c "print(f'{$tflops / 989:.1%} MFU')")
    elif [[ $reference != - && -f $OUTDIR/$reference.row ]]; then
        read -r _ ref_tflops _ _ < "$OUTDIR/$reference.row"
        [[ $tflops != - && -n $ref_tflops ]] && ratio=$(python3 -c "print(f'{$tflops / $ref_tflops:.2f}x {\"$reference\"}')")
    fi
    graphs=$(grep -m1 -oE 'CUDA graphs: [^;|]*' "$OUTDIR/$name.log" 2>/dev/null | cut -c14-)
    printf '%-22s %5s %9s %9s %9s %14s %6s  %s\n' "$name" "$gpus" "$ms" "$tflops" "$peak" "$ratio" "$exit_s" \
        "${graphs:--}" | tee -a "$table"
done
echo "table: $table (logs beside it)"
