"""Text generation with a KV cache at any TP/PP (and DP replicas), on CPU or GPU: a generation that holds the model
alone (MegaScope's WebSocket generations, and every generation of a model the batch cannot serve). Concurrent REST
requests are batched instead (megatron/inference/batcher.py), on the same slot cache.

A generation on one pipeline stage runs on megatron/inference/slot_cache.py: megatron-core's modules over a
preallocated KV cache, each decode step (the forward and the draw) replayed as a CUDA graph on a GPU; what an observer
reads out of a step (MegaScope's capture) is compiled into that step (``NoObserver.readout``). Otherwise (pipeline
stages, or an observer that hooks the model eagerly: ``NoObserver.core_path``) the KV cache is megatron-core's
``StaticInferenceContext`` handed to ``GPTModel.forward``; with pipeline parallelism each forward goes through
megatron-core's forward-only pipeline schedule (megatron/inference/greedy.py's ``logits``), so stages pass
activations as in training. A small-batch step is bound by host time (Python and op dispatch), hence
``torch.inference_mode`` (less per-op bookkeeping than ``no_grad``). Prompts of different lengths share one batch as
in Megatron-LM: the first step reads the shortest prompt's length, then every step reads one position of every row; a
row still inside its prompt takes its prompt token, the others take the drawn one.

Every rank of a data-parallel replica calls ``generate`` with the same arguments. The last pipeline stage draws the
tokens on the device (megatron/inference/sampling.py) and broadcasts the draw to the stages before it. Logits that are
not finite (a perturbation that broke the model) draw nothing: the draw carries that to every stage, and every rank of
the replica raises ``NonFiniteLogits`` at the same step, so the server can end the generation and go on. Between steps
the replica's first rank (global rank 0 for the first replica) may hand a small control message (cancel, a new
capture, perturbations) to every rank of the replica, so they all agree.
"""

import collections
import contextlib
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.utils import unwrap_model

from megatron.inference.greedy import logits as forward_logits
from megatron.inference.host_copy import HostCopy
from megatron.inference.last_stage import from_last_stage
from megatron.inference.sampling import Draw, DrawPlan, RowParams, draw, unpack
from megatron.inference.scores import position_scores
from megatron.inference.slot_cache import SlotCacheModel, hooked, supports
from megatron.training.errors import UserError


class NonFiniteLogits(Exception):
    """The model's logits for some prompts went NaN or infinite; raised at the same step on every rank of a
    replica. ``prompts``: their indices in the request; ``position``: the token position being chosen."""

    def __init__(self, prompts, position):
        self.prompts, self.position = list(prompts), position
        super().__init__(f"the model's logits for prompt(s) {', '.join(map(str, self.prompts))} at token position "
                         f"{position} are not finite (NaN or infinite), so no token can be drawn; the active "
                         f"perturbations (or the weights) break the model: clear or weaken them")

    def __reduce__(self):  # data-parallel replicas send it to global rank 0 (megatron/inference/replicas.py)
        return NonFiniteLogits, (self.prompts, self.position)


@dataclass
class Step:
    """What one forward step produced: positions [start, end) were read and position ``end`` chosen for
    every row; ``sampled`` lists the rows whose token there is generated (not a prompt token), ``finished``
    those whose generation ended with it (later steps read their last token, then only padding)."""
    index: int
    start: int
    end: int
    sampled: list
    finished: list
    draw: Draw
    readout: object = None  # the step's readout's packed tensor (slot cache path), on the device: may be rewritten


@dataclass
class Generation:
    tokens: list            # per prompt: prompt tokens and generated tokens
    prompt_lengths: list
    finish_reasons: list    # "length", "stop" or "cancelled"
    logprobs: list | None   # per prompt: log-probability of every token after the first
    # per prompt, per token after the first: [[token id, log-probability], ...] of the model's params.top_logprobs
    # most likely tokens there (None unless logprobs and top_logprobs are asked for)
    top_logprobs: list | None = None


def _pairs(ids, values):
    """[[token id, log-probability], ...] for each row of ``ids``/``values`` [rows, top]."""
    return [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]


