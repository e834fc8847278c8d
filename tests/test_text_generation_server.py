"""tools/run_text_generation_server.py over real sockets: REST and WebSocket generation agree for a seed, at
one rank and over a pipeline of two; bad requests get a 400 or an error frame naming the field and the
server goes on; a token guards a non-local WebSocket host; a client leaving mid-generation cancels it;
activation patches through the Python client (megascope.client) do what they say, the same at TP2xPP2 and DP2."""

import asyncio
import http.client
import json
import re
import signal
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import websockets
from helpers.generation_server import TINY_SERVER, GenerationServer, generation, receive, run, send, websocket
from helpers.launch import REPO, run_script, torchrun
from helpers.readme_commands import as_launched, readme_commands

from megascope.client import MegaScopeClient, MegaScopeError
from megascope.wire import decode_data_frame
from megatron.inference.model_setup import setup_for_generation
from megatron.training.errors import ArgumentError
from megatron.training.ports import free_port

TOKEN = "test-token"
PROMPTS = ["Hello world, this is", "The"]
# Captured values travel as float16: a layout that sums in another order may round to the neighbouring value, one
# unit in the last place (2**-10 of the value; 0.0039 at 4.02, seen in a TP2 x PP2 run), so allow two.
FLOAT16_RTOL = 2 ** -9
SAMPLED = {"prompts": PROMPTS, "tokens_to_generate": 6, "temperature": 0.8, "top_k": 40, "random_seed": 1234}


@pytest.fixture(scope="module")
def server():
    # The WebSocket on 127.0.0.2: not a local host name, so it needs the token.
    started = GenerationServer(1, TINY_SERVER + ["--ws-host", "127.0.0.2", "--ws-token", TOKEN,
                                                 "--ws-max-message-bytes", "4096", "--ws-send-queue-frames", "8"])
    yield started
    started.stop()


async def welcomed(ws):
    await send(ws, {"type": "hello", "protocol": 1, "token": TOKEN})
    welcome = await receive(ws)
    # the tiny model's 64 positions leave at most 63 new tokens, whatever --max-tokens-to-generate says
    assert welcome["type"] == "welcome" and welcome["limits"]["max_tokens_to_generate"] == 63, welcome


def websocket_tokens(server, request):
    async def client():
        async with websocket(server) as ws:
            await welcomed(ws)
            messages, _ = await generation(ws, {"type": "generate", "id": "s", **request})
        return messages
    messages = run(client())
    assert messages[0]["type"] == "generation_started" and messages[-1]["type"] == "generation_done", messages[-1]
    return messages


def test_rest_and_websocket_give_the_same_tokens(server):
    status, answer = server.put({**SAMPLED, "logprobs": True})
    assert status == 200, answer
    assert answer["random_seed"] == 1234 and answer["finish_reason"] == ["length", "length"]
    assert [len(values) for values in answer["logprobs"]] == [len(tokens) - 1 for tokens in answer["tokens"]]
    assert answer["text"][0].startswith(PROMPTS[0]) and "".join(answer["segments"][1]) == answer["text"][1]
    messages = websocket_tokens(server, SAMPLED)
    done = messages[-1]
    started = messages[0]
    prompt_ids = [[token["id"] for token in prompt] for prompt in started["prompt_tokens"]]
    assert [p + g for p, g in zip(prompt_ids, done["tokens"])] == answer["tokens"]
    streamed = {0: [], 1: []}
    for message in messages[1:-1]:
        for token in message["tokens"]:
            streamed[token["prompt_index"]].append(token["token_id"])
            assert 0 < token["prob"] <= 1 and token["topk"][0]["prob"] >= token["prob"] - 1e-6
            assert len(token["topk"]) == 5
    assert [streamed[0], streamed[1]] == done["tokens"]
    assert server.put(SAMPLED)[1]["tokens"] == answer["tokens"]  # the same seed again


@pytest.mark.parametrize("body, field", [({"prompts": "x"}, "prompts"), ({"prompts": ["x"], "top_k": 1.5}, "top_k"),
                                         ({"prompts": ["x"], "top_k": 2, "top_p": 0.5}, "top_p"),
                                         ({"prompts": ["x"], "beam_width": 4}, "beam_width"),
                                         ({"prompts": ["x"], "tokens_to_generate": 500}, "tokens_to_generate"),
                                         ({"prompts": ["x"], "stop_tokens": [10 ** 6]}, "stop_tokens"),
                                         ({"prompts": ["x"], "chat": True}, "chat"),
                                         ({"prompts": ["x"], "temperatur": 1}, "temperatur"),
                                         ({"prompts": ["x " * 80]}, "prompts")])  # longer than the model reads
def test_rest_refuses_each_bad_field_by_name(server, body, field):
    status, answer = server.put(body)
    assert status == 400 and answer["field"] == field, answer
    assert server.put(b"{not json")[0] == 400
    assert server.put(b"[" * 100_000 + b"]" * 100_000) == (
        400, {"error": "the body nests arrays or objects too deeply"})


def test_websocket_errors_and_the_server_goes_on(server):
    async def client():
        async with websocket(server) as ws:
            await send(ws, {"type": "generate", "prompts": ["x"]})
            assert (await receive(ws))["code"] == "unauthorized"  # hello first
            await welcomed(ws)
            for text, code, field in [("{oops", "bad_json", None), ('{"type": "warp"}', "unknown_type", "type"),
                                      ('{"type": "generate", "id": 1, "prompts": [3]}', "bad_field", "prompts"),
                                      ('{"type": "generate", "id": 2, "prompts": ["x"], "top_k": 99999}',
                                       "bad_field", "top_k"),
                                      ('{"type": "generate", "id": 3, "prompts": ["x"], '
                                       '"capture": {"hooks": [], "attribution": 1}}',
                                       "bad_field", "capture.attribution"),
                                      ('{"type": "cancel", "id": "nothing"}', "bad_field", "id")]:
                await ws.send(text)
                error = await receive(ws)
                assert (error["type"], error["code"], error.get("field")) == ("error", code, field), text
                assert error.get("id") == json.loads(text).get("id") if text != "{oops" else "id" not in error
            await send(ws, {"type": "ping", "padding": "x" * 5000})  # over --ws-max-message-bytes
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await receive(ws)
            assert closed.value.rcvd.code == 1009
        for token in (None, "wrong"):
            async with websocket(server) as ws:
                await send(ws, {"type": "hello", "protocol": 1, "token": token})
                assert (await receive(ws))["code"] == "unauthorized"
                with pytest.raises(websockets.ConnectionClosed):
                    await receive(ws)

    run(client())
    assert websocket_tokens(server, SAMPLED)[-1]["finish_reason"] == ["length", "length"]


