"""A tiny random Llama 3 converted from Hugging Face (tools/checkpoint/convert.py) served by
examples/inference/llama_mistral/run_text_generation_llama3.sh: greedy tokens equal transformers',
and "chat": true applies the tokenizer's chat template."""

import contextlib
import json
import socket
import sys

import pytest
import torch
from helpers.generation_server import GenerationServer
from helpers.launch import REPO
from test_hf_conversion import LLAMA3, _convert, _hf_model

PROMPT = [5, 17, 3, 250, 42]
CHAT_TEMPLATE = ("{% for message in messages %}{{ bos_token }} w9 {{ message['content'] }} w8 {% endfor %}"
                 "{% if add_generation_prompt %}w7{% endif %}")


TORCHRUN_DEFAULT_PORT = 29500


@contextlib.contextmanager
def _held(port):
    """``port`` in use while the block runs: listened on here, or already by someone else."""
    try:
        holder = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    except OSError:  # taken already
        holder = None
    try:
        yield
    finally:
        if holder is not None:
            holder.close()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama3_server")
    model = _hf_model(root / "hf", LLAMA3, seed=1)
    (root / "hf" / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "w2", "bos_token": "w1", "chat_template": CHAT_TEMPLATE}))
    _convert(root / "hf", root / "megatron")
    # No MASTER_PORT: the script picks a free rendezvous port. It took torchrun's 29500, so a second server
    # (or any other job there: held here while the server starts) died with torchrun's trace. Started from the
    # checkpoint's parent with relative paths (issue 53): the script moved into the repository before reading
    # them, and refused them as missing.
    with _held(TORCHRUN_DEFAULT_PORT):
        server = GenerationServer(0, [], command=[
            "bash", str(REPO / "examples/inference/llama_mistral/run_text_generation_llama3.sh"),
            "megatron", "megatron/hf", "--port", "0", "--ws-port", "0"],  # as documented
            env={"DEVICE": "cpu", "PYTHON": sys.executable}, cwd=root)
    yield model, server
    server.stop()


def test_greedy_tokens_equal_transformers(llama):
    model, server = llama
    status, answer = server.put({"prompts": [" ".join(f"w{i}" for i in PROMPT)], "tokens_to_generate": 10,
                                 "top_k": 1})
    assert status == 200, answer
    with torch.no_grad():
        expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0].tolist()
    got = answer["tokens"][0]
    assert len(got) > len(PROMPT) + 3 and got == expected[:len(got)]
    assert len(got) == len(expected) or got[-1] == 2  # stopped early only at the eos (w2)


def test_chat_applies_the_template(llama):
    _, server = llama
    status, answer = server.put({"prompts": ["w5 w17"], "tokens_to_generate": 2, "top_k": 1, "chat": True})
    assert status == 200, answer
    assert answer["tokens"][0][:6] == [1, 9, 5, 17, 8, 7]  # bos w9 <prompt> w8 w7
