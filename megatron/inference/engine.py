"""Text generation with a KV cache at any TP/PP (and DP replicas), on CPU or GPU.

A generation on one pipeline stage runs on megatron/inference/static_cache.py: megatron-core's modules over a
preallocated KV cache, each decode step replayed as a CUDA graph on a GPU; what an observer reads out of a step
(MegaScope's capture) is compiled into that step (``NoObserver.readout``). Otherwise (pipeline stages, sequence
parallelism, or an observer that hooks the model eagerly: ``NoObserver.core_path``) the KV cache is megatron-core's
``StaticInferenceContext`` handed to ``GPTModel.forward``; with pipeline
parallelism each forward goes through megatron-core's forward-only pipeline schedule (megatron/inference/
greedy.py's ``logits``), so stages pass activations as in training. A small-batch step is bound by host time
(Python and op dispatch), hence ``torch.inference_mode`` (less per-op bookkeeping than ``no_grad``). Prompts of
different lengths share one batch as in Megatron-LM: the prefill reads the shortest prompt's length, then every
step reads one position of every row; a row still inside its prompt takes its prompt token, the others take the
sampled one.

Every rank of a data-parallel replica calls ``generate`` with the same arguments. The last pipeline stage
draws the tokens and broadcasts them (with their probabilities) to the stages before it. Logits that are not
finite (a perturbation that broke the model) draw nothing: the draw's broadcast carries that to every stage,
and every rank of the replica raises ``NonFiniteLogits`` at the same step, so the server can end the
generation and go on. Between steps the
replica's first rank (global rank 0 for the first replica) may hand a small control message (cancel, a new
capture, perturbations) to every rank of the replica, so they all agree.
"""

import contextlib
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.utils import unwrap_model

from megatron.inference.greedy import logits as forward_logits
from megatron.inference.sampling import Draw, draw, prompt_generators
from megatron.inference.static_cache import StaticCacheModel, supports


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


_NON_FINITE = -2  # the token the last stage broadcasts for a row whose logits are not finite


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
    readout: torch.Tensor | None = None  # the packed tensor of the step's readout (static cache path), on device


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
        """Every rank, on the static cache path: the ``StepReadout`` of this step (positions [start, end)) or None."""
        return None

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
        """Every rank, inside ``forward``'s context, once the step's tokens are known."""

    def after(self, generation):
        """Every rank, after the last step (still in inference mode): the last tokens chosen were never read."""