def test_disconnect_mid_generation_cancels_and_the_next_client_is_served(server):
    async def leave_early():
        async with websocket(server) as ws:
            await welcomed(ws)
            await send(ws, {"type": "generate", "id": "long", "prompts": ["Once"], "tokens_to_generate": 50})
            assert (await receive(ws))["type"] == "generation_started"
            assert (await receive(ws))["type"] == "token"

    async def cancel():
        async with websocket(server) as ws:
            await welcomed(ws)
            await send(ws, {"type": "generate", "id": 9, "prompts": ["Once"], "tokens_to_generate": 50})
            assert (await receive(ws))["type"] == "generation_started"
            await send(ws, {"type": "cancel", "id": 9})
            while (message := await receive(ws))["type"] != "generation_done":
                assert message["type"] == "token"
            return message

    run(leave_early())
    done = run(cancel())  # waits its turn (busy is never answered to a client whose model became free)
    assert done["finish_reason"] == ["cancelled"] and len(done["tokens"][0]) < 50
    assert websocket_tokens(server, SAMPLED)[-1]["finish_reason"] == ["length", "length"]


CAPTURE = {"hooks": ["attn.pattern", "resid_post"], "layers": [1, 3], "logit_lens": True, "topk": 3}


def captured(server, token=None):
    """Messages and decoded data frames of SAMPLED with CAPTURE."""
    async def client():
        async with websocket(server) as ws:
            await send(ws, {"type": "hello", "protocol": 1, "token": token})
            assert (await receive(ws))["type"] == "welcome"
            await send(ws, {"type": "generate", "id": "c", "capture": CAPTURE, **SAMPLED})
            replies = []
            while True:
                replies.append(await receive(ws))
                if isinstance(replies[-1], dict) and replies[-1]["type"] in ("generation_done", "error"):
                    return replies
    replies = run(client())
    frames = [decode_data_frame(reply) for reply in replies if isinstance(reply, bytes)]
    return [reply for reply in replies if isinstance(reply, dict)], frames


def positions_read(messages):
    """Per prompt: how many steps read its tokens. The prefill reads the shortest prompt's length, then
    one position per step; a prompt's last token is read only if a longer one goes on."""
    lengths = [len(prompt) + len(generated) for prompt, generated in
               zip(messages[0]["prompt_tokens"], messages[-1]["tokens"])]
    shortest = min(len(prompt) for prompt in messages[0]["prompt_tokens"])
    return [1 + len(range(shortest, min(length, max(lengths) - 1))) for length in lengths], lengths


def expected_frames(messages):
    """Per hook and layer: a frame per step that read a prompt's tokens, and one of the final pass for each
    prompt whose last token no step read (the longest ones: no later step goes on)."""
    steps, lengths = positions_read(messages)
    return (sum(steps) + lengths.count(max(lengths))) * 2 * 2  # x hooks x layers


def test_capture_streams_data_frames_and_counts_what_it_dropped(server):
    messages, frames = captured(server, TOKEN)
    done = messages[-1]
    assert done["type"] == "generation_done", done
    expected = expected_frames(messages)
    reported = sum(message["frames"] for message in messages if message["type"] == "dropped")
    assert len(frames) + done["dropped_frames"] == expected and reported == done["dropped_frames"]
    for header, values in frames:
        assert header["layer"] in (1, 2)
        assert header["hook"] == f"blocks.{header['layer']}.{header['hook'].split('.', 2)[2]}"
        start, end = header["tokens"]
        if header["hook"].endswith("attn.pattern"):
            assert values.shape == (end - start, 4, end) and np.allclose(values.sum(-1), 1, atol=1e-2)
    lens = [message for message in messages if message["type"] == "logit_lens"]
    assert lens and all([layer["layer"] for layer in message["layers"]] == [1, 2] and
                        len(message["layers"][0]["topk"]) == 3 for message in lens)


NOISE = {"id": "n", "kind": "storage", "target": "mlp.fc1", "noise": "gaussian", "scale": 0.5, "seed": 3}
GREEDY = {"prompts": PROMPTS, "tokens_to_generate": 8, "top_k": 1}


def perturbed(server, token=None):
    """Greedy tokens before, with and after NOISE (and the reply to a bad perturbation)."""
    async def client():
        async with websocket(server) as ws:
            await send(ws, {"type": "hello", "protocol": 1, "token": token})
            assert (await receive(ws))["type"] == "welcome"
            tokens = []
            for perturbations in (None, [NOISE], []):
                if perturbations is not None:
                    await send(ws, {"type": "perturb", "perturbations": perturbations})
                    normalised = [{**p, "layers": None, "enabled": True} for p in perturbations]  # defaults filled in
                    assert (await receive(ws)) == {"type": "perturbations", "active": normalised}
                tokens.append((await generation(ws, {"type": "generate", **GREEDY}))[0][-1]["tokens"])
            await send(ws, {"type": "perturb", "perturbations": [{**NOISE, "noise": "loud"}]})
            return tokens, await receive(ws)
    return run(client())


