"""A capture compiled into the generation step: the slot cache's ``StepReadout`` (megatron/inference/slot_cache.py).

``Capture`` (megascope/capture.py) copies each hooked tensor and reduces it on the host after the step, which on a
GPU is a device-to-host copy and a sync per hook. A ``CapturePlan`` does the same reads with hooks whose work is device
ops only: each hook gathers its tensor-parallel shards, splits the fused QKV, reduces on the device and keeps the
result; the logit lens of every captured layer runs as one matrix product through the output layer; ``pack`` lays it
all out in one flat float32 tensor. Nothing syncs the host, so a CUDA graph of the decode step captures the hooks'
kernels and each replay rewrites the packed tensor; the observer then lands it in pinned memory with one
asynchronous copy (megascope/step_stream.py) and ``records`` cuts it back into Records on the host.

Two reads stay on the host because their shapes follow the generation's length, which a graph cannot: the attention
pattern is computed over the whole static cache (later keys weigh 0) and cut to the keys read so far, then reduced
over its key dim (a ``mean_heads`` is still done on the device); and the positions a spec's ``tokens`` range leaves
out are dropped when the records are made.
"""

import json
import math
from dataclasses import dataclass

import torch

from megascope.capture import Record, whole_over_tp
from megascope.hook_sites import HOOK_SITES
from megascope.hooks import QKV, HookInstaller, attention_pattern, softmax_scale, split_fused_qkv
from megascope.logit_lens import LOGIT_LENS_DIMS, logit_lens

_PATTERN = "attn.pattern"
_LENS = "logit_lens"
# Reductions of the pattern that read only its head dim: done on the device, the key dim left whole.
_DEVICE_PATTERN_REDUCTIONS = ("none", "mean_heads")


@dataclass(frozen=True)
class Slot:
    """Where one (hook, layer) read lies in the packed tensor: ``shape`` [tokens, batch, ...], the last ``tokens``
    positions of the step; ``dims`` after the token dim, and the reduction still to apply on the host."""
    hook: str
    layer: int | None
    offset: int
    shape: tuple
    dims: tuple
    reduction: str
    host_reduction: object = None  # a Reduction of the pattern's key dim, applied once it is cut


@dataclass
class PackedReadout:
    """One step's reads: ``values`` the flat float32 device tensor (a graph's replays rewrite it), ``slots`` where
    each read lies in it."""
    values: torch.Tensor
    slots: tuple