class NoObserver:
    """What ``generate`` calls around each step; a session overrides it to stream and capture."""

    def core_path(self):
        """Every rank, before the first step: whether this generation's forward hooks need megatron-core's own
        inference path (eager, every hook sees the tensors it expects) rather than the static cache."""
        return False

    def path_chosen(self, static_cache):
        """Every rank: the path the generation runs on (``static_cache``: the static cache, else megatron-core's)."""

    def readout(self, index, start, end):
        """Every rank, on the slot cache path: the ``StepReadout`` of this step (positions [start, end)) or None."""
        return None

    def step_launched(self, index, readout):
        """Every rank, on the slot cache path, right after the step is queued: its readout's packed tensor (on the
        device, rewritten by a later step) or None. Its ``step_done`` may come after the next step is queued."""

    def poll(self):
        """Rank 0: a control message for every rank (a dict) or None."""
        return None

    def apply(self, control):
        """Every rank: act on rank 0's control message; True stops the generation (cancel)."""
        return bool(control and control.get("cancel"))

    def forward(self, index, start, end):
        """Every rank: a context around one step's forward (where capture hooks live)."""
        return contextlib.nullcontext()

    def step_done(self, step):
        """Every rank, once the step's tokens are known: inside its ``forward`` context on megatron-core's path, on
        the slot cache path inside the next step's."""

    def after(self, generation):
        """Every rank, after the last step (still in inference mode): the last tokens chosen were never read."""


def agree(obj, device):
    """Rank 0's ``obj`` on every rank (nothing to send in a one-process job)."""
    if torch.distributed.get_world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0, device=device)
    return box[0]


def agree_in_replica(poll, device):
    """``poll()`` of the first rank of this data-parallel replica (global rank 0 for the first) on every rank
    of the replica: replicas generate different prompts, so they never wait on each other."""
    group = parallel_state.get_model_parallel_group()
    ranks = torch.distributed.get_process_group_ranks(group)
    box = [poll() if torch.distributed.get_rank() == ranks[0] else None]
    if len(ranks) > 1:
        torch.distributed.broadcast_object_list(box, src=ranks[0], group=group, device=device)
    return box[0]