def test_perturbations_change_the_tokens_and_removing_them_restores_them(server):
    (before, noisy, after), refusal = perturbed(server, TOKEN)
    assert noisy != before and after == before
    assert (refusal["code"], refusal["field"]) == ("bad_field", "perturbations.0.noise")


def _early_stop_token(generated):
    """A token that ends one prompt's greedy continuation early while the other one goes on: (row, token)."""
    for row, other in ((0, 1), (1, 0)):
        for index, token in enumerate(generated[row][:-2]):
            if token not in generated[row][:index] and token not in generated[other]:
                return row, token
    raise AssertionError(f"no token stops one prompt early: {generated}")


def test_pca_covers_exactly_every_token_of_each_prompt_and_equals_numpys_svd(server):
    capture = {"hooks": ["resid_post"], "layers": [2, 3], "pca": {"hook": "resid_post", "layer": 2}}
    # pca.layer null: one pca message per captured layer (the page's PCA tab switches layers without generating)
    every_layer = {**capture, "layers": [1, 3], "pca": {"hook": "resid_post", "layer": None}}

    async def client():
        async with websocket(server) as ws:
            await welcomed(ws)
            plain = (await generation(ws, {"type": "generate", **GREEDY}))[0][-1]["tokens"]
            row, stop = _early_stop_token(plain)
            request = {"type": "generate", "capture": capture, "stop_tokens": [stop], **GREEDY}
            one_layer = await generation(ws, request)
            return row, one_layer, (await generation(ws, {**request, "capture": every_layer}))[0]
    stopped_row, (messages, frames), every_layer_messages = run(client())
    pca = next(message for message in messages if message["type"] == "pca")
    started, done = messages[0], messages[-1]
    assert done["finish_reason"][stopped_row] == "stop" and done["finish_reason"][1 - stopped_row] == "length"
    texts = [[token["id"] for token in prompt] + generated
             for prompt, generated in zip(started["prompt_tokens"], done["tokens"])]
    # the vectors streamed for the PCA hook: every token of each prompt exactly once, nothing after its end
    vectors = {}
    for header, values in map(decode_data_frame, frames):
        if header["hook"] == "blocks.2.resid_post":
            for offset, position in enumerate(range(*header["tokens"])):
                assert (header["prompt_index"], position) not in vectors
                vectors[(header["prompt_index"], position)] = values[offset].astype(np.float64)
    real = [(prompt, position) for prompt, text in enumerate(texts) for position in range(len(text))]
    assert sorted(vectors) == real
    assert [(point["prompt_index"], point["token_index"]) for point in pca["points"]] == real
    data = np.stack([vectors[key] for key in real])
    centred = data - data.mean(axis=0)
    _, singular, right = np.linalg.svd(centred, full_matrices=False)
    want = centred @ right[:2].T
    got = np.array([[point["x"], point["y"]] for point in pca["points"]])
    got *= np.sign((got * want).sum(axis=0))  # a component's sign is a convention
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())  # the wire's float16 values
    np.testing.assert_allclose(pca["explained_variance"], singular[:2] ** 2 / (singular ** 2).sum(), atol=2e-3)
    assert pca["explained_variance"][0] >= pca["explained_variance"][1]
    # every captured layer: layers 1 and 2 in order, just before generation_done (the server's own vectors,
    # whatever the small send queue dropped), layer 2 the same projection as when asked alone
    ordered = [m for m in every_layer_messages if m["type"] in ("pca", "generation_done")]
    assert [m.get("layer") for m in ordered] == [1, 2, None] and ordered[-1]["tokens"] == done["tokens"]
    for layer_pca in ordered[:2]:
        assert [(point["prompt_index"], point["token_index"]) for point in layer_pca["points"]] == real
    assert ordered[1]["points"] == pca["points"] and ordered[1]["explained_variance"] == pca["explained_variance"]
    assert ordered[0]["points"] != pca["points"]


ATTRIBUTION = {"hooks": [], "attribution": True}


def attributed(server, token=None):
    """Messages of SAMPLED with ATTRIBUTION, and its attribution frames by (step, prompt index)."""
    async def client():
        async with websocket(server) as ws:
            await send(ws, {"type": "hello", "protocol": 1, "token": token})
            assert (await receive(ws))["type"] == "welcome"
            return await generation(ws, {"type": "generate", "capture": ATTRIBUTION, **SAMPLED})
    messages, frames = run(client())
    assert messages[-1]["type"] == "generation_done", messages[-1]
    return messages, {(h["step"], h["prompt_index"]): (h, v) for h, v in map(decode_data_frame, frames)}


def test_attribution_streams_the_parts_of_each_generated_tokens_logit(server):
    messages, frames = attributed(server, TOKEN)
    chosen, position = {}, [len(prompt) for prompt in messages[0]["prompt_tokens"]]
    for message in (m for m in messages if m["type"] == "token"):
        for token in message["tokens"]:
            chosen[(message["step"], token["prompt_index"])] = (token["token_id"], position[token["prompt_index"]])
            position[token["prompt_index"]] += 1
    # one frame per generated token (the fixture's small send queue may drop some: they are counted)
    assert len(chosen) == 12 and len(frames) + messages[-1]["dropped_frames"] == len(chosen)
    assert frames.keys() <= chosen.keys()
    for key, (header, values) in frames.items():
        token_id, at = chosen[key]
        assert (header["hook"], header["token_id"], header["tokens"], header["dtype"]) == \
            ("attribution", token_id, [at, at + 1], "float32")
        assert header["dims"] == ["token", "layer", "component"] and values.shape == (1, 4, 4 + 1)
        assert len(header["attn_bias"]) == 4
        parts = values.astype(np.float64).sum() + header["embed"] + sum(header["attn_bias"]) + header["final_norm_bias"]
        assert parts == pytest.approx(header["logit"], abs=1e-4 * max(1.0, abs(header["logit"])))


