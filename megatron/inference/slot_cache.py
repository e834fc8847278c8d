"""One pipeline stage's model over a preallocated KV cache of slots: fixed shapes, so that a GPU replays each decode
step (the forward, the draw and the advance of every row) as one CUDA graph.

megatron-core's ``StaticInferenceContext`` hands each layer a key/value view that grows by Python slicing every step,
so no two steps have the same shapes and a step cannot be captured. Here the stage runs through its own megatron-core
modules (embedding, decoder block with every layer of the stage, final norm and output layer on the last stage), with
one change: for the duration of a forward each layer's core attention is wrapped by ``CachedCoreAttention``, which
writes the step's keys and values into the layer's [length, slots, groups, d] cache at each row's own positions and
hands the layer's own core attention the row's whole cache, the positions after each query masked. Rotary
frequencies are picked from a precomputed table by the same positions.

Every row of the cache (a slot) has its own position, so rows of different requests, at different lengths, decode in
one step (continuous batching, megatron/inference/batcher.py). A decode step reads the first ``bucket`` slots over
the first ``key_length`` positions (a power of two covering every decoding row); the slot state it reads and
advances lives on the device (``SlotState``: each slot's next token and position, and its sampling parameters), so a
step needs nothing from the host: the host may queue the next step before it has read this one's tokens. Past the
``length`` positions each slot has one scratch position, which no step reads: a slot that holds no row (or a row
still reading its prompt in chunks) is parked there, and padding writes there, so what they compute lands nowhere
a row reads.

A step may carry a ``StepReadout`` (MegaScope's compiled capture): module hooks whose device ops read and reduce what
the model computes, packed into one flat tensor at the end of the forward. Its hooks are live while a graph is
captured, so their kernels are part of the graph and every replay writes the packed tensor again. A graph is kept per
(bucket, readout key, draw plan), the least recently used dropped past ``MAX_GRAPHS``; all share one memory pool, as
they never run at once and each step's outputs are copied out before the next step runs.

With pipeline parallelism each stage sends its hidden states to the next (point-to-point, as megatron-core's schedule
does) and the last stage's draw is broadcast to every stage; such steps run eagerly.
"""

import collections
import contextlib
import logging
import time
from collections.abc import Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron.inference.last_stage import from_last_stage
from megatron.inference.sampling import DrawPlan, RowParams, draw
from megatron.training.sdpa_attention import SDPAttention

# Core attentions that take a boolean mask (True = masked out) over keys longer than the queries.
_MASKABLE_CORE_ATTENTION = (SDPAttention, DotProductAttention)
MAX_GRAPHS = 64  # decode-step graphs kept: batch buckets x key lengths x captures x draw plans
log = logging.getLogger("megatron.inference")


class StepReadout(Protocol):
    """What a step reads out of the model besides its logits, as device ops (megascope/capture_plan.py)."""
    key: Hashable  # equal keys read the same: they share a graph

    def reading(self, model) -> AbstractContextManager:
        """Hooks on ``model`` (one unwrapped GPTModel) for the duration of one forward."""

    def pack(self) -> torch.Tensor:
        """After the forward, inside the captured region: one flat tensor of everything the hooks read."""


@dataclass
class StepOutput:
    """A step's results on the device: ``draw`` [rows, plan.width] (every stage), ``logits`` [rows, n, padded
    vocabulary] of the last stage when asked for every position (else None), ``readout`` the readout's packed
    tensor or None. A graphed step's tensors are rewritten by the next replay: copy them first."""
    draw: torch.Tensor
    logits: torch.Tensor | None = None
    readout: object = None


def supports(model, config) -> bool:
    """Whether ``model`` (one unwrapped GPTModel holding this stage's layers) can run on the slot cache."""
    layers = model.decoder.layers
    return (not config.sequence_parallel and config.mtp_num_layers is None and not config.multi_latent_attention
            and model.position_embedding_type in ("rope", "learned_absolute", "none")
            and all(isinstance(layer.self_attention.core_attention, _MASKABLE_CORE_ATTENTION) for layer in layers))


def hooked(model) -> bool:
    """Whether forward hooks sit on ``model``'s modules (MegaScope's calculation noise): they act in eager code
    only, and a CUDA graph would replay what they did at its capture."""
    return any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())


