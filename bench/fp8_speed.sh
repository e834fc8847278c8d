#!/usr/bin/env bash
# FP8 against our own bf16 default and against plain PyTorch with torchao's float8, side by side in one run on one
# GPU of compute capability 8.9+ (docs/benchmarks.md#fp8-linear-gemms-on-one-gpu). For each shape in SHAPES: GPT 1.3B
# (24 layers, hidden 2048, 16 heads, sequence 2048, the sample corpus, micro batch 4, global batch 16) and the
# Llama-3-8B shape with 8 layers (hidden 4096, GQA 32/8, SwiGLU 14336, RMSNorm, RoPE, vocabulary 128256, sequence
# 4096, mock data, micro batch 1, global batch 8), dropout 0; rows (ROWS):
#   bf16               pretrain_gpt.py's defaults (SDPA, CUDA graphs, fused Adam): what FP8 must beat
#   fp8_tensorwise     --fp8-format hybrid --fp8-recipe tensorwise, the layers eager (inside their CUDA graphs)
#   fp8_rowwise        --fp8-format hybrid --fp8-recipe rowwise, eager
#   fp8_tensorwise_compiled, fp8_rowwise_compiled, bf16_compiled   the same with --compile-transformer-layers
#   ref_fp8_tensorwise, ref_fp8_rowwise, ref_bf16   bench/reference_gpt.py of the same shape under torch.compile
#                      (torchao's convert_to_float8_training for the fp8 ones)
# Each row: ms per iteration (ours: the log line of iterations ITERS/2+1..ITERS; the reference: 20 iterations after 5
# warm-up ones), TFLOP/s (the same FLOP count for bf16 and FP8: the ratio is the speed-up), peak memory, and the
# ratio to the shape's bf16 row and to its ref_fp8_tensorwise row. Logs and table under ${RESULTS:-bench_results}/fp8.
#   [SHAPES="gpt1.3b llama8b_8l"] [ROWS="..."] [ITERS=16] [TORCHAO_WHEEL=path/to/torchao-*.whl] bash bench/fp8_speed.sh
# TORCHAO_WHEEL: installed (--no-deps) when torchao is missing, for a machine without a package index.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpt345m_setup.sh
if ! python3 -c "import torchao" 2>/dev/null; then
    [[ -n ${TORCHAO_WHEEL:-} ]] || { echo "fp8_speed.sh: torchao is missing: pip install -e '.[fp8]' or set TORCHAO_WHEEL" >&2; exit 2; }
    python3 -m pip install -q --no-deps "$TORCHAO_WHEEL" || exit 2
fi
ITERS=${ITERS:-16}
OUTDIR=$RESULTS/fp8
mkdir -p "$OUTDIR"
export TORCHINDUCTOR_CACHE_DIR=$OUTDIR/inductor_cache  # rows that compile the same graph compile it once

