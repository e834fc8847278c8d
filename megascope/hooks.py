"""Forward hooks at MegaScope's hook sites (megascope/hook_sites.py): reading what a site reads, rewriting it,
and the tensor helpers they need.

attn.q/k/v are the projections before rotary embeddings (TransformerLens' hook_q/k/v), read as the columns of
the fused QKV output (stored once, as ``QKV``, and split per head when collected); attn.pattern is computed from
the query and keys the core attention receives (after rotary, all cached keys in a KV-cache decode step), with
the model's scale and mask: PyTorch's SDPA kernels do not expose their softmax.
"""

import math

import torch

from megascope.hook_sites import (
    FUSED_QKV_READS,
    HOOK_SITES,
    INPUT,
    OUTPUT_PLUS_BIAS,
    SOFTMAX,
    site_modules,
)

QKV = "qkv"  # the stored fused QKV output of attn.q, attn.k and attn.v


def unwrap_model(chunk):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


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


def rewrite_at(module, site, rewrite):
    """The handle of a hook on ``module`` that passes what ``site`` reads there through ``rewrite``: its input
    (a pre-hook) or its output (with the bias added first where the site reads it so)."""
    if site.reads == INPUT:
        return module.register_forward_pre_hook(lambda _m, args: (rewrite(args[0]), *args[1:]))
    with_bias = site.reads == OUTPUT_PLUS_BIAS
    return module.register_forward_hook(lambda _m, _inputs, output: rewrite_output(output, rewrite, with_bias))


class HookInstaller(ModuleHooks):
    """Registers forward hooks that hand (site name, layer, tensor) to ``store`` and a core attention's
    (module, layer, args, kwargs) to ``on_pattern``; remembers the handles."""

    def __init__(self, store, on_pattern):
        super().__init__()
        self.store = store
        self.on_pattern = on_pattern

    def install(self, model, names, wants_layer):
        """Hooks on one stage's GPTModel for the sites ``names``, at the layers that ``wants_layer`` accepts."""
        fused_read = set()
        for site in (site for name, site in HOOK_SITES.items() if name in names):
            for layer, module in site_modules(model, site, wants_layer):
                if site.reads in FUSED_QKV_READS:
                    if layer not in fused_read:  # one hook keeps the fused output for attn.q, .k and .v
                        fused_read.add(layer)
                        self._on_output(module, QKV, layer, _output)
                elif site.reads == SOFTMAX:
                    self.handles.append(module.register_forward_pre_hook(
                        lambda m, args, kwargs, layer=layer: self.on_pattern(m, layer, args, kwargs), with_kwargs=True))
                elif site.reads == INPUT:
                    self.handles.append(module.register_forward_pre_hook(
                        lambda _m, inputs, name=site.name, layer=layer: self.store(name, layer, inputs[0])))
                else:
                    self._on_output(module, site.name, layer,
                                    _output_with_bias if site.reads == OUTPUT_PLUS_BIAS else _output)

    def _on_output(self, module, name, layer, read):
        self.handles.append(module.register_forward_hook(
            lambda _m, _inputs, output: self.store(name, layer, read(output))))
