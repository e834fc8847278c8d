"""Weights that do not depend on the parallel layout.

Megatron-LM seeds each pipeline stage differently and draws a tensor-parallel shard from a
full-size master weight, so the same ``--seed`` gives different models at TP1/PP1 and TP2xPP2.
With ``--use-cpu-initialization`` we redraw every matrix from a generator seeded by ``--seed``
and the weight's *global* name (layer numbers counted across pipeline stages), then keep this
rank's shard. Every layout then starts from the same model, which makes losses comparable
across layouts. Vectors (norm weights, biases) are constants and are left as built.

The distributions are megatron-core's own: ``config.init_method`` for every matrix and
``config.output_layer_init_method`` for the projections that feed the residual stream.
"""

from __future__ import annotations

import re
import zlib

import torch
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

_RESIDUAL_OUTPUT_PROJECTIONS = ("linear_proj.weight", "linear_fc2.weight")
_WORD_EMBEDDING = "embedding.word_embeddings.weight"


def global_parameter_names(chunk: torch.nn.Module) -> dict[str, str]:
    """Parameter name -> the same name with the layer index of the whole model, not of this stage (the last
    stage's copy of a tied output layer is named as the word embedding): the same weight has the same name at
    every parallel layout, so seeds and statistics keyed by it do not depend on the layout."""
    layer_prefixes = {}
    for module_name, module in chunk.named_modules():
        if isinstance(module, TransformerLayer):
            global_prefix = re.sub(r"\.\d+$", f".{module.layer_number - 1}", module_name)
            layer_prefixes[module_name + "."] = global_prefix + "."
    names = {}
    for name, _ in chunk.named_parameters():
        global_name = name
        for local, global_ in layer_prefixes.items():
            if name.startswith(local):
                global_name = global_ + name[len(local):]
                break
        if global_name == "output_layer.weight" and getattr(chunk, "share_embeddings_and_output_weights", False):
            global_name = _WORD_EMBEDDING  # the last stage's copy of the tied embedding
        names[name] = global_name
    return names


def this_ranks_shard(master: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """This tensor-parallel rank's shard of ``master``, a full-size tensor of ``param``'s model-wide shape
    (``full_shape``), split as megatron-core splits ``param`` (its partition dim and stride); ``master`` itself
    for a parameter that is not split."""
    if not getattr(param, "tensor_model_parallel", False):
        return master
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pieces = torch.chunk(master, tp_size * param.partition_stride, dim=param.partition_dim)
    return torch.cat(pieces[tp_rank::tp_size], dim=param.partition_dim)


def full_shape(param: torch.nn.Parameter) -> list[int]:
    """The shape of ``param`` before tensor parallelism split it (its shape when it is not split)."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= parallel_state.get_tensor_model_parallel_world_size()
    return shape


@torch.no_grad()
def reinitialize_layout_invariant(chunks: list[torch.nn.Module], config: TransformerConfig, seed: int) -> None:
    """Redraw every matrix of ``chunks`` from ``seed`` and its global name (module docstring) with ``config``'s
    init methods."""
    for chunk in chunks:
        global_names = global_parameter_names(chunk)
        for name, param in chunk.named_parameters():
            if param.dim() < 2:
                continue
            global_name = global_names[name]
            init = (config.output_layer_init_method if global_name.endswith(_RESIDUAL_OUTPUT_PROJECTIONS)
                    else config.init_method)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + zlib.crc32(global_name.encode()))
                master = torch.empty(full_shape(param), dtype=torch.float32)
                init(master)
            param.copy_(this_ranks_shard(master, param))
