"""Converting a model holds about one shard plus one layer in host memory, not the model: both ways.

The model is shaped like the real ones where this is hardest: a vocabulary large enough that the
embedding and the output layer are its largest tensors, each in a shard of its own (the largest
shards), so holding either of them past its shard, or twice, shows as one tensor too many. The
vocabulary (63990) is padded (to 64000), as Llama 3's is at TP4 and TP8."""

import re
import shutil

import pytest
import torch
from helpers.hf_tokenizer import write_word_tokenizer
from helpers.launch import assert_succeeded, run_script
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

SHARD_MB = 40
LAYERS = 12  # hidden 512, ffn 1536: 12.6 MB a layer; vocabulary 63990: 131 MB embedding and output layer, fp32
# What a conversion holds besides its tensors: arguments, the model's layout on the meta device,
# DCP's plan and metadata, and what the C allocator keeps of freed tensors (measured: 10-25 MB).
ALLOWANCE = 72e6
CONVERT_FLAGS = ["--model-type", "GPT"]


_PEAK_LINE = re.compile(r"peak host memory: [0-9.]+ GB, ([0-9.-]+) GB above the [0-9.]+ GB held before converting")


def _peak_growth(*flags):
    """The conversion's own report of its peak resident memory above what it held after its imports."""
    result = run_script("tools/checkpoint/convert.py", [*CONVERT_FLAGS, *flags], timeout=600)
    assert_succeeded(result)
    return float(_PEAK_LINE.fullmatch(result.stdout.strip().splitlines()[-1]).group(1)) * 1e9


def _tensor_bytes(hf_dir):
    """{name: bytes} of the tensors in ``hf_dir``'s safetensors files."""
    sizes = {}
    for path in hf_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():
                tensor = shard.get_slice(name)
                sizes[name] = torch.Size(tensor.get_shape()).numel() * 4  # fp32
    return sizes


def _largest_layer_bytes(sizes):
    layers = {}
    for name, size in sizes.items():
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            layers[layer] = layers.get(layer, 0) + size
    return max(layers.values())


def _largest_file(directory):
    return max(directory.glob("*.safetensors"), key=lambda path: path.stat().st_size)


@pytest.fixture(scope="module")
def large_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("large")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=LAYERS, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=63990, max_position_embeddings=256,
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    LlamaForCausalLM(config).save_pretrained(root / "hf", max_shard_size=f"{SHARD_MB}MB")
    write_word_tokenizer(root / "hf", config.vocab_size)
    sizes = _tensor_bytes(root / "hf")
    largest = _largest_file(root / "hf")
    with safe_open(str(largest), framework="pt") as shard:  # the embedding's or the output layer's
        assert set(shard.keys()) in ({"model.embed_tokens.weight"}, {"lm_head.weight"})
    model_bytes = sum(path.stat().st_size for path in (root / "hf").glob("*.safetensors"))
    yield root, sizes, largest.stat().st_size, model_bytes
    shutil.rmtree(root)  # a few hundred MB


def test_hf_to_core_peak_memory_is_a_shard_and_a_layer(large_model):
    root, sizes, largest_shard, model_bytes = large_model
    bound = largest_shard + _largest_layer_bytes(sizes) + ALLOWANCE
    # Below the model, and below holding the embedding until the output layer is read (as happened
    # while PyTorch's writer kept every tensor of its one file until the file was closed).
    assert bound < min(model_bytes, sizes["model.embed_tokens.weight"] + sizes["lm_head.weight"])
    growth = _peak_growth("--loader", "llama_mistral", "--saver", "core", "--load-dir", root / "hf",
                          "--save-dir", root / "core")
    assert growth < bound, (growth, bound)


def test_core_to_hf_peak_memory_is_a_shard_and_a_layer(large_model):
    root, sizes, _, model_bytes = large_model
    if not (root / "core").exists():
        pytest.skip("needs the checkpoint of the conversion test")
    growth = _peak_growth("--loader", "core", "--saver", "hf", "--load-dir", root / "core",
                          "--save-dir", root / "back", "--max-shard-size-gb", SHARD_MB / 1000)
    assert len(list((root / "back").glob("*.safetensors"))) > 3
    # One output file (at most --max-shard-size-gb, or one tensor) and one layer, or the tensor being
    # read: PyTorch's checkpoint reader loads a stored tensor whole, then copies it into ours.
    largest_tensor = max(sizes.values())
    bound = _largest_file(root / "back").stat().st_size + max(_largest_layer_bytes(sizes), largest_tensor) + ALLOWANCE
    # Below the model, and below holding the output layer from the start (and reading the embedding).
    assert bound < min(model_bytes, sizes["model.embed_tokens.weight"] + 2 * sizes["lm_head.weight"])
    assert growth < bound, (growth, bound)
