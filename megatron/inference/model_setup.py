"""A model for generation: our arguments, tokenizer, process groups and checkpoint loading (weights only).

Shared by the generation tools (tools/run_text_generation_server.py, tools/checkpoint/generate_greedy.py).
Without ``--load`` the model keeps its seeded initialization (as Megatron-LM's server does), which with
``--use-cpu-initialization`` is the same at every layout. A ``--load`` that holds no checkpoint is refused:
training starts from scratch there, but generating from random weights the user did not ask for would
look like a working model.
"""

import argparse
import functools
import os

from megatron.training.arguments import parse_args
from megatron.training.checkpointing import (
    TRACKER_FILENAME,
    load_checkpoint,
    read_tracker,
    recorded_model_flags,
    use_checkpoint_vocab_padding,
)
from megatron.training.errors import ArgumentError, UserError
from megatron.training.initialize import initialize_megatron
from megatron.training.model_setup import build_model
from megatron.training.tokenizer import build_tokenizer
from megatron.training.validate_args import validate_args

# Flags pretrain_gpt.py requires that generation does not use (the command line overrides them). Generation
# serves up to --max-position-embeddings positions; --seq-length 0 stands for "not given" (a converted
# checkpoint's model_args.txt has none).
_TRAINING_ONLY = ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "0", "--mock-data", "--seq-length", "0"]


def _no_cuda_graphs(args):
    """Training's default CUDA graphs stay off here: megatron-core replays layer graphs during generation
    only with flash decoding and static batching, which this engine does not use."""
    if args.enable_cuda_graph or args.cuda_graph_impl not in (None, "none"):
        raise ArgumentError("CUDA graphs (--enable-cuda-graph / --cuda-graph-impl) are not supported by the "
                            "generation engine; drop the flag")
    args.cuda_graph_impl = "none"


def _no_virtual_pipeline(args):
    """Before validate_args, whose checks of the interleaved schedule (its microbatches) mean nothing here."""
    if args.num_layers_per_virtual_pipeline_stage is not None:
        raise ArgumentError("--num-layers-per-virtual-pipeline-stage: generation runs one model chunk per pipeline "
                            "rank; leave virtual pipelining out")


def _require_checkpoint(load):
    if load is None:
        return
    remedy = ("give the directory a training run saved into (--save), or drop --load to generate from the "
              "seeded random initialization")
    if not os.path.isdir(load):
        raise UserError(f"--load {load}: no such directory; {remedy}")
    if read_tracker(load) is None:
        raise UserError(f"--load {load}: no checkpoint there ({TRACKER_FILENAME} not found); {remedy}")


def _load_flag(argv):
    """--load of ``argv``, before the whole command line can be parsed (its model flags may be missing)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--load")
    load = parser.parse_known_args(argv)[0].load
    if load is None:
        raise ArgumentError("--use-checkpoint-args needs --load: the checkpoint whose flags to use")
    _require_checkpoint(load)
    return load


def setup_for_generation(argv, prog, model_provider, extra_args_provider=None, check_args=None):
    """(args, model chunks in eval mode, tokenizer) from a command line of Megatron flags; ``check_args``
    (args) refuses a tool's own bad flags before anything is loaded."""
    argv = list(argv)
    if "--use-checkpoint-args" in argv:  # the checkpoint's flags first: the command line's override them
        argv = recorded_model_flags(_load_flag(argv)) + argv
    args = parse_args(_TRAINING_ONLY + argv, prog, extra_args_provider=extra_args_provider)
    # A training command's schedule and data flags (a warm-up longer than the one iteration above, --data-path
    # beside --mock-data) mean nothing here: its model flags can be pasted as they are.
    args.lr_warmup_iters, args.lr_warmup_fraction, args.lr_decay_iters = 0, None, None
    args.data_path = None
    if args.seq_length == 0:
        if args.max_position_embeddings is None:
            raise ArgumentError("give --max-position-embeddings (or --seq-length): the positions the model serves")
        args.seq_length = args.max_position_embeddings
    _no_cuda_graphs(args)
    if args.compile_transformer_layers:
        raise ArgumentError("--compile-transformer-layers: the generation engine runs its layers eagerly (each step "
                            "has a new length); drop the flag")
    if args.fp8 is not None:
        raise ArgumentError("--fp8-format: the generation tools run a checkpoint's layers in bf16 (an FP8 run saves "
                            "the same checkpoint as a bf16 one); drop the flag")
    _no_virtual_pipeline(args)
    validate_args(args)
    if check_args is not None:
        check_args(args)
    args.finetune = True  # weights only
    _require_checkpoint(args.load)
    use_checkpoint_vocab_padding(args)
    tokenizer = build_tokenizer(args)
    initialize_megatron(args)
    model = build_model(args, functools.partial(model_provider, args))
    load_checkpoint(args, model, None, None)
    for chunk in model:
        chunk.eval()
    return args, model, tokenizer
