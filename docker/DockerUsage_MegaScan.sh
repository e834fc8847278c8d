#!/usr/bin/env bash
# MegaScan in the container: a traced run of the tiny GPT on the detected GPUs (or CPU processes),
# tracing 2 of every 5 iterations, then tools/aggregate.py merges the per-rank traces into one
# timeline and runs the detection. SLOW_RANK=R slows rank R's layers SLOW_FACTOR (3) times, a
# fault for the detection to find. Writes under OUTPUT_DIR/megascan.
#   bash docker/DockerUsage_MegaScan.sh OUTPUT_DIR [extra pretrain_gpt.py flags]
source "$(dirname "$0")/common.sh"
FAULT=()
if [ -n "${SLOW_RANK:-}" ]; then
    FAULT=(--inject-slowdown-rank "$SLOW_RANK" --inject-slowdown-factor "${SLOW_FACTOR:-3}")
fi
OUT_DIR="$OUT_DIR/megascan" PYTHON="$PYTHON" TRAIN_ITERS=${TRAIN_ITERS:-20} TRACE_INTERVAL=5 \
    bash scripts/quickstart_job.sh --continuous-trace-iterations 2 "${FAULT[@]}" "$@"
