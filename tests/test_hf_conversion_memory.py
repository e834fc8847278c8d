"""Converting a model holds about one shard plus one layer in host memory, not the model: both ways."""

import re
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from launch import assert_succeeded, run_script

SHARD_MB = 10
LAYERS = 16  # hidden 512, ffn 1536: 12.6 MB a layer in fp32, about 210 MB in all
# What the conversion holds besides its tensors: arguments, the model's layout on the meta device,
# DCP's plan and metadata, and what the C allocator keeps of freed tensors (measured: 35-60 MB).
ALLOWANCE = 72e6
CONVERT_FLAGS = ["--model-type", "GPT"]


_PEAK_LINE = re.compile(r"peak host memory: [0-9.]+ GB, ([0-9.-]+) GB above the [0-9.]+ GB held before converting")


def _peak_growth(*flags):
    """The conversion's own report of its peak resident memory above what it held after its imports."""
    result = run_script("tools/checkpoint/convert.py", [*CONVERT_FLAGS, *flags], timeout=600)
    assert_succeeded(result)
    return float(_PEAK_LINE.fullmatch(result.stdout.strip().splitlines()[-1]).group(1)) * 1e9


def _largest_layer_bytes(hf_dir, layers):
    sizes = dict.fromkeys(range(layers), 0)
    for path in hf_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():
                if name.startswith("model.layers."):
                    tensor = shard.get_slice(name)
                    numel = torch.Size(tensor.get_shape()).numel()
                    sizes[int(name.split(".")[2])] += numel * 4  # converted to fp32
    return max(sizes.values())


@pytest.fixture(scope="module")
def large_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("large")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=LAYERS, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=1000, max_position_embeddings=256,
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    LlamaForCausalLM(config).save_pretrained(root / "hf", max_shard_size=f"{SHARD_MB}MB")
    model_bytes = sum(path.stat().st_size for path in (root / "hf").glob("*.safetensors"))
    bound = SHARD_MB * 1e6 + _largest_layer_bytes(root / "hf", LAYERS) + ALLOWANCE
    assert model_bytes > 2 * bound  # the bound is far below what holding the model would take
    yield root, bound
    shutil.rmtree(root)  # a few hundred MB


def test_hf_to_core_peak_memory_is_a_shard_and_a_layer(large_model):
    root, bound = large_model
    growth = _peak_growth("--loader", "llama_mistral", "--saver", "core", "--load-dir", root / "hf",
                          "--save-dir", root / "core")
    assert growth < bound, (growth, bound)


def test_core_to_hf_peak_memory_is_a_shard_and_a_layer(large_model):
    root, bound = large_model
    if not (root / "core").exists():
        pytest.skip("needs the checkpoint of the conversion test")
    growth = _peak_growth("--loader", "core", "--saver", "hf", "--load-dir", root / "core",
                          "--save-dir", root / "back", "--max-shard-size-gb", SHARD_MB / 1000)
    assert growth < bound, (growth, bound)
    assert len(list((root / "back").glob("*.safetensors"))) > 10