class GenerationEngine:
    """``static_cache``: generations run on the slot cache of megatron/inference/slot_cache.py where it supports the
    model (else megatron-core's StaticInferenceContext); ``cuda_graphs``: and replay decode steps as CUDA graphs on a
    GPU. ``slots``: the rows of that cache (the most prompts generated at once; megatron/inference/batcher.py batches
    requests in them)."""

    def __init__(self, model, vocab_size, eod, max_sequence_length, device, static_cache=True, cuda_graphs=True,
                 slots=16):
        self.model = model
        self.vocab_size = vocab_size
        self.eod = eod
        self.max_sequence_length = max_sequence_length
        self.device = torch.device(device)
        self.static_cache, self.cuda_graphs, self.slots = static_cache, cuda_graphs, slots
        self._cache = None

    @property
    def cache(self) -> SlotCacheModel | None:
        """This rank's stage over the slot cache (made on first use: it holds the KV cache's memory), or None where
        the model cannot run on it."""
        if self._cache is None and self.static_cache and len(self.model) == 1:
            model = unwrap_model(self.model[0])
            if supports(model, model.config):
                try:
                    with torch.inference_mode():  # its tensors are only ever used there
                        self._cache = SlotCacheModel(model, self.slots, self.max_sequence_length, self.vocab_size,
                                                     self.device, self.cuda_graphs)
                except torch.OutOfMemoryError:
                    raise UserError(f"--inference-max-requests {self.slots} x --inference-max-seq-length "
                                    f"{self.max_sequence_length}: the KV cache of that many slots and positions does "
                                    f"not fit beside the model on {self.device}; lower either") from None
        return self._cache

    @torch.inference_mode()
    def generate(self, prompts, params, observer=None):
        """``prompts``: lists of token ids; ``params``: SamplingParams. The same call on every rank; the generation
        holds the model alone (its rows read their prompts in step: see the module docstring)."""
        observer = observer or NoObserver()
        batch = len(prompts)
        lengths = [len(prompt) for prompt in prompts]
        total = min(max(lengths) + params.tokens_to_generate, self.max_sequence_length)
        tokens = torch.zeros(batch, total + 1, dtype=torch.long)  # a spare column: the last step's choice
        for row, prompt in enumerate(prompts):
            tokens[row, :len(prompt)] = torch.tensor(prompt)
        stops = {self.eod, *params.stop_tokens}
        generated = [0] * batch
        finish = [None if params.tokens_to_generate > 0 else "length" for _ in prompts]
        logprobs = [[] for _ in prompts] if params.logprobs else None
        best = [[] for _ in prompts] if params.logprobs and params.top_logprobs else None

        steps = _SlotSteps(self, tokens, lengths, params) if self._slot_path(observer, batch) else \
            _CoreSteps(self, tokens, lengths, params, total)
        observer.path_chosen(isinstance(steps, _SlotSteps))
        state = _Progress(tokens, lengths, params, stops, generated, finish, logprobs, best)
        launched = collections.deque()  # steps queued whose tokens are not read yet
        start, end, index = 0, min(lengths), 0
        try:
            while True:
                if observer.apply(agree_in_replica(observer.poll, self.device)):
                    finish[:] = [reason or "cancelled" for reason in finish]
                    break
                with observer.forward(index, start, end):
                    launched.append(self._launch(steps, observer, state, index, start, end))
                    start, end, index = end, end + 1, index + 1
                    last = end >= total  # the step just queued chose the last position there is
                    ended = False
                    # On the slot cache the next step is queued before this one's tokens are read (the device state
                    # carries them over), so the host's reading overlaps the device's next step.
                    while launched and (len(launched) > steps.ahead or last) and not ended:
                        ended = self._take(launched.popleft(), state, observer, steps)
                if ended or last:
                    break
        finally:
            steps.close()
        finish = [reason or "length" for reason in finish]  # the model's length ran out first
        generation = Generation(tokens=[tokens[row, :lengths[row] + generated[row]].tolist() for row in range(batch)],
                                prompt_lengths=lengths, finish_reasons=finish, logprobs=logprobs, top_logprobs=best)
        observer.after(generation)
        return generation

    def _launch(self, steps, observer, state, index, start, end):
        """Queue the step reading positions [start, end); the prompt's scores of the first step are read at once."""
        readout = observer.readout(index, start, end) if isinstance(steps, _SlotSteps) else None
        packed, step_logits, read = steps.step(index, start, end, readout, state.logprobs is not None)
        observer.step_launched(index, read)
        if state.logprobs is not None and index == 0:  # the prompt's positions before the last
            state.score_prompts(step_logits, end, self.vocab_size, self.device)
        steps.advance(start, end)
        return _Queued(index, start, end, HostCopy({"draw": packed}), read)

    def _take(self, queued, state, observer, steps):
        """Read a queued step's tokens; whether the generation has ended with them."""
        chosen = unpack(queued.draw.tensors()["draw"], steps.plan)
        broken = (chosen.tokens == Draw.NON_FINITE).nonzero().flatten().tolist()
        if broken:
            steps.broken()
            raise NonFiniteLogits([state.params.first_prompt + row for row in broken], queued.end)
        sampled, finished = state.take(chosen, queued.end)
        observer.step_done(Step(queued.index, queued.start, queued.end, sampled, finished, chosen, queued.readout))
        reading_prompts = any(queued.end + 1 < length for length in state.lengths)
        return all(state.finish) and not reading_prompts

    def _slot_path(self, observer, batch):
        """Whether this generation runs on the slot cache: one pipeline stage, no forward hooks (MegaScope's
        calculation noise acts in eager code only, and a CUDA graph would replay what they did at its capture) and
        nothing the observer hooks into megatron-core's own path."""
        cache = self.cache
        return (cache is not None and cache.model.pre_process and cache.model.post_process and batch <= cache.slots
                and not observer.core_path() and not hooked(cache.model))


@dataclass
class _Queued:
    """A step queued on the device: what it read and where its draw lands on the host."""
    index: int
    start: int
    end: int
    draw: HostCopy
    readout: object


class _Progress:
    """A generation's tokens, ends and log-probabilities as its steps' draws are read."""

    def __init__(self, tokens, lengths, params, stops, generated, finish, logprobs, best):
        self.tokens, self.lengths, self.params, self.stops = tokens, lengths, params, stops
        self.generated, self.finish, self.logprobs, self.best = generated, finish, logprobs, best

    def score_prompts(self, step_logits, end, vocab_size, device):
        """The log-probabilities of every prompt's tokens 1..end-1 (those the first step read and did not choose)."""
        top = self.params.top_logprobs if self.best is not None else 0
        scores = position_scores(None if step_logits is None else step_logits[:, :end - 1], self.tokens[:, 1:end],
                                 top, vocab_size, device).cpu()
        for row in range(len(self.lengths)):
            self.logprobs[row].extend(scores[row, :, 0].tolist())
            if self.best is not None:
                self.best[row].extend(_pairs(scores[row, :, 1:1 + top].long(), scores[row, :, 1 + top:]))

    def take(self, chosen, position):
        """The draw ``chosen`` of the step that chose ``position``: (rows that generated a token, rows that ended)."""
        params, batch = self.params, len(self.lengths)
        sampled = [row for row in range(batch) if self.finish[row] is None and position >= self.lengths[row]]
        for row in sampled:
            token = int(chosen.tokens[row])
            self.tokens[row, position] = token
            self.generated[row] += 1
            if token in self.stops:
                self.finish[row] = "stop"
            elif self.generated[row] == params.tokens_to_generate:
                self.finish[row] = "length"
        if self.logprobs is not None:
            for row in range(batch):
                if position < self.lengths[row] or row in sampled:
                    self.logprobs[row].append(float(chosen.logprobs[row]))
                    if self.best is not None:
                        self.best[row].extend(_pairs(chosen.best_ids[row:row + 1, :params.top_logprobs],
                                                     chosen.best_logprobs[row:row + 1, :params.top_logprobs]))
        return sampled, [row for row in sampled if self.finish[row] is not None]