declare -A OURS=([gpt1.3b]="${SIZES[1.3b]} --micro-batch-size 4 --global-batch-size 16"
                 [llama8b_8l]="--num-layers 8 --hidden-size 4096 --num-attention-heads 32 --group-query-attention
                     --num-query-groups 8 --ffn-hidden-size 14336 --swiglu --normalization RMSNorm --disable-bias-linear
                     --position-embedding-type rope --untie-embeddings-and-output-weights --seq-length 4096
                     --max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 8 --mock-data
                     --tokenizer-type NullTokenizer --vocab-size 128256")
declare -A REFERENCE=([gpt1.3b]="--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
                          --vocab-size 50304 --micro-batch-size 4 --global-batch-size 16"
                      [llama8b_8l]="--num-layers 8 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8
                          --ffn-hidden-size 14336 --swiglu --normalization RMSNorm --disable-bias-linear
                          --seq-length 4096 --vocab-size 128256 --micro-batch-size 1 --global-batch-size 8")
declare -A FLAGS=([bf16]="" [bf16_compiled]="--compile-transformer-layers"
                  [fp8_tensorwise]="--fp8-format hybrid --fp8-recipe tensorwise"
                  [fp8_rowwise]="--fp8-format hybrid --fp8-recipe rowwise"
                  [fp8_tensorwise_compiled]="--fp8-format hybrid --fp8-recipe tensorwise --compile-transformer-layers"
                  [fp8_rowwise_compiled]="--fp8-format hybrid --fp8-recipe rowwise --compile-transformer-layers"
                  [ref_bf16]="--compile" [ref_fp8_tensorwise]="--compile --fp8 --fp8-recipe tensorwise"
                  [ref_fp8_rowwise]="--compile --fp8 --fp8-recipe rowwise")
ROW_NAMES=${ROWS:-bf16 fp8_tensorwise fp8_tensorwise_compiled fp8_rowwise_compiled ref_fp8_tensorwise}

our_model() {  # GPT 345M's shared flags (data, optimizer, bf16) with the shape's; the Llama shape takes mock data
    if [[ $1 == llama8b_8l ]]; then
        printf '%s\n' "${MODEL[@]}" | sed -e '/^--data-path$/,+1d' -e '/^--tokenizer-type$/,+1d' \
            -e '/^--vocab-file$/,+1d' -e '/^--merge-file$/,+1d'
    else
        printf '%s\n' "${MODEL[@]}"
    fi
    printf '%s\n' ${OURS[$1]}
}

run() {  # shape, row: "ms TFLOP/s peak_MB" on stdout (dashes for a run that failed)
    local shape=$1 row=$2 log=$OUTDIR/$1_$2.log line
    if [[ $row == ref_* ]]; then
        timeout "${RUN_TIMEOUT:-300}" python3 bench/reference_gpt.py ${REFERENCE[$shape]} --dropout 0 ${FLAGS[$row]} \
            > "$log" 2>&1
        line=$(sed -nE 's/.*: ([0-9.]+) ms\/iteration ([0-9.]+) TFLOP\/s peak memory \(MB\): ([0-9]+).*/\1 \2 \3/p' "$log")
        echo "${line:-- - -}"
        return
    fi
    local model
    mapfile -t model < <(our_model "$shape")
    timeout "${RUN_TIMEOUT:-300}" torchrun --standalone --nproc_per_node 1 pretrain_gpt.py "${model[@]}" \
        --hidden-dropout 0 --attention-dropout 0 --train-iters "$ITERS" --log-interval $((ITERS / 2)) \
        ${FLAGS[$row]} > "$log" 2>&1
    line=$(grep -E "iteration +$ITERS/" "$log" | tail -1)
    echo "$(sed -nE 's/.*per iteration \(ms\): ([0-9.]+).*/\1/p' <<< "$line" | grep . || echo -)" \
         "$(sed -nE 's/.*TFLOP\/s\/GPU\): ([0-9.]+).*/\1/p' <<< "$line" | grep . || echo -)" \
         "$(sed -nE 's/.*peak memory \(MB\): ([0-9]+).*/\1/p' <<< "$line" | grep . || echo -)"
}

ratio() {  # TFLOP/s over a reference's, or -
    [[ $1 != - && -n $2 && $2 != - ]] && python3 -c "print(f'{$1 / $2:.2f}x')" || echo -
}

table=$OUTDIR/table.txt
python3 -c "import torch; print(torch.cuda.get_device_name(), 'torch', torch.__version__)" > "$table"
printf '%-11s %-24s %9s %9s %9s %8s %11s\n' shape row ms/iter TFLOP/s peak_MB vs_bf16 vs_ref_fp8 | tee -a "$table"
for shape in ${SHAPES:-gpt1.3b llama8b_8l}; do
    [[ -v OURS[$shape] ]] || { echo "SHAPES: $shape is none of ${!OURS[*]}" >&2; exit 2; }
    declare -A tflops_of=()
    # The rows the ratios refer to run first, whatever ROWS's order.
    for row in bf16 ref_fp8_tensorwise $ROW_NAMES; do
        [[ -v FLAGS[$row] ]] || { echo "ROWS: $row is none of ${!FLAGS[*]}" >&2; exit 2; }
        [[ -v tflops_of[$row] ]] && continue
        read -r ms tflops peak < <(run "$shape" "$row")
        tflops_of[$row]=$tflops
        printf '%-11s %-24s %9s %9s %9s %8s %11s\n' "$shape" "$row" "$ms" "$tflops" "$peak" \
            "$(ratio "$tflops" "${tflops_of[bf16]:-}")" "$(ratio "$tflops" "${tflops_of[ref_fp8_tensorwise]:-}")" \
            | tee -a "$table"
    done
    unset tflops_of
done
echo "table: $table (logs beside it)"