def test_pipeline_of_two_serves_the_same_tokens_and_captures(server):
    reference = server.put(SAMPLED)[1]["tokens"]
    pipeline = GenerationServer(2, TINY_SERVER + ["--pipeline-model-parallel-size", "2"])
    try:
        assert pipeline.put(SAMPLED)[1]["tokens"] == reference
        one_stage = {(h["hook"], h["prompt_index"], h["step"]): v for h, v in captured(server, TOKEN)[1]}
        messages, frames = captured(pipeline)
        assert messages[-1]["dropped_frames"] == 0 and len(frames) == expected_frames(messages)
        # layer 1 lives on the first stage, layer 2 on the second: both reach rank 0, equal to one stage's
        compared = 0
        for header, values in frames:
            key = (header["hook"], header["prompt_index"], header["step"])
            if key in one_stage:
                np.testing.assert_allclose(values, one_stage[key], rtol=FLOAT16_RTOL, atol=2e-3)
                compared += 1
        assert compared > 0 and {h["layer"] for h, _ in frames} == {1, 2}
        assert perturbed(pipeline)[0] == perturbed(server, TOKEN)[0]  # the same noise at both layouts
        # the attribution of layers on the first stage reaches the last stage's chosen token exactly
        one_stage, two_stages = attributed(server, TOKEN)[1], attributed(pipeline)[1]
        assert len(two_stages) == 12 and one_stage.keys() <= two_stages.keys()
        for key, (header, values) in one_stage.items():
            other, other_values = two_stages[key]
            np.testing.assert_allclose(other_values, values, rtol=1e-4, atol=1e-4)
            for name in ("token_id", "logit", "embed", "attn_bias", "final_norm_bias"):
                assert other[name] == pytest.approx(header[name], rel=1e-4, abs=1e-4), name
    finally:
        pipeline.stop()


def test_set_capture_during_a_generation_applies_from_the_next_steps(server):
    async def client():
        async with websocket(server) as ws:
            await welcomed(ws)
            await send(ws, {"type": "generate", "id": "late", "prompts": ["Once"], "tokens_to_generate": 60})
            assert (await receive(ws))["type"] == "generation_started"
            first = await receive(ws)
            await send(ws, {"type": "set_capture", "capture": {"hooks": ["resid_post"], "layers": [0, 1],
                                                               "reduction": "norm"}})
            replies = []
            while not (isinstance(reply := await receive(ws), dict) and reply["type"] == "generation_done"):
                replies.append(reply)
            return first, replies
    first, replies = run(client())
    frames = [decode_data_frame(reply)[0] for reply in replies if isinstance(reply, bytes)]
    # every default filled in
    normalised = {"hooks": ["resid_post"], "layers": [0, 1], "tokens": None, "reduction": "norm", "reductions": {},
                  "topk": 5, "logit_lens": False, "pca": None, "sample": 0, "attribution": False}
    assert {"type": "capture_set", "capture": normalised} in replies
    assert frames and all(frame["step"] > first["step"] and frame["reduction"] == "norm" for frame in frames)


def set_perturbations(server, perturbations, token=None):
    async def client():
        async with websocket(server) as ws:
            await send(ws, {"type": "hello", "protocol": 1, "token": token})
            assert (await receive(ws))["type"] == "welcome"
            await send(ws, {"type": "perturb", "perturbations": perturbations})
            assert (await receive(ws))["type"] == "perturbations"
    run(client())


def test_data_parallel_replicas_share_a_requests_prompts_and_answer_as_one_replica(server):
    request = {**SAMPLED, "prompts": [*PROMPTS, "Once upon a time", "x"], "logprobs": True}
    perturbed_request = {**GREEDY, "prompts": request["prompts"]}
    reference = server.put(request)[1]
    set_perturbations(server, [NOISE], TOKEN)
    try:
        perturbed_reference = server.put(perturbed_request)[1]
    finally:
        set_perturbations(server, [], TOKEN)
    replicas = GenerationServer(2, TINY_SERVER)  # DP 2: the replicas with the most free slots take the prompts
    try:
        status, answer = replicas.put(request)
        assert status == 200 and answer["tokens"] == reference["tokens"], answer
        assert answer["finish_reason"] == reference["finish_reason"] and answer["text"] == reference["text"]
        for ours, theirs in zip(answer["logprobs"], reference["logprobs"]):
            assert ours == pytest.approx(theirs, abs=1e-4)
        # a WebSocket generation runs on the first replica: the tokens of the one-replica server
        assert websocket_tokens(replicas, SAMPLED)[-1]["tokens"] == websocket_tokens(server, SAMPLED)[-1]["tokens"]
        # perturbations set over the WebSocket reach both replicas
        set_perturbations(replicas, [NOISE])
        assert replicas.put(perturbed_request)[1]["tokens"] == perturbed_reference["tokens"]
        code, output, _ = replicas.interrupt(signal.SIGINT, replicas.rank0)
        shared = re.search(r"batch: 2 requests served, .* prompts per replica (\d+), (\d+)", output)
        assert code == 0 and shared and shared.groups() == ("4", "4"), output  # both replicas took 2 of each
    finally:
        replicas.stop()


def _refuses_connections(url):
    try:
        urllib.request.urlopen(url, timeout=60)
    except urllib.error.URLError as error:
        return isinstance(error.reason, ConnectionRefusedError)
    return False


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_generation_stops_a_single_process_server_with_one_line(signum):
    command = [sys.executable, str(REPO / "tools/run_text_generation_server.py"), *TINY_SERVER,
               "--port", "0", "--enable-ws-server", "--ws-port", "0"]
    single = GenerationServer(0, [], command=command, env={"MASTER_PORT": str(free_port())})
    try:
        async def client():
            async with websocket(single) as ws:
                await send(ws, {"type": "hello", "protocol": 1})
                assert (await receive(ws))["type"] == "welcome"
                await send(ws, {"type": "generate", "prompts": ["Once"], "tokens_to_generate": 50})
                assert (await receive(ws))["type"] == "generation_started"
                assert (await receive(ws))["type"] == "token"
                stopped = asyncio.get_running_loop().run_in_executor(None, single.interrupt, signum)
                with pytest.raises(websockets.ConnectionClosed):  # the server closes the connection
                    while True:
                        await receive(ws)
                return await stopped
        code, output, alive = run(client())
    finally:
        single.stop()
    assert (code, output.splitlines(), alive) == (0, ["server stopped"], []), output
    assert _refuses_connections(single.rest + "/api")


