"""Choosing the next token on the device: temperature, then top-k or top-p, then a seeded draw (Megatron-LM's order).

The draw runs where the logits are, as tensor ops of fixed shapes with no host sync, so a CUDA graph of a decode step
holds it (megatron/inference/slot_cache.py): the host reads one small packed tensor per step, the tokens and what is
reported about them, instead of the logits over the whole vocabulary. Rows of one step may belong to different
requests, so every sampling parameter is per row (``RowParams``, one entry per KV-cache slot).

The draw is the Gumbel-max trick: a token is the argmax of its log-probability plus Gumbel noise, which samples the
softmax exactly. The noise of (row, token) is a counter-based hash of the row's seed, the number of tokens the row has
sampled so far and the token id, not a generator's state: so a row draws the same tokens whatever else is in its
batch, whichever replica or slot runs it, on CPU or GPU, and a graph replays it without RNG state. Prompt i of a
request is seeded ``random_seed + i * 2**31`` (distinct for every seed and index, as seeds are below 2**31) and
advances once per token sampled for it, never for a prompt token being read: a prompt's tokens do not depend on the
other prompts of its request, which lets data-parallel replicas each generate a share of a request's prompts and
still give the one-replica answer.
"""

from dataclasses import dataclass

import torch

_NON_FINITE = -2  # the token of a row whose logits are not finite: nothing is drawn for it
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0        # 0: off, 1: greedy
    top_p: float = 0.0    # 0: off
    random_seed: int = 0
    stop_tokens: tuple = ()
    tokens_to_generate: int = 32
    topk_report: int = 5  # how many candidates of the sampled distribution each step reports
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: how many of the model's most likely tokens each position reports
    first_prompt: int = 0  # the request's index of the first prompt generated here (a replica's share)

    def prompt_seed(self, row: int) -> int:
        """The seed of the request's prompt ``row`` of this share."""
        return self.random_seed + (self.first_prompt + row) * 2**31


@dataclass
class Draw:
    """One step's choice for every row: ``tokens`` [b], the sampled distribution's probability of each
    (``probs``), the unmodified model's log-probability (``logprobs``), and the sampled distribution's
    top candidates (``topk_ids``/``topk_probs`` [b, k], best first), and the unmodified model's most likely tokens
    (``best_ids``/``best_logprobs`` [b, params.top_logprobs], best first: what OpenAI's ``top_logprobs`` report).
    A row whose logits were not finite has the token ``NON_FINITE`` and zeros."""
    tokens: torch.Tensor
    probs: torch.Tensor
    logprobs: torch.Tensor
    topk_ids: torch.Tensor
    topk_probs: torch.Tensor
    best_ids: torch.Tensor
    best_logprobs: torch.Tensor

    NON_FINITE = _NON_FINITE


@dataclass(frozen=True)
class DrawPlan:
    """What a step's draw computes: it fixes the shapes, so a graph is kept per plan. ``report``: the sampled
    distribution's top candidates per row; ``best``: the model's most likely tokens per row; ``sampling``: some row
    samples (else every row is greedy and nothing is sorted); ``forced``: rows may take a given token instead."""
    report: int
    best: int
    sampling: bool
    forced: bool = False

    @property
    def width(self) -> int:
        return 3 + 2 * self.report + 2 * self.best

    @staticmethod
    def of(params: SamplingParams, vocab_size: int, forced: bool = False) -> "DrawPlan":
        return DrawPlan(min(params.topk_report, vocab_size), min(params.top_logprobs, vocab_size) if
                        params.logprobs else 0, params.top_k != 1, forced)

    def union(self, other: "DrawPlan") -> "DrawPlan":
        """The plan that serves the rows of both (a batch of requests)."""
        return DrawPlan(max(self.report, other.report), max(self.best, other.best), self.sampling or other.sampling,
                        self.forced or other.forced)


class RowParams:
    """The sampling parameters of every KV-cache slot, on the device; ``sampled`` counts the tokens each slot's row
    has sampled (the noise's counter), advanced by the draw itself."""

    def __init__(self, slots: int, device: torch.device):
        self.temperature = torch.ones(slots, device=device)
        self.top_k = torch.ones(slots, dtype=torch.long, device=device)
        self.top_p = torch.zeros(slots, device=device)
        self.seed = torch.zeros(slots, dtype=torch.long, device=device)
        self.sampled = torch.zeros(slots, dtype=torch.long, device=device)

    def set(self, slots: list[int], params: SamplingParams, rows: list[int]) -> None:
        """Slot ``slots[i]`` draws for the request's prompt ``rows[i]`` from now on, counting from zero."""
        index = torch.tensor(slots, device=self.seed.device)
        count = len(slots)
        for tensor, values in ((self.temperature, [float(params.temperature)] * count),
                               (self.top_k, [params.top_k] * count), (self.top_p, [params.top_p] * count),
                               (self.seed, [params.prompt_seed(row) for row in rows]), (self.sampled, [0] * count)):
            tensor.index_copy_(0, index, torch.tensor(values, dtype=tensor.dtype, device=tensor.device))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer over int64 tensors holding 32-bit values (the products wrap; the mask keeps their
    low 32 bits, the same on every device)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [b, n] of each row's ``tokens`` [b, n] ids, from its seed [b] and counter [b]."""
    row = _mix32((seeds & _MASK32) ^ _mix32(((seeds >> 32) + 0x9E3779B9) & _MASK32))
    step = _mix32(row ^ _mix32((counters + 0x7F4A7C15) & _MASK32))
    bits = _mix32(step[:, None] ^ _mix32((tokens + 0x2545F491) & _MASK32)) >> 8  # 24 bits: exact in float32
    uniform = (bits.float() + 0.5) / float(1 << 24)
    return -torch.log(-torch.log(uniform))


