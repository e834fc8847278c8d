"""OpenAI request bodies (``POST /v1/completions``, ``POST /v1/chat/completions``) checked field by field and
translated into the server's own request (megatron/inference/requests.py), so that the limits, the prompt
encoding and the sampling are the ones ``PUT /api`` and the WebSocket use. docs/openai_api.md lists the fields."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from megatron.inference.errors import ProtocolError
from megatron.inference.requests import MAX_SEED, Field, check_fields

MAX_STOP_STRINGS = 4  # as OpenAI

# Fields both routes take.
_COMMON_FIELDS = {
    "model": Field("str"),
    "temperature": Field("float", 1.0, nullable=True, low=0.0, high=2.0),
    "top_p": Field("float", 1.0, nullable=True, low=1e-6, high=1.0),
    "top_k": Field("int", None, nullable=True, low=-1),  # vLLM's extension; -1 or 0: off
    "seed": Field("int", None, nullable=True, low=0, high=MAX_SEED),
    "n": Field("int", 1, nullable=True, low=1),
    "stream": Field("bool", False, nullable=True),
    "stream_options": Field("object", None, nullable=True),
    "user": Field("str", None, nullable=True),  # the caller's name for itself: not used
}
COMPLETION_FIELDS = {**_COMMON_FIELDS,
                     "max_tokens": Field("int", 16, nullable=True, low=0),
                     "logprobs": Field("int", None, nullable=True, low=0, high=5),
                     "echo": Field("bool", False, nullable=True)}
CHAT_FIELDS = {**_COMMON_FIELDS,
               "max_tokens": Field("int", None, nullable=True, low=1),
               "max_completion_tokens": Field("int", None, nullable=True, low=1),
               "logprobs": Field("bool", False, nullable=True),
               "top_logprobs": Field("int", None, nullable=True, low=0, high=20)}
_CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class OpenAIRequest:
    """``request``: the server's own request (prompts repeated ``n`` times in a row: choice ``i`` is prompt
    ``i // n``); what the answer needs besides."""
    request: dict
    model: str
    n: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    echo: bool = False
    logprobs: int | None = None  # None: no logprobs in the answer; k: with the k most likely tokens at each


def _shown(value: Any) -> str:
    return json.dumps(value)[:40]


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                           for x in value)


def _prompts(value: Any) -> list:
    """OpenAI's ``prompt``: a text, a list of texts, token ids, or a list of token-id lists."""
    if isinstance(value, str) or _is_token_ids(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(x, str) or _is_token_ids(x) for x in value):
        return value
    raise ProtocolError("bad_field", f"prompt must be a string, a list of strings, a list of token ids or a list of "
                        f"token-id lists, none empty; not {_shown(value)}", "prompt")


def _stop(value: Any) -> tuple[str, ...]:
    stops = [] if value is None else [value] if isinstance(value, str) else value
    if not (isinstance(stops, list) and len(stops) <= MAX_STOP_STRINGS
            and all(isinstance(stop, str) and stop for stop in stops)):
        raise ProtocolError("bad_field", f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} "
                            f"of them, not {_shown(value)}", "stop")
    return tuple(stops)


def _message_text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of {"type": "text", "text"} parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)
    raise ProtocolError("bad_field", f"{where}.content must be a string or a list of text parts "
                        f'({{"type": "text", "text": ...}}), not {_shown(content)}', "messages")


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ProtocolError("bad_field", "messages must be a non-empty list of {\"role\", \"content\"} objects",
                            "messages")
    conversation = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in _CHAT_ROLES:
            raise ProtocolError("bad_field", f"{where} must be an object whose role is one of "
                                f"{', '.join(_CHAT_ROLES)}", "messages")
        conversation.append({"role": message["role"], "content": _message_text(message.get("content"), where)})
    return conversation