def _stopped_alone(server, output, alive):
    assert alive == [] and output.count("server stopped") == 1, output
    assert not re.search(r"\[rank\d\]", output), output  # no rank says anything else (no stack trace)
    assert _refuses_connections(server.rest + "/api")


def test_torchrun_ranks_stop_together_when_rank_0_gets_the_signal_or_ctrl_c_reaches_the_readme_command():
    server = GenerationServer(2, TINY_SERVER + ["--tensor-model-parallel-size", "2"])
    code, output, alive = server.interrupt(signal.SIGTERM, server.rank0)
    _stopped_alone(server, output, alive)
    assert code == 0 and output.splitlines() == ["server stopped"], output  # torchrun sees every rank exit 0
    # The README's commands, as a newcomer runs them (its ports made free ones: tests run side by side).
    launch, curl = readme_commands("MegaScope: text generation server")
    readme = GenerationServer(0, [], command=as_launched(launch, {"--port": 0, "--ws-port": 0}))
    status, answer = readme.put(json.loads(curl[curl.index("-d") + 1]))
    assert status == 200 and answer["text"][0].startswith("Hello") and len(answer["tokens"][0]) > 1, answer
    (openai_curl,) = readme_commands("Serving with an OpenAI-compatible API")  # the same server, OpenAI's API
    assert openai_curl[1] == "localhost:5000/v1/completions", openai_curl
    request = urllib.request.Request(readme.rest + "/v1/completions", data=openai_curl[openai_curl.index("-d") + 1]
                                     .encode(), headers={"Content-Type": "application/json"})  # curl -d: a POST
    with urllib.request.urlopen(request, timeout=300) as reply:
        completion = json.loads(reply.read())
    assert completion["choices"][0]["text"] and completion["usage"]["completion_tokens"] > 0, completion
    code, output, alive = readme.interrupt(signal.SIGINT)  # Ctrl-C: torchrun passes it on to every rank
    _stopped_alone(readme, output, alive)
    assert "SignalException" in output, output  # torchrun reports the signal it received in its own words


def test_a_bad_flag_is_one_line_and_exit_code_2():
    result = run_script("tools/run_text_generation_server.py", TINY_SERVER + ["--ws-port", "99999"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == \
        "run_text_generation_server.py: error: --ws-port 99999: a port is 0..65535"


def test_a_virtual_pipeline_is_refused_by_its_flag_not_by_the_microbatches(monkeypatch):
    """A generation tool's virtual pipeline used to be refused for its "number of microbatches (1)"."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ArgumentError) as refused:  # in-process: it is refused before any process group
        setup_for_generation(TINY_SERVER + ["--pipeline-model-parallel-size", "2",
                                            "--num-layers-per-virtual-pipeline-stage", "1"], "x", model_provider=None)
    assert str(refused.value) == ("--num-layers-per-virtual-pipeline-stage: generation runs one model chunk per "
                                  "pipeline rank; leave virtual pipelining out")


def test_compiled_layers_are_refused_by_the_generation_engine():
    with pytest.raises(ArgumentError) as refused:  # in-process: it is refused before any process group
        setup_for_generation(TINY_SERVER + ["--compile-transformer-layers"], "x", model_provider=None)
    assert str(refused.value) == ("--compile-transformer-layers: the generation engine runs its layers eagerly (each "
                                  "step has a new length); drop the flag")


def test_a_port_in_use_at_tp2_is_one_line_from_the_job():
    """Issue 53: rank 0 printed its line, then rank 1, waiting in the service's loop for rank 0's first job, printed
    gloo's "Connection closed by peer" trace."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = torchrun(2, "tools/run_text_generation_server.py",
                          TINY_SERVER + ["--tensor-model-parallel-size", "2", "--port", port], timeout=300)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("run_text_generation_server.py: ")]
    assert errors == [f"run_text_generation_server.py: error: --port {port}: cannot listen on 127.0.0.1:{port} "
                      f"(Address already in use); pick a free port"], result.stderr
    assert "RuntimeError" not in result.stderr and 'server.py", line' not in result.stderr, result.stderr


@pytest.mark.parametrize("tool, where", [("tools/run_text_generation_server.py", "missing"),
                                         ("tools/checkpoint/generate_greedy.py", "empty")])
def test_a_load_without_a_checkpoint_is_refused_not_served_as_random_weights(tmp_path, tool, where):
    """A mistyped --load used to print "training from scratch" and serve the seeded random initialization."""
    load = tmp_path / "checkpoints"
    if where == "empty":
        load.mkdir()
    prompts = tmp_path / "prompts.json"
    prompts.write_text('["The cat sat"]')
    extra = ["--prompts-json", prompts, "--output", tmp_path / "o"] if "greedy" in tool else []
    result = run_script(tool, TINY_SERVER + extra + ["--load", load])
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    reason = "no such directory" if where == "missing" else "no checkpoint there"
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{Path(tool).name}: error: --load {load}: {reason}"), last