class SlotState:
    """Per slot, on the device: the token a decode step reads next and its position, the sampling parameters, and
    (for generations whose rows read their prompts step by step) the prompt token to take at each position."""

    def __init__(self, slots: int, length: int, device: torch.device):
        self.next_tokens = torch.zeros(slots, dtype=torch.long, device=device)
        self.positions = torch.full((slots,), length, dtype=torch.long, device=device)  # parked: the scratch position
        self.params = RowParams(slots, device)
        self.forced = torch.full((slots, length + 1), -1, dtype=torch.long, device=device)

    def snapshot(self) -> list[torch.Tensor]:
        return [tensor.clone() for tensor in (self.next_tokens, self.positions, self.params.sampled)]

    def restore(self, snapshot: list[torch.Tensor]) -> None:
        for tensor, saved in zip((self.next_tokens, self.positions, self.params.sampled), snapshot):
            tensor.copy_(saved)


class _ForwardState:
    """What every layer's ``CachedCoreAttention`` reads during one forward."""

    def __init__(self, length, slots, device):
        self.key_positions = torch.arange(length + 1, device=device)
        self.slot_ids = torch.arange(slots, device=device)
        self.write_positions = self.write_slots = None  # [n, b]: where the forward's keys and values go
        self.rows = None        # the forward's slots: a slice (read as a view) or a tensor of slot indices
        self.key_length = length
        self.mask = None        # [b, 1, n, key_length], True where a key comes after the query


class CachedCoreAttention(torch.nn.Module):
    """A layer's core attention over its KV cache (see the module docstring)."""

    def __init__(self, inner, keys, values, state):
        super().__init__()
        self.inner = inner
        self.keys, self.values = keys, values  # [length, slots, groups per TP rank, d]
        self.state = state

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        state = self.state
        where = (state.write_positions, state.write_slots)
        self.keys.index_put_(where, key)
        self.values.index_put_(where, value)
        keys, values = self.keys[:state.key_length], self.values[:state.key_length]
        if isinstance(state.rows, slice):
            keys, values = keys[:, state.rows], values[:, state.rows]
        else:
            keys, values = keys.index_select(1, state.rows), values.index_select(1, state.rows)
        return self.inner(query, keys, values, state.mask, attn_mask_type=AttnMaskType.padding,
                          attention_bias=attention_bias, packed_seq_params=packed_seq_params)


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    output: StepOutput


