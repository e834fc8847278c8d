"""``--fp8-format`` and ``--fp8-recipe``: which FP8 runs can work, checked before start-up, and the recipe's default.

Megatron-LM's flags. With ``--transformer-impl transformer_engine`` they go to Transformer Engine's FP8 as in
Megatron-LM (``core_configs.transformer_config``); with the local layers the transformer layers' linear GEMMs run in
FP8 through torchao (``fp8_linears.py``). Every combination that cannot work stops here in one line.
"""

import importlib.util
import os

import torch

from megatron.training.errors import ArgumentError

# The recipe each implementation takes, its first the default. Transformer Engine's default is Megatron-LM's.
# The local default is torchao's fastest by its own account, until bench/fp8_speed.sh measures both on an H200.
RECIPES = {"local": ("tensorwise", "rowwise"),
           "transformer_engine": ("delayed", "tensorwise", "mxfp8", "blockwise")}
FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper, Blackwell
RECIPE_CAPABILITY = {"mxfp8": (10, 0)}  # MXFP8's block scales: Blackwell
GEMM_MULTIPLE = 16  # torch._scaled_mm multiplies only dimensions that are multiples of 16


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ArgumentError(message)


def _require_recipe_of_implementation(args) -> None:
    impl = args.transformer_impl
    if args.fp8_recipe is None:
        args.fp8_recipe = RECIPES[impl][0]
    takes = RECIPES[impl]
    _require(args.fp8_recipe in takes,
             f"--fp8-recipe {args.fp8_recipe} does not run with --transformer-impl {impl}, which takes "
             f"{', '.join(takes)}; pick one of them or the other --transformer-impl")


def _require_fp8_gpu(args) -> None:
    needs = max(FP8_CAPABILITY, RECIPE_CAPABILITY.get(args.fp8_recipe, FP8_CAPABILITY))
    needed = f"a GPU of compute capability {needs[0]}.{needs[1]} or newer"
    what = f"--fp8-format {args.fp8} --fp8-recipe {args.fp8_recipe}"
    _require(args.device == "cuda", f"{what} needs {needed} (FP8 tensor cores); --device cpu has none: drop "
                                    f"--fp8-format")
    device = int(os.environ.get("LOCAL_RANK", "0"))  # the rank's own GPU, the one initialize_megatron sets
    capability = torch.cuda.get_device_capability(device)
    _require(capability >= needs, f"{what} needs {needed}; {torch.cuda.get_device_name(device)} is "
                                  f"{capability[0]}.{capability[1]}: drop --fp8-format")


def _gemm_dimensions(args) -> list[tuple[str, int]]:
    """(what, size) of each dimension of the layers' GEMMs. The tokens of a microbatch are the inner dimension of
    the weight gradients' GEMM; the QKV width covers the query and the key-value groups' heads."""
    head_dim = args.kv_channels
    return [("--hidden-size", args.hidden_size),
            ("--ffn-hidden-size", args.ffn_hidden_size),
            ("--num-attention-heads x --kv-channels (the attention's width)", args.num_attention_heads * head_dim),
            ("(--num-attention-heads + 2 x --num-query-groups) x --kv-channels (the QKV projection's width)",
             (args.num_attention_heads + 2 * args.num_query_groups) * head_dim),
            ("--micro-batch-size x --seq-length (the tokens of a microbatch)", args.micro_batch_size * args.seq_length)]


def _validate_local(args) -> None:
    _require(importlib.util.find_spec("torchao") is not None,
             "--fp8-format with --transformer-impl local needs torchao: pip install -e '.[fp8]'")
    _require(args.bf16, "--fp8-format with --transformer-impl local needs --bf16 (the FP8 GEMMs take and give "
                        "bf16); add it")
    _require(args.tensor_model_parallel_size == 1,
             f"--fp8-format with --transformer-impl local is not yet measured under tensor parallelism (got "
             f"--tensor-model-parallel-size {args.tensor_model_parallel_size}); use 1, or --transformer-impl "
             f"transformer_engine")
    for what, size in _gemm_dimensions(args):
        _require(size % GEMM_MULTIPLE == 0,
                 f"--fp8-format: the FP8 GEMMs take only multiples of {GEMM_MULTIPLE}, and {what} is {size}; "
                 f"change it or drop --fp8-format")


def validate_fp8(args) -> None:
    """Refuse, in one line, an FP8 run that cannot work, and fill in the default ``--fp8-recipe``. Runs after the
    model's sizes and the device are known. ``--fp8-recipe`` alone is ignored, as in Megatron-LM."""
    if args.fp8 is None:
        return
    _require_recipe_of_implementation(args)
    _require_fp8_gpu(args)
    if args.transformer_impl == "local":
        _validate_local(args)


def fp8_summary(args) -> str:
    """What computes the layers' GEMMs in FP8, for the start-up line; empty without FP8."""
    if args.fp8 is None:
        return ""
    by = "torchao" if args.transformer_impl == "local" else "Transformer Engine"
    return f"; linear GEMMs of the layers in FP8 ({args.fp8}, {args.fp8_recipe} scaling, {by})"
