"""megascope/wire.py: message checks name the offending field; data frames round-trip byte-exactly."""

import json
import struct

import numpy as np
import pytest

from megascope.errors import ProtocolError
from megascope.wire import TRAINING_TYPES, decode_data_frame, encode_data_frame, encode_message, parse_message


def refused(text, **kwargs):
    with pytest.raises(ProtocolError) as caught:
        parse_message(text, **kwargs)
    return caught.value.code, caught.value.field


def test_generate_defaults_filled():
    message = parse_message(json.dumps({"type": "generate", "id": "a", "prompts": ["hi"]}))
    assert message == {"type": "generate", "id": "a", "prompts": ["hi"], "tokens_to_generate": 32,
                       "temperature": 1.0, "top_k": 0, "top_p": 0.0, "random_seed": None, "add_BOS": False,
                       "stop_tokens": [], "chat": False, "capture": "connection", "patch": []}


@pytest.mark.parametrize("text, expected", [
    ("{not json", ("bad_json", None)),
    ("[1, 2]", ("bad_json", None)),
    ("[" * 100_000 + "]" * 100_000, ("bad_json", None)),
    ('{"a": ' * 100_000 + "1" + "}" * 100_000, ("bad_json", None)),
    ('{"type": "fly"}', ("unknown_type", "type")),
    ('{"prompts": ["x"]}', ("unknown_type", "type")),
    ('{"type": "generate"}', ("bad_field", "prompts")),
    ('{"type": "generate", "prompts": "x"}', ("bad_field", "prompts")),
    ('{"type": "generate", "prompts": ["x"], "tokens_to_generate": 2.0}', ("bad_field", "tokens_to_generate")),
    ('{"type": "generate", "prompts": ["x"], "temperature": 0}', ("bad_field", "temperature")),
    ('{"type": "generate", "prompts": ["x"], "add_BOS": 1}', ("bad_field", "add_BOS")),
    ('{"type": "generate", "prompts": ["x"], "top_k": 3, "top_p": 0.5}', ("bad_field", "top_p")),
    ('{"type": "generate", "prompts": ["x"], "stop_tokens": [-1]}', ("bad_field", "stop_tokens")),
    ('{"type": "generate", "prompts": ["x"], "tempreature": 1}', ("bad_field", "tempreature")),
    ('{"type": "generate", "prompts": []}', ("bad_field", "prompts")),
    ('{"type": "hello"}', ("bad_field", "protocol")),
    ('{"type": "ping", "id": [1]}', ("bad_field", "id")),
    ('{"type": "perturb", "perturbations": [1]}', ("bad_field", "perturbations")),
])
def test_bad_messages_are_named(text, expected):
    assert refused(text) == expected


def test_a_one_sided_range_is_said_as_one():
    with pytest.raises(ProtocolError, match=r"^top_k must be at least 0, not -1$"):
        parse_message('{"type": "generate", "prompts": ["x"], "top_k": -1}')
    with pytest.raises(ProtocolError, match=r"^temperature must be between 1e-06 and 100.0, not 0.0$"):
        parse_message('{"type": "generate", "prompts": ["x"], "temperature": 0}')


def test_modes_take_their_own_types():
    assert refused('{"type": "train", "action": "pause"}') == ("unknown_type", "type")
    assert parse_message('{"type": "train", "action": "step", "n": 3}', TRAINING_TYPES)["n"] == 3
    assert refused('{"type": "train", "action": "jump"}', allowed_types=TRAINING_TYPES) == ("bad_field", "action")
    assert refused('{"type": "train", "action": "pause", "n": 2}', allowed_types=TRAINING_TYPES) == ("bad_field", "n")


def test_data_frame_matches_the_documented_bytes():
    header = {"id": "g1", "step": 2, "hook": "blocks.0.resid_post", "layer": 0, "prompt_index": 0,
              "tokens": [5, 6], "dims": ["token"], "reduction": "norm"}
    frame = encode_data_frame(header, np.array([1.5], dtype=np.float32), dtype="float32")
    assert frame[:8] == b"MSD1" + struct.pack("<I", 157) and len(frame) == 172
    assert frame[165:168] == b"\0\0\0" and frame[168:] == bytes.fromhex("0000c03f")
    decoded, values = decode_data_frame(frame)
    assert decoded["shape"] == [1] and decoded["dtype"] == "float32" and values.tolist() == [1.5]


def test_data_frame_float16_and_overflow():
    values = np.random.default_rng(0).standard_normal((3, 4, 5)).astype(np.float32)
    header, decoded = decode_data_frame(encode_data_frame({"hook": "embed"}, values))
    assert header["dtype"] == "float16" and decoded.shape == (3, 4, 5)
    np.testing.assert_allclose(decoded, values, rtol=1e-3, atol=1e-3)
    big = values * 1e5
    header, decoded = decode_data_frame(encode_data_frame({"hook": "embed"}, big))
    assert header["dtype"] == "float32" and np.array_equal(decoded, big)
    with pytest.raises(ValueError):
        decode_data_frame(encode_data_frame({"hook": "embed"}, values)[:-2])


def test_non_finite_json_becomes_null():
    assert json.loads(encode_message({"type": "iteration", "lm_loss": float("nan")}))["lm_loss"] is None
