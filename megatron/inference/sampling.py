"""Choosing the next token: temperature, then top-k or top-p, then a seeded draw (Megatron-LM's order).

Sampling runs on CPU in float32 over logits that every layout computes alike (gathered over tensor
parallelism, cut to the tokenizer's vocabulary), so the same seed draws the same tokens at every TP/PP/DP
layout and on CPU or GPU. Each prompt of a request draws from a stream of its own (``prompt_generators``):
prompt i's generator is seeded ``random_seed + i * 2**31`` (distinct for every seed and index, as seeds are
below 2**31; prompt 0 uses the seed itself) and advances once per token sampled for that prompt, never for
a prompt token being read. So a prompt's tokens do not depend on the other prompts of its batch, which lets
data-parallel replicas each generate a share of a request's prompts and still give the one-replica answer.
"""

from dataclasses import dataclass

import torch


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


@dataclass
class Draw:
    """One step's choice for every row: ``tokens`` [b], the sampled distribution's probability of each
    (``probs``), the unmodified model's log-probability (``logprobs``), and the sampled distribution's
    top candidates (``topk_ids``/``topk_probs`` [b, k], best first), and the unmodified model's most likely tokens
    (``best_ids``/``best_logprobs`` [b, params.top_logprobs], best first: what OpenAI's ``top_logprobs`` report)."""
    tokens: torch.Tensor
    probs: torch.Tensor
    logprobs: torch.Tensor
    topk_ids: torch.Tensor
    topk_probs: torch.Tensor
    best_ids: torch.Tensor
    best_logprobs: torch.Tensor


def sampling_distribution(logits, params):
    """[b, vocab] float32 logits -> [b, vocab] probabilities of the distribution actually sampled from."""
    if params.top_k == 1:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    scaled = logits / params.temperature
    if params.top_k > 1:
        kth = scaled.topk(min(params.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    elif params.top_p > 0.0:
        ordered, order = scaled.sort(dim=-1, descending=True)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        # Keep the smallest prefix reaching top_p: a token goes when the tokens before it already reach it.
        drop = (cumulative - ordered.softmax(dim=-1)) >= params.top_p
        scaled = scaled.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return scaled.softmax(dim=-1)


def prompt_generators(params, count):
    """One generator per prompt of ``count`` prompts starting at the request's ``params.first_prompt``."""
    return [torch.Generator().manual_seed(params.random_seed + (params.first_prompt + row) * 2**31)
            for row in range(count)]


def draw(logits, params, generators, forced=None):
    """Sample one token per row of ``logits`` [b, vocab], row r from ``generators[r]``; rows where ``forced``
    [b] is >= 0 take that token (a prompt token still being read), draw nothing and report its probabilities."""
    logits = logits.float().cpu()
    probs = sampling_distribution(logits, params)
    tokens = torch.full((probs.shape[0],), -1, dtype=torch.long) if forced is None else forced.cpu().clone()
    for row in (tokens < 0).nonzero().flatten().tolist():
        if params.top_k == 1:  # the one-hot's token: what multinomial would draw, without its pass over the vocabulary
            tokens[row] = int(probs[row].argmax())
        else:
            tokens[row] = torch.multinomial(probs[row], 1, generator=generators[row]).item()
    k = min(params.topk_report, probs.shape[-1])
    topk_probs, topk_ids = probs.topk(k, dim=-1)
    rows = torch.arange(tokens.shape[0])
    model_logprobs = logits.log_softmax(dim=-1)
    best_logprobs, best_ids = model_logprobs.topk(min(params.top_logprobs, probs.shape[-1]), dim=-1)
    return Draw(tokens=tokens, probs=probs[rows, tokens], logprobs=model_logprobs[rows, tokens],
                topk_ids=topk_ids, topk_probs=topk_probs, best_ids=best_ids, best_logprobs=best_logprobs)
