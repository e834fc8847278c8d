# Sourced by the serve scripts of examples/inference (with their arguments): checks that CKPT and TOKENIZER
# are given, sets CHECKPOINT, TOKENIZER and EXTRA_FLAGS (the arguments after them) and defines
# launch_server MODEL_FLAGS..., which starts tools/run_text_generation_server.py under torchrun:
# the model flags first, then the layout, device, checkpoint and ports from the environment (NPROC 1, TP 1,
# PP 1, DEVICE cuda when a GPU is there else cpu, PORT 5000, WS_PORT 5001, PYTHON python3), then EXTRA_FLAGS,
# so that the user's flags win (the last of a repeated flag wins). torchrun's rendezvous port is MASTER_PORT
# when set, else a free one (torchrun --standalone), so that a second server can start beside the first (with
# PORT and WS_PORT of its own: a port in use is refused in one line naming the flag). It stays in the directory
# it was started from: relative paths (CKPT, TOKENIZER, extra flags) mean what they mean where the user typed them.
if [ $# -lt 2 ]; then
    echo "usage: $0 CKPT TOKENIZER_DIR [extra flags]" >&2
    exit 2
fi
CHECKPOINT=$1
TOKENIZER=$2
EXTRA_FLAGS=("${@:3}")
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-$("$PYTHON" -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")}

if [ -n "${MASTER_PORT:-}" ]; then
    RENDEZVOUS=(--master-port "$MASTER_PORT")
else
    RENDEZVOUS=(--standalone)
fi

launch_server() {
    "$PYTHON" -m torch.distributed.run --nproc_per_node "${NPROC:-1}" "${RENDEZVOUS[@]}" \
        "$REPO/tools/run_text_generation_server.py" "$@" \
        --device "$DEVICE" \
        --tensor-model-parallel-size "${TP:-1}" --pipeline-model-parallel-size "${PP:-1}" \
        --load "$CHECKPOINT" \
        --port "${PORT:-5000}" --enable-ws-server --ws-port "${WS_PORT:-5001}" \
        "${EXTRA_FLAGS[@]}"
}
