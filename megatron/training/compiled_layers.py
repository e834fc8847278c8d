"""``--compile-transformer-layers``: each transformer layer runs under ``torch.compile`` (inductor).

Layer by layer, as torchtitan compiles each block, rather than the whole model: megatron-core's schedule, its
pipeline transfers and DDP's gradient hooks stay in Python, and the layers of a chunk (same code, same shapes) share
one compiled graph, so compiling costs one layer's time. Inductor fuses each layer's elementwise work (norms,
residual adds, biases, activation, RoPE) into fewer kernels: fewer launches for the host, fewer round trips through
memory for the GPU. Under tensor parallelism megatron-core's collectives (asynchronous, into its global buffers)
stay eager: the graph breaks around each, and the work between them is compiled.

``Module.compile`` compiles the module's own call, inside megatron-core's ``__call__``: a CUDA-graphed layer
(``--cuda-graph-impl local``) captures and replays the compiled kernels.
"""

import functools
import warnings

from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import compiler

from megatron.training.errors import ArgumentError


def compile_transformer_layers(model_chunks):
    """Compile every transformer layer of ``model_chunks`` in place (each layer's first call compiles)."""
    _skip_warnings_in_compiled_code()
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, TransformerLayer):
                module.compile()


@functools.cache  # a substitute is registered once per process
def _skip_warnings_in_compiled_code():
    """megatron-core warns from inside its layers on every call (RowParallelLinear passes no tensor-parallel group,
    a deprecated default). Dynamo cannot trace ``warnings.warn``: each layer's graph would break there, and inside
    megatron-core's context managers the rest of the layer would run eagerly. Compiled code skips the warning;
    eager code still warns."""

    @compiler.substitute_in_graph(warnings.warn, skip_signature_check=True)
    def _skipped_warning(*_args, **_kwargs):
        return None


def refuse_compiled_layers(args, needs: str):
    """For a module that works inside the layers from Python (hooks, shadowed forwards), which compiled code does
    not follow: one line when ``--compile-transformer-layers`` is on. ``needs``: the flag and what it does there."""
    if args.compile_transformer_layers:
        raise ArgumentError(f"{needs}, which --compile-transformer-layers compiles away; drop one of them")
