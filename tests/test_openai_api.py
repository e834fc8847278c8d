"""The OpenAI-compatible routes (docs/openai_api.md) of tools/run_text_generation_server.py at TP2 x PP2 on CPU
(and at TP2 and at PP2 on two GPUs where there are),
driven by the pinned ``openai`` client: completions (a text, a batch, token ids, n, seed, stop strings),
log-probabilities with echo, streaming, chat with the tokenizer's chat template, and OpenAI-shaped errors for
bad fields after which the server goes on. The numbers are checked against ``PUT /api`` of the same server
(one engine) and the stop string against the greedy text."""

import json
import urllib.error
import urllib.request

import openai
import pytest
import torch
from helpers.generation_server import TINY_SERVER, GenerationServer, receive, run, send, websocket
from helpers.hf_tokenizer import write_word_tokenizer

VOCAB = 256
CHAT_TEMPLATE = ("{% for message in messages %}{{ bos_token }} w9 {{ message['content'] }} w8 {% endfor %}"
                 "{% if add_generation_prompt %}w7{% endif %}")
NAME = "tiny"


def word_model_flags(folder):
    """The tiny model's flags with a word tokenizer (and a chat template) in ``folder``."""
    write_word_tokenizer(folder, VOCAB)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "w2", "bos_token": "w1", "chat_template": CHAT_TEMPLATE}))
    gpt2 = TINY_SERVER.index("--tokenizer-type")
    return TINY_SERVER[:gpt2] + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(folder),
                                 "--served-model-name", NAME]


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
# (ranks, device, layout flags): TP2 x PP2 on CPU; on two GPUs (NCCL) TP2 and PP2, each its own server.
LAYOUTS = {"cpu-tp2-pp2": (4, "cpu", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
           "cuda-tp2": (2, "cuda", ["--tensor-model-parallel-size", "2"]),
           "cuda-pp2": (2, "cuda", ["--pipeline-model-parallel-size", "2"])}


def on_device(flags, device):
    at = flags.index("--device")
    return flags[:at] + ["--device", device] + flags[at + 2:]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def server(request, tmp_path_factory):
    ranks, device, layout = LAYOUTS[request.param]
    if device == "cuda" and GPUS < ranks:
        pytest.skip(f"needs {ranks} GPUs, {GPUS} found")
    started = GenerationServer(ranks, on_device(word_model_flags(tmp_path_factory.mktemp("openai_tokenizer")), device)
                               + layout)
    started.device = device
    yield started
    started.stop()


@pytest.fixture(scope="module")
def client(server):
    # no retries: a refusal must reach the test as it was answered
    return openai.OpenAI(base_url=server.rest + "/v1", api_key="unused", max_retries=0, timeout=300)


def words(*ids):
    return " ".join(f"w{i}" for i in ids)


def test_models_lists_the_served_model(client):
    assert [model.id for model in client.models.list()] == [NAME]
    assert client.models.retrieve(NAME).id == NAME


def test_greedy_completions_equal_the_rest_api(server, client):
    prompts = [words(5, 17, 3, 250), words(11, 12)]
    answer = client.completions.create(model=NAME, prompt=prompts, max_tokens=8, temperature=0)
    status, rest = server.put({"prompts": prompts, "tokens_to_generate": 8, "top_k": 1})
    assert status == 200, rest
    for choice, prompt, text in zip(answer.choices, prompts, rest["text"]):
        assert prompt + " " + choice.text == text
    generated = sum(len(tokens) for tokens in rest["tokens"]) - 6
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (6, generated)
    by_ids = client.completions.create(model=NAME, prompt=[[5, 17, 3, 250], [11, 12]], max_tokens=8, temperature=0)
    assert [choice.text for choice in by_ids.choices] == [choice.text for choice in answer.choices]


def test_seeded_samples_repeat_and_n_gives_distinct_choices(server, client):
    request = {"model": NAME, "prompt": words(4, 5, 6), "max_tokens": 6, "temperature": 0.9, "seed": 77}
    first = client.completions.create(n=3, **request)
    again = client.completions.create(n=3, **request)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and len({c.text for c in first.choices}) > 1
    # choice i draws from prompt i's stream: PUT /api with the prompt repeated gives the same samples
    status, rest = server.put({"prompts": [words(4, 5, 6)] * 3, "tokens_to_generate": 6, "temperature": 0.9,
                               "random_seed": 77})
    assert status == 200 and [words(4, 5, 6) + " " + c.text for c in first.choices] == rest["text"]


def test_echo_logprobs_score_the_prompt(server, client):
    prompt = words(5, 17, 3, 250, 42, 9)
    answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=3)
    logprobs = answer.choices[0].logprobs
    assert answer.choices[0].text == prompt and logprobs.tokens == prompt.split()
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    status, rest = server.put({"prompts": [prompt], "tokens_to_generate": 0, "logprobs": True})
    assert status == 200
    assert logprobs.token_logprobs[1:] == pytest.approx(rest["logprobs"][0], abs=1e-5)
    for token, value, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
        assert len(top) == 3 and max(top.values()) >= value - 1e-6
        assert token not in top or top[token] == pytest.approx(value, abs=1e-5)
    assert logprobs.text_offset[:3] == [0, 2, 6]  # "w5 w17 w3": where the text before each ends
    generated = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=1)
    for value, top in zip(generated.choices[0].logprobs.token_logprobs, generated.choices[0].logprobs.top_logprobs):
        assert max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy: the chosen token is the best one


