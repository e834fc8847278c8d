"""Every check of how flags fit together, and the values derived from them, in one place.

Runs before ``torch.distributed`` starts, so a wrong layout fails in a second with one line.
"""

import os

import torch

from megatron.training.checkpointing import read_tracker
from megatron.training.data import blend_from_args
from megatron.training.errors import ArgumentError
from megatron.training.fp8_flags import validate_fp8
from megatron.training.save_dir.checks import check_save_dir
from megatron.training.save_dir.writable import check_directory_writable


def _require(condition, message):
    if not condition:
        raise ArgumentError(message)


def _validate_layout(args, world_size):
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _require(tp >= 1 and pp >= 1, "--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
    _require(world_size % (tp * pp) == 0,
             f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
             f"--pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} processes")
    args.data_parallel_size = world_size // (tp * pp)
    if args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None:
        _validate_uneven_stages(args, pp)
    else:
        _require(args.num_layers % pp == 0,
                 f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        _require(pp > 1, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
        per_stage = args.num_layers // pp
        chunk = args.num_layers_per_virtual_pipeline_stage
        _require(chunk >= 1 and per_stage % chunk == 0,
                 f"--num-layers-per-virtual-pipeline-stage {chunk} must divide the "
                 f"{per_stage} layers of each pipeline stage")
        args.virtual_pipeline_model_parallel_size = per_stage // chunk
    _require(args.num_attention_heads % tp == 0,
             f"--num-attention-heads {args.num_attention_heads} is not divisible by "
             f"--tensor-model-parallel-size {tp}")
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # as Megatron-LM: nothing to split with one TP rank
    if args.tp_comm_overlap:
        _require(args.sequence_parallel, "--tp-comm-overlap overlaps sequence parallelism's collectives: add "
                                         "--sequence-parallel (and --tensor-model-parallel-size > 1)")
        _require(args.transformer_impl == "local", "--tp-comm-overlap works on the local layers: drop it or use "
                                                   "--transformer-impl local")


def _validate_uneven_stages(args, pp):
    """Megatron-LM's uneven split: the first and/or last stage get the layers given, the others the rest."""
    ends = (("--decoder-first-pipeline-num-layers", args.decoder_first_pipeline_num_layers),
            ("--decoder-last-pipeline-num-layers", args.decoder_last_pipeline_num_layers))
    given = {flag: value for flag, value in ends if value is not None}
    flags = " and ".join(given)
    _require(pp > 1, f"{flags} needs --pipeline-model-parallel-size > 1")
    _require(args.num_layers_per_virtual_pipeline_stage is None,
             f"{flags} cannot be combined with --num-layers-per-virtual-pipeline-stage here")
    for flag, value in given.items():
        _require(value >= 1, f"{flag} must be at least 1, got {value}")
    rest, middle = args.num_layers - sum(given.values()), pp - len(given)
    _require(rest >= 0 and (rest == 0) == (middle == 0) and (middle == 0 or rest % middle == 0),
             f"--num-layers {args.num_layers} minus {flags} leaves {rest} layers, which do not split evenly "
             f"over the other {middle} pipeline stage(s)")


def _validate_batch(args):
    dp, mbs = args.data_parallel_size, args.micro_batch_size
    _require(mbs >= 1, "--micro-batch-size must be >= 1")
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    _require(args.global_batch_size % (mbs * dp) == 0,
             f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size {mbs} x "
             f"data-parallel size {dp}")
    args.num_microbatches = args.global_batch_size // (mbs * dp)
    if args.virtual_pipeline_model_parallel_size is not None:
        pp = args.pipeline_model_parallel_size
        _require(args.num_microbatches % pp == 0,
                 f"the interleaved pipeline needs the number of microbatches ({args.num_microbatches}) "
                 f"to be a multiple of --pipeline-model-parallel-size {pp}")


def _validate_model(args):
    _require(args.hidden_size % args.num_attention_heads == 0 or args.kv_channels is not None,
             f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
             f"{args.num_attention_heads}; set --kv-channels")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    _require(args.num_query_groups % args.tensor_model_parallel_size == 0,
             "--num-query-groups must be divisible by --tensor-model-parallel-size")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    _require(args.position_embedding_type != "learned_absolute" or args.seq_length <= args.max_position_embeddings,
             f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}")
    if args.recompute_granularity == "full":
        _require(args.recompute_method is not None,
                 "--recompute-granularity full needs --recompute-method uniform or block")
        if args.recompute_num_layers is None:
            args.recompute_num_layers = 1
    if args.recompute_method is not None:
        _require(args.recompute_granularity == "full", "--recompute-method needs --recompute-granularity full")


def _validate_precision_and_device(args):
    _require(not (args.bf16 and args.fp16), "--bf16 and --fp16 are mutually exclusive; pick one")
    args.params_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    if args.bf16:
        args.accumulate_allreduce_grads_in_fp32 = True  # as Megatron-LM: bf16 gradients lose too much
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    _require(args.device == "cpu" or torch.cuda.is_available(),
             "--device cuda was asked for but no GPU is visible; use --device cpu")
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if args.device == "cuda" else "gloo"
    _require(not (args.device == "cpu" and args.distributed_backend == "nccl"),
             "--distributed-backend nccl needs --device cuda; use gloo on CPU")
    _require(not (args.device == "cpu" and args.fp16),
             "--fp16 is not supported with --device cpu (no loss-scaling kernels); use --bf16 or fp32")
    if args.transformer_impl == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            raise ArgumentError("--transformer-impl transformer_engine needs the transformer-engine package "
                                "(pip install 'megatronapp[te]'); or use --transformer-impl local") from None
        _require(args.device == "cuda", "--transformer-impl transformer_engine needs --device cuda")
    if args.overlap_param_gather:
        _require(args.use_distributed_optimizer, "--overlap-param-gather needs --use-distributed-optimizer")
    _validate_kernels(args)


def _validate_kernels(args):
    on_cpu = args.device == "cpu"
    if args.transformer_impl == "local":
        # PyTorch's CPU kernels: a flash kernel without dropout, and the math one.
        _require(not (on_cpu and args.attention_backend == "fused"),
                 "--attention-backend fused (cuDNN / memory-efficient kernels) needs --device cuda; "
                 "use auto or flash on CPU")
        _require(not (on_cpu and args.attention_backend == "flash" and args.attention_dropout > 0),
                 "--attention-backend flash on CPU has no attention dropout; set --attention-dropout 0 "
                 "or use --attention-backend auto")
    _require(not (args.deterministic_mode and not on_cpu and args.attention_backend not in ("local", "unfused")),
             f"--deterministic-mode on GPUs needs --attention-backend local or unfused (got "
             f"{args.attention_backend}): the fused attention kernels' backward accumulates with atomics")
    # Attention dropout forks megatron-core's RNG tracker inside the layer; dynamo cannot trace the generator
    # state's swap, so the layer falls back to eager in pieces (on a GPU the first iteration did not end in 2 min).
    _require(not (args.compile_transformer_layers and args.attention_dropout > 0),
             f"--compile-transformer-layers needs --attention-dropout 0 (got {args.attention_dropout}): attention "
             f"dropout swaps the RNG state inside the layer, which compiled code cannot follow; set it to 0 or drop "
             f"the flag")
    if args.enable_cuda_graph:
        _require(args.cuda_graph_impl in (None, "local"),
                 "--enable-cuda-graph means --cuda-graph-impl local; give only one of them")
        args.cuda_graph_impl = "local"
    args.cuda_graph_by_default = args.cuda_graph_impl is None
    if args.cuda_graph_by_default:
        reason = _why_no_default_cuda_graphs(args)
        args.cuda_graph_impl = "none" if reason else "local"
        args.cuda_graph_note = reason or "on by default"
    else:
        args.cuda_graph_note = "as asked"
    if args.cuda_graph_impl != "none":
        _require(not on_cpu, f"--cuda-graph-impl {args.cuda_graph_impl} needs --device cuda")
        _require(args.cuda_graph_impl == "local" or args.transformer_impl == "transformer_engine",
                 "--cuda-graph-impl transformer_engine needs --transformer-impl transformer_engine; "
                 "use --cuda-graph-impl local")
        _require(args.recompute_granularity != "full",
                 "CUDA graphs of transformer layers cannot replay a fully recomputed layer; drop "
                 "--recompute-granularity full or add --cuda-graph-impl none")
        _require(args.cuda_graph_warmup_steps >= 1, "--cuda-graph-warmup-steps must be >= 1")
    if "full_iteration" in args.cuda_graph_scope:
        _require(args.cuda_graph_impl == "local",
                 "--cuda-graph-scope full_iteration needs megatron-core's graphs: add --cuda-graph-impl local")
        _require(args.cuda_graph_scope == ["full_iteration"],
                 "--cuda-graph-scope full_iteration captures whole layers already: give it alone")


def _why_no_default_cuda_graphs(args):
    """Why the default leaves CUDA graphs off for this run, or None when it turns them on.

    Graphs remove the host's per-kernel cost, which bounds small models (GPT 345M ran 3.4x faster on
    an H100 with them); they are on by default only where they were verified on a GPU here."""
    if args.device != "cuda":
        return "not on a GPU"
    if args.transformer_impl != "local":
        return "--transformer-impl transformer_engine (ask for --cuda-graph-impl transformer_engine)"
    if args.recompute_granularity == "full":
        return "--recompute-granularity full"
    if args.overlap_param_gather:
        return "not yet verified with --overlap-param-gather (--cuda-graph-impl local turns them on)"
    return None


def _validate_schedule(args):
    _require(args.train_iters >= 1, "--train-iters must be >= 1")
    _require(args.lr >= args.min_lr >= 0, "--lr must be >= --min-lr >= 0")
    _require(args.log_interval >= 1, "--log-interval must be >= 1")
    _require(args.eval_interval >= 1 and args.eval_iters >= 0, "--eval-interval must be >= 1, --eval-iters >= 0")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        _require(args.lr_warmup_iters == 0, "use either --lr-warmup-iters or --lr-warmup-fraction, not both")
        _require(0.0 <= args.lr_warmup_fraction <= 1.0, "--lr-warmup-fraction must be in [0, 1]")
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    _require(args.lr_warmup_iters < args.lr_decay_iters,
             f"the warm-up ({args.lr_warmup_iters} iterations) must end before the decay does "
             f"(--lr-decay-iters, default --train-iters: {args.lr_decay_iters})")
    if args.lr_decay_style == "WSD":
        _require(args.lr_wsd_decay_iters is not None, "--lr-decay-style WSD needs --lr-wsd-decay-iters")
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay
    if args.load is not None:
        read_tracker(args.load)  # a corrupt tracker file fails here, not after start-up
    if args.save_interval is not None:
        _require(args.save_interval >= 1, "--save-interval must be >= 1")
        _require(args.save is not None, "--save-interval needs --save <directory>")
    check_save_dir(args)


def _validate_data(args):
    if args.mock_data:
        _require(not args.data_path, "--mock-data and --data-path are mutually exclusive")
    else:
        _require(bool(args.data_path), "give --data-path <prefix> (a preprocessed dataset) or --mock-data")
        blend_from_args(args)  # every prefix has its .bin and .idx
    split = args.split.replace("/", ",").split(",")
    _require(all(part.strip().replace(".", "", 1).isdigit() for part in split) and 1 <= len(split) <= 3,
             f"--split {args.split!r} must be up to three numbers like 969,30,1")
    if args.tokenizer_type is None and args.mock_data:
        _require(args.vocab_size is not None, "--mock-data needs --tokenizer-type or --vocab-size")
        args.tokenizer_type = "NullTokenizer"
    _require(args.tokenizer_type is not None, "--tokenizer-type is required with --data-path")


def _validate_garbage_collection(args):
    _require(args.manual_gc_interval >= 0, f"--manual-gc-interval {args.manual_gc_interval} must be >= 0 "
                                           f"(0: no collection between iterations)")
    _require(args.manual_gc or (args.manual_gc_interval == 0 and args.manual_gc_eval),
             "--manual-gc-interval and --no-manual-gc-eval only apply with --manual-gc; add it")


def _validate_profiling_and_tensorboard(args):
    if args.profile:
        start, end = args.profile_step_start, args.profile_step_end
        _require(1 <= start < end, f"--profile-step-start {start} must be >= 1 and below --profile-step-end {end}")
        _require(end <= args.train_iters, f"--profile-step-end {end} exceeds --train-iters {args.train_iters}")
        outside = [rank for rank in args.profile_ranks if not 0 <= rank < args.world_size]
        _require(not outside, f"--profile-ranks {' '.join(map(str, outside))}: not a rank of this job "
                              f"(world size {args.world_size})")
        _require(args.use_pytorch_profiler or args.device == "cuda",
                 "--profile without --use-pytorch-profiler opens a CUDA profiler range for nsys; "
                 "on CPU add --use-pytorch-profiler")
    _require(args.tensorboard_log_interval >= 1, "--tensorboard-log-interval must be >= 1")
    _require(args.tensorboard_queue_size >= 1, "--tensorboard-queue-size must be >= 1")
    if args.tensorboard_dir is not None:
        check_directory_writable(args.tensorboard_dir, "--tensorboard-dir")


def validate_args(args, world_size=None):
    """Check ``args`` for a launch of ``world_size`` processes and fill in derived values."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.world_size = world_size
    _validate_layout(args, world_size)
    _validate_batch(args)
    _validate_model(args)
    _validate_precision_and_device(args)
    validate_fp8(args)
    _validate_schedule(args)
    _validate_data(args)
    _validate_profiling_and_tensorboard(args)
    _validate_garbage_collection(args)
    return args
