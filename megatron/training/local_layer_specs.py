"""megatron-core's local (no transformer-engine) layer specs, made to work with sequence parallelism.

Without apex, the local specs normalize with ``WrappedTorchNorm``, which refuses
``--sequence-parallel``: under sequence parallelism each tensor-parallel rank normalizes a different
slice of the sequence, so the norm's weight gradients must be summed over the tensor-parallel group.
megatron-core's ``finalize_model_grads`` does that for every parameter marked ``sequence_parallel``;
``SequenceParallelTorchNorm`` is PyTorch's LayerNorm/RMSNorm with that mark. The block spec carries
it into the final norm too.
"""

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

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
