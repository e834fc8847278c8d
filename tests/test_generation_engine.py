"""The KV-cache generation engine (megatron/inference/engine.py) under torchrun with gloo: greedy equals the
no-cache greedy loop, the static-cache path equals megatron-core's inference path (also for a Llama-like
architecture), and a fixed seed draws the same tokens (and log-probabilities) at TP1, TP2, PP2, TP2xPP2
and with two data-parallel replicas, also when each replica generates a share of the prompts (each prompt
draws from its own stream: alone it gets the tokens it has in the batch)."""

import json

import pytest
from helpers.generation_server import TINY_SERVER as TINY  # the servers' tiny model: the same flags
from helpers.launch import assert_succeeded, torchrun

LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "tp2pp2": (2, 2, 1), "dp2": (1, 1, 2)}
# Llama's architecture (rotary, grouped-query attention with QKV bias, SwiGLU, RMSNorm) at TP2.
LLAMA_LIKE = ["--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "2", "--swiglu",
              "--normalization", "RMSNorm", "--disable-bias-linear", "--add-qkv-bias"]


@pytest.fixture(scope="module")
def generations(tmp_path_factory):
    results = {}
    for name, (tp, pp, dp), extra in [*((name, layout, []) for name, layout in LAYOUTS.items()),
                                      ("llama_tp2", (2, 1, 1), LLAMA_LIKE)]:
        out = tmp_path_factory.mktemp(name) / "generation.json"
        result = torchrun(tp * pp * dp, "tests/helpers/generation_check.py",
                          TINY + extra + ["--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp],
                          env={"GENERATION_CHECK_OUT": str(out)})
        assert_succeeded(result)
        results[name] = json.loads(out.read_text())
    return results


def test_kv_cache_greedy_equals_the_no_cache_greedy_loop(generations):
    for name, result in generations.items():
        assert result["kv_greedy"] == result["no_cache_greedy"], name
    assert len(set(generations["tp1"]["kv_greedy"][0][6:])) > 1  # not one token repeated


def test_static_cache_path_equals_megatron_cores_inference_path(generations):
    """Where the engine runs on its own static KV cache (one pipeline stage) it must generate what megatron-core's
    StaticInferenceContext path generates; with pipeline stages both runs take megatron-core's path."""
    for name, result in generations.items():
        theirs = result["megatron_path"]
        assert result["kv_greedy"] == theirs["greedy"], name
        assert result["plain"]["tokens"] == theirs["plain"]["tokens"], name
        for ours, reference in zip(result["plain"]["logprobs"], theirs["plain"]["logprobs"]):
            assert ours == pytest.approx(reference, abs=1e-4), name
    assert len(set(generations["llama_tp2"]["kv_greedy"][0][6:])) > 1


def test_same_seed_same_tokens_at_every_layout(generations):
    reference = generations["tp1"]
    for name, result in generations.items():
        if name not in LAYOUTS:
            continue  # another architecture
        for sampling in ("top_k", "top_p", "plain"):
            assert result[sampling]["tokens"] == reference[sampling]["tokens"], (name, sampling)
            assert result[sampling]["finish"] == ["length"] * 3
        for ours, theirs in zip(result["plain"]["logprobs"], reference["plain"]["logprobs"]):
            assert ours == pytest.approx(theirs, abs=1e-4), name
        # the server's DP path (at dp2 each replica generates a share) and prompt 1 alone: the same tokens
        assert result["shared"]["tokens"] == reference["plain"]["tokens"], name
        for ours, theirs in zip(result["shared"]["logprobs"], reference["plain"]["logprobs"]):
            assert ours == pytest.approx(theirs, abs=1e-4), name
        assert result["alone"] == reference["plain"]["tokens"][1:2], name
    lengths = [len(tokens) for tokens in reference["plain"]["tokens"]]
    assert lengths == [3 + 12, 7 + 12, 2 + 12]  # mixed prompt lengths, 12 new tokens each
    assert [len(values) for values in reference["plain"]["logprobs"]] == [n - 1 for n in lengths]
