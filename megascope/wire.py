"""MegaScope's wire protocol (docs/megascope_protocol.md): JSON messages checked field by field,
error frames, and binary data frames.

Every client message is checked against a declarative table (type, default, range) before anything acts
on it; nothing a client sends is ever evaluated. The table's field kinds, the sampling fields a generate shares
with Megatron-LM's REST API, and the JSON loading are the generation server's (megatron/inference/requests.py).
Capture specs and perturbations are checked by the library (megascope.capture / megascope.perturbations): here
they only have to be JSON objects.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np

from megascope.errors import ProtocolError
from megatron.inference.requests import (
    MAX_SEED,
    SAMPLING_FIELDS,
    Field,
    check_fields,
    check_sampling,
    load_json,
    valid_id,
)

PROTOCOL_VERSION = 3
# Versions 2 and 3 kept what an earlier client sends valid (version 3 renamed one perturbation target and takes
# the old name too): a version-1 or version-2 client's hello is taken.
ACCEPTED_PROTOCOLS = (1, 2, 3)
ERROR_CODES = ("bad_json", "unknown_type", "bad_field", "bad_reduction", "bad_hook", "unauthorized",
               "too_large", "rate_limited", "busy", "non_finite", "internal")
DATA_MAGIC = b"MSD1"

# Client -> server messages; "id" is allowed on every one of them.
MESSAGES = {
    "hello": {"protocol": Field("int"), "token": Field("str", None, nullable=True)},
    "generate": {**SAMPLING_FIELDS,
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


def parse_message(data: str | bytes, allowed_types: tuple[str, ...] = INFERENCE_TYPES) -> dict:
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


def _finite(value: Any) -> Any:
    """JSON for a browser: NaN and infinities become null (JSON has no spelling for them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def encode_message(message: dict) -> str:
    """A server message dict -> compact JSON text."""
    try:
        return json.dumps(message, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return json.dumps(_finite(message), separators=(",", ":"), allow_nan=False)


def error_message(code: str, message: str, field: str | None = None, id: str | int | None = None) -> dict:
    """An error frame: {"type": "error", "code", "message"}, with "field" and "id" when given."""
    assert code in ERROR_CODES, code
    frame: dict[str, str | int] = {"type": "error", "code": code, "message": message}
    if field is not None:
        frame["field"] = field
    if id is not None:
        frame["id"] = id
    return frame


def sent_id(data: str | bytes) -> str | int | None:
    """The ``id`` a client's text frame carries when it is a valid one, whatever else is wrong with the frame
    (so an error frame can echo it), else None."""
    if isinstance(data, bytes):
        return None
    try:
        obj = load_json(data)
    except ProtocolError:
        return None
    value = obj.get("id") if isinstance(obj, dict) else None
    return value if valid_id(value) else None


def echo_id(message: dict) -> dict:
    """{"id": ...} of a checked message that carried one (every reply to it echoes it), else {}."""
    return {"id": message["id"]} if "id" in message else {}


def error_from(exception: ProtocolError, id: str | int | None = None) -> dict:
    """The error frame of a refused request."""
    return error_message(exception.code, exception.message, exception.field, id)


def encode_data_frame(header: dict, values: Any, dtype: str = "float16") -> bytes:
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


def decode_data_frame(frame: bytes) -> tuple[dict, np.ndarray]:
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
