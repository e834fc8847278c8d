"""--fp8-format and --fp8-recipe: the defaults, what megatron-core is given, and every refusal's one line. The checks
run on this CPU host as on a GPU one: where a test needs a GPU, the host is made to look like one (CUDA available, a
GPU of the given compute capability), which is all the checks read."""

import importlib.util
import sys
import types

import pytest
import torch

from megatron.inference.model_setup import setup_for_generation
from megatron.training.arguments import parse_args
from megatron.training.core_configs import transformer_config
from megatron.training.errors import ArgumentError
from megatron.training.validate_args import validate_args
from pretrain_gpt import model_provider

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "3", "--mock-data", "--vocab-size", "1000",
         "--bf16"]


@pytest.fixture
def gpu(monkeypatch):
    """Makes this host look like one with GPUs of compute capability ``gpu(major, minor)``."""
    def with_capability(major, minor, name="NVIDIA H200"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return with_capability


@pytest.fixture
def transformer_engine(monkeypatch):
    """An importable transformer_engine: the checks only ask whether it is installed."""
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))


def _validated(*flags, world_size=1):
    return validate_args(parse_args(MODEL + list(flags), "test"), world_size)


def _refusal(*flags, world_size=1):
    with pytest.raises(ArgumentError) as refused:
        _validated(*flags, world_size=world_size)
    return str(refused.value)


def test_fp8_is_off_by_default_and_megatron_core_never_sees_it_without_transformer_engine(gpu):
    gpu(9, 0)
    args = _validated("--device", "cuda")
    assert args.fp8 is None and args.fp8_recipe is None
    local = _validated("--device", "cuda", "--fp8-format", "hybrid")
    assert (local.fp8, local.fp8_recipe) == ("hybrid", "tensorwise")  # the local layers' default recipe
    assert transformer_config(local).fp8 is None  # megatron-core would enter Transformer Engine's FP8 autocast


def test_transformer_engine_gets_megatron_lms_fp8_settings(gpu, transformer_engine):
    gpu(9, 0)
    args = _validated("--device", "cuda", "--transformer-impl", "transformer_engine", "--fp8-format", "e4m3")
    assert (args.fp8, args.fp8_recipe) == ("e4m3", "delayed")  # Megatron-LM's default recipe
    config = transformer_config(args)
    assert (config.fp8, config.fp8_recipe) == ("e4m3", "delayed")
    args = _validated("--device", "cuda", "--transformer-impl", "transformer_engine", "--fp8-format", "hybrid",
                      "--fp8-recipe", "tensorwise")
    assert (transformer_config(args).fp8, transformer_config(args).fp8_recipe) == ("hybrid", "tensorwise")


def test_a_recipe_without_a_format_is_ignored_as_in_megatron_lm():
    args = _validated("--fp8-recipe", "delayed")
    assert args.fp8 is None and transformer_config(args).fp8 is None


def test_fp8_on_cpu_is_refused():
    assert _refusal("--device", "cpu", "--fp8-format", "hybrid") == (
        "--fp8-format hybrid --fp8-recipe tensorwise needs a GPU of compute capability 8.9 or newer (FP8 tensor "
        "cores); --device cpu has none: drop --fp8-format")


def test_a_gpu_without_fp8_tensor_cores_is_refused_by_its_name_and_capability(gpu):
    gpu(8, 0, name="NVIDIA A100-SXM4-80GB")
    assert _refusal("--device", "cuda", "--fp8-format", "e4m3") == (
        "--fp8-format e4m3 --fp8-recipe tensorwise needs a GPU of compute capability 8.9 or newer; "
        "NVIDIA A100-SXM4-80GB is 8.0: drop --fp8-format")
    gpu(8, 9, name="NVIDIA L40S")
    assert _validated("--device", "cuda", "--fp8-format", "e4m3").fp8 == "e4m3"


