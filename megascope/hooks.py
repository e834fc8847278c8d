"""TransformerLens-style hook points on megatron-core's GPTModel (local layer spec).

Each hook point names one activation, the megatron-core module it is read from, and how the
activation is laid out over the tensor-parallel ranks, so that ``capture`` can gather it:

    name            read from                                   layout on a TP rank
    embed           embedding output                            hidden (sequence-split under SP)
    ln1             input_layernorm output                      hidden
    attn.q/k/v      self_attention.linear_qkv output            fused QKV columns (split per head here)
    attn.pattern    core_attention inputs (softmax recomputed)  heads
    attn.out        self_attention output (+ its bias)          hidden
    resid_mid       pre_mlp_layernorm input                     hidden
    mlp.pre         mlp.linear_fc2 input (after activation)     columns
    mlp.out         mlp output (+ its bias)                     hidden
    resid_post      transformer layer output                    hidden
    final_norm      decoder.final_layernorm output              hidden
    logits          output_layer output                         columns (vocabulary)

attn.q/k/v are the projections before rotary embeddings (TransformerLens' hook_q/k/v);
attn.pattern is computed from the query and keys the core attention receives (after rotary, all
cached keys in a KV-cache decode step), with the model's scale and mask: PyTorch's SDPA kernels do
not expose their softmax.
"""

import math
from dataclasses import dataclass

import torch

from megascope.errors import ProtocolError

HIDDEN, COLUMNS, HEADS, FUSED_QKV = "hidden", "columns", "heads", "fused_qkv"


@dataclass(frozen=True)
class HookPoint:
    name: str
    per_layer: bool
    layout: str          # how a TP rank holds it (see the module docstring)
    dims: tuple          # dims after the token dim

MODEL_HOOKS = {
    "embed": HookPoint("embed", False, HIDDEN, ("hidden",)),
    "final_norm": HookPoint("final_norm", False, HIDDEN, ("hidden",)),
    "logits": HookPoint("logits", False, COLUMNS, ("vocab",)),
}
LAYER_HOOKS = {
    "ln1": HookPoint("ln1", True, HIDDEN, ("hidden",)),
    "attn.q": HookPoint("attn.q", True, FUSED_QKV, ("head", "d_head")),
    "attn.k": HookPoint("attn.k", True, FUSED_QKV, ("head", "d_head")),
    "attn.v": HookPoint("attn.v", True, FUSED_QKV, ("head", "d_head")),
    "attn.pattern": HookPoint("attn.pattern", True, HEADS, ("head", "key")),
    "attn.out": HookPoint("attn.out", True, HIDDEN, ("hidden",)),
    "resid_mid": HookPoint("resid_mid", True, HIDDEN, ("hidden",)),
    "mlp.pre": HookPoint("mlp.pre", True, COLUMNS, ("ffn",)),
    "mlp.out": HookPoint("mlp.out", True, HIDDEN, ("hidden",)),
    "resid_post": HookPoint("resid_post", True, HIDDEN, ("hidden",)),
}
HOOK_POINTS = {"embed": MODEL_HOOKS["embed"], **LAYER_HOOKS, "final_norm": MODEL_HOOKS["final_norm"],
               "logits": MODEL_HOOKS["logits"]}  # in the order of the forward
HOOK_NAMES = tuple(HOOK_POINTS)


def full_hook_name(hook, layer):
    """TransformerLens-style full name: ``blocks.{layer}.{hook}`` for per-layer hooks."""
    return hook if layer is None else f"blocks.{layer}.{hook}"


def full_hook_names():
    """Every hook's full name, ``{l}`` standing for the layer (the welcome message's list)."""
    return [full_hook_name(name, "{l}" if point.per_layer else None) for name, point in HOOK_POINTS.items()]


def hook_point(name, field="hooks"):
    if name not in HOOK_POINTS:
        raise ProtocolError("bad_hook", f"unknown hook {name!r}; known hooks: {', '.join(HOOK_NAMES)}", field)
    return HOOK_POINTS[name]


def unwrap_model(chunk):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def global_layer_index(layer):
    return layer.layer_number - 1  # megatron-core counts layers from 1 across all pipeline stages


def _output(output):
    """A module's main output: megatron-core layers return (tensor, bias) or (hidden, context)."""
    return output[0] if isinstance(output, tuple) else output


