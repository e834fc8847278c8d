#!/usr/bin/env bash
# The quickstart in the container: the sample data, the tiny GPT at TP2 x PP2 on the GPUs (fewer
# ranks on fewer GPUs, 4 CPU processes without any) with MegaScan tracing, its checkpoint, and the
# merged trace with the detection report, all under OUTPUT_DIR.
#   bash docker/DockerUsage_Quickstart.sh OUTPUT_DIR [extra pretrain_gpt.py flags]
# Environment: TRAIN_ITERS (100), TRACE_INTERVAL (half of TRAIN_ITERS).
source "$(dirname "$0")/common.sh"
OUT_DIR="$OUT_DIR" PYTHON="$PYTHON" bash scripts/quickstart_job.sh "$@"
