"""Rank 0's plan of the continuous batch: which prompt of which request holds which KV-cache slot, what each step
reads and decodes, and what becomes of the tokens it drew.

A request's prompts become sequences. A waiting sequence takes the lowest free slot of the data-parallel replica
with the most free slots, then reads its prompt into that slot, ``prefill_tokens`` tokens at most per step shared
by every sequence reading on a replica (a longer prompt is read in chunks over several steps, so the decoding rows
wait no more than one such chunk each step). The step that reads the prompt's last token draws its first new token;
from then on it decodes one token a step with every other decoding sequence of its replica, in one forward over the
replica's first slots (a bucket: a power of two, so that a few CUDA graphs serve every batch). A sequence leaves at
its stop token, its length, its request's cancel or a broken draw; its slot is free from the next step.

Each step's plan (``plan_step``) is one message every rank executes (megatron/inference/batcher.py); its results come
back one step later (``take_results``), while the next step runs: so the plan counts the tokens launched, not the
ones read, and a sequence that turns out to have stopped has computed one token more, never kept.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from megatron.inference.engine import Generation, NonFiniteLogits
from megatron.inference.jobs import Job, TokenEvent
from megatron.inference.sampling import Draw, DrawPlan, SamplingParams


@dataclass
class Sequence:
    """One prompt of a request: its slot once admitted, the prompt tokens read so far, the tokens launched (drawn
    on the device, maybe not read yet) and those read back."""
    request: BatchedRequest
    row: int
    prompt: list[int]
    replica: int = -1
    slot: int = -1
    read: int = 0
    launched: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    best: list = field(default_factory=list)
    finish: str | None = None

    @property
    def decoding(self) -> bool:
        """Whether the next step decodes it: its prompt is read and it may launch another token."""
        return (self.finish is None and self.read == len(self.prompt)
                and self.launched < self.request.params.tokens_to_generate)

    @property
    def position(self) -> int:
        """The position the next decode step reads for it."""
        return len(self.prompt) + self.launched - 1


@dataclass
class BatchedRequest:
    job: Job
    params: SamplingParams
    plan: DrawPlan
    sequences: list[Sequence] = field(default_factory=list)
    error: BaseException | None = None

    @property
    def ended(self) -> bool:
        return self.error is not None or all(sequence.finish is not None for sequence in self.sequences)

    def generation(self) -> Generation:
        logprobs = [sequence.logprobs for sequence in self.sequences] if self.params.logprobs else None
        best = [sequence.best for sequence in self.sequences] if self.params.logprobs and self.params.top_logprobs \
            else None
        return Generation(tokens=[sequence.prompt + sequence.tokens for sequence in self.sequences],
                          prompt_lengths=[len(sequence.prompt) for sequence in self.sequences],
                          finish_reasons=[sequence.finish or "length" for sequence in self.sequences],
                          logprobs=logprobs, top_logprobs=best)


@dataclass
class Served:
    """What the batch has done so far, for the server's progress lines."""
    requests: int = 0
    tokens: int = 0
    steps: int = 0
    prompts: list = field(default_factory=list)  # per data-parallel replica: the prompts it took

    def line(self, seconds: float, running: int, waiting: int) -> str:
        rate = self.tokens / seconds if seconds > 0 else 0.0
        replicas = f"; prompts per replica {', '.join(map(str, self.prompts))}" if len(self.prompts) > 1 else ""
        return (f"batch: {self.requests} requests served, {self.tokens} tokens in {self.steps} steps "
                f"({rate:.1f} tokens/s); {running} prompts running, {waiting} waiting{replicas}")


@dataclass
class _Launched:
    """What one step launched, per replica, to read its results by: the sequences of its prefill rows (and which
    of them drew) and of its decode rows, the plans."""
    prefill: dict = field(default_factory=dict)   # replica -> [(sequence, drew, start, count)]
    scored: dict = field(default_factory=dict)    # replica -> whether the prefill scored its positions
    decode: dict = field(default_factory=dict)    # replica -> [sequence] by slot order
    plans: dict = field(default_factory=dict)     # replica -> (prefill plan, decode plan)


