"""megatron-core's local (no transformer-engine) layer specs: our core attention, and sequence parallelism.

The core attention is ``SDPAttention`` (PyTorch's fused kernels) unless ``--attention-backend``
asks for megatron-core's unfused ``DotProductAttention``.

Without apex, the local specs normalize with ``WrappedTorchNorm``, which refuses
``--sequence-parallel``: under sequence parallelism each tensor-parallel rank normalizes a different
slice of the sequence, so the norm's weight gradients must be summed over the tensor-parallel group.
megatron-core's ``finalize_model_grads`` does that for every parameter marked ``sequence_parallel``;
``SequenceParallelTorchNorm`` is PyTorch's LayerNorm/RMSNorm with that mark. The block spec carries
it into the final norm too.
"""

import copy
import functools

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from megatron.training.sdpa_attention import SDPA_KERNELS, SDPAttention

_TORCH_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class SequenceParallelTorchNorm:
    """Builds PyTorch's norm with its parameters marked for the sequence-parallel gradient sum."""

    def __new__(cls, config, hidden_size, eps=1e-5, **_unused_fused_norm_options):
        norm = _TORCH_NORMS[config.normalization](hidden_size, eps=eps)
        for parameter in norm.parameters():
            parameter.sequence_parallel = config.sequence_parallel
        return norm


def block_spec_with_torch_norms(layer_spec, config, vp_stage):
    """A TransformerBlock spec of ``layer_spec`` layers whose torch norms support sequence parallelism.

    Layer specs that already use a fused norm (apex installed) are returned unchanged."""
    layer = layer_spec.submodules
    if layer.input_layernorm is not WrappedTorchNorm:
        return layer_spec
    layer.input_layernorm = SequenceParallelTorchNorm
    layer.pre_mlp_layernorm = SequenceParallelTorchNorm
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(
            layer_specs=[layer_spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
            layer_norm=SequenceParallelTorchNorm,
        ),
    )


def local_core_attention(attention_backend):
    """The core attention module of ``--attention-backend`` for ``--transformer-impl local``."""
    if attention_backend in ("unfused", "local"):
        return DotProductAttention
    return functools.partial(SDPAttention, kernels=SDPA_KERNELS[attention_backend])


def with_core_attention(layer_spec, attention_backend):
    """A copy of ``layer_spec`` (module-level specs are shared) whose self-attention uses our choice."""
    layer_spec = copy.deepcopy(layer_spec)
    layer_spec.submodules.self_attention.submodules.core_attention = local_core_attention(attention_backend)
    return layer_spec


def with_fp8_gemms(layer_spec, args):
    """``layer_spec`` whose attention and MLP linears compute in FP8 under ``--fp8-format``, else itself. torchao
    (the optional ``[fp8]`` extra) is imported only then."""
    if args.fp8 is None:
        return layer_spec
    from megatron.training.fp8_linears import with_float8_linears

    return with_float8_linears(layer_spec, args.fp8, args.fp8_recipe)


def attention_summary(args):
    """What computes core attention in this run, for the start-up log."""
    if args.transformer_impl != "local":
        return f"Transformer Engine, --attention-backend {args.attention_backend}"
    if args.attention_backend in ("unfused", "local"):
        return "megatron-core DotProductAttention (unfused)"
    kernels = SDPA_KERNELS[args.attention_backend]
    return "scaled_dot_product_attention, " + (
        "any kernel" if kernels is None else " or ".join(kernel.name.lower() for kernel in kernels))
