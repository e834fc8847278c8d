"""Capture: forward hooks on this rank's model chunks, and ``collect``, the collective that turns what
they saw into whole (unsharded) Records on the first rank of the model-parallel group (global rank 0
for the first data-parallel replica).

    with Capture(model_chunks, spec) as capture:
        ...one forward step (prefill, or one KV-cache decode step)...
        records = capture.collect(step=s, token_offset=position_of_the_steps_first_token)

Hooks only copy tensors (detached); ``collect`` gathers tensor-parallel shards (heads, columns,
vocabulary, sequence-parallel slices), splits the fused QKV per head, runs the logit lens on the
last pipeline stage, reduces, and sends every stage's records to the group's first rank. No
Capture, no hooks: capture off costs nothing.
"""

from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType

from megascope.capture_spec import CaptureSpec  # noqa: F401  (the API: from megascope.capture import CaptureSpec)
from megascope.distributed import all_gather_along
from megascope.hook_sites import CAPTURED, COLUMNS, FUSED_QKV, HEADS, HOOK_SITES, full_hook_name
from megascope.hooks import QKV, HookInstaller, attention_pattern, softmax_scale, split_fused_qkv, unwrap_model
from megascope.logit_lens import LOGIT_LENS_DIMS, logit_lens_on_last_stage
from megascope.reductions import Reduction
from megatron.training.collectives import gather_objects

_NO_REDUCTION = Reduction("none")


@dataclass
class Record:
    hook: str
    layer: int | None
    prompt_index: int
    token_start: int
    values: torch.Tensor       # float32, CPU, [tokens, ...reduced dims]
    dims: list
    reduction: str

    def frame_header(self, generation_id, step, prompt_index=None):
        """This record's data frame header (docs/megascope_protocol.md); ``prompt_index``: training's sample."""
        return {"id": generation_id, "step": step, "hook": full_hook_name(self.hook, self.layer),
                "layer": self.layer,
                "prompt_index": self.prompt_index if prompt_index is None else prompt_index,
                "tokens": [self.token_start, self.token_start + int(self.values.shape[0])],
                "dims": list(self.dims), "reduction": str(self.reduction)}


def whole_over_tp(name, tensor, sequence_parallel, vocab_shard_size):
    """What a hook site read on this tensor-parallel rank, gathered over the TP group into the whole tensor
    (collective). ``vocab_shard_size()``: the output layer's columns on one rank (logits already whole are kept);
    asked for logits only, which only the last pipeline stage has."""
    tp = parallel_state.get_tensor_model_parallel_group()
    layout = FUSED_QKV if name == QKV else HOOK_SITES[name].layout
    if name == "logits" and tensor.size(-1) != vocab_shard_size():
        return tensor  # inference gathers the vocabulary itself (runtime_gather_output)
    if layout in (COLUMNS, FUSED_QKV):
        return all_gather_along(tensor, -1, tp)
    if layout == HEADS:
        return all_gather_along(tensor, 2, tp)
    return all_gather_along(tensor, 0, tp) if sequence_parallel else tensor


def record_order(record):
    """The order of a step's records on the wire: the embedding, each layer's hooks in forward order, the rest."""
    position = 0 if record.hook == "embed" else 2 if record.layer is None else 1
    hook_rank = CAPTURED.index(record.hook) if record.hook in CAPTURED else len(CAPTURED)
    return position, record.layer or 0, hook_rank, record.prompt_index


