#!/usr/bin/env bash
# MegaScope in the container: the text generation server with MegaScope's WebSocket (REST on PORT
# 5000, WebSocket on WS_PORT 5001) serving the quickstart's checkpoint in OUTPUT_DIR, trained first
# (scripts/quickstart_job.sh) when OUTPUT_DIR has none; the page is served at the REST address when
# the image was built with NODE_VERSION. The server binds 127.0.0.1: run the container with
# --network host, or pass --host 0.0.0.0 --ws-host 0.0.0.0 (the WebSocket then needs a token:
# --ws-token, or one is printed). Runs until stopped (Ctrl-C).
#   bash docker/DockerUsage_MegaScope.sh OUTPUT_DIR [extra server flags]
source "$(dirname "$0")/common.sh"
if [ ! -f "$OUT_DIR/checkpoints/latest_checkpointed_iteration.txt" ]; then
    echo "no checkpoint in $OUT_DIR/checkpoints: training the quickstart's model first"
    OUT_DIR="$OUT_DIR" PYTHON="$PYTHON" bash scripts/quickstart_job.sh
fi
detect_layout  # the quickstart's layout on this machine: the checkpoint loads as it was saved
PYTHON="$PYTHON" NPROC=$NPROC TP=$TP PP=$PP DEVICE=$DEVICE \
    bash examples/inference/a_text_generation_server_bash_script.sh "$OUT_DIR/checkpoints" datasets/gpt \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 512 \
    --seq-length 128 --max-position-embeddings 128 "$@"