class BatchSchedule:
    """``replicas`` data-parallel replicas of ``slots`` slots over ``length`` positions each."""

    def __init__(self, replicas: int, slots: int, length: int, prefill_tokens: int, vocab_size: int, eod: int,
                 key_length):
        self.replicas, self.slots, self.length = replicas, slots, length
        self.prefill_tokens, self.vocab_size, self.eod = prefill_tokens, vocab_size, eod
        self.key_length = key_length  # end -> the keys a decode step reads (the slot cache's buckets)
        self.waiting: list[Sequence] = []
        self.holding: dict[tuple[int, int], Sequence] = {}  # (replica, slot) -> sequence
        self.requests: list[BatchedRequest] = []
        self._clear: set[tuple[int, int]] = set()   # slots a broken sequence held: zeroed before reuse
        self._free: set[tuple[int, int]] = set()    # slots freed since the last step: parked by it
        self._in_flight: collections.deque[_Launched] = collections.deque()  # steps whose results are not read
        self.served = Served(prompts=[0] * replicas)

    # -- requests in and out --------------------------------------------------------------------------------
    def add(self, job: Job, params: SamplingParams, plan: DrawPlan) -> None:
        request = BatchedRequest(job, params, plan)
        request.sequences = [Sequence(request, row, list(prompt)) for row, prompt in enumerate(job.payload["prompts"])]
        self.requests.append(request)
        if params.tokens_to_generate == 0 and not params.logprobs:
            for sequence in request.sequences:
                sequence.finish = "length"
            return
        self.waiting.extend(request.sequences)

    @property
    def busy(self) -> bool:
        return bool(self.requests)

    def cancel(self, request: BatchedRequest) -> None:
        """End ``request`` with what it has ("cancelled" for its unfinished prompts)."""
        for sequence in request.sequences:
            if sequence.finish is None:
                sequence.finish = "cancelled"
        self._release(request)

    def finished_requests(self) -> list[BatchedRequest]:
        """The requests that ended since the last call, taken out of the schedule (their slots already free)."""
        done = [request for request in self.requests if request.ended]
        for request in done:
            self._release(request)
            self.served.requests += 1
        self.requests = [request for request in self.requests if not request.ended]
        return done

    def _release(self, request: BatchedRequest) -> None:
        self.waiting = [sequence for sequence in self.waiting if sequence.request is not request]
        for sequence in request.sequences:
            key = (sequence.replica, sequence.slot)
            if self.holding.get(key) is sequence:
                del self.holding[key]
                self._free.add(key)

    # -- the next step ----------------------------------------------------------------------------------------
    def plan_step(self, admitting: bool = True) -> dict:
        self.served.steps += 1
        return self._plan_step(admitting)

    def _plan_step(self, admitting: bool) -> dict:
        """The message every rank executes for the next step (see batcher.py); ``admitting``: new sequences may
        take slots (False while a generation waits to hold the model alone)."""
        replicas: dict[int, dict[str, Any]] = {
            replica: {"admit": [], "free": [], "clear": [], "prefill": None, "decode": None}
            for replica in range(self.replicas)}
        for replica, slot in sorted(self._free):
            replicas[replica]["clear" if (replica, slot) in self._clear else "free"].append(slot)
        self._clear -= self._free
        self._free = set()
        if admitting:
            self._admit(replicas)
        launched = _Launched()
        reading = sorted((sequence for sequence in self.holding.values() if sequence.read < len(sequence.prompt)),
                         key=lambda sequence: (sequence.replica, sequence.slot))
        for replica, sequences in itertools.groupby(reading, key=lambda sequence: sequence.replica):
            self._plan_prefill(replica, list(sequences), replicas[replica], launched)
        for replica in range(self.replicas):
            self._plan_decode(replica, replicas[replica], launched)
        self._in_flight.append(launched)
        return {"kind": "batch", "replicas": replicas}

    def _admit(self, replicas):
        free = {replica: sorted(set(range(self.slots)) - {slot for r, slot in self.holding if r == replica})
                for replica in range(self.replicas)}
        for sequence in list(self.waiting):
            replica = max(range(self.replicas), key=lambda r: len(free[r]))
            if not free[replica]:
                break
            sequence.replica, sequence.slot = replica, free[replica].pop(0)
            self.served.prompts[replica] += 1
            self.holding[(replica, sequence.slot)] = sequence
            self.waiting.remove(sequence)
            replicas[replica]["admit"].append((sequence.slot, asdict(sequence.request.params), sequence.row))

    def _plan_prefill(self, replica, sequences, part, launched):
        """Chunks of the prompts being read on ``replica``, within the step's prefill budget (at least one chunk)."""
        rows, budget = [], self.prefill_tokens
        for sequence in sequences:
            if budget <= 0:
                break
            count = min(len(sequence.prompt) - sequence.read, max(budget, 1))
            drew = sequence.read + count == len(sequence.prompt) and sequence.request.params.tokens_to_generate > 0
            rows.append((sequence, drew, sequence.read, count))
            budget -= count
        scored = any(sequence.request.params.logprobs for sequence, *_ in rows)
        plan = _union(sequence.request.plan for sequence, *_ in rows)
        part["prefill"] = {
            "slots": [sequence.slot for sequence, *_ in rows], "starts": [start for *_, start, _ in rows],
            "counts": [count for *_, count in rows], "draw": [drew for _, drew, *_ in rows],
            "tokens": [sequence.prompt[start:start + count] for sequence, _, start, count in rows],
            # the token each read position predicts (scoring): the prompt's next, -1 past the prompt
            "targets": [sequence.prompt[start + 1:start + count + 1] for sequence, _, start, count in rows]
            if scored else None, "plan": asdict(plan), "best": max(seq.request.params.top_logprobs for seq, *_ in rows)}
        for sequence, drew, _, count in rows:
            sequence.read += count
            sequence.launched += drew
        launched.prefill[replica] = rows
        launched.scored[replica] = scored
        launched.plans[replica] = (plan, None)

    def _plan_decode(self, replica, part, launched):
        # A sequence whose last prompt chunk this very step reads decodes in it too: the prefill comes first.
        decoding = [sequence for (r, _), sequence in self.holding.items() if r == replica and sequence.decoding]
        if not decoding:
            return
        highest = max(sequence.slot for sequence in decoding)
        bucket = min(1 << highest.bit_length(), self.slots)
        end = max(sequence.position for sequence in decoding) + 1
        plan = _union(sequence.request.plan for sequence in decoding)
        part["decode"] = {"bucket": bucket, "key_length": self.key_length(end), "plan": asdict(plan)}
        for sequence in decoding:
            sequence.launched += 1
        launched.decode[replica] = sorted(decoding, key=lambda sequence: sequence.slot)
        prefill_plan = launched.plans.get(replica, (None, None))[0]
        launched.plans[replica] = (prefill_plan, plan)

    # -- the results of the step before -----------------------------------------------------------------------
    def take_results(self, results: dict) -> None:
        """``results``: replica -> {"prefill": packed draws [k, width], "scores": [k, n, 1 + 2 best] or None,
        "decode": packed draws [bucket, width]} (numpy, on the host) of the oldest step whose results are not read."""
        launched = self._in_flight.popleft()
        for replica, part in results.items():
            prefill_plan, decode_plan = launched.plans.get(replica, (None, None))
            prefill_draws = _Draws(part["prefill"], prefill_plan) if "prefill" in part else None
            decode_draws = _Draws(part["decode"], decode_plan) if "decode" in part else None
            if replica in launched.prefill:
                rows = launched.prefill[replica]
                scores = part.get("scores")
                for index, (sequence, drew, start, count) in enumerate(rows):
                    if scores is not None and sequence.request.params.logprobs:
                        self._score(sequence, scores[index], start, count)
                    if sequence.read == len(sequence.prompt) and sequence.request.params.tokens_to_generate == 0:
                        self._end(sequence, "length")  # scored, nothing to generate
                    if drew:
                        assert prefill_draws is not None, "a step that drew for a prompt returns its prefill draws"
                        self._take(sequence, prefill_draws, index)
            for sequence in launched.decode.get(replica, []):
                assert decode_draws is not None, "a step that decoded returns its decode draws"
                self._take(sequence, decode_draws, sequence.slot)

    def _score(self, sequence, values, start, count):
        """The prompt positions' log-probabilities of their next prompt tokens (and the best tokens there)."""
        best = sequence.request.params.top_logprobs
        for offset in range(count):
            if start + offset + 1 >= len(sequence.prompt):
                break
            sequence.logprobs.append(float(values[offset, 0]))
            if best:
                ids, logprobs = values[offset, 1:1 + best], values[offset, 1 + best:1 + 2 * best]
                sequence.best.append([[int(token), float(value)] for token, value in zip(ids, logprobs)])

    def _take(self, sequence: Sequence, draws: _Draws, index: int):
        """The token drawn for ``sequence`` in row ``index`` of ``draws``, unless it already ended (a step launched
        before its end was read)."""
        request = sequence.request
        if sequence.finish is not None or request.error is not None:
            return
        token = int(draws.tokens[index])
        if token == Draw.NON_FINITE:
            request.error = NonFiniteLogits([request.params.first_prompt + sequence.row],
                                            len(sequence.prompt) + len(sequence.tokens))
            # Every slot the request holds may keep NaNs (each of its prompts met the same weights): zeroed.
            self._clear.update((other.replica, other.slot) for other in request.sequences
                               if self.holding.get((other.replica, other.slot)) is other)
            self._release(request)
            return
        sequence.tokens.append(token)
        self.served.tokens += 1
        params = request.params
        logprob = float(draws.logprobs[index])
        best = draws.best(index, params.top_logprobs)
        if params.logprobs:
            sequence.logprobs.append(logprob)
            if params.top_logprobs:
                sequence.best.append(best)
        if request.job.stream is not None:
            request.job.stream(TokenEvent(sequence.row, token, logprob, best))
        if token == self.eod or token in params.stop_tokens:
            self._end(sequence, "stop")
        elif len(sequence.tokens) == params.tokens_to_generate:
            self._end(sequence, "length")

    def _end(self, sequence, reason):
        sequence.finish = reason
        key = (sequence.replica, sequence.slot)
        if self.holding.get(key) is sequence:
            del self.holding[key]
            self._free.add(key)


def _union(plans) -> DrawPlan:
    plans = list(plans)
    result = plans[0]
    for plan in plans[1:]:
        result = result.union(plan)
    return result


class _Draws:
    """One step's packed draws (numpy, sampling.py's layout) read row by row without unpacking each row."""

    def __init__(self, packed: np.ndarray, plan: DrawPlan):
        self.tokens, self.logprobs = packed[:, 0].astype(np.int64), packed[:, 2]
        start = 3 + 2 * plan.report
        self._best_ids = packed[:, start:start + plan.best].astype(np.int64)
        self._best_logprobs = packed[:, start + plan.best:start + 2 * plan.best]

    def best(self, index: int, count: int) -> list:
        """[[token id, log-probability], ...] of the model's ``count`` most likely tokens at row ``index``."""
        return [[int(token), float(value)] for token, value in
                zip(self._best_ids[index, :count], self._best_logprobs[index, :count])]
