"""Megatron-LM's command-line flags (same names, same meanings) and their parsing.

Checks of how flags fit together live in ``validate_args.py``; plugins add their own flags
through the registry in ``plugins.py``.
"""

import argparse

from megatron.training.errors import ArgumentError
from megatron.training.profiling import DEFAULT_PROFILE_DIR


class MegatronArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (via ``ArgumentError``) instead of usage + exit."""

    def error(self, message):
        raise ArgumentError(f"{message} (run with --help to list the flags)")


def _add_model_args(parser):
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 * hidden size")
    g.add_argument("--kv-channels", type=int, default=None, help="default: hidden size / heads")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: seq length")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"],
                   default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama 3's rotary frequency scaling")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0, help="with --use-rope-scaling")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    g.add_argument("--add-qkv-bias", action="store_true", help="biases on Q/K/V even with --disable-bias-linear")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)


def _add_kernel_args(parser):
    g = parser.add_argument_group("attention, fusions and CUDA graphs")
    g.add_argument("--attention-backend", choices=["auto", "flash", "fused", "unfused", "local"], default="auto",
                   help="with --transformer-impl local: auto = PyTorch's scaled_dot_product_attention picks a "
                        "flash / cuDNN / memory-efficient kernel (or the math one); flash = only its flash kernel; "
                        "fused = only its cuDNN and memory-efficient kernels (GPU only); unfused and local = "
                        "megatron-core's DotProductAttention (explicit scores, masked softmax). With "
                        "--transformer-impl transformer_engine: Transformer Engine's backends of these names")
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false",
                   help="do not fuse bias + GeLU (fused by torch.compile on GPU by default)")
    g.add_argument("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion", action="store_false",
                   help="with --swiglu: do not fuse bias + SwiGLU (fused by torch.compile on GPU by default)")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="compute the loss with megatron-core's fused vocab-parallel cross entropy (torch.compile, "
                        "GPU) instead of the unfused one")
    g.add_argument("--no-bias-dropout-fusion", dest="bias_dropout_fusion", action="store_false",
                   help="do not fuse bias + dropout + residual add (fused by torch.compile on GPU by default)")
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false",
                   help="unfused attention only: do not use apex's fused masked softmax when apex is installed")
    g.add_argument("--compile-transformer-layers", action="store_true",
                   help="run each transformer layer under torch.compile (inductor): its norms, residual adds, "
                        "biases and activation fused into fewer kernels; the first iterations compile")
    g.add_argument("--cuda-graph-impl", choices=["none", "local", "transformer_engine"], default=None,
                   help="capture each transformer layer's forward and backward as CUDA graphs after "
                        "--cuda-graph-warmup-steps iterations (local: megatron-core's own graphs). Default: "
                        "local on a GPU at every layout (local implementation, no full recomputation, no "
                        "--overlap-param-gather); none otherwise; the start-up log says which and why")
    g.add_argument("--enable-cuda-graph", action="store_true", help="same as --cuda-graph-impl local")
    g.add_argument("--cuda-graph-scope", nargs="*", default=[], choices=["attn", "mlp", "full_iteration"],
                   help="parts of each layer to capture (default: the whole layer), or full_iteration: the whole "
                        "forward-backward schedule of an iteration as one graph (no per-microbatch host work)")
    g.add_argument("--cuda-graph-warmup-steps", type=int, default=3)


def _add_training_args(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro batch size * data-parallel size")
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="exit (after saving, when --save is set) at an iteration divisible by this")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--manual-gc", action="store_true",
                   help="Python's automatic garbage collector off during training; collect at the same iterations "
                        "on every rank instead, so no rank stalls the others with a collection of its own")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="with --manual-gc: collect every this many iterations (0: never between iterations)")
    g.add_argument("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
                   help="with --manual-gc: no collection before and after each evaluation")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="deterministic kernels only (torch.use_deterministic_algorithms; cuBLAS workspace and "
                        "NCCL's ring algorithm set unless given): the same run twice computes the same numbers, "
                        "slower; with --attention-backend local or unfused on GPUs")
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="initialize weights on the CPU, identically for every parallel layout")
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", choices=["constant", "linear", "cosine"],
                   default="constant")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)

    lr = parser.add_argument_group("learning rate")
    lr.add_argument("--lr", type=float, required=True)
    lr.add_argument("--min-lr", type=float, default=0.0)
    lr.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                    default="linear")
    lr.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    lr.add_argument("--lr-warmup-iters", type=int, default=0)
    lr.add_argument("--lr-warmup-fraction", type=float, default=None)
    lr.add_argument("--lr-warmup-init", type=float, default=0.0)
    lr.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    lr.add_argument("--lr-wsd-decay-style", choices=["exponential", "linear", "cosine"], default="exponential")

    mp = parser.add_argument_group("mixed precision")
    mp.add_argument("--bf16", action="store_true")
    mp.add_argument("--fp16", action="store_true")
    mp.add_argument("--loss-scale", type=float, default=None, help="static loss scale (fp16)")
    mp.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    mp.add_argument("--min-loss-scale", type=float, default=1.0)
    mp.add_argument("--loss-scale-window", type=float, default=1000)
    mp.add_argument("--hysteresis", type=int, default=2)
    mp.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    mp.add_argument("--fp8-format", dest="fp8", choices=["e4m3", "hybrid"], default=None,
                    help="the transformer layers' linear GEMMs in FP8 (a GPU of compute capability 8.9+): e4m3 for "
                         "every operand, or hybrid: e5m2 output gradients. --transformer-impl local: torchao's float8 "
                         "training (pip install -e '.[fp8]', with --bf16), master weights, optimizer, gradients and "
                         "checkpoints as without; transformer_engine: Transformer Engine's FP8, as in Megatron-LM")
    mp.add_argument("--fp8-recipe", choices=["tensorwise", "rowwise", "delayed", "mxfp8", "blockwise"], default=None,
                    help="FP8 scaling. --transformer-impl local: tensorwise (default: one scale per tensor) or rowwise "
                         "(one per row); transformer_engine: delayed (default, as Megatron-LM), tensorwise, mxfp8 "
                         "(compute capability 10.0+) or blockwise")


def _add_parallel_args(parser):
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="transformer layers of the first pipeline stage (default: an even split); the other "
                        "stages share the rest evenly")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="transformer layers of the last pipeline stage (default: an even split)")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--tp-comm-overlap", action="store_true",
                   help="with --sequence-parallel: overlap each linear layer's tensor-parallel all-gather and "
                        "reduce-scatter with its GEMM (PyTorch's symmetric-memory fused operators on GPUs; on CPU "
                        "the same layers without overlap)")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--batch-p2p-sync", action="store_true",
                   help="synchronize the device after every batched pipeline transfer (megatron-core's default, "
                        "a workaround for old PyTorch versions; off here: the schedule's stream waits order them)")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda when a GPU is visible, else cpu (gloo)")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl on cuda, gloo on cpu")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)


def _add_data_args(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="dataset prefixes, optionally weighted: [w1] prefix1 [w2] prefix2 ...")
    g.add_argument("--split", default="969,30,1", help="train,valid,test proportions")
    g.add_argument("--mock-data", action="store_true", help="random tokens instead of --data-path")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--mask-prob", type=float, default=0.15, help="BERT masked-LM probability")
    g.add_argument("--short-seq-prob", type=float, default=0.1, help="BERT short-sequence probability")
    g.add_argument("--bert-no-binary-head", dest="bert_binary_head", action="store_false")

    t = parser.add_argument_group("tokenizer")
    t.add_argument("--tokenizer-type", default=None,
                   choices=["GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase",
                            "HuggingFaceTokenizer", "NullTokenizer"])
    t.add_argument("--vocab-file", default=None)
    t.add_argument("--merge-file", default=None)
    t.add_argument("--tokenizer-model", default=None, help="HuggingFaceTokenizer: tokenizer.json or its folder")
    t.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: vocabulary size")


def _add_checkpoint_args(parser):
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--override-save", action="store_true",
                   help="save into a --save directory whose latest checkpoint is ahead of this run's start (a run "
                        "without --load of it, or with --finetune): its tracker then moves back to this run's "
                        "iterations; a checkpoint of an iteration saved again is kept as iter_XXXXXXX.replaced-<time>")
    g.add_argument("--load", default=None)
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="generation tools: the model and tokenizer flags the --load checkpoint recorded; flags on "
                        "the command line override them")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load weights only and restart the iteration count at 0")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="accepted for Megatron-LM compatibility: SIGTERM always saves when --save is set")


def _add_logging_args(parser):
    g = parser.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-throughput", action="store_true",
                   help="accepted for Megatron-LM compatibility: throughput is always logged")


def _add_profiling_and_tensorboard_args(parser):
    g = parser.add_argument_group("profiling and TensorBoard")
    g.add_argument("--profile", action="store_true",
                   help="profile iterations [--profile-step-start, --profile-step-end) of the --profile-ranks: "
                        "torch.profiler with --use-pytorch-profiler, else a CUDA profiler capture range for "
                        "`nsys profile --capture-range=cudaProfilerApi`")
    g.add_argument("--profile-step-start", type=int, default=10,
                   help="first profiled iteration, numbered as in the log line (from 1); default 10")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="the iteration after the last profiled one, at most --train-iters; default 12")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0], help="global ranks to profile; default 0")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="with --profile: torch.profiler; writes rank<R>.<time>.pt.trace.json (Chrome trace "
                        "JSON, for Perfetto) and rank<R>.<time>.summary.txt (the top operators) into "
                        f"--tensorboard-dir, else {DEFAULT_PROFILE_DIR}/")
    g.add_argument("--tensorboard-dir", default=None,
                   help="write the log line's scalars as TensorBoard event files here (last rank); "
                        "open with `tensorboard --logdir DIR`")
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="iterations between per-iteration scalars (losses, learning rate, grad norm, batch size)")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="scalars the writer queues before it writes them to disk")
    for flag in ("--log-timers-to-tensorboard", "--log-memory-to-tensorboard", "--log-validation-ppl-to-tensorboard"):
        g.add_argument(flag, action="store_true",
                       help="accepted for Megatron-LM compatibility: always written with --tensorboard-dir")


def build_parser(prog, add_plugin_arguments=None, extra_args_provider=None):
    parser = MegatronArgumentParser(prog=prog, allow_abbrev=False,
                                    description="Megatron training on megatron-core")
    for add in (_add_model_args, _add_kernel_args, _add_training_args, _add_parallel_args, _add_data_args,
                _add_checkpoint_args, _add_logging_args, _add_profiling_and_tensorboard_args):
        add(parser)
    if extra_args_provider is not None:
        extra_args_provider(parser)
    if add_plugin_arguments is not None:
        add_plugin_arguments(parser)
    return parser


def parse_args(argv, prog, add_plugin_arguments=None, extra_args_provider=None):
    """Parse ``argv`` (a list of strings) with every flag known to the loop and its plugins."""
    return build_parser(prog, add_plugin_arguments, extra_args_provider).parse_args(argv)
