#!/usr/bin/env bash
# A tiny GPT (4 layers, hidden 128) on the sample data: the quickstart's job, minutes on a laptop CPU.
# Environment: DATA_PATH (prefix from tools/preprocess_data.py), CHECKPOINT_DIR, NPROC (4), TP (2),
# PP (2), DEVICE (cpu|cuda), PYTHON (python3), TRAIN_ITERS (100; the learning-rate warm-up is a tenth of
# it, so that shorter runs still end it before the decay does). Extra arguments are passed on to pretrain_gpt.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -m torch.distributed.run --nproc_per_node "${NPROC:-4}" --master-port "${MASTER_PORT:-29500}" \
    pretrain_gpt.py \
    --device "${DEVICE:-cpu}" \
    --tensor-model-parallel-size "${TP:-2}" --pipeline-model-parallel-size "${PP:-2}" \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 512 \
    --seq-length 128 --max-position-embeddings 128 \
    --micro-batch-size 4 --global-batch-size 16 \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters $(( ${TRAIN_ITERS:-100} / 10 )) \
    --weight-decay 0.01 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 \
    --train-iters "${TRAIN_ITERS:-100}" \
    --data-path "${DATA_PATH:?set DATA_PATH to a preprocessed prefix}" --split 98,2,0 \
    --tokenizer-type GPT2BPETokenizer --vocab-file datasets/gpt/vocab.json --merge-file datasets/gpt/merges.txt \
    --log-interval 10 --eval-interval 50 --eval-iters 5 \
    --save "${CHECKPOINT_DIR:?set CHECKPOINT_DIR}" --save-interval 50 \
    --num-workers 1 "$@"
