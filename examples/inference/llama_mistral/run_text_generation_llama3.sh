#!/usr/bin/env bash
# Serve a Llama 3 (or Mistral, Qwen2) checkpoint converted from Hugging Face by tools/checkpoint/convert.py:
#   bash examples/inference/llama_mistral/run_text_generation_llama3.sh CKPT TOKENIZER_DIR [extra flags]
# CKPT: convert.py's --save-dir (its model_args.txt has the model's flags); TOKENIZER_DIR: the folder with
# tokenizer.json and tokenizer_config.json (CKPT/hf after a conversion). A client asking for chat
# ("chat": true in PUT /api or in a WebSocket generate) gets the tokenizer's chat template applied.
# Environment: NPROC (1), TP (1), PP (1), DEVICE (cuda|cpu; cuda when a GPU is there), PORT (5000),
# WS_PORT (5001), MASTER_PORT (torchrun's; a free one when unset), PYTHON (python3). Extra flags override
# model_args.txt's (e.g. --bf16 on a GPU).
set -euo pipefail
source "$(dirname "$0")/../serve_common.sh"
if [ ! -f "$CHECKPOINT/model_args.txt" ]; then
    echo "$0: $CHECKPOINT/model_args.txt not found; give the --save-dir of tools/checkpoint/convert.py" >&2
    exit 2
fi
# shellcheck disable=SC2046  # model_args.txt is a list of flags
launch_server $(cat "$CHECKPOINT/model_args.txt") \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