def test_stop_strings_and_streaming(client):
    request = {"model": NAME, "prompt": words(8, 30, 31), "max_tokens": 10, "temperature": 0}
    greedy = client.completions.create(**request).choices[0]
    stop = greedy.text.split()[3]
    expected = greedy.text[:greedy.text.index(stop)]
    cut = client.completions.create(stop=stop, **request).choices[0]
    assert (cut.text, cut.finish_reason) == (expected, "stop")

    def streamed(**extra):
        chunks = list(client.completions.create(stream=True, **request, **extra))
        return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices), chunks
    text, chunks = streamed()
    assert text == greedy.text and chunks[-1].choices[0].finish_reason == greedy.finish_reason
    text, chunks = streamed(stop=[stop], stream_options={"include_usage": True})
    assert text == expected and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.prompt_tokens == 3 and chunks[-1].usage.completion_tokens <= 4


def test_streamed_events_end_with_done(server):
    body = json.dumps({"model": NAME, "prompt": words(3, 4), "max_tokens": 3, "stream": True}).encode()
    request = urllib.request.Request(server.rest + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as answer:
        assert answer.headers["Content-Type"] == "text/event-stream"
        events = [line for line in answer.read().decode().split("\n\n") if line]
    assert all(event.startswith("data: ") for event in events) and events[-1] == "data: [DONE]"


def test_chat_uses_the_chat_template(client):
    messages = [{"role": "system", "content": words(20)}, {"role": "user", "content": words(5, 17)}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=2)
    rendered = words(1) + " w9 " + words(20) + " w8 " + words(1) + " w9 " + words(5, 17) + " w8 w7"
    completion = client.completions.create(model=NAME, prompt=rendered, max_tokens=6, temperature=0)
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == completion.choices[0].text
    assert chat.usage.prompt_tokens == len(rendered.split()) == completion.usage.prompt_tokens
    assert [entry.token for entry in choice.logprobs.content] == choice.message.content.split()
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == choice.message.content


@pytest.mark.parametrize("extra, status, param", [
    ({"temperature": 3}, 400, "temperature"),
    ({"max_tokens": 10 ** 5}, 400, "max_tokens"),
    ({"n": 100}, 400, "prompt"),
    ({"logprobs": 9}, 400, "logprobs"),
    ({"top_k": 5, "top_p": 0.5}, 400, "top_p"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"seed": -4}, 400, "seed"),
    ({"frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"prompt": (words(1) + " ") * 70}, 400, "prompt"),  # longer than the model reads
    ({"prompt": [[VOCAB + 10]]}, 400, "prompt"),
    ({"prompt": 3}, 400, "prompt"),
    ({"model": "gpt-4"}, 404, "model"),
    ({"prompt": "w1 " * 400_000}, 413, None),  # over the server's body limit
])
def test_bad_fields_get_openai_errors_and_the_server_goes_on(client, extra, status, param):
    body = {"model": NAME, "prompt": words(3), "max_tokens": 2, **extra}
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(**{key: body.pop(key) for key in ("model", "prompt")}, extra_body=body)
    error = refused.value
    assert error.status_code == status, error.body
    assert set(error.body) == {"message", "type", "param", "code"} and error.body["param"] == param, error.body
    assert error.body["type"] == "invalid_request_error" and error.body["message"]
    assert client.completions.create(model=NAME, prompt=words(3), max_tokens=1).choices[0].finish_reason


def test_chat_errors_name_the_chat_fields(client):
    for extra, param in [({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "x"}]},
                                                          "messages"),
                         ({"top_logprobs": 2}, "top_logprobs"), ({"max_completion_tokens": 10 ** 5}, "max_tokens")]:
        body = {"messages": [{"role": "user", "content": words(3)}], **extra}
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=NAME, messages=body.pop("messages"), extra_body=body)
        assert refused.value.body["param"] == param, refused.value.body


