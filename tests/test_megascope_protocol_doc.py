"""docs/megascope_protocol.md against the server: its welcome example is what a real server sends (over a real
socket), layers a model lacks get the error code its error table names for them, every field its tables mark
required is refused when left out (a capture without `hooks` included), and an unknown key inside `pca` is named
as the document says of unknown fields."""

import asyncio
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from websockets.asyncio.client import connect

from megascope.capture_spec import parse_capture
from megascope.errors import ProtocolError
from megascope.patching import parse_patches
from megascope.perturbations import parse_perturbations
from megascope.welcome import welcome_info
from megascope.wire import PROTOCOL_VERSION
from megascope.ws_server import WebSocketServer
from megatron.inference.limits import Limits

DOC = (Path(__file__).resolve().parents[1] / "docs" / "megascope_protocol.md").read_text()
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2}
SHAPE = {"num_layers": 2, "num_attention_heads": 4, "num_query_groups": 2}  # what patches check against


def section(heading):
    """The text under a ``## `` or ``### `` heading of the document, up to the next heading."""
    match = re.search(rf"^#+ {re.escape(heading)}.*?\n(.*?)(?=^#+ )", DOC, re.MULTILINE | re.DOTALL)
    assert match, f"docs/megascope_protocol.md has no section {heading!r}"
    return match.group(1)


def table_rows(text):
    """The rows of the first markdown table in ``text``: lists of cells, the header and rule left out."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


class WelcomeOnly:
    """A session of the model the document's example describes, served by the real WebSocketServer."""
    mode = "inference"

    def welcome_info(self):
        args = SimpleNamespace(**MODEL, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                               data_parallel_size=1)
        return welcome_info(args, vocab_size=1000)

    def on_welcome(self, client):
        pass

    def on_message(self, client, message):
        pass

    def on_disconnect(self, client):
        pass


def test_the_welcome_example_is_what_the_server_sends():
    example = json.loads(re.search(r"```json\n(.*?)```", section("welcome"), re.DOTALL).group(1))
    server = WebSocketServer(WelcomeOnly(), port=0, limits=Limits(max_tokens_to_generate=63)).start()

    async def hello():
        async with connect(f"ws://127.0.0.1:{server.port}") as ws:
            await ws.send(json.dumps({"type": "hello", "protocol": PROTOCOL_VERSION}))
            return json.loads(await ws.recv())
    try:
        welcome = asyncio.run(asyncio.wait_for(hello(), 60))
    finally:
        server.stop()
    assert example["protocol"] == welcome["protocol"] == PROTOCOL_VERSION
    assert f"# MegaScope wire protocol, version {PROTOCOL_VERSION}\n" in DOC
    assert example.keys() == welcome.keys()
    for key in ("type", "mode", "model", "reductions", "noise", "perturbation_targets", "limits"):
        assert example[key] == welcome[key], key
    shown = [hook for hook in example["hooks"] if hook != "..."]  # the example elides the middle
    assert shown == welcome["hooks"][:3] + welcome["hooks"][-2:]


def _codes_of_refused_layers():
    """The error (code, field) of each request naming a layer this 2-layer model lacks."""
    refusals = [lambda: parse_capture({"hooks": ["resid_post"], "layers": [0, 3]}, 2),
                lambda: parse_capture({"hooks": ["resid_post"], "pca": {"hook": "resid_post", "layer": 2}}, 2),
                lambda: parse_patches([{"hook": "resid_post", "layers": [2], "source": "zero"}], SHAPE, 2),
                lambda: parse_perturbations([{"kind": "system", "target": "resid_post", "noise": "constant",
                                              "scale": 1, "layers": [2]}], 2)]
    codes = []
    for refuse in refusals:
        with pytest.raises(ProtocolError) as error:
            refuse()
        codes.append((error.value.code, error.value.field))
    return codes


def test_layers_the_model_lacks_get_the_code_the_error_table_names():
    table = {row[0].strip("`"): row[1] for row in table_rows(section("error"))}
    naming_layers = [code for code, when in table.items() if "layer" in when]
    assert len(naming_layers) == 1, f"the error table names layers under {naming_layers}"
    assert _codes_of_refused_layers() == [(naming_layers[0], "capture.layers"), (naming_layers[0], "capture.pca.layer"),
                                          (naming_layers[0], "patch.0.layers"),
                                          (naming_layers[0], "perturbations.0.layers")]


VALID = {  # document section -> a valid object of it, and the parser of a message's field holding it
    "CaptureSpec": ({"hooks": ["resid_post"], "layers": [0, 1]}, lambda obj: parse_capture(obj, 2), "capture."),
    "Perturbation": ({"kind": "system", "target": "resid_post", "noise": "constant", "scale": 1},
                     lambda obj: parse_perturbations([obj], 2), "perturbations.0."),
    "Patch (activation patching and ablation)": ({"hook": "resid_post", "source": "zero"},
                                                 lambda obj: parse_patches([obj], SHAPE, 2), "patch.0."),
}


@pytest.mark.parametrize("heading", list(VALID))
def test_every_field_the_document_requires_is_refused_when_left_out(heading):
    valid, parse, prefix = VALID[heading]
    required = [row[0].strip("`") for row in table_rows(section(heading)) if row[2] == "required"]
    assert required and set(required) <= valid.keys(), required
    parse(valid)
    for field in required:
        with pytest.raises(ProtocolError) as error:
            parse({key: value for key, value in valid.items() if key != field})
        assert (error.value.code, error.value.field) == ("bad_field", prefix + field), field


def test_a_capture_without_hooks_is_refused_and_an_empty_list_is_taken():
    with pytest.raises(ProtocolError) as error:
        parse_capture({"logit_lens": True}, 2)
    assert (error.value.code, error.value.field) == ("bad_field", "capture.hooks")
    assert "[] for none" in error.value.message
    assert parse_capture({"hooks": [], "logit_lens": True}, 2).hooks == ()


def test_an_unknown_key_inside_pca_is_named():
    assert "Unknown fields in a client message are refused (`bad_field`, naming the field)" in DOC
    with pytest.raises(ProtocolError) as error:
        parse_capture({"hooks": ["resid_post"], "pca": {"hook": "resid_post", "layr": 1}}, 2)
    assert (error.value.code, error.value.field) == ("bad_field", "capture.pca.layr")
    assert "'layr'" in error.value.message and "hook, layer" in error.value.message
