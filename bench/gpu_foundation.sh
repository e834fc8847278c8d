#!/usr/bin/env bash
# The foundation's GPU figures in one go (docs/benchmarks.md): GPT 345M bf16 from pretrain_gpt.py
# at DP2, DP2 + distributed optimizer, TP2 and PP2 on two GPUs, then the loop-overhead comparison
# at each layout. Writes logs and JSON under ${RESULTS:-bench_results}.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-bench_results}
ITERS=${ITERS:-60}
mkdir -p "$RESULTS/data"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 tools/preprocess_data.py --input datasets/gpt/corpus.jsonl --output-prefix "$RESULTS/data/gpt" \
    --tokenizer-type GPT2BPETokenizer --vocab-file datasets/gpt/vocab.json \
    --merge-file datasets/gpt/merges.txt --append-eod --workers 8 || exit 1
MODEL=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
       --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 32 --bf16
       --lr 0.00015 --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 1e-2
       --clip-grad 1.0 --adam-beta2 0.95 --data-path "$RESULTS/data/gpt_text_document" --split 98,2,0
       --tokenizer-type GPT2BPETokenizer --vocab-file datasets/gpt/vocab.json
       --merge-file datasets/gpt/merges.txt --eval-interval 100000 --eval-iters 0)
declare -A LAYOUTS=([dp2]="" [dp2_distopt]="--use-distributed-optimizer"
                    [tp2]="--tensor-model-parallel-size 2" [pp2]="--pipeline-model-parallel-size 2")
for name in dp2 dp2_distopt tp2 pp2; do
    echo "=== train $name"
    timeout 240 torchrun --nproc_per_node 2 pretrain_gpt.py "${MODEL[@]}" ${LAYOUTS[$name]} \
        --train-iters "$ITERS" --log-interval 10 > "$RESULTS/train_$name.log" 2>&1
    echo "exit $?"; grep -E "iteration +[0-9]+/" "$RESULTS/train_$name.log" | tail -3 | cut -c1-330
done
for name in dp2 tp2 pp2; do
    echo "=== loop overhead $name"
    timeout 240 torchrun --nproc_per_node 2 bench/loop_overhead.py "${MODEL[@]}" ${LAYOUTS[$name]} \
        --train-iters 100 --log-interval 10 --bench-pairs 40 \
        --bench-json "$RESULTS/overhead_$name.json" > "$RESULTS/overhead_$name.log" 2>&1
    echo "exit $?"; grep "loop overhead" "$RESULTS/overhead_$name.log"
done
