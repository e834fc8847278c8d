"""How a Llama-family layer's Hugging Face tensors map onto our model's, both ways.

megatron-core keeps Q, K and V in one matrix, grouped by query group: for each group its query
heads, then its key head, then its value head (so a tensor-parallel split takes whole groups).
SwiGLU's fc1 is saved as two parts, gate then up (the parts megatron-core's checkpoint uses).
"""

import torch

HF_EMBEDDING = "model.embed_tokens.weight"
HF_FINAL_NORM = "model.norm.weight"
HF_OUTPUT = "lm_head.weight"


def hf_layer_names(layer, qkv_bias):
    prefix = f"model.layers.{layer}."
    names = {"input_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
             "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
             "o": "self_attn.o_proj.weight", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
             "down": "mlp.down_proj.weight"}
    if qkv_bias:
        names.update(q_bias="self_attn.q_proj.bias", k_bias="self_attn.k_proj.bias", v_bias="self_attn.v_proj.bias")
    return {part: prefix + name for part, name in names.items()}


def fused_qkv(q, k, v, num_query_groups):
    """[q; k; v] rows (weights or biases) -> megatron-core's per-group [q heads, k, v] rows."""
    rest = q.shape[1:]
    parts = [t.reshape(num_query_groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv, num_attention_heads, num_query_groups):
    """Inverse of ``fused_qkv``."""
    rest = qkv.shape[1:]
    per_group = qkv.reshape(num_query_groups, -1, *rest)
    head_rows = per_group.shape[1] // (num_attention_heads // num_query_groups + 2)
    q_rows = per_group.shape[1] - 2 * head_rows
    q, k, v = per_group.split([q_rows, head_rows, head_rows], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


def unchanged(tensor):
    return tensor


def megatron_layer_recipes(shape):
    """{our state key suffix: [(HF parts, combine) for each part it is saved as]}: how each tensor
    of a layer is made from the layer's HF tensors, so that it can be made on its own when written."""
    def qkv(q, k, v):
        return fused_qkv(q, k, v, shape.num_query_groups)

    recipes = {
        "input_layernorm.weight": [(("input_norm",), unchanged)],
        "pre_mlp_layernorm.weight": [(("mlp_norm",), unchanged)],
        "self_attention.linear_qkv.weight": [(("q", "k", "v"), qkv)],
        "self_attention.linear_proj.weight": [(("o",), unchanged)],
        "mlp.linear_fc1.weight": [(("gate",), unchanged), (("up",), unchanged)],
        "mlp.linear_fc2.weight": [(("down",), unchanged)],
    }
    if shape.qkv_bias:
        recipes["self_attention.linear_qkv.bias"] = [(("q_bias", "k_bias", "v_bias"), qkv)]
    return recipes


def hf_layer(megatron, shape):
    """Inverse of ``megatron_layer_recipes``: {HF part: tensor} from {our key suffix: tensor or [gate, up]}."""
    q, k, v = split_qkv(megatron["self_attention.linear_qkv.weight"], shape.num_attention_heads,
                        shape.num_query_groups)
    gate, up = megatron["mlp.linear_fc1.weight"]
    parts = {"input_norm": megatron["input_layernorm.weight"], "mlp_norm": megatron["pre_mlp_layernorm.weight"],
             "q": q, "k": k, "v": v, "o": megatron["self_attention.linear_proj.weight"],
             "gate": gate, "up": up, "down": megatron["mlp.linear_fc2.weight"]}
    if shape.qkv_bias:
        parts["q_bias"], parts["k_bias"], parts["v_bias"] = split_qkv(
            megatron["self_attention.linear_qkv.bias"], shape.num_attention_heads, shape.num_query_groups)
    return parts


def padded_rows(tensor, rows):
    """The vocabulary rows padded with zeros to ``rows`` (rows beyond the vocabulary are never sampled)."""
    if tensor.shape[0] == rows:
        return tensor
    padded = tensor.new_zeros(rows, *tensor.shape[1:])
    padded[: tensor.shape[0]] = tensor
    return padded
