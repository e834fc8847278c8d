#!/usr/bin/env bash
# MegaDPP in the container: the dynamic pipeline schedule over every GPU as one pipeline stage each
# (2, 4 or 8 stages: the largest that fits; interleaved, 2 model chunks per stage), or over 4 CPU
# processes without 2 GPUs, on the sample data; each rank's executed order goes to
# OUTPUT_DIR/megadpp/schedule.json. Environment: DPP_POLICY (depth-first), TRAIN_ITERS (20).
#   bash docker/DockerUsage_MegaDPP.sh OUTPUT_DIR [extra pretrain_gpt.py flags]
source "$(dirname "$0")/common.sh"
prepare_sample_data "$OUT_DIR"
GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -ge 8 ]; then PP=8 DEVICE=cuda
elif [ "$GPUS" -ge 4 ]; then PP=4 DEVICE=cuda
elif [ "$GPUS" -ge 2 ]; then PP=2 DEVICE=cuda
else PP=4 DEVICE=cpu
fi
mkdir -p "$OUT_DIR/megadpp"
echo "MegaDPP on $PP pipeline stages, device $DEVICE"
"$PYTHON" -m torch.distributed.run --nproc_per_node "$PP" --master-port "${MASTER_PORT:-29500}" pretrain_gpt.py \
    --device "$DEVICE" --pipeline-model-parallel-size "$PP" --num-layers-per-virtual-pipeline-stage 1 \
    --use-dpp --dpp-policy "${DPP_POLICY:-depth-first}" --dpp-log-schedule "$OUT_DIR/megadpp/schedule.json" \
    --num-layers $((2 * PP)) --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 \
    --micro-batch-size 2 --global-batch-size 16 --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine \
    --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 \
    --init-method-std 0.006 --train-iters "${TRAIN_ITERS:-20}" \
    --data-path "$OUT_DIR/data/gpt_text_document" --split 98,2,0 \
    --tokenizer-type GPT2BPETokenizer --vocab-file datasets/gpt/vocab.json --merge-file datasets/gpt/merges.txt \
    --log-interval 5 --eval-interval 10 --eval-iters 2 "$@" 2>&1 | tee "$OUT_DIR/megadpp/train.log"
echo "schedule each rank ran: $OUT_DIR/megadpp/schedule.json"
