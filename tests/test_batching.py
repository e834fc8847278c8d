"""Continuous batching (megatron/inference/batcher.py) on CPU with gloo: requests submitted at once (mixed prompt
lengths, greedy and seeded sampling, log-probabilities, scoring, a prompt read in chunks beside decoding rows) yield
exactly what each yields alone in the batch and on the exclusive path, at TP1, TP2 x PP2 and two data-parallel
replicas, and the same tokens at every layout; a server answers 64 concurrent clients in far fewer steps than it
would one at a time."""

import concurrent.futures
import json
import re
import signal

import pytest
from helpers.generation_server import TINY_SERVER, GenerationServer
from helpers.launch import assert_succeeded, torchrun

LAYOUTS = {"tp1": (1, 1, 1), "tp2pp2": (2, 2, 1), "dp2": (1, 1, 2)}


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    results = {}
    for name, (tp, pp, dp) in LAYOUTS.items():
        out = tmp_path_factory.mktemp(name) / "batching.json"
        result = torchrun(tp * pp * dp, "tests/helpers/batching_check.py",
                          TINY_SERVER + ["--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp],
                          env={"BATCHING_CHECK_OUT": str(out)})
        assert_succeeded(result)
        results[name] = json.loads(out.read_text())
    return results


def test_a_batched_request_yields_what_it_yields_alone(checks):
    for name, result in checks.items():
        for index, (batched, alone, exclusive) in enumerate(zip(result["batched"], result["alone"],
                                                                result["exclusive"])):
            assert "error" not in batched and "error" not in alone, (name, index, batched, alone)
            assert batched["tokens"] == alone["tokens"] == exclusive, (name, index)
            assert batched["finish"] == alone["finish"], (name, index)
            assert (batched["logprobs"] is None) == (alone["logprobs"] is None)
            for ours, theirs in zip(batched["logprobs"] or [], alone["logprobs"] or []):
                assert ours == pytest.approx(theirs, abs=1e-4), (name, index)
            for ours, theirs in zip(batched["top_logprobs"] or [], alone["top_logprobs"] or []):  # the same ids
                assert [[token for token, _ in pairs] for pairs in ours] == \
                    [[token for token, _ in pairs] for pairs in theirs], (name, index)


def test_scoring_and_sampling_requests_report_every_position(checks):
    result = checks["tp1"]
    scored = result["batched"][4]  # max_tokens 0 with logprobs: the 20-token prompt scored, read in chunks
    assert [len(tokens) for tokens in scored["tokens"]] == [20]
    assert [len(values) for values in scored["logprobs"]] == [19]
    assert all(len(pairs) == 2 for pairs in scored["top_logprobs"][0])
    sampled = result["batched"][2]  # top-p with logprobs and 3 top log-probabilities
    assert [len(values) for values in sampled["logprobs"]] == [len(tokens) - 1 for tokens in sampled["tokens"]]
    assert len(set(sampled["tokens"][0][20:])) > 1  # not one token repeated


def test_every_layout_gives_the_same_tokens(checks):
    reference = checks["tp1"]["batched"]
    for name, result in checks.items():
        assert [request["tokens"] for request in result["batched"]] == [request["tokens"] for request in reference], \
            name


def test_the_batch_runs_fewer_steps_than_its_requests_one_after_another(checks):
    for name, result in checks.items():
        tokens = sum(len(tokens) - length for request in result["batched"]
                     for tokens, length in zip(request["tokens"], request["prompt_lengths"]))
        assert result["steps"] < tokens / 2, (name, result["steps"], tokens)


@pytest.fixture(scope="module")
def server():
    server = GenerationServer(1, TINY_SERVER + ["--inference-max-requests", "64"])
    yield server
    server.stop()


def test_64_concurrent_clients_share_the_batch_and_each_gets_its_own_tokens(server):
    def generate(index):
        return server.put({"prompts": [f"Client {index} asks" + " why" * (index % 5)], "tokens_to_generate": 8,
                           "top_k": 1})
    with concurrent.futures.ThreadPoolExecutor(64) as clients:
        answers = list(clients.map(generate, range(64)))
    assert [status for status, _ in answers] == [200] * 64
    for index in (0, 13, 63):  # the same request alone
        assert generate(index)[1]["tokens"] == answers[index][1]["tokens"]
    code, output, alive = server.interrupt(signal.SIGINT, pid=server.rank0)  # as kill -INT <server pid>
    served = re.search(r"batch: (\d+) requests served, (\d+) tokens in (\d+) steps", output)
    assert code == 0 and not alive and served, output[-3000:]
    requests, tokens, steps = map(int, served.groups())
    assert requests == 67 and tokens == 67 * 8
    assert steps < tokens / 8  # one at a time, each token would take a step
