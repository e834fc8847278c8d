"""MegaScope's capture compiled into the static cache's step (megascope/capture_plan.py) against the same capture on
megatron-core's eager inference path, over real sockets, on a TP2 generation server with grouped-query attention
(and on one GPU, where the decode steps are CUDA graphs; skipped without one):
every data frame the eager path sends is sent, with the same header and the same values (float16 on the wire), for
raw values and for reductions done on the device (norm, mean_heads) and on the host (the pattern's bins over its
keys); the tokens and the logit lens agree. A capture with attribution is what sends a generation to the eager
path (welcome.eager), which is how the reference is asked for here."""

import numpy as np
import pytest
import torch
from helpers.generation_server import TINY_SERVER, GenerationServer, generation, receive, run, send, websocket

from megascope.hook_sites import CAPTURED
from megascope.wire import decode_data_frame

FLOAT16_RTOL = 2 ** -9  # two units in the last place of float16: the paths may round one step apart
REQUEST = {"type": "generate", "id": "g", "prompts": ["Hello world, this is", "The"], "tokens_to_generate": 5,
           "top_k": 1}
CAPTURES = {
    "raw": {"hooks": list(CAPTURED), "logit_lens": True, "topk": 5},
    "reduced": {"hooks": list(CAPTURED), "reduction": "norm", "logit_lens": True,
                "reductions": {"attn.pattern": "bins(3)", "attn.q": "mean_heads", "attn.k": "topk_abs(2)"}},
}


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
GQA = ["--group-query-attention", "--num-query-groups", "2"]
# (ranks, flags, relative tolerance): TP2 on CPU (float32, then float16 on the wire); on one GPU (bf16) the decode
# steps replay CUDA graphs, where the eager path's attention may round apart by a unit of bf16 (2**-8).
LAYOUTS = {"cpu-tp2": (2, TINY_SERVER + GQA + ["--tensor-model-parallel-size", "2"], FLOAT16_RTOL),
           "cuda": (1, TINY_SERVER + GQA + ["--bf16"], 2 ** -6)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def server(request):
    ranks, flags, rtol = LAYOUTS[request.param]
    if request.param == "cuda":
        if GPUS < 1:
            pytest.skip("needs a GPU, 0 found")
        at = flags.index("--device")
        flags = [flag for flag in flags[:at] + ["--device", "cuda"] + flags[at + 2:]
                 if flag != "--use-cpu-initialization"]
    started = GenerationServer(ranks, flags)
    started.rtol = rtol
    yield started
    started.stop()


def _generate(server, capture):
    async def client():
        async with websocket(server) as ws:
            await send(ws, {"type": "hello", "protocol": 3})
            welcome = await receive(ws)
            messages, frames = await generation(ws, {**REQUEST, "capture": capture})
        return welcome, messages, frames
    return run(client())


def _by_key(frames):
    decoded = [decode_data_frame(frame) for frame in frames]
    return {(h["hook"], h["prompt_index"], tuple(h["tokens"])): (h, values) for h, values in decoded}


@pytest.mark.parametrize("name", list(CAPTURES))
def test_the_compiled_capture_sends_what_the_eager_path_sends(server, name):
    welcome, messages, frames = _generate(server, CAPTURES[name])
    _, eager_messages, eager_frames = _generate(server, {**CAPTURES[name], "attribution": True})
    assert set(welcome["eager"]) == {"patch", "attribution", "calculation"}
    assert messages[-1]["type"] == "generation_done" and messages[-1]["dropped_frames"] == 0
    assert messages[-1]["tokens"] == eager_messages[-1]["tokens"]
    ours, theirs = _by_key(frames), _by_key(eager_frames)
    assert len(ours) == len(frames)  # no frame twice
    assert ours.keys() == {key for key in theirs if key[0] != "attribution"}
    assert any(key[0] == "attribution" for key in theirs)  # the reference did run on the eager path
    for key, (header, values) in ours.items():
        their_header, their_values = theirs[key]
        assert {**header, "dtype": None} == {**their_header, "dtype": None}, key
        np.testing.assert_allclose(values, their_values, rtol=server.rtol, atol=1e-3, err_msg=str(key))
    lens = [m for m in messages if m["type"] == "logit_lens"]
    eager_lens = [m for m in eager_messages if m["type"] == "logit_lens"]
    assert [(m["step"], m["prompt_index"], len(m["layers"])) for m in lens] == \
        [(m["step"], m["prompt_index"], len(m["layers"])) for m in eager_lens] and lens
    for ours_lens, their_lens in zip(lens, eager_lens):
        for layer, their_layer in zip(ours_lens["layers"], their_lens["layers"]):
            np.testing.assert_allclose([t["prob"] for t in layer["topk"]], [t["prob"] for t in their_layer["topk"]],
                                       rtol=1e-4, atol=1e-6)
    steps = [(m["step"], [t["token_id"] for t in m["tokens"]]) for m in messages if m["type"] == "token"]
    assert steps == [(m["step"], [t["token_id"] for t in m["tokens"]]) for m in eager_messages if m["type"] == "token"]
