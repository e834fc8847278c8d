#!/usr/bin/env bash
# GPT-3 345M (24 layers, hidden 1024, 16 heads, sequence 1024) in bf16 on GPUs.
# Environment: GPUS_PER_NODE (all visible), NNODES (1), NODE_RANK (0), MASTER_ADDR (localhost),
# MASTER_PORT (6000), TP (1), PP (1), MICRO_BATCH (4), GLOBAL_BATCH (32), TRAIN_ITERS (500000),
# DATA_PATH (a preprocessed prefix; unset: --mock-data), VOCAB_FILE + MERGE_FILE (GPT-2 BPE files,
# default: the sample vocabulary), CHECKPOINT_PATH (unset: no checkpoints).
# Extra arguments are passed on, e.g. --use-distributed-optimizer or --sequence-parallel.
set -euo pipefail
cd "$(dirname "$0")/../.."
GPUS_PER_NODE=${GPUS_PER_NODE:-$(python3 -c "import torch; print(torch.cuda.device_count())")}

DATA_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file "${VOCAB_FILE:-datasets/gpt/vocab.json}"
           --merge-file "${MERGE_FILE:-datasets/gpt/merges.txt}" --split 949,50,1)
if [ -n "${DATA_PATH:-}" ]; then DATA_ARGS+=(--data-path "$DATA_PATH"); else DATA_ARGS+=(--mock-data); fi
OUTPUT_ARGS=(--log-interval 10 --eval-interval 1000 --eval-iters 10)
if [ -n "${CHECKPOINT_PATH:-}" ]; then
    OUTPUT_ARGS+=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval 10000)
fi

torchrun --nproc_per_node "$GPUS_PER_NODE" --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-6000}" \
    pretrain_gpt.py \
    --tensor-model-parallel-size "${TP:-1}" --pipeline-model-parallel-size "${PP:-1}" \
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --seq-length 1024 --max-position-embeddings 1024 \
    --micro-batch-size "${MICRO_BATCH:-4}" --global-batch-size "${GLOBAL_BATCH:-32}" \
    --lr 0.00015 --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-fraction .01 \
    --weight-decay 1e-2 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.02 \
    --train-iters "${TRAIN_ITERS:-500000}" --bf16 \
    "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