class CapturePlan:
    """``spec`` (a CaptureSpec) compiled for one stage's GPTModel; equal specs share a key (and a decode graph)."""

    def __init__(self, spec, config):
        self.spec = spec
        self.config = config
        self.key = ("megascope", json.dumps(spec.to_json(), sort_keys=True))
        self.names = set(spec.hooks) | ({"resid_post"} if spec.logit_lens else set())
        self.model = None
        self.reads = {}      # (hook, layer) -> [tokens, b, ...] float32 on the device, in the forward's order
        self.residuals = {}  # layer -> resid_post [tokens, b, hidden] for the logit lens

    # -- the forward -----------------------------------------------------------------------------
    def reading(self, model):
        self.model = model
        self.reads, self.residuals = {}, {}
        installer = HookInstaller(self._read, self._read_pattern)
        installer.install(model, self.names, self.spec.wants_layer)
        return installer

    def _read(self, name, layer, tensor):
        whole = whole_over_tp(name, tensor, self.config.sequence_parallel, self._vocab_shard_size)
        if name == QKV:
            q, k, v = split_fused_qkv(whole, self.config.num_attention_heads,
                                      self.config.num_query_groups or self.config.num_attention_heads,
                                      self.config.kv_channels)
            for hook, part in zip(("attn.q", "attn.k", "attn.v"), (q, k, v)):
                if hook in self.spec.hooks:
                    self._keep(hook, layer, part)
            return
        if name == "resid_post" and self.spec.logit_lens:
            self.residuals[layer] = whole
        if name in self.spec.hooks:
            self._keep(name, layer, whole)

    def _read_pattern(self, module, layer, args, kwargs):
        query, key = args[0], args[1]
        mask = args[3] if len(args) > 3 else kwargs.get("attention_mask")
        pattern = attention_pattern(query, key, mask, mask is None, softmax_scale(self.config), key.size(2))
        self._read(_PATTERN, layer, pattern.permute(2, 0, 1, 3))  # [sq, b, heads, sk]

    def _host_reduction(self, name):
        """The reduction left to the host: the pattern's over its key dim, applied once the keys are cut; else None."""
        reduction = self.spec.reduction_for(name)
        return reduction if name == _PATTERN and str(reduction) not in _DEVICE_PATTERN_REDUCTIONS else None

    def _keep(self, name, layer, tensor):
        # A copy: the model adds the residual into some outputs in place (mlp.out) after the hook has run.
        values, reduction = tensor.to(torch.float32, copy=True), self.spec.reduction_for(name)
        if self._host_reduction(name) is not None:
            self.reads[(name, layer)] = values
            return
        tokens, batch = values.shape[:2]
        reduced, _ = reduction.apply(values.reshape(tokens * batch, *values.shape[2:]), HOOK_SITES[name].dims)
        self.reads[(name, layer)] = reduced.reshape(tokens, batch, *reduced.shape[1:])

    def _vocab_shard_size(self):
        return self.model.output_layer.output_size_per_partition

    # -- after the forward -----------------------------------------------------------------------
    def pack(self):
        reads = dict(self.reads)
        if self.residuals:
            layers = sorted(self.residuals)
            stacked = torch.cat([self.residuals[layer] for layer in layers])  # one product through the output layer
            sizes = [self.residuals[layer].size(0) for layer in layers]
            lens = logit_lens(self.model, stacked, self.spec.topk).split(sizes)
            reads.update({(_LENS, layer): part for layer, part in zip(layers, lens)})
        slots, offset = [], 0
        for (name, layer), values in reads.items():
            slots.append(self._slot(name, layer, offset, tuple(values.shape)))
            offset += values.numel()
        flat = torch.cat([values.reshape(-1) for values in reads.values()]) if reads else torch.zeros(0)
        return PackedReadout(flat, tuple(slots))

    def _slot(self, name, layer, offset, shape):
        if name == _LENS:
            return Slot(name, layer, offset, shape, LOGIT_LENS_DIMS, "none")
        reduction = self.spec.reduction_for(name)
        dims = tuple(HOOK_SITES[name].dims)
        if self._host_reduction(name) is not None:
            return Slot(name, layer, offset, shape, dims, str(reduction), host_reduction=reduction)
        return Slot(name, layer, offset, shape, tuple(reduction.dims_after(dims)), str(reduction))


def records(host_values, slots, spec, start, end):
    """The Records of one step from its packed values on the host (``host_values`` flat float32): each slot's
    positions are the last of [start, end); the pattern is cut to the ``end`` keys read so far; positions outside
    ``spec.tokens`` are left out. Values are copies (the host buffer is reused)."""
    # numpy, not torch: this runs on a thread beside the model loop, and torch's host ops share its thread pool.
    flat = host_values.numpy()
    result = []
    for slot in slots:
        values = flat[slot.offset:slot.offset + math.prod(slot.shape)].reshape(slot.shape)
        first = end - slot.shape[0]
        keep = [t for t in range(slot.shape[0]) if spec.wants_token(first + t)]
        if not keep:
            continue
        values = values[keep[0]:keep[-1] + 1]  # the wanted positions of one step are contiguous
        if slot.hook == _PATTERN:
            values = values[..., :end]
        for row in range(values.shape[1]):
            row_values, dims = torch.from_numpy(values[:, row].copy()), list(slot.dims)
            if slot.host_reduction is not None:
                row_values, dims = slot.host_reduction.apply(row_values, slot.dims)
            result.append(Record(slot.hook, slot.layer, row, first + keep[0], row_values, ["token", *dims],
                                 slot.reduction))
    return result
