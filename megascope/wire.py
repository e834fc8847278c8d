"""MegaScope protocol v1 on the wire (docs/megascope_protocol.md): JSON messages checked field by field,
error frames, and binary data frames.

Every client message is checked against a declarative table (type, default, range) before anything acts
on it; nothing a client sends is ever evaluated. Capture specs and perturbations are checked by the
library (megascope.capture / megascope.perturbations): here they only have to be JSON objects.
"""

import json
import math
import struct
from dataclasses import dataclass

import numpy as np

from megascope.errors import ProtocolError

PROTOCOL_VERSION = 2
# Version 2 only added to version 1 (fields, messages, a close code): a version-1 client's hello is taken too.
ACCEPTED_PROTOCOLS = (1, 2)
ERROR_CODES = ("bad_json", "unknown_type", "bad_field", "bad_reduction", "bad_hook", "unauthorized",
               "too_large", "rate_limited", "busy", "non_finite", "internal")
DATA_MAGIC = b"MSD1"
MAX_SEED = 2**31 - 1
_REQUIRED = object()


@dataclass(frozen=True)
class Limits:
    """The bounds a server announces in `welcome.limits` and enforces."""
    max_message_bytes: int = 1 << 20
    max_messages_per_second: int = 50
    send_queue_frames: int = 256
    max_prompts: int = 16
    max_tokens_to_generate: int = 1024
    max_topk: int = 100

    def as_json(self):
        return dict(self.__dict__)


@dataclass(frozen=True)
class Field:
    """One field of a message: `kind` is int, float, bool, str, id, str_list, int_list, object, object_list."""
    kind: str
    default: object = _REQUIRED
    nullable: bool = False
    low: float | None = None
    high: float | None = None
    choices: tuple = ()


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


_KIND_CHECKS = {
    "int": (_is_int, "an integer"),
    "float": (lambda v: _is_int(v) or (isinstance(v, float) and math.isfinite(v)), "a finite number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "id": (lambda v: (isinstance(v, str) and len(v) <= 64) or _is_int(v),
           "a string (at most 64 characters) or an integer"),
    "str_list": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "int_list": (lambda v: isinstance(v, list) and all(_is_int(x) for x in v), "a list of integers"),
    "object": (lambda v: isinstance(v, dict), "a JSON object"),
    "object_list": (lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v), "a list of JSON objects"),
}

_SAMPLING_FIELDS = {
    "prompts": Field("str_list"),
    "temperature": Field("float", 1.0, low=1e-6, high=100.0),
    "top_k": Field("int", 0, low=0),
    "top_p": Field("float", 0.0, low=0.0, high=1.0),
    "add_BOS": Field("bool", False),
    "stop_tokens": Field("int_list", [], low=0),
    "chat": Field("bool", False),
}

# Client -> server messages; "id" is allowed on every one of them.
MESSAGES = {
    "hello": {"protocol": Field("int"), "token": Field("str", None, nullable=True)},
    "generate": {**_SAMPLING_FIELDS,
                 "tokens_to_generate": Field("int", 32, low=0),
                 "random_seed": Field("int", None, nullable=True, low=0, high=MAX_SEED),
                 "capture": Field("object", "connection", nullable=True),
                 "patch": Field("object_list", [])},
    "cancel": {"id": Field("id")},
    "set_capture": {"capture": Field("object", nullable=True)},
    "perturb": {"perturbations": Field("object_list")},
    "train": {"action": Field("str", choices=("pause", "resume", "step", "stop")),
              "n": Field("int", 1, low=1, high=1_000_000)},
    "ping": {},
}
INFERENCE_TYPES = ("hello", "generate", "cancel", "set_capture", "perturb", "ping")
TRAINING_TYPES = ("hello", "train", "set_capture", "perturb", "ping")

# Megatron-LM's REST API (PUT /api). Its fields we do not implement are refused by name.
REST_FIELDS = {**_SAMPLING_FIELDS,
               "tokens_to_generate": Field("int", 64, low=0),
               "logprobs": Field("bool", False),
               "random_seed": Field("int", -1, low=-1, high=MAX_SEED),
               "stop_token": Field("int", None, nullable=True, low=0)}
REST_UNSUPPORTED = ("top_p_decay", "top_p_bound", "beam_width", "length_penalty", "stop_on_eol",
                    "stop_on_double_eol", "prevent_newline_after_colon", "no_log")


def _bounds(field):
    """A field's allowed range in words: "between 0 and 1", "at least 0", "at most 9"."""
    if field.low is not None and field.high is not None:
        return f"between {field.low} and {field.high}"
    return f"at least {field.low}" if field.low is not None else f"at most {field.high}"


def check_fields(obj, fields, prefix=""):
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
        if not _KIND_CHECKS["id"][0](obj["id"]):
            raise ProtocolError("bad_field", "id must be a string (at most 64 characters) or an integer", "id")
        out["id"] = obj["id"]
    return out


def load_json(data, what="message"):
    """A client's JSON text (``what``: "message", "body") -> the value, or ProtocolError("bad_json") saying
    what is wrong with it."""
    try:
        return json.loads(data)
    except RecursionError:  # the parser recurses once per bracket: thousands of them exhaust the stack
        raise ProtocolError("bad_json", f"the {what} nests arrays or objects too deeply") from None
    except ValueError as error:
        where = f" ({error.msg} at character {error.pos})" if isinstance(error, json.JSONDecodeError) else ""
        raise ProtocolError("bad_json", f"the {what} is not valid JSON{where}") from None