def _hooked(model):
    """Whether forward hooks sit on ``model``'s modules (MegaScope's calculation noise): they act in eager code
    only, and a CUDA graph would replay what they did at its capture."""
    return any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())


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
    """``static_cache``: plain generations run on megatron/inference/static_cache.py where it supports the model
    (else megatron-core's StaticInferenceContext); ``cuda_graphs``: and replay decode steps as a CUDA graph on a GPU."""

    def __init__(self, model, vocab_size, eod, max_sequence_length, device, static_cache=True, cuda_graphs=True):
        self.model = model
        self.vocab_size = vocab_size
        self.eod = eod
        self.max_sequence_length = max_sequence_length
        self.device = torch.device(device)
        self.static_cache, self.cuda_graphs = static_cache, cuda_graphs
        self._static_models = {}

    @torch.inference_mode()
    def generate(self, prompts, params, observer=None):
        """``prompts``: lists of token ids; ``params``: SamplingParams. The same call on every rank."""
        observer = observer or NoObserver()
        batch = len(prompts)
        lengths = [len(prompt) for prompt in prompts]
        total = min(max(lengths) + params.tokens_to_generate, self.max_sequence_length)
        tokens = torch.zeros(batch, total + 1, dtype=torch.long)  # a spare column: the last step's choice
        for row, prompt in enumerate(prompts):
            tokens[row, :len(prompt)] = torch.tensor(prompt)
        generators = prompt_generators(params, batch)
        stops = {self.eod, *params.stop_tokens}
        generated = [0] * batch
        finish = [None if params.tokens_to_generate > 0 else "length" for _ in prompts]
        logprobs = [[] for _ in prompts] if params.logprobs else None
        best = [[] for _ in prompts] if params.logprobs and params.top_logprobs else None

        static = self._static_cache(batch, total, observer)
        observer.path_chosen(static is not None)
        cache = static or StaticInferenceContext(batch, total)
        start, position, index = 0, min(lengths), 0
        while True:
            if observer.apply(agree_in_replica(observer.poll, self.device)):
                finish = [reason or "cancelled" for reason in finish]
                break
            inputs = tokens[:, start:position].to(self.device)
            with observer.forward(index, start, position):
                readout = observer.readout(index, start, position) if static else None
                step_logits, packed = self._logits(inputs, start, cache, params.logprobs and index == 0, readout)
                if logprobs is not None and index == 0:
                    values, best_ids, best_values = self._prompt_logprobs(step_logits, inputs, params.top_logprobs)
                    for row in range(batch):
                        logprobs[row].extend(values[row].tolist())
                        if best is not None:
                            best[row].extend(_pairs(best_ids[row], best_values[row]))
                # A row still inside its prompt reads its prompt token (and reports its probabilities).
                forced = torch.tensor([int(tokens[row, position]) if position < lengths[row] else -1
                                       for row in range(batch)])
                chosen = self._draw(step_logits, params, generators, forced)
                broken = (chosen.tokens == _NON_FINITE).nonzero().flatten().tolist()
                if broken:
                    raise NonFiniteLogits([params.first_prompt + row for row in broken], position)
                sampled = [row for row in range(batch) if finish[row] is None and position >= lengths[row]]
                for row in sampled:
                    token = int(chosen.tokens[row])
                    tokens[row, position] = token
                    generated[row] += 1
                    if token in stops:
                        finish[row] = "stop"
                    elif generated[row] == params.tokens_to_generate:
                        finish[row] = "length"
                if logprobs is not None:
                    for row in range(batch):
                        if position < lengths[row] or row in sampled:
                            logprobs[row].append(float(chosen.logprobs[row]))
                            if best is not None:
                                best[row].extend(_pairs(chosen.best_ids[row:row + 1],
                                                        chosen.best_logprobs[row:row + 1]))
                finished = [row for row in sampled if finish[row] is not None]
                observer.step_done(Step(index, start, position, sampled, finished, chosen, packed))
            if isinstance(cache, StaticInferenceContext):
                cache.increment_sequence_len_offset(position - start)
                cache.enable_decode_mode()
            start, position, index = position, position + 1, index + 1
            reading_prompts = any(position < length for length in lengths)
            if position >= total or (all(finish) and not reading_prompts):
                break
        finish = [reason or "length" for reason in finish]  # the model's length ran out first
        generation = Generation(tokens=[tokens[row, :lengths[row] + generated[row]].tolist() for row in range(batch)],
                                prompt_lengths=lengths, finish_reasons=finish, logprobs=logprobs, top_logprobs=best)
        observer.after(generation)
        return generation

    def _static_cache(self, batch, total, observer):
        """A ``StaticCacheModel`` for this generation, or None for megatron-core's inference path (pipeline stages,
        sequence parallelism, hooks). Kept for the next generation of the same batch size and cache length: the
        length is rounded up to a power of two so that requests of similar lengths share one CUDA graph."""
        model = unwrap_model(self.model[0])
        if (not self.static_cache or observer.core_path() or len(self.model) != 1 or _hooked(model)
                or not supports(model, model.config)):
            return None
        length = min(1 << (total - 1).bit_length(), self.max_sequence_length)
        key = (batch, length)
        if key not in self._static_models:
            self._static_models.clear()  # one cache (and graph) at a time: they hold device memory
            self._static_models[key] = StaticCacheModel(model, batch, length, self.device,
                                                        self.cuda_graphs and self.device.type == "cuda")
        return self._static_models[key]

    def _logits(self, inputs, start, cache, all_positions, readout):
        """(The last stage's [b, s or 1, vocab] float32 logits over the tokenizer's vocabulary, else None; the packed
        readout or None). ``cache``: a ``StaticCacheModel`` or megatron-core's ``StaticInferenceContext``."""
        packed = None
        if isinstance(cache, StaticCacheModel):
            output, packed = cache.logits(inputs, start, all_positions, readout)
        else:
            cache.materialize_only_last_token_logits = not all_positions
            output = forward_logits(self.model, inputs, start, inference_context=cache)
        return (None if output is None else output[..., :self.vocab_size].float()), packed

    def _from_last_stage(self, tensor, shape, dtype):
        """``tensor`` of the last pipeline stage on every stage (as is without pipeline parallelism)."""
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return tensor
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        if tensor is not None:
            buffer.copy_(tensor)
        torch.distributed.broadcast(buffer, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                    group=parallel_state.get_pipeline_model_parallel_group())
        return buffer.cpu()

    def _prompt_logprobs(self, step_logits, inputs, top):
        """Over the prefill's tokens: log p(token t | tokens before t) [b, s - 1], and the ids and log-probabilities
        of the ``top`` most likely tokens at each of those positions [b, s - 1, top]."""
        batch, positions = inputs.shape[0], inputs.shape[1] - 1
        packed = None
        if step_logits is not None:
            model_logprobs = step_logits[:, :-1].log_softmax(dim=-1)
            values = model_logprobs.gather(-1, inputs[:, 1:, None])
            best_values, best_ids = model_logprobs.topk(min(top, model_logprobs.shape[-1]), dim=-1)
            packed = torch.cat([values.double(), best_ids.double(), best_values.double()], dim=-1)
        packed = self._from_last_stage(packed, (batch, positions, 1 + 2 * top), torch.float64).cpu()
        return packed[..., 0].float(), packed[..., 1:1 + top].long(), packed[..., 1 + top:].float()

    def _draw(self, step_logits, params, generators, forced):
        """The last stage draws; every stage receives the draw, packed in one float64 tensor. Rows whose
        logits are not finite get the token ``_NON_FINITE`` and nothing is drawn (no row is, then)."""
        batch, k = forced.shape[0], min(params.topk_report, self.vocab_size)
        best = min(params.top_logprobs, self.vocab_size)
        packed = None
        if step_logits is not None:
            # The check runs where the logits are (a pass over the vocabulary is slow on the host); the draw reads
            # the one copy to the host.
            finite = torch.isfinite(step_logits[:, -1]).all(dim=-1).cpu()
            last = step_logits[:, -1].cpu()
            if finite.all():
                chosen = draw(last, params, generators, forced)
            else:
                zeros = torch.zeros(batch)
                chosen = Draw(tokens=torch.where(finite, 0, _NON_FINITE), probs=zeros, logprobs=zeros,
                              topk_ids=torch.zeros(batch, k, dtype=torch.long), topk_probs=torch.zeros(batch, k),
                              best_ids=torch.zeros(batch, best, dtype=torch.long),
                              best_logprobs=torch.zeros(batch, best))
            if parallel_state.get_pipeline_model_parallel_world_size() == 1:
                return chosen
            packed = torch.cat([chosen.tokens[:, None].double(), chosen.probs[:, None].double(),
                                chosen.logprobs[:, None].double(), chosen.topk_ids.double(),
                                chosen.topk_probs.double(), chosen.best_ids.double(),
                                chosen.best_logprobs.double()], dim=1)
        packed = self._from_last_stage(packed, (batch, 3 + 2 * k + 2 * best), torch.float64)
        columns = torch.split(packed, [1, 1, 1, k, k, best, best], dim=1)
        return Draw(tokens=columns[0][:, 0].long(), probs=columns[1][:, 0].float(), logprobs=columns[2][:, 0].float(),
                    topk_ids=columns[3].long(), topk_probs=columns[4].float(), best_ids=columns[5].long(),
                    best_logprobs=columns[6].float())
