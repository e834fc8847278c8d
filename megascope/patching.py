"""Activation patching and ablation: declarative requests (validated, never evaluated).

    {"hook", "layers", "heads", "positions", "prompts", "source": {"prompt": i} | "zero" | "mean"}

The prompts of one request are one batch, so a patch needs no second run: in every forward, the activation
at ``hook`` of the ``prompts`` rows (default: every prompt but the source) is replaced, at the named layers,
heads and absolute token positions, by the same activation of the source row at the same position (or by
zeros, or by the mean over the request's prompts at that position). The source row of a shard lives on the
rank that holds the target rows' shard, so every rank rewrites its own piece: exact at any TP/PP/DP (heads
are found in this rank's query groups; sequence-parallel ranks hold their slice of the positions).

A forward that reads positions [start, end) patches those of them that the patch names: the prefill patches
prompt positions, each decode step the one position it reads (``positions`` null: every position). The KV
cache keeps the patched keys and values, so later steps attend to the patched past.
"""

import json
from dataclasses import asdict, dataclass

import torch
from megatron.core import parallel_state

from megascope.errors import ProtocolError, within
from megascope.hook_sites import (
    FUSED_QKV,
    HIDDEN,
    HOOK_SITES,
    KEY_COLUMNS,
    PATCHABLE,
    QUERY_COLUMNS,
    current_name,
    site_modules,
)
from megascope.hooks import ModuleHooks, rewrite_at, unwrap_model

_HEADED = tuple(name for name, site in HOOK_SITES.items() if site.layout == FUSED_QKV)
SOURCES = ("zero", "mean")
_FIELDS = ("hook", "layers", "heads", "positions", "prompts", "source")


def _bad(message, field):
    return ProtocolError("bad_field", message, field)


def _indices(value, field, what):
    """A list of distinct non-negative integers, or None (all)."""
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value):
        raise _bad(f"{field} must be a non-empty list of {what} (integers from 0) or null for all", field)
    if len(set(value)) != len(value):
        raise _bad(f"{field} names a {what[:-1]} twice; name each once", field)
    return tuple(value)


def _beyond(values, count, field, what):
    """ProtocolError when ``values`` name an index outside [0, count)."""
    outside = [v for v in values or () if v >= count]
    if outside:
        raise _bad(f"{field} {outside} are not {what} of this request: use indices from 0 to {count - 1}", field)