def test_the_page_build_is_served_at_the_root_when_there_is_one(server):
    index = REPO / "tools/visualization/transformer-visualize/dist/index.html"
    try:
        with urllib.request.urlopen(server.rest + "/", timeout=60) as answer:
            status, body = answer.status, answer.read()
    except urllib.error.HTTPError as error:
        status, body = error.code, error.read()
    if index.is_file():
        assert (status, body) == (200, index.read_bytes())
    else:
        assert status == 404 and b"no page build" in body
    with pytest.raises(urllib.error.HTTPError) as outside:
        urllib.request.urlopen(server.rest + "/../../etc/passwd", timeout=60)
    assert outside.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as api:  # the API is PUT only, page build or not
        urllib.request.urlopen(server.rest + "/api", timeout=60)
    assert api.value.code == 405 and b"use PUT /api" in api.value.read()


# Two prompts of 5 tokens each: a patch writes prompt 1's activations at prompt 0's positions.
PAIR = ["The said that it was", "A is in the and"]
LAST = 4
LOGITS = {"hooks": ["logits"]}
TRANSPLANT = [{"hook": "resid_post", "layers": [3], "positions": [LAST], "source": {"prompt": 1}}]
# Query heads 1 and 2 (on different ranks at TP2) from prompt 1 at every position read, prefill and decode steps.
HEADS = [{"hook": "attn.q", "layers": [1], "heads": [1, 2], "source": {"prompt": 1}}]
SEEDED = {"tokens_to_generate": 4, "random_seed": 7}
GREEDY_PAIR = {"tokens_to_generate": 8, "top_k": 1}


def patched_runs(url, token=None):
    """Through the Python client: the pair plain, with each prompt patched by its own activations, with prompt
    1's last residual in prompt 0 (at the prompt's last position; at every position), with heads of prompt 1,
    and with every MLP output zeroed."""
    with MegaScopeClient(url, token=token) as scope:
        # Patched generations run on megatron-core's eager path (welcome.eager): so does the plain one they are
        # compared with bit for bit, which asking for attribution does.
        plain = scope.generate(PAIR, capture={**LOGITS, "attribution": True}, **SEEDED)
        own = scope.patch(PAIR, [{"hook": "resid_post", "source": {"prompt": row}, "prompts": [row]}
                                 for row in (0, 1)], capture=LOGITS, **SEEDED)
        transplant = scope.patch(PAIR, TRANSPLANT, capture=LOGITS, **SEEDED)
        every_step = scope.patch(PAIR, [{**TRANSPLANT[0], "positions": None}], **SEEDED)
        heads = scope.patch(PAIR, HEADS, capture=LOGITS, **SEEDED)
        zero = scope.patch(PAIR, [{"hook": "mlp.out", "source": "zero"}], **SEEDED)
    return plain, own, transplant, every_step, heads, zero


@pytest.fixture(scope="module")
def one_rank_patches(server):
    return patched_runs(server.ws, TOKEN)


def test_patches_over_the_websocket_with_the_python_client(one_rank_patches):
    plain, own, transplant, every_step, heads, zero = one_rank_patches
    assert [len(prompt) for prompt in plain.started["prompt_tokens"]] == [LAST + 1] * 2
    # a prompt patched with its own activations: the same tokens, distributions and logits
    assert [step["tokens"] for step in own.tokens] == [step["tokens"] for step in plain.tokens]
    for row in (0, 1):
        np.testing.assert_array_equal(own.activation("logits", row), plain.activation("logits", row))
    assert plain.activations[("logits", 0)].start == LAST  # the prefill keeps the logits of its last position
    # prompt 1's last residual in prompt 0: prompt 0's next token is drawn from prompt 1's distribution
    assert plain.step(0, 0)["topk"] != plain.step(0, 1)["topk"]
    for entry, want in zip(transplant.step(0, 0)["topk"], plain.step(0, 1)["topk"]):
        assert entry["token_id"] == want["token_id"] and entry["prob"] == pytest.approx(want["prob"], abs=1e-5)
    np.testing.assert_allclose(transplant.activation("logits", 0, LAST), plain.activation("logits", 1, LAST),
                               atol=1e-2)  # float16 on the wire
    assert transplant.step(0, 1) == plain.step(0, 1)  # the source is not written
    assert transplant.started["patch"] == [{**TRANSPLANT[0], "heads": None, "prompts": None}]
    assert transplant.done["patched"] == [[LAST]]
    # at every position: each decode step too draws prompt 0's token from prompt 1's distribution
    assert every_step.generated[0] != every_step.generated[1]  # their own generators: different tokens
    for step in range(SEEDED["tokens_to_generate"]):
        ours, theirs = every_step.step(step, 0)["topk"], every_step.step(step, 1)["topk"]
        assert [t["token_id"] for t in ours] == [t["token_id"] for t in theirs], step
        assert [t["prob"] for t in ours] == pytest.approx([t["prob"] for t in theirs], abs=1e-5)
    # heads patched at the prefill and at each decode step; zeroed MLPs change the text: both are reported
    assert heads.done["patched"] == [list(range(LAST + 4))]
    assert heads.step(0, 0)["topk"] != plain.step(0, 0)["topk"] and heads.step(0, 1) == plain.step(0, 1)
    assert zero.generated != plain.generated and zero.done["patched"] == [list(range(LAST + 4))]
    assert zero.started["patch"] == [{"hook": "mlp.out", "source": "zero", "layers": None, "heads": None,
                                      "positions": None, "prompts": None}]


def test_the_client_captures_and_perturbs(server):
    with MegaScopeClient(server.ws, token=TOKEN) as scope:
        assert scope.model["num_layers"] == 4
        run = scope.capture(PAIR, ["resid_post", "attn.q"], layers=[3, 4])
        assert run.generated == [[], []] and run.activations[("blocks.3.attn.q", 1)].dims == ["token", "head", "d_head"]
        assert run.activation("blocks.3.resid_post", 1).shape == (LAST + 1, 64)
        before = scope.generate(PAIR, **GREEDY_PAIR).generated
        assert scope.perturb([NOISE]) == [{**NOISE, "layers": None, "enabled": True}]
        try:
            assert scope.generate(PAIR, **GREEDY_PAIR).generated != before
        finally:
            assert scope.perturb([]) == []
        assert scope.generate(PAIR, **GREEDY_PAIR).generated == before
        with pytest.raises(MegaScopeError) as refused:
            scope.perturb([{**NOISE, "noise": "loud"}])
        assert refused.value.field == "perturbations.0.noise"