def _output_with_bias(output):
    out, bias = output if isinstance(output, tuple) else (output, None)
    return out if bias is None else out + bias


def rewrite_output(output, rewrite, with_bias):
    """A forward hook's replacement of a module's ``output``: its main tensor through ``rewrite``. ``with_bias``
    (attn.out, mlp.out, which are read with their bias added): a separate bias is added first and returned as
    None, so that the model adds nothing after the rewrite."""
    if not isinstance(output, tuple):
        return rewrite(output)
    main, bias = output[0], output[1] if len(output) > 1 else None
    if with_bias and bias is not None:
        return (rewrite(main + bias), None)
    return (rewrite(main), *output[1:])


def split_fused_qkv(mixed, num_heads, num_groups, head_dim):
    """megatron-core's fused QKV output [..., groups * (heads/groups + 2) * d] -> q [..., heads, d],
    k and v [..., groups, d]. Per query group: its query heads, then its key head, then its value head."""
    per_group = num_heads // num_groups
    grouped = mixed.reshape(*mixed.shape[:-1], num_groups, per_group + 2, head_dim)
    query = grouped[..., :per_group, :].reshape(*mixed.shape[:-1], num_heads, head_dim)
    return query, grouped[..., per_group, :], grouped[..., per_group + 1, :]


def attention_pattern(query, key, attention_mask, causal, scale, num_groups_per_partition):
    """Post-softmax weights [b, heads, sq, sk] from core attention's query [sq, b, heads, d] and
    key [sk, b, groups, d], in float32. ``attention_mask``: True = masked out (megatron-core)."""
    q = query.float().permute(1, 2, 0, 3)
    k = key.float().permute(1, 2, 0, 3).repeat_interleave(query.size(2) // num_groups_per_partition, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    sq, sk = q.size(2), k.size(2)
    if attention_mask is not None:
        scores = scores.masked_fill(attention_mask, float("-inf"))
    elif causal:
        # The queries are the last sq of sk positions (a KV-cache decode step has sq < sk).
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal=sk - sq)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(dim=-1)


def softmax_scale(config):
    return config.softmax_scale if config.softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)


class ModuleHooks:
    """Module hooks kept by their handles and removed together (at the end of a ``with`` block)."""

    def __init__(self):
        self.handles = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []


class HookInstaller(ModuleHooks):
    """Registers forward hooks that hand (hook name, layer, tensor) to ``store``; remembers the handles."""

    def __init__(self, store):
        super().__init__()
        self.store = store

    def _on_output(self, module, name, layer, read):
        self.handles.append(module.register_forward_hook(
            lambda _m, _inputs, output: self.store(name, layer, read(output))))

    def _on_input(self, module, name, layer):
        self.handles.append(module.register_forward_pre_hook(
            lambda _m, inputs: self.store(name, layer, inputs[0])))

    def install_model_hooks(self, model, names):
        if "embed" in names and model.pre_process:
            self._on_output(model.embedding, "embed", None, _output)
        if model.post_process:
            if "final_norm" in names and getattr(model.decoder, "final_layernorm", None) is not None:
                self._on_output(model.decoder.final_layernorm, "final_norm", None, _output)
            if "logits" in names:
                self._on_output(model.output_layer, "logits", None, _output)

    def install_layer_hooks(self, layer, names, on_pattern):
        index = global_layer_index(layer)
        attention, mlp = layer.self_attention, layer.mlp
        if "ln1" in names:
            self._on_output(layer.input_layernorm, "ln1", index, _output)
        if names & {"attn.q", "attn.k", "attn.v"}:
            self._on_output(attention.linear_qkv, "qkv", index, _output)
        if "attn.pattern" in names:
            self.handles.append(attention.core_attention.register_forward_pre_hook(
                lambda module, args, kwargs: on_pattern(module, index, args, kwargs), with_kwargs=True))
        if "attn.out" in names:
            self._on_output(attention, "attn.out", index, _output_with_bias)
        if "resid_mid" in names:
            self._on_input(layer.pre_mlp_layernorm, "resid_mid", index)
        if "mlp.pre" in names:
            self._on_input(mlp.linear_fc2, "mlp.pre", index)
        if "mlp.out" in names:
            self._on_output(mlp, "mlp.out", index, _output_with_bias)
        if "resid_post" in names:
            self._on_output(layer, "resid_post", index, _output)