@dataclass(frozen=True)
class Patch:
    hook: str
    source: int | str               # a prompt index, "zero" or "mean"
    layers: tuple | None = None     # per-layer hooks: None = every layer
    heads: tuple | None = None      # attn.q: query heads; attn.k/v: key/value heads (query groups)
    positions: tuple | None = None  # absolute token positions; None = every position read
    prompts: tuple | None = None    # the rows written; None = every prompt but the source

    @classmethod
    def from_json(cls, obj: object) -> "Patch":
        """The Patch of one JSON object; ProtocolError naming the field otherwise (shape-free checks only)."""
        if not isinstance(obj, dict):
            raise _bad("a patch is a JSON object", None)
        unknown = sorted(set(obj) - set(_FIELDS))
        if unknown:
            raise _bad(f"unknown patch field {unknown[0]!r}; known: {', '.join(_FIELDS)}", unknown[0])
        name = current_name(obj.get("hook"))
        if name is None:
            raise _bad(f"hook is required: one of {', '.join(PATCHABLE)}", "hook")
        if name not in PATCHABLE:
            raise ProtocolError("bad_hook", f"hook {json.dumps(name)[:40]} cannot be patched; patchable hooks: "
                                f"{', '.join(PATCHABLE)}", "hook")
        point = HOOK_SITES[name]
        source = obj.get("source")
        if isinstance(source, dict) and set(source) == {"prompt"}:
            source = _indices([source["prompt"]], "source.prompt", "prompts")[0]
        elif source not in SOURCES:
            raise _bad('source must be {"prompt": index}, "zero" or "mean"', "source")
        layers = _indices(obj.get("layers"), "layers", "layers")
        if layers is not None and not point.per_layer:
            raise _bad(f"layers must be null for {name!r}, which has no layer", "layers")
        heads = _indices(obj.get("heads"), "heads", "heads")
        if heads is not None and point.layout != FUSED_QKV:
            raise _bad(f"heads apply to {', '.join(_HEADED)} only, not {name!r}; leave heads out", "heads")
        prompts = _indices(obj.get("prompts"), "prompts", "prompts")
        return cls(name, source, layers, heads, _indices(obj.get("positions"), "positions", "positions"), prompts)

    def check(self, model: dict, num_prompts: int) -> None:
        """The indices against the welcome's ``model`` shape and a request of ``num_prompts`` prompts."""
        if isinstance(self.source, int):
            _beyond([self.source], num_prompts, "source.prompt", "prompts")
            if self.prompts is None and num_prompts == 1:
                raise _bad("a patch from a prompt needs another prompt to write into: add one, or name the "
                           "source itself in prompts (which changes nothing)", "prompts")
        _beyond(self.prompts, num_prompts, "prompts", "prompts")
        layers = model["num_layers"]
        outside = [layer for layer in self.layers or () if layer >= layers]
        if outside:
            raise _bad(f"layers {outside} are not layers of this model: use indices from 0 to {layers - 1}",
                       "layers")
        query = HOOK_SITES[self.hook].reads == QUERY_COLUMNS
        heads = model["num_attention_heads"] if query else model["num_query_groups"]
        outside = [head for head in self.heads or () if head >= heads]
        if outside:
            raise _bad(f"heads {outside} are not {self.hook} heads of this model (it has {heads}): use indices "
                       f"from 0 to {heads - 1}", "heads")

    def to_json(self) -> dict:
        obj = asdict(self)
        obj["source"] = {"prompt": self.source} if isinstance(self.source, int) else self.source
        for name in ("layers", "heads", "positions", "prompts"):
            obj[name] = None if obj[name] is None else list(obj[name])
        return obj

    def wants_layer(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def targets(self, batch: int) -> list:
        if self.prompts is not None:
            return list(self.prompts)
        return [row for row in range(batch) if row != self.source]

    def positions_within(self, start: int, end: int) -> list:
        """The positions of [start, end) that this patch writes."""
        if self.positions is None:
            return list(range(start, end))
        return sorted(p for p in self.positions if start <= p < end)


def parse_patches(objs: list, model: dict, num_prompts: int, prefix: str = "patch") -> list:
    """The Patches of a message's list for the welcome's ``model`` shape and ``num_prompts`` prompts; errors
    name ``<prefix>.<index>.<field>``."""
    patches = []
    for index, obj in enumerate(objs):
        try:
            patch = Patch.from_json(obj)
            patch.check(model, num_prompts)
        except ProtocolError as error:
            raise within(error, f"{prefix}.{index}") from None
        patches.append(patch)
    return patches


class Patcher(ModuleHooks):
    """``with Patcher(model_chunks, patches, start): <one forward reading positions from start>``: forward
    hooks on this rank's chunks that rewrite the patched activations, removed on exit."""

    def __init__(self, model_chunks, patches, start):
        super().__init__()
        self.models = [unwrap_model(chunk) for chunk in model_chunks]
        config = self.models[0].config
        self.start = start
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.sequence_split = config.sequence_parallel and self.tp_size > 1
        self.heads, self.groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
        self.head_dim = config.kv_channels
        for patch in patches:
            self._install(patch)

    def _install(self, patch):
        site = HOOK_SITES[patch.hook]
        for model in self.models:
            for _layer, module in site_modules(model, site, patch.wants_layer):
                self.handles.append(rewrite_at(module, site, lambda values, patch=patch: self._patched(values, patch)))

    def _patched(self, values, patch):
        """``values`` [s, b, ...] (this rank's piece) with the patch's rows, positions and columns replaced."""
        tokens, batch = values.shape[0], values.shape[1]
        first = self.start
        site = HOOK_SITES[patch.hook]
        if site.layout == HIDDEN and self.sequence_split:
            first += self.tp_rank * tokens  # this rank's slice of the sequence
        positions = torch.zeros(tokens, dtype=torch.bool)
        for position in patch.positions_within(first, first + tokens):
            positions[position - first] = True
        rows = torch.zeros(batch, dtype=torch.bool)
        rows[patch.targets(batch)] = True
        if not positions.any() or not rows.any():
            return values
        if patch.source == "zero":
            replacement = torch.zeros_like(values)
        elif patch.source == "mean":
            replacement = values.mean(dim=1, keepdim=True).expand_as(values)
        else:
            replacement = values[:, patch.source:patch.source + 1].expand_as(values)
        mask = (positions[:, None] & rows[None, :]).to(values.device)
        mask = mask.reshape(tokens, batch, *[1] * (values.dim() - 2))
        if site.layout == FUSED_QKV:  # only q's, k's or v's columns of the fused output
            mask = mask & self._head_columns(patch, site.reads).to(values.device)
        return torch.where(mask, replacement, values)

    def _head_columns(self, patch, reads):
        """This rank's fused-QKV columns that hold the patch's heads of its hook (q, k or v: ``reads``)."""
        local_groups = self.groups // self.tp_size
        per_group = self.heads // self.groups
        columns = torch.zeros(local_groups, per_group + 2, self.head_dim, dtype=torch.bool)
        first_group = self.tp_rank * local_groups
        if reads == QUERY_COLUMNS:
            heads = range(self.heads) if patch.heads is None else patch.heads
            for head in heads:
                group = head // per_group - first_group
                if 0 <= group < local_groups:
                    columns[group, head % per_group] = True
        else:
            slot = per_group if reads == KEY_COLUMNS else per_group + 1
            for group in range(self.groups) if patch.heads is None else patch.heads:
                if 0 <= group - first_group < local_groups:
                    columns[group - first_group, slot] = True
        return columns.flatten()
