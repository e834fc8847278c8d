"""The checkpoint layout of our GPT model, taken from the model itself (built on the meta device).

Keys, global shapes and the split of SwiGLU's fc1 into its gate and up halves are whatever
megatron-core's ``sharded_state_dict`` of ``pretrain_gpt.py``'s model says: a converted checkpoint
then loads through the same path as a trained one, at any TP/PP.
"""

import contextlib
from collections.abc import Iterator

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

import pretrain_gpt  # the model provider every checkpoint of ours is loaded with
from megatron.training.arguments import parse_args
from megatron.training.cpu_compat import install_cpu_compat
from megatron.training.validate_args import validate_args

# Flags pretrain_gpt.py requires that do not shape the model.
_NOT_SHAPING_THE_MODEL = ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "0", "--mock-data",
                          "--vocab-size", "1", "--device", "cpu", "--use-cpu-initialization"]


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """dist_checkpointing saves and loads through torch.distributed: one gloo process, TP1/PP1, for the block.
    Destroyed after it: a group left to the interpreter's teardown once aborted a finished conversion (exit 134).
    Its store is in memory: a TCP store's port could be taken by another process before it binds (it was, once,
    in a test run: EADDRINUSE), and a group of one has nobody to meet."""
    install_cpu_compat()
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), world_size=1, rank=0)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def model_args(model_flags, padded_vocab_size, dtype_flags):
    args = parse_args(model_flags + dtype_flags + ["--seq-length", "1"] + _NOT_SHAPING_THE_MODEL,
                      prog="convert.py")
    validate_args(args, world_size=1)
    args.padded_vocab_size = padded_vocab_size
    return args


def checkpoint_templates(args):
    """{state key: ShardedTensor, or a list of them for a tensor saved in parts} at TP1/PP1, data on
    the meta device; plus the ShardedObjects (extra state) a checkpoint must also hold."""
    with torch.device("meta"):
        model = pretrain_gpt.model_provider(args)
    templates = model.sharded_state_dict()
    apply_factories(templates)
    return templates


def layer_keys(templates, layer):
    prefix = f"decoder.layers.{layer}."
    return [key for key in templates if key.startswith(prefix)]


def joined(parts):
    """One template spanning consecutive row parts of a tensor (fc1's gate and up), so that a read
    asks for each key once and splits the result."""
    first, rows = parts[0], sum(part.local_shape[0] for part in parts)
    axis = first.prepend_axis_num
    fragments = list(first.axis_fragmentations)
    fragments[axis] = first.global_shape[axis] // rows
    return ShardedTensor(first.key, None, first.dtype, (rows, *first.local_shape[1:]), first.global_shape,
                         first.global_offset, tuple(fragments), first.replica_id, first.prepend_axis_num)

