# Sourced by the GPU benchmark scripts: the sample data preprocessed under $RESULTS and, in MODEL,
# the GPT 345M bf16 flags they share (24 layers, hidden 1024, 16 heads, sequence 1024); SIZES holds
# what turns it into GPT 1.3B (hidden 2048, sequence 2048), and 1.3b_mb8 that with micro batch 8
# (global 64): twice the GPU's work per launch, so that the GPUs, not the hosts, set the pace.
RESULTS=${RESULTS:-bench_results}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
# The sample data under $RESULTS/data; sourced with --data-later, the script calls this itself once it knows it
# will run a job (a listing or a refused input then costs no preprocessing).
prepare_gpt_data() {
    mkdir -p "$RESULTS/data"
    python3 tools/preprocess_data.py --input datasets/gpt/corpus.jsonl --output-prefix "$RESULTS/data/gpt" \
        --tokenizer-type GPT2BPETokenizer --vocab-file datasets/gpt/vocab.json \
        --merge-file datasets/gpt/merges.txt --append-eod --workers 8 > /dev/null || exit 1
}
[[ ${1-} == --data-later ]] || prepare_gpt_data
MODEL=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
       --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 32 --bf16
       --lr 0.00015 --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 1e-2
       --clip-grad 1.0 --adam-beta2 0.95 --data-path "$RESULTS/data/gpt_text_document" --split 98,2,0
       --tokenizer-type GPT2BPETokenizer --vocab-file datasets/gpt/vocab.json
       --merge-file datasets/gpt/merges.txt --eval-interval 100000 --eval-iters 0 --log-interval 10)
declare -A SIZES=([345m]="" [1.3b]="--hidden-size 2048 --seq-length 2048 --max-position-embeddings 2048"
                 [1.3b_mb8]="--hidden-size 2048 --seq-length 2048 --max-position-embeddings 2048
                             --micro-batch-size 8 --global-batch-size 64")
declare -A LAYOUTS=([dp2]="" [dp]="" [tp2_sp]="--tensor-model-parallel-size 2 --sequence-parallel"
                    [dp2_distopt]="--use-distributed-optimizer"
                    [tp2]="--tensor-model-parallel-size 2" [pp2]="--pipeline-model-parallel-size 2"
                    [tp2_distopt]="--tensor-model-parallel-size 2 --use-distributed-optimizer"
                    [pp2_distopt]="--pipeline-model-parallel-size 2 --use-distributed-optimizer"
                    [dp2_fp16]="--fp16")
# The model flags of a layout: MODEL with its --bf16 dropped when the layout asks for --fp16.
model_flags() {
    local flag
    for flag in "${MODEL[@]}"; do
        [[ $flag == --bf16 && " ${LAYOUTS[$1]} " == *" --fp16 "* ]] || printf '%s\n' "$flag"
    done
}