@pytest.mark.parametrize("patch, code, field", [
    ({"hook": "attn.pattern", "source": "zero"}, "bad_hook", "patch.0.hook"),
    ({"hook": "resid_post", "source": {"prompt": 2}}, "bad_field", "patch.0.source.prompt"),
    ({"hook": "attn.q", "heads": [4], "source": "mean"}, "bad_field", "patch.0.heads"),
    ({"hook": "resid_post", "layers": [4], "source": "zero"}, "bad_field", "patch.0.layers"),
    ({"hook": "resid_post", "source": "zero", "eval": "1"}, "bad_field", "patch.0.eval"),
])
def test_a_bad_patch_is_one_error_frame_and_the_connection_goes_on(server, patch, code, field):
    async def client():
        async with websocket(server) as ws:
            await welcomed(ws)
            await send(ws, {"type": "generate", "id": "p", "prompts": PAIR, "patch": [patch]})
            error = await receive(ws)
            await send(ws, {"type": "ping", "id": "after"})
            return error, await receive(ws)
    error, after = run(client())
    assert (error["type"], error["code"], error["field"], error["id"]) == ("error", code, field, "p"), error
    assert after == {"type": "pong", "id": "after"}  # nothing else came: one error frame, no generation
    with MegaScopeClient(server.ws, token=TOKEN) as scope, pytest.raises(MegaScopeError) as raised:
        scope.patch(PAIR, [patch])
    assert (raised.value.code, raised.value.field) == (code, field)


# Every upper bit of mlp.fc1's float32 storage flipped: its zero biases become NaN, and so do the logits (bit
# flips in exponent bits do that to a trained model; a 4-rank server then died inside torch.multinomial).
BREAKING = {"id": "b", "kind": "storage", "target": "mlp.fc1", "noise": "bitflip", "scale": 1.0}


@pytest.fixture(scope="module", params=["tp2_pp2", "dp2"])
def layout_server(request):
    """A server of four ranks (TP2xPP2) or of two data-parallel replicas, shared by the module's tests."""
    flags = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    started = GenerationServer(4, TINY_SERVER + flags) if request.param == "tp2_pp2" else \
        GenerationServer(2, TINY_SERVER)
    yield started
    started.stop()


def test_patches_at_tp2_pp2_and_dp2_equal_one_rank(layout_server, one_rank_patches):
    for got, want in zip(patched_runs(layout_server.ws), one_rank_patches):
        assert got.generated == want.generated and got.done["patched"] == want.done["patched"]
        for ours, theirs in zip(got.tokens, want.tokens):
            for entry, other in zip(ours["tokens"], theirs["tokens"]):
                assert [t["token_id"] for t in entry["topk"]] == [t["token_id"] for t in other["topk"]]
                assert entry["prob"] == pytest.approx(other["prob"], abs=1e-4)
        assert got.activations.keys() == want.activations.keys()
        for key, activation in want.activations.items():
            np.testing.assert_allclose(got.activations[key].values, activation.values, rtol=FLOAT16_RTOL,
                                       atol=2e-3)


def test_a_perturbation_that_makes_the_logits_nan_ends_that_generation_and_the_server_goes_on(layout_server):
    server = layout_server
    try:
        set_perturbations(server, [BREAKING])

        async def client():
            async with websocket(server) as ws:
                await send(ws, {"type": "hello", "protocol": 1})
                assert (await receive(ws))["type"] == "welcome"
                messages, _ = await generation(ws, {"type": "generate", "id": "s", **SAMPLED})
                done = await receive(ws)
                while isinstance(done, bytes) or done["type"] != "generation_done":
                    done = await receive(ws)
                return messages[-1], done
        error, done = run(client())
        assert (error["type"], error["code"], error["id"]) == ("error", "non_finite", "s"), error
        assert "not finite (NaN or infinite)" in error["message"] and "perturbations" in error["message"]
        assert done["finish_reason"] == ["error", "error"]
        status, answer = server.put(SAMPLED)  # REST: every data-parallel replica's share broke
        assert status == 422 and "not finite" in answer["error"], answer
        completion = urllib.request.Request(server.rest + "/v1/completions", method="POST", data=json.dumps(
            {"model": "megatron", "prompt": PROMPTS, "max_tokens": 6}).encode())  # the OpenAI-compatible route too
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(completion, timeout=300)
        error = json.loads(refused.value.read())["error"]
        assert refused.value.code == 422 and error["code"] == "non_finite_logits" and "not finite" in error["message"]
    finally:
        set_perturbations(server, [])
    status, answer = server.put(SAMPLED)
    assert status == 200 and len(answer["tokens"]) == 2, answer
    assert server.job.poll() is None



def _raw_put(server, head, body=b""):
    """Send ``head`` (the request line and headers, without the blank line) and ``body`` over a socket of its own;
    the server's answer: (status, its body as JSON, or as text when it is not JSON)."""
    host, port = server.rest.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as connection:
        connection.sendall(head.encode() + b"\r\n\r\n" + body)
        answer = http.client.HTTPResponse(connection)
        answer.begin()
        data = answer.read()
    is_json = answer.getheader("Content-Type", "").startswith("application/json")
    return answer.status, json.loads(data) if is_json else data.decode()


TOO_LARGE = (413, {"error": "the body is over 1048576 bytes"})


