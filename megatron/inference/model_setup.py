"""A model for generation: our arguments, tokenizer, process groups and checkpoint loading (weights only).

Shared by the generation tools (tools/run_text_generation_server.py, tools/checkpoint/generate_greedy.py).
Without ``--load`` the model keeps its seeded initialization (as Megatron-LM's server does), which with
``--use-cpu-initialization`` is the same at every layout.
"""

import functools

from megatron.training.arguments import parse_args
from megatron.training.checkpointing import load_checkpoint, use_checkpoint_vocab_padding
from megatron.training.initialize import initialize_megatron
from megatron.training.model_setup import build_model
from megatron.training.tokenizer import build_tokenizer
from megatron.training.validate_args import validate_args

# Flags pretrain_gpt.py requires that generation does not use (the command line overrides them).
_TRAINING_ONLY = ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "0", "--mock-data"]


def setup_for_generation(argv, prog, model_provider, extra_args_provider=None, check_args=None):
    """(args, model chunks in eval mode, tokenizer) from a command line of Megatron flags; ``check_args``
    (args) refuses a tool's own bad flags before anything is loaded."""
    args = parse_args(_TRAINING_ONLY + list(argv), prog, extra_args_provider=extra_args_provider)
    validate_args(args)
    if check_args is not None:
        check_args(args)
    args.finetune = True  # weights only
    use_checkpoint_vocab_padding(args)
    tokenizer = build_tokenizer(args)
    initialize_megatron(args)
    model = build_model(args, functools.partial(model_provider, args))
    load_checkpoint(args, model, None, None)
    for chunk in model:
        chunk.eval()
    return args, model, tokenizer