def draw(logits: torch.Tensor, rows: slice | torch.Tensor, params: RowParams, plan: DrawPlan,
         forced: torch.Tensor | None = None, kept: torch.Tensor | None = None) -> torch.Tensor:
    """The draw of ``logits`` [b, vocab] (float32, over the tokenizer's vocabulary) for slots ``rows``, packed
    [b, plan.width] float32: token, its probability in the sampled distribution, the model's log-probability of it,
    ``plan.report`` candidate ids and probabilities, ``plan.best`` model's best ids and log-probabilities
    (``unpack`` reads it). Rows where ``forced`` [b] is >= 0 take that token (a prompt token still being read),
    sample nothing and report its probabilities. Advances ``params.sampled`` of the rows that sampled, of those
    where ``kept`` [b] is True if given (the others' draws are thrown away: a prompt not read whole yet)."""
    batch, vocab = logits.shape
    finite = torch.isfinite(logits).all(dim=-1)
    logits = torch.where(finite[:, None], logits, torch.zeros_like(logits))
    model_logprobs = logits.log_softmax(dim=-1)
    greedy_tokens = logits.argmax(dim=-1)
    top_k = params.top_k[rows]
    if plan.sampling:
        scaled = logits / params.temperature[rows, None]
        ordered, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)
        keep = (top_k[:, None] <= 1) | (ranks[None, :] < top_k[:, None])
        top_p = params.top_p[rows, None]
        full = ordered.softmax(dim=-1)
        # Keep the smallest prefix reaching top_p: a token goes when the tokens before it already reach it.
        drop = (top_k[:, None] == 0) & (top_p > 0) & ((full.cumsum(dim=-1) - full) >= top_p)
        masked = ordered.masked_fill(~keep | drop, float("-inf"))
        dist = masked.softmax(dim=-1)  # the sampled distribution, in ``order``
        noise = gumbel_noise(params.seed[rows], params.sampled[rows], order)
        picked = (masked + noise).argmax(dim=-1, keepdim=True)
        sampled_tokens = order.gather(-1, picked)[:, 0]
        greedy = top_k == 1
        tokens = torch.where(greedy, greedy_tokens, sampled_tokens)
        report_ids = torch.where(greedy[:, None], logits.topk(plan.report, dim=-1).indices, order[:, :plan.report])
        one_hot_report = torch.zeros(batch, plan.report, device=logits.device)
        one_hot_report[:, 0] = 1.0
        report_probs = torch.where(greedy[:, None], one_hot_report, dist[:, :plan.report])
        if plan.forced:
            probs_of = torch.zeros_like(dist).scatter(-1, order, dist)  # the distribution in vocabulary order
        else:
            probs_of = None
        token_probs = torch.where(greedy, 1.0, dist.gather(-1, picked)[:, 0])
    else:
        tokens = greedy_tokens
        report_ids = logits.topk(plan.report, dim=-1).indices
        report_probs = torch.zeros(batch, plan.report, device=logits.device)
        report_probs[:, 0] = 1.0
        probs_of = None
        token_probs = torch.ones(batch, device=logits.device)
    sampling_rows = finite
    if plan.forced:
        assert forced is not None, "a plan with forced rows is drawn with their tokens"
        reading = forced >= 0
        tokens = torch.where(reading, forced, tokens)
        sampling_rows = finite & ~reading
        if probs_of is None:
            forced_probs = (tokens == greedy_tokens).float()
        else:
            forced_probs = torch.where(top_k == 1, (tokens == greedy_tokens).float(),
                                       probs_of.gather(-1, tokens[:, None])[:, 0])
        token_probs = torch.where(reading, forced_probs, token_probs)
    if kept is not None:
        sampling_rows = sampling_rows & kept
    params.sampled[rows] += sampling_rows.long()
    columns = [tokens[:, None].float(), token_probs[:, None], model_logprobs.gather(-1, tokens[:, None]),
               report_ids.float(), report_probs]
    if plan.best:
        best_logprobs, best_ids = model_logprobs.topk(plan.best, dim=-1)
        columns += [best_ids.float(), best_logprobs]
    packed = torch.cat(columns, dim=1)
    return torch.where(finite[:, None], packed, _non_finite_row(plan, logits.device))


def _non_finite_row(plan: DrawPlan, device: torch.device) -> torch.Tensor:
    row = torch.zeros(1, plan.width, device=device)
    row[0, 0] = _NON_FINITE
    return row


def unpack(packed: torch.Tensor, plan: DrawPlan) -> Draw:
    """The Draw of ``packed`` [b, plan.width] (on the host)."""
    columns = torch.split(packed, [1, 1, 1, plan.report, plan.report, plan.best, plan.best], dim=1)
    return Draw(tokens=columns[0][:, 0].long(), probs=columns[1][:, 0], logprobs=columns[2][:, 0],
                topk_ids=columns[3].long(), topk_probs=columns[4], best_ids=columns[5].long(),
                best_logprobs=columns[6])