class SlotCacheModel:
    """This stage of ``model`` (one unwrapped GPTModel) over a KV cache of ``slots`` rows of ``length`` positions;
    ``vocab_size``: the tokenizer's (the draw never picks the padding of the output layer). ``cuda_graphs``: replay
    decode steps as CUDA graphs (one GPU per pipeline: a GPU without pipeline parallelism). Not thread-safe."""

    def __init__(self, model, slots, length, vocab_size, device, cuda_graphs):
        self.model, self.slots, self.length, self.vocab_size = model, slots, length, vocab_size
        self.device = torch.device(device)
        self.forward_state = _ForwardState(length, slots, self.device)
        self.state = SlotState(slots, length, self.device)
        self.wrappers = []
        for layer in model.decoder.layers:
            attention = layer.self_attention
            dtype = attention.linear_qkv.weight.dtype
            shape = (length + 1, slots, attention.num_query_groups_per_partition,
                     attention.hidden_size_per_attention_head)
            # Zeros, not empty memory: masked positions weigh 0, and 0 times a NaN left in memory would be NaN.
            keys, values = (torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(2))
            self.wrappers.append(CachedCoreAttention(attention.core_attention, keys, values, self.forward_state))
        self.rotary = model.rotary_pos_emb(length + 1) if model.position_embedding_type == "rope" else None
        self.pipeline = parallel_state.get_pipeline_model_parallel_world_size()
        self.hidden_dtype = model.config.params_dtype
        self.cuda_graphs = (cuda_graphs and self.device.type == "cuda" and self.pipeline == 1
                            and all(isinstance(w.inner, SDPAttention) for w in self.wrappers))
        self.graphs = collections.OrderedDict()
        self._pool = None
        self.hooked = hooked(model)

    def hooks_changed(self) -> None:
        """Forward hooks came or went (perturbations): steps run eagerly while there are any."""
        self.hooked = hooked(self.model)

    # -- a prompt's tokens, and the rows that read them ---------------------------------------------------------
    def clear(self, slots: list[int]) -> None:
        """Zero ``slots``' keys and values (a slot a broken generation held may keep NaNs that masked positions
        would spread) and park them."""
        index = torch.tensor(slots, device=self.device)
        for wrapper in self.wrappers:
            wrapper.keys.index_fill_(1, index, 0)
            wrapper.values.index_fill_(1, index, 0)
        self.park(slots)

    def park(self, slots: list[int]) -> None:
        """``slots`` hold no row from now on: what they compute is never read."""
        index = torch.tensor(slots, device=self.device)
        self.state.positions.index_fill_(0, index, self.length)
        self.state.forced.index_fill_(0, index, -1)

    def prefill(self, tokens, starts, counts, slots, plan, all_positions=False, readout=None, draw_rows=None):
        """Read ``tokens`` [k, n] (the first stage's; row i's first ``counts[i]`` are real) at positions
        ``starts[i]``.. into ``slots``, and draw each row's next token from its last real position, unless
        ``draw_rows`` [k] bools says a row has more of its prompt to read (its draw is then ignored and its slot not
        advanced). The rows drawn decode from the next step on. ``all_positions``: keep every position's logits."""
        rows = _as_rows(slots, self.device)
        k, n = len(slots), int(max(counts))
        offsets = torch.arange(n, device=self.device)[None, :]
        positions = torch.tensor(starts, device=self.device)[:, None] + offsets
        last = torch.tensor(counts, device=self.device) - 1
        writes = torch.where(offsets <= last[:, None], positions, self.length)  # padding: the scratch position
        positions = positions.clamp(max=self.length - 1)
        if tokens is not None:
            tokens = tokens[:, :n].to(self.device)
        forced = None
        if plan.forced:
            forced = self.state.forced[rows].gather(1, positions.gather(1, last[:, None]) + 1)[:, 0]
        key_length = int(max(start + count for start, count in zip(starts, counts)))
        advance = torch.ones(k, dtype=torch.bool, device=self.device) if draw_rows is None else \
            torch.tensor(draw_rows, device=self.device)
        output = self._step(tokens, positions, writes, rows, key_length, last, all_positions, readout, plan, forced,
                            advance)
        drawn = output.draw[:, 0].long().clamp(min=0)
        self.state.next_tokens[rows] = torch.where(advance, drawn, self.state.next_tokens[rows])
        ends = positions.gather(1, last[:, None])[:, 0] + 1
        self.state.positions[rows] = torch.where(advance, ends, self.state.positions[rows])
        return output

    def key_length(self, end: int) -> int:
        """The keys a decode step reads when no row is past position ``end`` - 1: a power of two (at least 64), so
        that steps of similar lengths share a graph and a short generation does not read the whole cache."""
        return min(self.length, max(64, 1 << (max(end, 1) - 1).bit_length()))

    def decode(self, bucket: int, plan: DrawPlan, readout=None, key_length: int | None = None) -> StepOutput:
        """One token for each of the first ``bucket`` slots, from the state each slot holds; the slots advance.
        ``key_length`` (from ``key_length``): the keys read, at least every row's position + 1 (default: all)."""
        key_length = key_length or self.length
        if not self.cuda_graphs or self.hooked:
            return self._decode(bucket, key_length, plan, readout)
        graph = self._graph(bucket, key_length, plan, readout)
        graph.graph.replay()
        return graph.output

    def _decode(self, bucket, key_length, plan, readout):
        rows = slice(0, bucket)
        # A parked row (or one past its end, its last tokens not read yet) writes to the scratch position or its own
        # slot past its end, and its query reads what it may; nothing reads what it computes.
        ahead = self.state.positions[rows]
        writes = ahead.clamp(max=self.length)
        positions = ahead.clamp(max=key_length - 1)
        forced = self.state.forced[rows].gather(1, (positions + 1)[:, None])[:, 0] if plan.forced else None
        # Only rows that hold a token to draw advance their sampling counter: a parked row's draw is thrown away.
        output = self._step(self.state.next_tokens[rows][:, None], positions[:, None], writes[:, None], rows,
                            key_length, None, False, readout, plan, forced, kept=ahead < self.length)
        self.state.next_tokens[rows] = output.draw[:, 0].long().clamp(min=0)  # a non-finite row's -2: a parked token
        self.state.positions[rows] += 1
        return output

    # -- one forward of this stage and the draw ----------------------------------------------------------------
    def _step(self, tokens, positions, writes, rows, key_length, last, all_positions, readout, plan, forced,
              kept=None):
        logits, packed = self._read(tokens, positions, writes, rows, key_length, last, all_positions, readout)
        drawn = None
        if logits is not None:
            final = logits[:, -1, :self.vocab_size].float() if not all_positions else \
                logits[:, :, :self.vocab_size].float().gather(
                    1, last[:, None, None].expand(-1, 1, self.vocab_size))[:, 0]
            drawn = draw(final, rows, self.state.params, plan, forced, kept)
        drawn = from_last_stage(drawn, (positions.shape[0], plan.width), self.device)
        return StepOutput(drawn, logits if all_positions else None, packed)

    def _read(self, tokens, positions, writes, rows, key_length, last, all_positions, readout):
        if readout is None:
            return self._forward(tokens, positions, writes, rows, key_length, last, all_positions), None
        with readout.reading(self.model):
            output = self._forward(tokens, positions, writes, rows, key_length, last, all_positions)
        return output, readout.pack()

    def _forward(self, tokens, positions, writes, rows, key_length, last, all_positions):
        """The last stage's logits [b, n or 1, padded vocabulary] (every position, else each row's ``last`` or
        the last), else None after sending the hidden states on. ``positions`` [b, n]: where each token is read;
        ``writes`` [b, n]: where its key and value go (the scratch position for padding)."""
        model, state = self.model, self.forward_state
        batch, n = positions.shape
        state.rows, state.key_length = rows, key_length
        state.write_positions = writes.t()
        state.write_slots = (state.slot_ids[rows] if isinstance(rows, slice) else rows)[None, :].expand(n, -1)
        state.mask = (state.key_positions[:key_length][None, None, None, :] > positions[:, None, :, None])
        rotary = None if self.rotary is None else self.rotary[positions.t()].squeeze(2)  # [n, b, 1, d]
        if model.pre_process:
            hidden = model.embedding(input_ids=tokens, position_ids=positions)
        else:
            hidden = torch.empty(n, batch, model.config.hidden_size, dtype=self.hidden_dtype, device=self.device)
            torch.distributed.recv(hidden, parallel_state.get_pipeline_model_parallel_prev_rank())
            model.decoder.set_input_tensor(hidden)
        with self._cached_attention():
            hidden = model.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rotary)
        if not model.post_process:
            torch.distributed.send(hidden.contiguous(), parallel_state.get_pipeline_model_parallel_next_rank())
            return None
        if not all_positions:
            hidden = hidden[-1:] if last is None else hidden.gather(
                0, last[None, :, None].expand(1, -1, hidden.shape[-1]))
        weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        output, _ = model.output_layer(hidden, weight=weight, runtime_gather_output=True)
        return output.transpose(0, 1)

    @contextlib.contextmanager
    def _cached_attention(self):
        attentions = [layer.self_attention for layer in self.model.decoder.layers]
        for attention, wrapper in zip(attentions, self.wrappers):
            attention.core_attention = wrapper
        try:
            yield
        finally:
            for attention, wrapper in zip(attentions, self.wrappers):
                attention.core_attention = wrapper.inner

    # -- CUDA graphs of the decode step ------------------------------------------------------------------------
    def _graph(self, bucket, key_length, plan, readout):
        """The graph of a decode step of ``bucket`` slots over ``key_length`` keys with ``readout`` and ``plan``,
        captured on first use."""
        key = (bucket, key_length, None if readout is None else readout.key, plan)
        if key in self.graphs:
            self.graphs.move_to_end(key)
            return self.graphs[key]
        if len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        began = time.perf_counter()
        self.graphs[key] = graph = self._capture(bucket, key_length, plan, readout)
        log.log(logging.INFO if readout is not None else logging.DEBUG,
                "captured the decode step of %d slots over %d keys (readout %s) in %.0f ms", bucket, key_length,
                None if readout is None else readout.key, (time.perf_counter() - began) * 1e3)
        return graph

    def _capture(self, bucket, key_length, plan, readout):
        """Capture the decode step. Its warm-up runs compute exactly the step at hand and the slot state is put back
        after each, so the cache entries they write are the ones the replay writes again."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        saved = self.state.snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # lazy initialisations (cuBLAS handles, workspaces) happen outside the graph
                self._decode(bucket, key_length, plan, readout)
                self.state.restore(saved)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self._decode(bucket, key_length, plan, readout)
        return _Graph(graph, output)


def _as_rows(slots, device):
    """A slice when ``slots`` are consecutive (the cache is read as a view), else a tensor of slot indices."""
    if all(later == earlier + 1 for earlier, later in zip(slots, slots[1:])):
        return slice(slots[0], slots[-1] + 1)
    return torch.tensor(slots, device=device)