class Capture:
    """``microbatch`` / ``batch_index`` (training): keep only that microbatch's forward and that sample."""

    def __init__(self, model_chunks, spec, args=None, microbatch=None, batch_index=None):
        self.models = [unwrap_model(chunk) for chunk in model_chunks]
        self.config = self.models[0].config
        self.spec = spec
        self.microbatch, self.batch_index = microbatch, batch_index
        names = set(spec.hooks) | ({"resid_post"} if spec.logit_lens else set())
        self.returned = set(spec.hooks)
        self.stored = {}
        self.forward_counts = {}
        self.step_tokens = None
        self.installer = HookInstaller(self._store, self._store_pattern)
        for model in self.models:
            self.installer.install(model, names, spec.wants_layer)
            if "logits" in names and model.post_process and len(model.decoder.layers) > 0:
                self.installer.handles.append(model.decoder.layers[0].register_forward_pre_hook(
                    self._count_step_tokens, with_kwargs=True))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.installer.remove()
        self.stored.clear()

    # -- during the forward -------------------------------------------------------------------
    def _store(self, name, layer, tensor):
        key = (name, -1 if layer is None else layer)
        seen = self.forward_counts.get(key, 0)
        self.forward_counts[key] = seen + 1
        if self.microbatch is not None and seen != self.microbatch:
            return
        if self.batch_index is not None:
            tensor = tensor[:, self.batch_index:self.batch_index + 1]
        self.stored[key] = tensor.detach().clone()

    def _store_pattern(self, module, layer, args, kwargs):
        query, key = args[0], args[1]
        mask = args[3] if len(args) > 3 else kwargs.get("attention_mask")
        mask_type = kwargs.get("attn_mask_type") or module.attn_mask_type
        with torch.no_grad():
            pattern = attention_pattern(query, key, mask, mask_type == AttnMaskType.causal,
                                        softmax_scale(self.config), key.size(2))
        self._store("attn.pattern", layer, pattern.permute(2, 0, 1, 3))  # [sq, b, heads, sk]

    def _count_step_tokens(self, module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        split = parallel_state.get_tensor_model_parallel_world_size() if self.config.sequence_parallel else 1
        self.step_tokens = hidden.size(0) * split

    # -- collect ------------------------------------------------------------------------------
    def _vocab_shard_size(self):
        return next(model.output_layer.output_size_per_partition for model in self.models if model.post_process)

    def _whole_tensors(self):
        """{(hook, layer): [s, b, ...] unsharded} from this rank's hooks; collective over the TP group."""
        whole = {}
        for (name, layer), tensor in sorted(self.stored.items()):
            full = whole_over_tp(name, tensor, self.config.sequence_parallel, self._vocab_shard_size)
            if name == QKV:
                config = self.config
                q, k, v = split_fused_qkv(full, config.num_attention_heads,
                                          config.num_query_groups or config.num_attention_heads, config.kv_channels)
                whole.update({(hook, layer): t for hook, t in zip(("attn.q", "attn.k", "attn.v"), (q, k, v))})
            else:
                whole[(name, layer)] = full
        self.stored.clear()
        self.forward_counts.clear()
        return whole

    def _positions(self, name, tokens, token_offset):
        """Sequence positions of a tensor's tokens: logits may hold only the step's last tokens."""
        step_tokens = self.step_tokens if name == "logits" and self.step_tokens is not None else tokens
        first = token_offset + step_tokens - tokens
        return torch.arange(first, first + tokens)

    def _records(self, name, layer, tensor, positions, dims, reduction):
        keep = torch.tensor([self.spec.wants_token(int(p)) for p in positions], dtype=torch.bool)
        if not keep.any():
            return []
        start = int(positions[keep][0])
        kept = tensor[keep.to(tensor.device)].float().cpu()
        records = []
        for prompt in range(kept.size(1)):
            values, reduced_dims = reduction.apply(kept[:, prompt], dims)
            prompt_index = prompt if self.batch_index is None else self.batch_index
            records.append(Record(name, None if layer < 0 else layer, prompt_index, start,
                                  values.contiguous(), ["token", *reduced_dims], str(reduction)))
        return records

    def collect(self, step=0, token_offset=0):
        """Collective over the model-parallel group: on its first rank the Records of this step, else [].

        ``token_offset``: the sequence position of this forward's first token (a decode step's position).
        ``step`` is the caller's own count (records carry no step: the caller stamps its frames)."""
        whole = self._whole_tensors()
        first_of_stage = parallel_state.get_tensor_model_parallel_rank() == 0
        local = []
        if self.spec.logit_lens:
            lens = logit_lens_on_last_stage(
                self.models, {layer: (self._positions(n, t.size(0), token_offset), t)
                              for (n, layer), t in whole.items() if n == "resid_post"}, self.spec.topk)
            for layer, (positions, topk) in sorted(lens.items()):
                if first_of_stage:
                    local += self._records("logit_lens", layer, topk, positions, LOGIT_LENS_DIMS,
                                           _NO_REDUCTION)
        if first_of_stage:
            for (name, layer), tensor in whole.items():
                if name in self.returned:
                    local += self._records(name, layer, tensor, self._positions(name, tensor.size(0), token_offset),
                                           HOOK_SITES[name].dims, self.spec.reduction_for(name))
        return _gather_to_first_rank(local)


def _gather_to_first_rank(records):
    received = gather_objects(records, parallel_state.get_model_parallel_group(), 0)
    if received is None:
        return []
    return sorted((r for part in received for r in part), key=record_order)
