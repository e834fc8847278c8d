"""megatron/inference/requests.py and limits.py: the generation server's own request checks (the REST body, the
limits shared with MegaScope's generate), each refusal naming its field."""

import pytest

from megascope.wire import parse_message
from megatron.inference.errors import ProtocolError
from megatron.inference.limits import Limits, check_limits
from megatron.inference.requests import load_json, parse_rest_request


def test_limits():
    request = parse_message('{"type": "generate", "prompts": ["a", "b"], "tokens_to_generate": 40}')
    check_limits(request, Limits(), 100)
    with pytest.raises(ProtocolError, match="at most 30"):
        check_limits(request, Limits(), 30)
    with pytest.raises(ProtocolError, match="prompts"):
        check_limits(request, Limits(max_prompts=1), 100)


def test_rest_request():
    request = parse_rest_request({"prompts": ["x"], "stop_token": 7, "logprobs": True})
    assert request["stop_tokens"] == [7] and request["random_seed"] is None and request["tokens_to_generate"] == 64
    for body, field in [({"prompts": ["x"], "beam_width": 2}, "beam_width"),
                        ({"prompts": ["x"], "tokens_to_generate": 0}, "tokens_to_generate"),
                        ({"prompts": ["x"], "random_seed": -2}, "random_seed"),
                        ({"prompts": ["x"], "id": 3}, "id")]:
        with pytest.raises(ProtocolError) as caught:
            parse_rest_request(body)
        assert caught.value.field == field


def test_rest_body_errors_read_as_before():
    with pytest.raises(ProtocolError, match=r"^the body is not valid JSON \(Expecting value at character 0\)$"):
        load_json(b"nope", "body")
    with pytest.raises(ProtocolError, match=r"^the body must be a JSON object$"):
        parse_rest_request(["x"])
    with pytest.raises(ProtocolError, match=r"^top_k and top_p cannot both be set; use one of them$"):
        parse_rest_request({"prompts": ["x"], "top_k": 2, "top_p": 0.5})
