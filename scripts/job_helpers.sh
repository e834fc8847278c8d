# Sourced by scripts/quickstart_job.sh and the container's docker/DockerUsage_*.sh: the pieces of a job
# they share. Needs PYTHON and the repository root as the working directory.

# Sets NPROC, TP, PP and DEVICE for the tiny GPT from the GPUs torch sees: TP2 x PP2 on 4 GPUs,
# fewer on fewer GPUs, and 4 CPU processes (gloo) without any.
detect_layout() {
    GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
    if [ "$GPUS" -ge 4 ]; then NPROC=4 TP=2 PP=2 DEVICE=cuda
    elif [ "$GPUS" -ge 2 ]; then NPROC=2 TP=2 PP=1 DEVICE=cuda
    elif [ "$GPUS" -eq 1 ]; then NPROC=1 TP=1 PP=1 DEVICE=cuda
    else NPROC=4 TP=2 PP=2 DEVICE=cpu
    fi
}

# The shipped sample corpus as Megatron data under $1/data (made once; later jobs reuse it):
# the --data-path prefix is $1/data/gpt_text_document.
prepare_sample_data() {
    if [ ! -f "$1/data/gpt_text_document.idx" ]; then
        mkdir -p "$1/data"
        "$PYTHON" tools/preprocess_data.py --input datasets/gpt/corpus.jsonl --output-prefix "$1/data/gpt" \
            --tokenizer-type GPT2BPETokenizer --vocab-file datasets/gpt/vocab.json \
            --merge-file datasets/gpt/merges.txt --append-eod --workers 2
    fi
}
