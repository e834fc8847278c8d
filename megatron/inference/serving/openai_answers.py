"""The OpenAI-compatible routes' answers from a generation: completions and chat completions, whole or as
stream chunks, with stop strings, log-probabilities and usage counts (docs/openai_api.md)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

from megatron.inference.engine import Generation
from megatron.inference.prompts import PromptEncoder
from megatron.inference.serving.openai_requests import OpenAIRequest

_INCOMPLETE = "\ufffd"  # what a token cut inside a UTF-8 character decodes to: held back until the rest comes


class ChoiceText:
    """One choice's generated text as its tokens come: cut before the first stop string (``stopped`` then, and
    ``kept`` tokens are the ones up to the one where it begins); ``delta()`` is the text that can be sent now."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.text, self.kept, self.stopped, self._sent = "", 0, False, 0
        self._hold = max((len(stop) for stop in stops), default=1) - 1  # a stop string may still be forming

    def add(self, tokens: list[int]) -> None:
        if self.stopped:
            return
        self.tokens += tokens
        self.text, self.kept = self.tokenizer.detokenize(self.tokens), len(self.tokens)
        found = [index for index in (self.text.find(stop) for stop in self.stops) if index >= 0]
        if found:
            cut = min(found)
            self.text, self.stopped = self.text[:cut], True
            self.kept = next(count for count in range(1, len(self.tokens) + 1)
                             if len(self.tokenizer.detokenize(self.tokens[:count])) > cut)

    def delta(self, final: bool) -> str:
        """The text not sent yet that no later token can change (all of it when ``final`` or stopped)."""
        end = len(self.text)
        if not (final or self.stopped):
            end = max(self._sent, end - self._hold)
            while end > self._sent and self.text[end - 1] == _INCOMPLETE:
                end -= 1
        piece, self._sent = self.text[self._sent:end], max(self._sent, end)
        return piece


def answer_header(kind: str, model: str) -> dict:
    """The fields every answer (and every chunk of a stream) of one request shares."""
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {"id": f"{prefix}-{secrets.token_hex(12)}", "object": kind, "created": int(time.time()), "model": model}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(reason: str, text: ChoiceText) -> str:
    """OpenAI's finish reason: "stop" (the end-of-document token or a stop string) or "length"."""
    return "stop" if text.stopped else reason


def completion_logprobs(encoder: PromptEncoder, token_ids: list[int], logprobs: list[float | None],
                        best: list | None) -> dict:
    """OpenAI's completions ``logprobs``: each token's text, log-probability, most likely alternatives (text ->
    log-probability) and character offset in the text of ``token_ids``. ``best``: [[id, logprob], ...] per
    token, or None."""
    texts = [encoder.token_text(token) for token in token_ids]
    # where the text of the tokens before ends: decoded pieces need not add up (a word tokenizer's spaces)
    offsets = [len(encoder.tokenizer.detokenize(token_ids[:count])) for count in range(len(token_ids))]
    if best is None:  # no alternatives asked for: an empty one where a token has a log-probability
        best = [None if value is None else [] for value in logprobs]
    tops = [None if pairs is None else {encoder.token_text(token): value for token, value in pairs} for pairs in best]
    return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(encoder: PromptEncoder, token_ids: list[int], logprobs: list[float | None],
                  best: list | None) -> dict:
    """OpenAI's chat ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""
    def entry(token: int, value: float | None) -> dict:
        text = encoder.token_text(token)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}
    return {"content": [{**entry(token, value), "top_logprobs": [entry(t, v) for t, v in (pairs or [])]}
                        for token, value, pairs in zip(token_ids, logprobs, best or [None] * len(token_ids))]}


def _generated_logprobs(generation: Generation, row: int, kept: int) -> tuple[list, list | None]:
    """The log-probabilities (and alternatives) of a row's first ``kept`` generated tokens."""
    first = generation.prompt_lengths[row] - 1  # logprobs start at the prompt's second token
    best = generation.top_logprobs[row][first:first + kept] if generation.top_logprobs else None
    assert generation.logprobs is not None, "a request for log-probabilities generates them"
    return generation.logprobs[row][first:first + kept], best


def _answer(kind: str, generation: Generation, encoder: PromptEncoder, parsed: OpenAIRequest,
            choice: Callable[[int, list[int], int, ChoiceText], dict]) -> dict:
    """An answer whose choices ``choice(row, tokens, prompt length, ChoiceText)`` shapes (their index and finish
    reason added), with the usage counts: each prompt once, the tokens generated up to a stop string."""
    choices, generated = [], 0
    for row, tokens in enumerate(generation.tokens):
        length = generation.prompt_lengths[row]
        text = ChoiceText(encoder.tokenizer, parsed.stop)
        text.add(tokens[length:])
        generated += text.kept
        choices.append({"index": row, **choice(row, tokens, length, text),
                        "finish_reason": finish_reason(generation.finish_reasons[row], text)})
    return {**answer_header(kind, parsed.model), "choices": choices,
            "usage": usage(sum(generation.prompt_lengths[::parsed.n]), generated)}


def completion_answer(generation: Generation, encoder: PromptEncoder, parsed: OpenAIRequest) -> dict:
    """The whole answer of ``POST /v1/completions``."""
    def choice(row: int, tokens: list[int], length: int, text: ChoiceText) -> dict:
        prompt_text = encoder.tokenizer.detokenize(tokens[:length]) if parsed.echo else ""
        if parsed.logprobs is None:
            return {"text": prompt_text + text.text, "logprobs": None}
        values, best = _generated_logprobs(generation, row, text.kept)
        ids = tokens[length:length + text.kept]
        if parsed.echo:  # the prompt's tokens too; its first has no log-probability
            logprobs, top_logprobs = generation.logprobs, generation.top_logprobs
            assert logprobs is not None, "a request for log-probabilities generates them"
            ids, values = tokens[:length + text.kept], [None, *logprobs[row][:length - 1], *values]
            best = None if best is None or top_logprobs is None else [None, *top_logprobs[row][:length - 1], *best]
        return {"text": prompt_text + text.text, "logprobs": completion_logprobs(encoder, ids, values, best)}
    return _answer("text_completion", generation, encoder, parsed, choice)


def chat_answer(generation: Generation, encoder: PromptEncoder, parsed: OpenAIRequest) -> dict:
    """The whole answer of ``POST /v1/chat/completions``."""
    def choice(row: int, tokens: list[int], length: int, text: ChoiceText) -> dict:
        logprobs = None
        if parsed.logprobs is not None:
            values, best = _generated_logprobs(generation, row, text.kept)
            logprobs = chat_logprobs(encoder, tokens[length:length + text.kept], values, best)
        return {"message": {"role": "assistant", "content": text.text}, "logprobs": logprobs}
    return _answer("chat.completion", generation, encoder, parsed, choice)