def test_busy_while_a_websocket_generation_holds_the_model(server, client):
    async def hold_the_model():
        async with websocket(server) as ws:
            await send(ws, {"type": "hello", "protocol": 2})
            assert (await receive(ws))["type"] == "welcome"
            await send(ws, {"type": "generate", "id": "long", "prompts": [words(3)], "tokens_to_generate": 60})
            assert (await receive(ws))["type"] == "generation_started"
            with pytest.raises(openai.InternalServerError) as refused:
                client.completions.create(model=NAME, prompt=words(3), max_tokens=1)
            await send(ws, {"type": "cancel", "id": "long"})
            while (await receive(ws))["type"] != "generation_done":
                pass
        return refused.value
    busy = run(hold_the_model())
    assert busy.status_code == 503 and busy.body["code"] == "server_busy" and busy.body["type"] == "server_error"
    assert client.completions.create(model=NAME, prompt=words(3), max_tokens=1).choices[0].finish_reason


@pytest.mark.parametrize("method, path, code", [("POST", "/v1/embeddings", "not_found"),
                                                ("GET", "/v1/completions", "not_found"),
                                                ("GET", "/v1/models/gpt-4", "model_not_found")])
def test_unknown_routes_get_openai_errors(server, method, path, code):
    request = urllib.request.Request(server.rest + path, data=b"{}" if method == "POST" else None, method=method)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 404 and json.loads(refused.value.read())["error"]["code"] == code


def test_data_parallel_replicas_answer_as_one(server, client, tmp_path):
    """DP 2 (on the server's device): a whole answer shares its choices among the replicas, a stream runs on the
    first; both give the model-parallel server's seeded choices."""
    request = {"model": NAME, "prompt": [words(4, 5), words(6, 7, 8)], "max_tokens": 5, "temperature": 0.8,
               "seed": 5, "n": 2}
    expected = [choice.text for choice in client.completions.create(**request).choices]
    replicas = GenerationServer(2, on_device(word_model_flags(tmp_path), server.device))
    try:
        dp = openai.OpenAI(base_url=replicas.rest + "/v1", api_key="unused", max_retries=0, timeout=300)
        assert [choice.text for choice in dp.completions.create(**request).choices] == expected
        streamed = ["", "", "", ""]
        for chunk in dp.completions.create(stream=True, **request):
            streamed[chunk.choices[0].index] += chunk.choices[0].text
        assert streamed == expected
    finally:
        replicas.stop()
