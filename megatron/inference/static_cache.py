"""Plain generation over a preallocated KV cache: fixed shapes, so that a GPU replays each decode step as a CUDA graph.

megatron-core's ``StaticInferenceContext`` hands each layer a key/value view that grows by Python slicing every step,
so no two steps have the same shapes and a step cannot be captured; at batch 1 such a step is bound by host time
(op dispatch in megatron-core's layers), which made generation slower than ``transformers``. Here the model is run
through its own megatron-core modules (embedding, decoder block with every layer, norm and MLP, output layer), with
one change: for the duration of a forward each layer's core attention is wrapped by ``CachedCoreAttention``, which
writes the step's keys and values into a fixed [length, batch, groups, d] cache at the positions held in a device
tensor and hands the layer's own core attention the whole cache, the positions after each query masked. Rotary
frequencies are picked from a precomputed table by the same device positions. Every decode step then has the same
shapes and no host-side state: on a GPU the first one is captured in a CUDA graph, the others replay it.

A step may carry a ``StepReadout`` (MegaScope's compiled capture): module hooks whose device ops read and reduce
what the model computes, packed into one flat tensor at the end of the forward. Its hooks are live while a graph is
captured, so their kernels are part of the graph and every replay writes the packed tensor again; a graph is kept
per readout (``readout.key``; None: the plain step), the least recently used dropped past ``MAX_GRAPHS``.

Used by the engine for one pipeline stage without sequence parallelism, unless a generation asks for what only
megatron-core's own path does (MegaScope's patches, perturbations and attribution hook into it eagerly).
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
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron.training.sdpa_attention import SDPAttention

# Core attentions that take a boolean mask (True = masked out) over keys longer than the queries.
_MASKABLE_CORE_ATTENTION = (SDPAttention, DotProductAttention)
MAX_GRAPHS = 4  # decode-step graphs kept per cache: each holds its own activation memory
log = logging.getLogger("megatron.inference")


class StepReadout(Protocol):
    """What a step reads out of the model besides its logits, as device ops (megascope/capture_plan.py)."""
    key: Hashable  # equal keys read the same: they share a graph

    def reading(self, model) -> AbstractContextManager:
        """Hooks on ``model`` (one unwrapped GPTModel) for the duration of one forward."""

    def pack(self) -> torch.Tensor:
        """After the forward, inside the captured region: one flat tensor of everything the hooks read."""


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    logits: torch.Tensor
    packed: torch.Tensor | None


class _CacheState:
    """What every layer's ``CachedCoreAttention`` reads during one forward: the positions written and the mask."""

    def __init__(self, length, device):
        self.key_positions = torch.arange(length, device=device)
        self.positions = None  # [n] positions of the forward's tokens
        self.mask = None       # [1, 1, n, length], True where a key comes after the query


class CachedCoreAttention(torch.nn.Module):
    """A layer's core attention over its slot of the KV cache (see the module docstring)."""

    def __init__(self, inner, keys, values, state):
        super().__init__()
        self.inner = inner
        self.keys, self.values = keys, values  # [length, batch, groups per TP rank, d]
        self.state = state

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        self.keys.index_copy_(0, self.state.positions, key)
        self.values.index_copy_(0, self.state.positions, value)
        return self.inner(query, self.keys, self.values, self.state.mask, attn_mask_type=AttnMaskType.padding,
                          attention_bias=attention_bias, packed_seq_params=packed_seq_params)


def supports(model, config):
    """Whether ``model`` (one unwrapped GPTModel holding every layer) can run on the static cache."""
    layers = model.decoder.layers
    return (model.pre_process and model.post_process and not config.sequence_parallel
            and config.mtp_num_layers is None and not config.multi_latent_attention
            and model.position_embedding_type in ("rope", "learned_absolute", "none")
            and all(isinstance(layer.self_attention.core_attention, _MASKABLE_CORE_ATTENTION) for layer in layers))


class StaticCacheModel:
    """``model``'s logits for ``batch`` rows of at most ``length`` tokens, over a KV cache it owns.

    ``cuda_graphs``: replay one-token steps as a CUDA graph (GPU only). Not thread-safe; one generation at a time."""

    def __init__(self, model, batch, length, device, cuda_graphs):
        self.model = model
        self.state = _CacheState(length, device)
        self.wrappers = []
        for layer in model.decoder.layers:
            attention = layer.self_attention
            dtype = attention.linear_qkv.weight.dtype
            shape = (length, batch, attention.num_query_groups_per_partition, attention.hidden_size_per_attention_head)
            # Zeros, not empty memory: masked positions weigh 0, and 0 times a NaN left in memory would be NaN.
            keys, values = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
            self.wrappers.append(CachedCoreAttention(attention.core_attention, keys, values, self.state))
        self.rotary = model.rotary_pos_emb(length) if model.position_embedding_type == "rope" else None
        # The CUDA graphs of a one-token step (one per readout key) and their static input tensors.
        self.cuda_graphs = cuda_graphs and all(isinstance(w.inner, SDPAttention) for w in self.wrappers)
        self.graphs = collections.OrderedDict()
        self.step_tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.step_position = torch.zeros(1, dtype=torch.long, device=device)

    def logits(self, tokens, start, all_positions, readout=None):
        """([b, n or 1, padded vocabulary] logits, ``readout``'s packed tensor or None) of ``tokens`` [b, n] at
        positions start..start+n-1, caching their keys and values (``all_positions``: every position's logits,
        else the last one's). A graphed step's packed tensor is rewritten by the next replay: copy it first."""
        if tokens.shape[1] == 1 and self.cuda_graphs:
            self.step_tokens.copy_(tokens)
            self.step_position.fill_(start)
            graph = self._graph(readout)
            graph.graph.replay()
            return graph.logits.clone(), graph.packed
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        return self._read(tokens, positions, all_positions, readout)

    def _read(self, tokens, positions, all_positions, readout):
        if readout is None:
            return self._forward(tokens, positions, all_positions), None
        with readout.reading(self.model):
            output = self._forward(tokens, positions, all_positions)
        return output, readout.pack()

    def _forward(self, tokens, positions, all_positions):
        model, state = self.model, self.state
        state.positions = positions
        state.mask = (state.key_positions[None, :] > positions[:, None])[None, None]
        hidden = model.embedding(input_ids=tokens, position_ids=positions.expand(tokens.shape[0], -1))
        rotary = None if self.rotary is None else self.rotary.index_select(0, positions)
        with self._cached_attention():
            hidden = model.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rotary)
        if not all_positions:
            hidden = hidden[-1:]
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

    def _graph(self, readout):
        """The graph of a one-token step with ``readout``, captured on first use."""
        key = None if readout is None else readout.key
        if key in self.graphs:
            self.graphs.move_to_end(key)
            return self.graphs[key]
        if len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        began = time.perf_counter()
        self.graphs[key] = graph = self._capture(readout)
        if readout is not None:
            log.info("captured the decode step with readout %s in %.0f ms", key, (time.perf_counter() - began) * 1e3)
        return graph

    def _capture(self, readout):
        """Capture the one-token step. The warm-up runs compute exactly the step at hand (same tokens and position),
        so the cache entries they write are the ones the replay writes again."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # lazy initialisations (cuBLAS handles, workspaces) happen outside the graph
                self._read(self.step_tokens, self.step_position, False, readout)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits, packed = self._read(self.step_tokens, self.step_position, False, readout)
        return _Graph(graph, logits, packed)
