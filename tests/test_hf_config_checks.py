"""convert.py's checks of a Hugging Face model directory, called in-process (the conversion tests run the tool
itself): each mistake in config.json, the flags or the tokenizer folder is one line naming it, where they used
to be a KeyError, TypeError or ZeroDivisionError trace, a misread name, or a checkpoint that failed only when
it was loaded."""


import convert
import pytest
from llama_config import llama_shape

from megatron.training.errors import ArgumentError, UserError
from megatron.training.save_dir.conversion_output import check_tokenizer

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
         "max_position_embeddings": 256}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def _without(key):
    return {name: value for name, value in LLAMA.items() if name != key}


@pytest.mark.parametrize("config, message", [
    (_without("num_attention_heads"), "num_attention_heads is missing"),
    ({**LLAMA, "num_hidden_layers": "4"}, "num_hidden_layers must be a positive integer, got '4'"),
    ({**LLAMA, "hidden_size": 0}, "hidden_size must be a positive integer, got 0"),
    ({**LLAMA, "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "factor"}},
     "llama3 rope scaling needs a positive factor, got None"),
    ({**LLAMA, "architectures": "LlamaForCausalLM"},
     "architectures must be a list of names, like [\"LlamaForCausalLM\"]; got 'LlamaForCausalLM'"),
], ids=["missing heads", "layers as text", "zero hidden size", "rope without factor", "architectures as text"])
def test_a_config_mistake_is_one_line_naming_the_entry(config, message):
    with pytest.raises(UserError) as refused:
        llama_shape(config, "HF/config.json")
    assert str(refused.value) == f"HF/config.json: {message}"


def test_a_good_config_still_reads():
    shape = llama_shape({**LLAMA, "rope_scaling": LLAMA3_ROPE}, "HF/config.json")
    assert (shape.num_layers, shape.kv_channels, shape.num_query_groups, shape.rope_scaling_factor) == (4, 16, 2, 8.0)


def test_a_zero_vocabulary_multiple_is_refused(tmp_path):
    with pytest.raises(ArgumentError, match="--make-vocab-size-divisible-by must be >= 1, got 0"):
        convert.parse(["--model-type", "GPT", "--loader", "llama_mistral", "--saver", "core",
                       "--load-dir", str(tmp_path), "--save-dir", str(tmp_path / "out"),
                       "--make-vocab-size-divisible-by", "0"])


def test_a_tokenizer_folder_without_a_tokenizer_is_refused(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(UserError, match="no tokenizer there"):
        check_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{}")
    check_tokenizer(str(tmp_path))