@pytest.mark.parametrize("length", ["abc", "-1", "1e3", pytest.param("9" * 5000, id="5000-digits")])
def test_a_bad_content_length_is_a_400_naming_it_and_no_traceback(server, length):
    """It used to drop the connection with a ValueError traceback in the log ("-1": read until the client closed).
    aiohttp's parser answers a Content-Length that is not a size (or past any size) itself, in its own words."""
    seen = len(server.lines)
    status, answer = _raw_put(server, f"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Length: {length}",
                              b'{"prompts": ["x"]}')
    assert status == 400 and "Content-Length" in answer, answer
    assert server.put({"prompts": ["x"], "tokens_to_generate": 1})[0] == 200  # the server goes on
    assert "Traceback" not in "".join(server.lines[seen:])


def test_a_body_over_the_limit_is_a_413_whether_announced_or_sent(server):
    over = b"x" * ((1 << 20) + 1)
    head = "PUT /api HTTP/1.1\r\nHost: x\r\nContent-Length: "
    assert _raw_put(server, head + str(len(over))) == TOO_LARGE  # refused on its announced size, before it comes
    assert _raw_put(server, head + str(len(over)), over) == TOO_LARGE
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in (over[:1 << 19], over[1 << 19:]))
    chunked = "PUT /api HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
    assert _raw_put(server, chunked, chunks + b"0\r\n\r\n") == TOO_LARGE


def test_a_chunked_body_is_read_as_the_same_request(server):
    """Issue 53: a body sent with Transfer-Encoding: chunked (no Content-Length) was read as empty and refused with
    400 "the body must be a JSON object"."""
    request = {"prompts": ["Hello world"], "tokens_to_generate": 3, "top_k": 1}
    data = json.dumps(request).encode()
    host, port = server.rest.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request("PUT", "/api", body=iter([data[:7], data[7:]]), encode_chunked=True,
                           headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        answer = connection.getresponse()
        status, chunked = answer.status, json.loads(answer.read())
    finally:
        connection.close()
    assert status == 200, chunked
    assert chunked["tokens"] == server.put(request)[1]["tokens"]
    # a malformed chunk or an unknown transfer coding: aiohttp's parser answers 400 in its own words
    status, answer = _raw_put(server, "PUT /api HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked",
                              b"zz\r\n{}\r\n0\r\n\r\n")
    assert status == 400 and "chunk size" in answer, answer
    status, answer = _raw_put(server, "PUT /api HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip", b"x")
    assert status == 400 and "Transfer-Encoding" in answer, answer


@pytest.mark.parametrize("count", [17, 129])
def test_the_prompt_limit_is_one_limit_in_one_message(server, count):
    """17 prompts were refused with "at most 16", 129 with "at most 128": two limits for one request."""
    status, answer = server.put({"prompts": ["x"] * count, "tokens_to_generate": 1})
    assert (status, answer) == (400, {"field": "prompts", "error": f"prompts: at most 16 prompts per request here, "
                                      f"not {count}; send the others in another request"})


LONG = {"prompts": ["Once"], "tokens_to_generate": 63, "top_k": 1}
LONG_COMPLETION = {"model": "megatron", "prompt": "Once", "max_tokens": 63, "temperature": 0, "stream": True}


@pytest.mark.parametrize("method, path, body", [("PUT", "/api", LONG), ("POST", "/v1/completions", LONG_COMPLETION)],
                         ids=["rest", "openai-stream"])
def test_a_rest_client_that_goes_away_stops_its_generation(server, method, path, body):
    """An abandoned request used to generate all its tokens (holding the model from the requests behind it)."""
    seen = len(server.lines)
    data = json.dumps(body).encode()
    host, port = server.rest.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as connection:
        connection.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    # closed at once: the server reads the body, then finds the connection closed between steps
    assert server.put(SAMPLED)[0] == 200  # served after the abandoned one (REST requests take turns)
    assert server.logged("went away: its generation stopped after", since=seen), "".join(server.lines[-20:])
    stopped = re.search(r"went away: its generation stopped after (\d+) of 63 tokens", "".join(server.lines[seen:]))
    assert stopped and int(stopped.group(1)) < 63, "".join(server.lines[-20:])


CLIENT_PROMPTS = ["Once", "Hello world", "The", "In a"]


async def _answers_of_256_clients_at_once(server, greedy):
    """Client i sends prompt i % 4 at once with the others: PUT /api (even i) or POST /v1/completions (odd i).
    (status, generated text) of each, or the exception of one that got no answer."""
    async def ask(session, client):
        prompt = CLIENT_PROMPTS[client % len(CLIENT_PROMPTS)]
        if client % 2 == 0:
            async with session.put(server.rest + "/api", json={"prompts": [prompt], **greedy}) as answer:
                return answer.status, (await answer.json())["text"][0].removeprefix(prompt)
        completion = {"model": "megatron", "prompt": prompt, "max_tokens": greedy["tokens_to_generate"],
                      "temperature": 0}
        async with session.post(server.rest + "/v1/completions", json=completion) as answer:
            return answer.status, (await answer.json())["choices"][0]["text"]

    # a connection of its own for each client (no pool limit): 256 connections arrive together
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        return await asyncio.gather(*(ask(session, client) for client in range(256)), return_exceptions=True)


def test_256_clients_at_once_each_get_their_own_answer(server):
    """A burst beyond the standard library's listen backlog of 5 had connections reset (18 of 64 on this server), and
    each waiting request held a thread. Greedy, 2 new tokens: each client gets its own prompt's answer."""
    greedy = {"tokens_to_generate": 2, "top_k": 1}
    expected = {prompt: server.put({"prompts": [prompt], **greedy})[1]["text"][0].removeprefix(prompt)
                for prompt in CLIENT_PROMPTS}
    assert len(set(expected.values())) == len(CLIENT_PROMPTS), expected  # so that a mix-up between clients shows
    answers = run(_answers_of_256_clients_at_once(server, greedy))
    assert [answer for answer in answers if isinstance(answer, BaseException)] == []
    assert answers == [(200, expected[CLIENT_PROMPTS[client % len(CLIENT_PROMPTS)]]) for client in range(256)]
