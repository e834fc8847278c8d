#!/usr/bin/env bash
# The quickstart's job in an installed environment (scripts/quickstart.sh installs first; the
# container's docker/DockerUsage_Quickstart.sh runs it as is): turn the sample corpus into Megatron
# data, train a small GPT at TP2 x PP2 (4 CPU processes, or the local GPUs when there are any) with
# MegaScan tracing, save a checkpoint, merge the traces into one timeline and print the detection
# report. Everything is written under OUT_DIR. Environment: OUT_DIR (outputs/quickstart), PYTHON
# (python3), TRAIN_ITERS (100), TRACE_INTERVAL (half of TRAIN_ITERS). Extra arguments go to pretrain_gpt.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
source scripts/job_helpers.sh

OUT_DIR=${OUT_DIR:-outputs/quickstart}
TRAIN_ITERS=${TRAIN_ITERS:-100}
prepare_sample_data "$OUT_DIR"
detect_layout
TRACE_DIR="$OUT_DIR/trace/$(date +%Y%m%d-%H%M%S)"  # a fresh directory: a run never writes into old traces
# A rerun trains from scratch into the same checkpoint directory, on purpose (--override-save): the checkpoints
# of the earlier run stay beside the new ones as iter_XXXXXXX.replaced-<time>.
echo "training on $NPROC process(es), TP$TP x PP$PP, device $DEVICE"
PYTHON="$PYTHON" NPROC=$NPROC TP=$TP PP=$PP DEVICE=$DEVICE TRAIN_ITERS=$TRAIN_ITERS \
    DATA_PATH="$OUT_DIR/data/gpt_text_document" CHECKPOINT_DIR="$OUT_DIR/checkpoints" \
    bash examples/gpt3/train_gpt_tiny.sh --trace --trace-dir "$TRACE_DIR" --override-save \
    --trace-interval "${TRACE_INTERVAL:-$((TRAIN_ITERS / 2))}" "$@" \
    2>&1 | tee "$OUT_DIR/train.log"
echo
"$PYTHON" tools/aggregate.py -b "$TRACE_DIR" -d

echo
echo "outputs:"
echo "  data:        $OUT_DIR/data/gpt_text_document.{bin,idx}"
echo "  checkpoint:  $OUT_DIR/checkpoints/iter_$(printf %07d "$(cat "$OUT_DIR/checkpoints/latest_checkpointed_iteration.txt")")"
echo "  log:         $OUT_DIR/train.log"
echo "  traces:      $TRACE_DIR (merged timeline: $TRACE_DIR/benchmark.json, open in ui.perfetto.dev)"
echo
echo "serve the checkpoint (REST on :5000, MegaScope WebSocket on :5001):"
echo "  NPROC=$NPROC TP=$TP PP=$PP DEVICE=$DEVICE bash examples/inference/a_text_generation_server_bash_script.sh" \
     "$OUT_DIR/checkpoints datasets/gpt --num-layers 4 --hidden-size 128 --num-attention-heads 4" \
     "--ffn-hidden-size 512 --seq-length 128 --max-position-embeddings 128"