def test_mxfp8_needs_blackwell(gpu, transformer_engine):
    gpu(9, 0)
    assert _refusal("--device", "cuda", "--transformer-impl", "transformer_engine", "--fp8-format", "e4m3",
                    "--fp8-recipe", "mxfp8") == (
        "--fp8-format e4m3 --fp8-recipe mxfp8 needs a GPU of compute capability 10.0 or newer; NVIDIA H200 is 9.0: "
        "drop --fp8-format")


@pytest.mark.parametrize("impl, recipe, takes", [
    ("local", "delayed", "tensorwise, rowwise"),
    ("local", "mxfp8", "tensorwise, rowwise"),
    ("transformer_engine", "rowwise", "delayed, tensorwise, mxfp8, blockwise"),
])
def test_a_recipe_of_the_other_implementation_is_refused(gpu, transformer_engine, impl, recipe, takes):
    gpu(9, 0)
    assert _refusal("--device", "cuda", "--transformer-impl", impl, "--fp8-format", "hybrid",
                    "--fp8-recipe", recipe) == (
        f"--fp8-recipe {recipe} does not run with --transformer-impl {impl}, which takes {takes}; pick one of them "
        f"or the other --transformer-impl")


def test_the_local_fp8_gemms_need_bf16(gpu):
    gpu(9, 0)
    with pytest.raises(ArgumentError, match=r"^--fp8-format with --transformer-impl local needs --bf16 \(the FP8 "
                                            r"GEMMs take and give bf16\); add it$"):
        validate_args(parse_args([f for f in MODEL if f != "--bf16"] + ["--device", "cuda", "--fp8-format", "hybrid"],
                                 "test"), 1)


def test_the_local_fp8_gemms_need_torchao(gpu, monkeypatch):
    gpu(9, 0)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "torchao"
                        else find_spec(name, *rest))
    assert _refusal("--device", "cuda", "--fp8-format", "hybrid") == (
        "--fp8-format with --transformer-impl local needs torchao: pip install -e '.[fp8]'")


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"],
                                    ["--tensor-model-parallel-size", "2", "--sequence-parallel"]], ids=["tp", "sp"])
def test_tensor_parallelism_is_refused_until_measured(gpu, layout):
    gpu(9, 0)
    assert _refusal("--device", "cuda", "--fp8-format", "hybrid", *layout, world_size=2) == (
        "--fp8-format with --transformer-impl local is not yet measured under tensor parallelism (got "
        "--tensor-model-parallel-size 2); use 1, or --transformer-impl transformer_engine")


@pytest.mark.parametrize("flags, what", [
    (["--hidden-size", "72"], "--hidden-size is 72"),
    (["--ffn-hidden-size", "200"], "--ffn-hidden-size is 200"),
    (["--kv-channels", "10"], "--num-attention-heads x --kv-channels (the attention's width) is 40"),
    # Grouped-query attention: the 4 heads of 20 (80) fit, their QKV projection's (4 + 2 x 1) x 20 does not.
    (["--kv-channels", "20", "--group-query-attention", "--num-query-groups", "1"],
     "(--num-attention-heads + 2 x --num-query-groups) x --kv-channels (the QKV projection's width) is 120"),
    (["--seq-length", "60", "--micro-batch-size", "1"],
     "--micro-batch-size x --seq-length (the tokens of a microbatch) is 60"),
], ids=["hidden", "ffn", "attention", "qkv", "tokens"])
def test_dimensions_the_fp8_gemms_cannot_take_are_named(gpu, flags, what):
    gpu(9, 0)
    assert _refusal("--device", "cuda", "--fp8-format", "hybrid", *flags) == (
        f"--fp8-format: the FP8 GEMMs take only multiples of 16, and {what}; change it or drop --fp8-format")


def test_the_generation_tools_refuse_fp8(tmp_path):
    with pytest.raises(ArgumentError, match=r"^--fp8-format: the generation tools run a checkpoint's layers in bf16"):
        setup_for_generation(MODEL + ["--fp8-format", "hybrid", "--load", str(tmp_path)], "test", model_provider)
