#!/usr/bin/env bash
# Serve a GPT checkpoint trained by pretrain_gpt.py (Megatron-LM's example of the same name):
#   bash examples/inference/a_text_generation_server_bash_script.sh CKPT TOKENIZER [extra flags]
# CKPT: the --save directory of the training run; TOKENIZER: a folder with the GPT-2 BPE vocab.json and
# merges.txt (e.g. datasets/gpt). The model flags default to GPT 345M (24 layers, hidden 1024, 16 heads,
# sequence 1024); extra flags override them (the last of a repeated flag wins), e.g. the shape of the
# quickstart's tiny model. Environment: NPROC (1), TP (1), PP (1), DEVICE (cuda|cpu; cuda when a GPU is
# there), PORT (5000), WS_PORT (5001), MASTER_PORT (torchrun's; a free one when unset), PYTHON (python3).
# Then: curl -X PUT localhost:5000/api \
#   -H 'Content-Type: application/json' -d '{"prompts": ["Hello"], "tokens_to_generate": 32}'
set -euo pipefail
source "$(dirname "$0")/serve_common.sh"
launch_server \
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --seq-length 1024 --max-position-embeddings 1024 \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$TOKENIZER/vocab.json" --merge-file "$TOKENIZER/merges.txt"