class _SlotSteps:
    """A generation's steps on the engine's slot cache, in slots 0..b-1: the first step reads every row's prompt up
    to the shortest one's length, the next ones one position each, a row still inside its prompt taking its prompt
    token (the slot state's forced tokens) rather than the drawn one."""

    def __init__(self, engine, tokens, lengths, params):
        self.cache = engine.cache
        self.tokens, self.lengths = tokens, lengths
        self.slots = list(range(len(lengths)))
        self.cache.park(self.slots)
        self.cache.state.params.set(self.slots, params, self.slots)
        uneven = len(set(lengths)) > 1
        if uneven:
            forced = torch.full((len(lengths), self.cache.length + 1), -1, dtype=torch.long)
            for row, length in enumerate(lengths):
                forced[row, :length] = tokens[row, :length]
            self.cache.state.forced[:len(lengths)] = forced.to(self.cache.device)
        self.plan = DrawPlan.of(params, engine.vocab_size, forced=uneven)

    ahead = 1  # the next step is queued before this one's tokens are read

    def step(self, index, start, end, readout, all_positions):
        """(the packed draw, every position's logits on the first step when ``all_positions`` else None, the
        readout's packed tensor or None) of the step reading positions [start, end)."""
        if index == 0:
            count = end - start
            output = self.cache.prefill(self.tokens[:, start:end], [start] * len(self.slots), [count] * len(self.slots),
                                        self.slots, self.plan, all_positions=all_positions, readout=readout)
        else:
            output = self.cache.decode(len(self.slots), self.plan, readout, key_length=self.cache.key_length(end))
        return output.draw, output.logits, output.readout

    def advance(self, start, end):
        pass  # the slot state advanced on the device

    def broken(self):
        self.cache.clear(self.slots)  # NaNs in the cache would spread to the next generation in these slots

    def close(self):
        self.cache.park(self.slots)


class _CoreSteps:
    """A generation's steps on megatron-core's own inference path (its StaticInferenceContext, its forward-only
    pipeline schedule), where MegaScope's eager hooks see the tensors they expect; the draw is the same."""

    def __init__(self, engine, tokens, lengths, params, total):
        self.engine, self.tokens, self.lengths = engine, tokens, lengths
        batch = len(lengths)
        self.context = StaticInferenceContext(batch, total)
        self.row_params = RowParams(batch, engine.device)
        self.row_params.set(list(range(batch)), params, list(range(batch)))
        self.plan = DrawPlan.of(params, engine.vocab_size, forced=True)

    ahead = 0  # the next step reads the tokens this one chose from the host

    def step(self, index, start, end, readout, all_positions):
        engine = self.engine
        self.context.materialize_only_last_token_logits = not (all_positions and index == 0)
        output = forward_logits(engine.model, self.tokens[:, start:end].to(engine.device), start,
                                inference_context=self.context)
        batch = len(self.lengths)
        packed = None
        if output is not None:
            forced = torch.tensor([int(self.tokens[row, end]) if end < self.lengths[row] else -1
                                   for row in range(batch)], device=engine.device)
            packed = draw(output[:, -1, :engine.vocab_size].float(), slice(0, batch), self.row_params, self.plan,
                          forced)
        packed = from_last_stage(packed, (batch, self.plan.width), engine.device)
        return packed, output if all_positions and index == 0 else None, None

    def advance(self, start, end):
        self.context.increment_sequence_len_offset(end - start)
        self.context.enable_decode_mode()

    def broken(self):
        pass

    def close(self):
        pass