def parse_message(data, allowed_types=INFERENCE_TYPES):
    """One client frame (str or bytes) -> a checked message dict with "type" and defaults filled."""
    if isinstance(data, bytes):
        raise ProtocolError("bad_json", "binary frames are for server data only; send JSON text frames")
    obj = load_json(data)
    if not isinstance(obj, dict):
        raise ProtocolError("bad_json", "a message must be a JSON object with a \"type\"")
    kind = obj.get("type")
    if not isinstance(kind, str) or kind not in allowed_types:
        served = ", ".join(allowed_types)
        raise ProtocolError("unknown_type", f"unknown message type {json.dumps(kind)[:40]}; this server takes "
                            f"{served}", "type")
    message = check_fields(obj, MESSAGES[kind])
    message["type"] = kind
    if kind == "generate":
        check_sampling(message)
    if kind == "train" and "n" in obj and message["action"] != "step":
        raise ProtocolError("bad_field", f"n counts the iterations of a step; {message['action']} takes none", "n")
    return message


def check_sampling(request):
    """What single fields cannot say: top-k and top-p are alternatives; prompts are not empty."""
    if request["top_k"] > 0 and request["top_p"] > 0.0:
        raise ProtocolError("bad_field", "top_k and top_p cannot both be set; use one of them", "top_p")
    if not request["prompts"]:
        raise ProtocolError("bad_field", "prompts must hold at least one prompt", "prompts")


def check_limits(request, limits, max_new_tokens):
    """Prompts and new tokens within the server's limits (``max_new_tokens``: what the model's length allows)."""
    if len(request["prompts"]) > limits.max_prompts:
        raise ProtocolError("bad_field", f"at most {limits.max_prompts} prompts per request here, not "
                            f"{len(request['prompts'])}; send the others in another request", "prompts")
    bound = min(limits.max_tokens_to_generate, max_new_tokens)
    if request["tokens_to_generate"] > bound:
        raise ProtocolError("bad_field", f"tokens_to_generate must be at most {bound} here", "tokens_to_generate")


def parse_rest_request(obj):
    """A Megatron-LM style PUT /api body -> the same request dict as a WebSocket generate (the server's
    limits, check_limits, apply to both)."""
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


def _finite(value):
    """JSON for a browser: NaN and infinities become null (JSON has no spelling for them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def encode_message(message):
    """A server message dict -> compact JSON text."""
    try:
        return json.dumps(message, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return json.dumps(_finite(message), separators=(",", ":"), allow_nan=False)


def error_message(code, message, field=None, id=None):
    assert code in ERROR_CODES, code
    frame = {"type": "error", "code": code, "message": message}
    if field is not None:
        frame["field"] = field
    if id is not None:
        frame["id"] = id
    return frame


def sent_id(data):
    """The ``id`` a client's text frame carries when it is a valid one, whatever else is wrong with the frame
    (so an error frame can echo it), else None."""
    if isinstance(data, bytes):
        return None
    try:
        obj = load_json(data)
    except ProtocolError:
        return None
    value = obj.get("id") if isinstance(obj, dict) else None
    return value if _KIND_CHECKS["id"][0](value) else None


def echo_id(message):
    """{"id": ...} of a checked message that carried one (every reply to it echoes it), else {}."""
    return {"id": message["id"]} if "id" in message else {}


def error_from(exception, id=None):
    return error_message(exception.code, exception.message, exception.field, id)


def encode_data_frame(header, values, dtype="float16"):
    """Binary data frame: b"MSD1", uint32 header length, JSON header, zero padding to 4 bytes, values.

    ``values``: a numpy array or CPU tensor. float16 is used only where every finite value fits in it;
    otherwise the frame is float32. ``header`` gets "dtype" and "shape" filled in."""
    array = values.numpy() if hasattr(values, "numpy") else np.asarray(values)
    array = np.ascontiguousarray(array, dtype=np.float32)
    if dtype == "float16":
        with np.errstate(over="ignore"):  # an overflow is detected below and sends float32 instead
            half = array.astype("<f2")
        if np.array_equal(np.isfinite(half), np.isfinite(array)):
            array = half
        else:
            dtype = "float32"
    if dtype == "float32":
        array = array.astype("<f4", copy=False)
    header = {**header, "dtype": dtype, "shape": list(array.shape)}
    head = json.dumps(_finite(header), separators=(",", ":")).encode("utf-8")
    padding = (-(8 + len(head))) % 4
    return b"".join((DATA_MAGIC, struct.pack("<I", len(head)), head, b"\0" * padding, array.tobytes()))


def decode_data_frame(frame):
    """(header dict, numpy array) of a binary data frame; ValueError when it is not a whole, valid frame."""
    if len(frame) < 8 or frame[:4] != DATA_MAGIC:
        raise ValueError("not a MegaScope data frame (magic MSD1 missing)")
    (length,) = struct.unpack_from("<I", frame, 4)
    if 8 + length > len(frame):
        raise ValueError("data frame shorter than its header length")
    header = json.loads(frame[8:8 + length].decode("utf-8"))
    start = 8 + length + (-(8 + length)) % 4
    dtype = {"float16": "<f2", "float32": "<f4"}.get(header.get("dtype"))
    if dtype is None:
        raise ValueError(f"data frame dtype {header.get('dtype')!r} is not float16 or float32")
    count = int(np.prod(header["shape"], dtype=np.int64))
    if len(frame) - start != count * np.dtype(dtype).itemsize:
        raise ValueError("data frame length does not match its shape and dtype")
    return header, np.frombuffer(frame, dtype=dtype, offset=start).reshape(header["shape"])
