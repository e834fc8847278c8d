"""A Llama-family Hugging Face config.json, checked, and the Megatron flags of the same model.

Llama 2/3, Mistral and Qwen2 share one shape: RMSNorm, SwiGLU, rotary embeddings (rotate-half,
the layout megatron-core's non-interleaved rotary uses), grouped-query attention, no linear
biases except Qwen2's on Q/K/V. What megatron-core cannot compute the same way is refused here.
"""

import dataclasses
import functools
import json
import os

from megatron.training.errors import UserError
from megatron.training.tokenizer.build import vocab_size_with_padding

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": False, "MistralForCausalLM": False, "Qwen2ForCausalLM": True}
# megatron-core's RotaryEmbedding applies Llama 3's scaling with these constants fixed.
_LLAMA3_ROPE_CONSTANTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    architecture: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    max_position_embeddings: int
    norm_epsilon: float
    rotary_base: int
    rope_scaling_factor: float | None  # Llama 3's scaling, None without
    qkv_bias: bool
    tied_embeddings: bool

    def padded_vocab_size(self, make_vocab_size_divisible_by, tensor_parallel_size):
        return vocab_size_with_padding(self.vocab_size, make_vocab_size_divisible_by, tensor_parallel_size)

    def megatron_flags(self):
        """The model flags of pretrain_gpt.py that build this model (with --load of the converted checkpoint)."""
        flags = ["--num-layers", self.num_layers, "--hidden-size", self.hidden_size,
                 "--ffn-hidden-size", self.ffn_hidden_size, "--num-attention-heads", self.num_attention_heads,
                 "--group-query-attention", "--num-query-groups", self.num_query_groups,
                 "--kv-channels", self.kv_channels, "--max-position-embeddings", self.max_position_embeddings,
                 "--position-embedding-type", "rope", "--rotary-base", self.rotary_base,
                 "--normalization", "RMSNorm", "--norm-epsilon", self.norm_epsilon, "--swiglu",
                 "--disable-bias-linear", "--attention-dropout", 0, "--hidden-dropout", 0]
        if not self.tied_embeddings:
            flags.append("--untie-embeddings-and-output-weights")
        if self.qkv_bias:
            flags.append("--add-qkv-bias")
        if self.rope_scaling_factor is not None:
            flags += ["--use-rope-scaling", "--rope-scaling-factor", self.rope_scaling_factor]
        return [str(flag) for flag in flags]


def read_config(hf_dir, flag="--load-dir"):
    """The config.json of ``hf_dir``, the directory given by ``flag`` (named in errors)."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"{flag} {hf_dir}: no config.json (a Hugging Face model directory holds one)")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as error:
        raise UserError(f"{flag} {hf_dir}: config.json is not readable JSON ({error})") from None


def _rope(config, path):
    """(base, Llama 3 scaling factor or None); transformers 5 nests both in rope_parameters."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    base = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return base, None
    if kind != "llama3":
        raise UserError(f"{path}: rope type {kind!r} is not supported (default and llama3 are)")
    for name, value in _LLAMA3_ROPE_CONSTANTS.items():
        if rope.get(name, value) != value:
            raise UserError(f"{path}: llama3 rope scaling with {name} {rope[name]} is not supported "
                            f"(megatron-core fixes it at {value})")
    factor = rope.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise UserError(f"{path}: llama3 rope scaling needs a positive factor, got {factor!r}")
    return base, float(factor)


def _refuse_sliding_window(config, architecture, path):
    """transformers applies ``sliding_window`` to Mistral whenever it is set, to Qwen2 only with
    ``use_sliding_window``; a window at least as long as the positions never takes effect."""
    window = config.get("sliding_window")
    applies = config.get("use_sliding_window") if architecture == "Qwen2ForCausalLM" else window is not None
    positions = config.get("max_position_embeddings")
    if applies and (window is None or positions is None or window < positions):
        raise UserError(f"{path}: sliding-window attention (sliding_window {window}, max_position_embeddings "
                        f"{positions}) is not supported: the converted model would attend beyond the window")


def _count(config, path, key, default=None):
    """A positive integer entry of config.json (``default`` where it is absent or null)."""
    value = config.get(key)
    if value is None and default is not None:
        return default
    if value is None:
        raise UserError(f"{path}: {key} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{path}: {key} must be a positive integer, got {value!r}")
    return value


def llama_shape(config, path):
    """The model config.json describes, or a UserError naming what is not supported."""
    names = config.get("architectures") or ["(none named)"]
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise UserError(f"{path}: architectures must be a list of names, like [\"LlamaForCausalLM\"]; got {names!r}")
    architecture = names[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UserError(f"{path}: architecture {architecture} is not supported; "
                        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if config.get("hidden_act", "silu") != "silu" or config.get("mlp_bias") or config.get("attention_bias"):
        raise UserError(f"{path}: only SwiGLU (hidden_act silu) without MLP/attention biases is supported")
    _refuse_sliding_window(config, architecture, path)
    base, scaling = _rope(config, path)
    if base != int(base):
        raise UserError(f"{path}: rope_theta {base} is not an integer (--rotary-base takes integers)")
    count = functools.partial(_count, config, path)
    heads, hidden = count("num_attention_heads"), count("hidden_size")
    return LlamaShape(
        architecture=architecture,
        num_layers=count("num_hidden_layers"),
        hidden_size=hidden,
        ffn_hidden_size=count("intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=count("num_key_value_heads", default=heads),
        kv_channels=count("head_dim", default=hidden // heads),
        vocab_size=count("vocab_size"),
        max_position_embeddings=count("max_position_embeddings"),
        norm_epsilon=config.get("rms_norm_eps", 1e-6),
        rotary_base=int(base),
        rope_scaling_factor=scaling,
        qkv_bias=SUPPORTED_ARCHITECTURES[architecture],
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def check_layout(shape, tensor_parallel_size, pipeline_parallel_size):
    """The layout flags are Megatron-LM's converter's; the message names them."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    for count, what in ((shape.num_attention_heads, "attention heads"), (shape.num_query_groups, "query groups")):
        if count % tp:
            raise UserError(f"--target-tensor-parallel-size {tp} does not divide the model's {count} {what}")
    if shape.num_layers % pp:
        raise UserError(f"--target-pipeline-parallel-size {pp} does not divide the model's {shape.num_layers} layers")
