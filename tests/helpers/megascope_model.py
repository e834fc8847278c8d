"""A tiny GPT built in a torchrun worker from pretrain_gpt.py's flags, at any TP/PP, with weights that
do not depend on the layout; a forward through megatron-core's pipeline schedule (forward only); and the
runs of megascope_run.py that the MegaScope tests share (each layout runs once per test session)."""

import megatron.training  # noqa: F401

# isort: split
import functools

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megascope.capture import Capture
from megatron.training.arguments import parse_args
from megatron.training.initialize import initialize_megatron
from megatron.training.layout_invariant_init import reinitialize_layout_invariant
from megatron.training.model_setup import _build_chunks
from megatron.training.tokenizer import build_tokenizer
from megatron.training.validate_args import validate_args
from pretrain_gpt import model_provider

TINY_MODEL_FLAGS = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--use-cpu-initialization", "--device", "cpu",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--make-vocab-size-divisible-by", "64", "--lr", "1e-3",
    "--train-iters", "1",
    "--mock-data",
]


def build(argv):
    args = parse_args(argv, "megascope-test")
    validate_args(args)
    build_tokenizer(args)
    initialize_megatron(args)
    chunks = _build_chunks(args, functools.partial(model_provider, args))
    reinitialize_layout_invariant(chunks, chunks[0].config, args.seed)
    return args, chunks


def forward(chunks, tokens, inference_context=None, position_offset=0):
    """One forward of tokens [b, s] through every stage (megatron-core's schedule, forward only)."""
    batch, seq = tokens.shape
    positions = torch.arange(position_offset, position_offset + seq).expand(batch, seq)

    def step(data_iterator, model):
        output = model(tokens, positions, None, inference_context=inference_context,
                       runtime_gather_output=inference_context is not None or None)
        return output, lambda out: (out.float().sum() * 0, {})

    get_forward_backward_func()(forward_step_func=step, data_iterator=None, model=chunks, num_microbatches=1,
                                seq_length=seq, micro_batch_size=batch, forward_only=True)


def capture(chunks, spec, tokens, **forward_kwargs):
    """rank 0's Records of one forward (the others get [])."""
    with Capture(chunks, spec) as active:
        forward(chunks, tokens, **forward_kwargs)
        return active.collect(step=0, token_offset=forward_kwargs.get("position_offset", 0))
