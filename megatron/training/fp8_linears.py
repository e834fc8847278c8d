"""``--fp8-format`` on the local layers: the transformer layers' linear GEMMs in FP8, by torchao's float8 training.

torchao makes a model train in FP8 by swapping each ``nn.Linear`` for its ``Float8Linear``. megatron-core's layers
are ``ColumnParallelLinear`` and ``RowParallelLinear`` instead, whose GEMM is one method, ``_forward_impl``; the FP8
linears here replace only that method, with the autograd function inside ``Float8Linear``
(``matmul_with_hp_or_float8_args``): in the forward GEMM and in both backward ones (input and weight gradients) the
operands are scaled and cast to FP8 on the fly (dynamic scaling: no amax history, no state) and multiplied by
``torch._scaled_mm`` into bf16. Everything else is the bf16 layer's: the parameters and their initialization, the
bf16 gradients megatron-core's DDP accumulates, the optimizer and the checkpoints (same keys, shapes and dtypes), so a
checkpoint moves between FP8 and bf16 runs unchanged. The embedding and the output layer are built outside the
layer spec and stay bf16.

Formats, as Transformer Engine's: ``e4m3`` casts every operand to e4m3; ``hybrid`` casts the output gradients to
e5m2 (more range, less precision). Recipes, as torchao's: ``tensorwise`` scales each operand by one factor (cuBLAS's
FP8 GEMM); ``rowwise`` by one per row, rounded to a power of two (CUTLASS's FP8 GEMM; finer, costs more).
"""

import copy
import dataclasses

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from torchao.float8 import Float8LinearConfig, LinearMMConfig, ScaledMMConfig
from torchao.float8.config import e4m3_dtype, e5m2_dtype
from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

GRADIENT_DTYPES = {"e4m3": e4m3_dtype, "hybrid": e5m2_dtype}


def float8_linear_config(fp8_format: str, fp8_recipe: str) -> Float8LinearConfig:
    """torchao's configuration of ``--fp8-recipe``, with the output gradients' FP8 type of ``--fp8-format``.

    torchao's own recipes are tensorwise hybrid and rowwise e4m3; the other two pairs change that one dtype."""
    recipe = Float8LinearConfig.from_recipe_name(fp8_recipe)
    gradient = dataclasses.replace(recipe.cast_config_grad_output, target_dtype=GRADIENT_DTYPES[fp8_format])
    return dataclasses.replace(recipe, cast_config_grad_output=gradient,
                               cast_config_grad_output_for_grad_weight=gradient)


def _gemm_configs(config: Float8LinearConfig) -> LinearMMConfig:
    """The three GEMMs' settings (output, input gradient, weight gradient), as ``Float8Linear`` derives them."""
    def gemm(gemm_config):
        return ScaledMMConfig(config.emulate, gemm_config.use_fast_accum, False, config.pad_inner_dim)

    return LinearMMConfig(gemm(config.gemm_config_output), gemm(config.gemm_config_grad_input),
                          gemm(config.gemm_config_grad_weight))


class _Float8Gemm:
    """The GEMM of megatron-core's linear in FP8, at one tensor-parallel rank.

    Under tensor parallelism megatron-core's GEMM function also all-gathers a sequence-parallel input or all-reduces
    the input gradient; this one does neither, and the flags refuse tensor parallelism (``fp8_flags.py``) until FP8
    there is built and measured on several GPUs."""

    def __init__(self, *args, fp8: Float8LinearConfig, **kwargs):
        super().__init__(*args, **kwargs)
        self.fp8_config = fp8
        self.fp8_gemms = _gemm_configs(fp8)

    def _forward_impl(self, input, weight, bias=None, **_options):
        # _options: the collectives of tensor parallelism (off at one rank), gradient-accumulation fusion and the
        # embedding's deferred weight gradient (never on for these layers: core_configs.transformer_config).
        output = matmul_with_hp_or_float8_args.apply(input, weight.t(), self.fp8_gemms, self.fp8_config)
        return output if bias is None else output + bias


class Float8ColumnParallelLinear(_Float8Gemm, ColumnParallelLinear):
    """megatron-core's column-parallel linear (QKV, MLP fc1) whose GEMMs run in FP8."""


class Float8RowParallelLinear(_Float8Gemm, RowParallelLinear):
    """megatron-core's row-parallel linear (attention projection, MLP fc2) whose GEMMs run in FP8."""


def with_float8_linears(layer_spec: ModuleSpec, fp8_format: str, fp8_recipe: str) -> ModuleSpec:
    """A copy of a local layer spec (GPT's or BERT's) whose attention and MLP linears compute in FP8."""
    layer_spec = copy.deepcopy(layer_spec)
    params = {"fp8": float8_linear_config(fp8_format, fp8_recipe)}
    attention, mlp = layer_spec.submodules.self_attention.submodules, layer_spec.submodules.mlp.submodules
    attention.linear_qkv = mlp.linear_fc1 = ModuleSpec(module=Float8ColumnParallelLinear, params=params)
    attention.linear_proj = mlp.linear_fc2 = ModuleSpec(module=Float8RowParallelLinear, params=params)
    return layer_spec
