"""Generation requests checked field by field before anything acts on them: Megatron-LM's REST body
(``PUT /api``) here, and the declarative field table that MegaScope's WebSocket messages (megascope/wire.py)
are checked with too. Nothing a client sends is ever evaluated. The REST format is documented in
docs/megascope_protocol.md ("REST API")."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron.inference.errors import ProtocolError

MAX_SEED = 2**31 - 1
_REQUIRED = object()


@dataclass(frozen=True)
class Field:
    """One field of a message: `kind` is int, float, bool, str, id, str_list, int_list, object, object_list."""
    kind: str
    default: object = _REQUIRED
    nullable: bool = False
    low: float | None = None
    high: float | None = None
    choices: tuple = ()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def valid_id(value: object) -> bool:
    """Whether ``value`` may be a message's ``id``: a string of at most 64 characters or an integer."""
    return (isinstance(value, str) and len(value) <= 64) or _is_int(value)


_KIND_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (_is_int, "an integer"),
    "float": (lambda v: _is_int(v) or (isinstance(v, float) and math.isfinite(v)), "a finite number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "id": (valid_id, "a string (at most 64 characters) or an integer"),
    "str_list": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "int_list": (lambda v: isinstance(v, list) and all(_is_int(x) for x in v), "a list of integers"),
    "object": (lambda v: isinstance(v, dict), "a JSON object"),
    "object_list": (lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v), "a list of JSON objects"),
}

# What every generation request says about its prompts and sampling (REST and WebSocket alike).
SAMPLING_FIELDS = {
    "prompts": Field("str_list"),
    "temperature": Field("float", 1.0, low=1e-6, high=100.0),
    "top_k": Field("int", 0, low=0),
    "top_p": Field("float", 0.0, low=0.0, high=1.0),
    "add_BOS": Field("bool", False),
    "stop_tokens": Field("int_list", [], low=0),
    "chat": Field("bool", False),
}

# Megatron-LM's REST API (PUT /api). Its fields we do not implement are refused by name.
REST_FIELDS = {**SAMPLING_FIELDS,
               "tokens_to_generate": Field("int", 64, low=0),
               "logprobs": Field("bool", False),
               "random_seed": Field("int", -1, low=-1, high=MAX_SEED),
               "stop_token": Field("int", None, nullable=True, low=0)}
REST_UNSUPPORTED = ("top_p_decay", "top_p_bound", "beam_width", "length_penalty", "stop_on_eol",
                    "stop_on_double_eol", "prevent_newline_after_colon", "no_log")


def _bounds(field: Field) -> str:
    """A field's allowed range in words: "between 0 and 1", "at least 0", "at most 9"."""
    if field.low is not None and field.high is not None:
        return f"between {field.low} and {field.high}"
    return f"at least {field.low}" if field.low is not None else f"at most {field.high}"


def check_fields(obj: dict, fields: dict[str, Field], prefix: str = "") -> dict:
    """``obj`` with every field of ``fields`` checked and defaults filled in; ProtocolError otherwise."""
    out = {}
    for name in obj:
        if name not in fields and name != "type" and name != "id":
            raise ProtocolError("bad_field", f"unknown field {prefix}{name!r}; see docs/megascope_protocol.md",
                                prefix + name)
    for name, field in fields.items():
        where = prefix + name
        if name not in obj:
            if field.default is _REQUIRED:
                raise ProtocolError("bad_field", f"{where} is required", where)
            out[name] = list(field.default) if isinstance(field.default, list) else field.default
            continue
        value = obj[name]
        if value is None and field.nullable:
            out[name] = None
            continue
        check, expected = _KIND_CHECKS[field.kind]
        if not check(value):
            raise ProtocolError("bad_field", f"{where} must be {expected}, not {json.dumps(value)[:40]}", where)
        if field.kind == "float":
            value = float(value)
        numbers = value if field.kind == "int_list" else [value] if field.kind in ("int", "float") else []
        for number in numbers:
            if (field.low is not None and number < field.low) or (field.high is not None and number > field.high):
                raise ProtocolError("bad_field", f"{where} must be {_bounds(field)}, not {number}", where)
        if field.choices and value not in field.choices:
            raise ProtocolError("bad_field", f"{where} must be one of {', '.join(field.choices)}", where)
        out[name] = value
    if "id" in obj and "id" not in fields:
        if not valid_id(obj["id"]):
            raise ProtocolError("bad_field", "id must be a string (at most 64 characters) or an integer", "id")
        out["id"] = obj["id"]
    return out


def load_json(data: str | bytes, what: str = "message") -> Any:
    """A client's JSON text (``what``: "message", "body") -> the value, or ProtocolError("bad_json") saying
    what is wrong with it."""
    try:
        return json.loads(data)
    except RecursionError:  # the parser recurses once per bracket: thousands of them exhaust the stack
        raise ProtocolError("bad_json", f"the {what} nests arrays or objects too deeply") from None
    except ValueError as error:
        where = f" ({error.msg} at character {error.pos})" if isinstance(error, json.JSONDecodeError) else ""
        raise ProtocolError("bad_json", f"the {what} is not valid JSON{where}") from None


def check_sampling(request: dict) -> None:
    """What single fields cannot say: top-k and top-p are alternatives; prompts are not empty."""
    if request["top_k"] > 0 and request["top_p"] > 0.0:
        raise ProtocolError("bad_field", "top_k and top_p cannot both be set; use one of them", "top_p")
    if not request["prompts"]:
        raise ProtocolError("bad_field", "prompts must hold at least one prompt", "prompts")


def parse_rest_request(obj: Any) -> dict:
    """A Megatron-LM style PUT /api body -> the same request dict as a WebSocket generate (the server's
    limits, megatron/inference/limits.py, apply to both)."""
    if not isinstance(obj, dict):
        raise ProtocolError("bad_json", "the body must be a JSON object")
    for name in REST_UNSUPPORTED:
        if name in obj:
            raise ProtocolError("bad_field", f"{name} is not supported by this server; leave it out", name)
    if "type" in obj or "id" in obj:
        field = "type" if "type" in obj else "id"
        raise ProtocolError("bad_field", f"unknown field {field!r}", field)
    request = check_fields(obj, REST_FIELDS)
    check_sampling(request)
    if request["tokens_to_generate"] == 0 and not request["logprobs"]:
        raise ProtocolError("bad_field", "tokens_to_generate 0 only scores prompts: set logprobs true",
                            "tokens_to_generate")
    if request.pop("stop_token") is not None:
        request["stop_tokens"].append(obj["stop_token"])
    if request["random_seed"] == -1:
        request["random_seed"] = None
    return request