def _checked(body: Any, fields: dict[str, Field], shaped: tuple[str, ...], route: str) -> dict:
    """``body``'s ``fields`` checked; ``shaped`` fields (which take more than one shape) are the caller's to check."""
    if not isinstance(body, dict):
        raise ProtocolError("bad_json", "the body must be a JSON object")
    for name in body:
        if name not in fields and name not in shaped:
            raise ProtocolError("bad_field", f"{name} is not supported by {route} here; leave it out "
                                "(docs/openai_api.md lists the fields)", name)
    checked = check_fields({name: value for name, value in body.items() if name in fields}, fields)
    options = checked["stream_options"] or {}
    if set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
        raise ProtocolError("bad_field", 'stream_options must be {"include_usage": true or false}', "stream_options")
    if options and not checked["stream"]:
        raise ProtocolError("bad_field", "stream_options needs stream true", "stream_options")
    return checked


def _sampling(checked: dict) -> dict:
    """OpenAI's sampling fields -> the server's: temperature 0 is greedy, top_p 1 and top_k -1 or 0 are off."""
    top_k = checked["top_k"] or 0
    top_p = 1.0 if checked["top_p"] is None else checked["top_p"]
    temperature = 1.0 if checked["temperature"] is None else checked["temperature"]
    if temperature == 0.0:
        temperature, top_k, top_p = 1.0, 1, 1.0
    if top_k > 0 and top_p < 1.0:
        raise ProtocolError("bad_field", "top_k and top_p cannot both be set; use one of them", "top_p")
    return {"temperature": temperature, "top_k": max(top_k, 0), "top_p": 0.0 if top_p == 1.0 else top_p,
            "add_BOS": False, "stop_tokens": [], "random_seed": checked["seed"]}


def _answer_options(checked: dict) -> dict:
    return {"model": checked["model"], "n": checked["n"] or 1, "stream": bool(checked["stream"]),
            "include_usage": bool((checked["stream_options"] or {}).get("include_usage"))}


def _own_request(checked: dict, prompts: list, chat: bool, max_tokens: int | None, logprobs: int | None) -> dict:
    n = checked["n"] or 1
    return {**_sampling(checked), "prompts": [prompt for prompt in prompts for _ in range(n)], "chat": chat,
            "tokens_to_generate": max_tokens, "logprobs": logprobs is not None, "top_logprobs": logprobs or 0}


def parse_completion(body: Any) -> OpenAIRequest:
    """A ``POST /v1/completions`` body -> OpenAIRequest; ProtocolError naming the field otherwise."""
    checked = _checked(body, COMPLETION_FIELDS, ("prompt", "stop"), "/v1/completions")
    if "prompt" not in body:
        raise ProtocolError("bad_field", "prompt is required", "prompt")
    prompts, stop = _prompts(body["prompt"]), _stop(body.get("stop"))
    max_tokens = 16 if checked["max_tokens"] is None else checked["max_tokens"]
    if checked["echo"] and checked["stream"]:
        raise ProtocolError("bad_field", "echo is not supported with stream here; send one of them", "echo")
    request = _own_request(checked, prompts, False, max_tokens, checked["logprobs"])
    return OpenAIRequest(request=request, stop=stop, echo=bool(checked["echo"]), logprobs=checked["logprobs"],
                         **_answer_options(checked))


def parse_chat(body: Any) -> OpenAIRequest:
    """A ``POST /v1/chat/completions`` body -> OpenAIRequest; ProtocolError naming the field otherwise."""
    checked = _checked(body, CHAT_FIELDS, ("messages", "stop"), "/v1/chat/completions")
    if "messages" not in body:
        raise ProtocolError("bad_field", "messages is required", "messages")
    conversation, stop = _messages(body["messages"]), _stop(body.get("stop"))
    if checked["top_logprobs"] is not None and not checked["logprobs"]:
        raise ProtocolError("bad_field", "top_logprobs needs logprobs true", "top_logprobs")
    logprobs = (checked["top_logprobs"] or 0) if checked["logprobs"] else None
    max_tokens = checked["max_completion_tokens"] or checked["max_tokens"]  # None: what the limits allow
    request = _own_request(checked, [conversation], True, max_tokens, logprobs)
    return OpenAIRequest(request=request, stop=stop, logprobs=logprobs, **_answer_options(checked))
