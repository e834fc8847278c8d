#!/usr/bin/env bash
# MegaFBD in the container: forward and backward instances of the tiny GPT (mock data): PP2 on 4 GPUs
# (a backward and a forward process per stage), PP1 on 2 or 3 GPUs, PP2 on 4 CPU processes without
# 2 GPUs; the backward side's checkpoint goes to OUTPUT_DIR/megafbd/checkpoints.
# Environment: TRAIN_ITERS (10).
#   bash docker/DockerUsage_MegaFBD.sh OUTPUT_DIR [extra pretrain_gpt.py flags]
source "$(dirname "$0")/common.sh"
GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -ge 4 ]; then NPROC=4 PP=2 DEVICE=cuda
elif [ "$GPUS" -ge 2 ]; then NPROC=2 PP=1 DEVICE=cuda
else NPROC=4 PP=2 DEVICE=cpu
fi
mkdir -p "$OUT_DIR/megafbd"
echo "MegaFBD on $NPROC processes (PP$PP, half forward, half backward), device $DEVICE"
"$PYTHON" -m torch.distributed.run --nproc_per_node "$NPROC" --master-port "${MASTER_PORT:-29500}" pretrain_gpt.py \
    --device "$DEVICE" --forward-backward-disaggregating \
    --pipeline-model-parallel-size "$PP" --recompute-granularity full --recompute-method uniform \
    --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
    --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --train-iters "${TRAIN_ITERS:-10}" --lr-warmup-iters 2 \
    --mock-data --vocab-size 1000 --log-interval 1 --save "$OUT_DIR/megafbd/checkpoints" \
    "$@" 2>&1 | tee "$OUT_DIR/megafbd/train.log"
