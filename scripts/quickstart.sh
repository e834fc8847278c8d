#!/usr/bin/env bash
# The main job on the embedded default: install, turn the sample corpus into Megatron data, train a
# small GPT at TP2 x PP2 (4 CPU processes, or the local GPUs when there are any) with MegaScan tracing,
# save a checkpoint, merge the traces into one timeline and print the detection report.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh

OUT_DIR=${OUT_DIR:-outputs/quickstart}
mkdir -p "$OUT_DIR/data"
"$PYTHON" tools/preprocess_data.py --input datasets/gpt/corpus.jsonl --output-prefix "$OUT_DIR/data/gpt" \
    --tokenizer-type GPT2BPETokenizer --vocab-file datasets/gpt/vocab.json \
    --merge-file datasets/gpt/merges.txt --append-eod --workers 2

GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -ge 4 ]; then NPROC=4 TP=2 PP=2 DEVICE=cuda
elif [ "$GPUS" -ge 2 ]; then NPROC=2 TP=2 PP=1 DEVICE=cuda
elif [ "$GPUS" -eq 1 ]; then NPROC=1 TP=1 PP=1 DEVICE=cuda
else NPROC=4 TP=2 PP=2 DEVICE=cpu
fi
TRACE_DIR="$OUT_DIR/trace/$(date +%Y%m%d-%H%M%S)"  # a fresh directory: a run never writes into old traces
# A rerun trains from scratch into the same checkpoint directory, on purpose (--override-save): the checkpoints
# of the earlier run stay beside the new ones as iter_XXXXXXX.replaced-<time>.
echo "training on $NPROC process(es), TP$TP x PP$PP, device $DEVICE"
PYTHON="$PYTHON" NPROC=$NPROC TP=$TP PP=$PP DEVICE=$DEVICE \
    DATA_PATH="$OUT_DIR/data/gpt_text_document" CHECKPOINT_DIR="$OUT_DIR/checkpoints" \
    bash examples/gpt3/train_gpt_tiny.sh --trace --trace-dir "$TRACE_DIR" --trace-interval 50 --override-save \
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
