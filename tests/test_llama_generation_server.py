"""A tiny random Llama 3 converted from Hugging Face (tools/checkpoint/convert.py) served by
examples/inference/llama_mistral/run_text_generation_llama3.sh: greedy tokens equal transformers',
and "chat": true applies the tokenizer's chat template."""

import json
import sys

import pytest
import torch

from generation_server import GenerationServer
from launch import REPO, free_port
from test_hf_conversion import LLAMA3, _convert, _hf_model

PROMPT = [5, 17, 3, 250, 42]
CHAT_TEMPLATE = ("{% for message in messages %}{{ bos_token }} w9 {{ message['content'] }} w8 {% endfor %}"
                 "{% if add_generation_prompt %}w7{% endif %}")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama3_server")
    model = _hf_model(root / "hf", LLAMA3, seed=1)
    (root / "hf" / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "w2", "bos_token": "w1", "chat_template": CHAT_TEMPLATE}))
    _convert(root / "hf", root / "megatron")
    server = GenerationServer(0, [], command=[
        "bash", str(REPO / "examples/inference/llama_mistral/run_text_generation_llama3.sh"),
        str(root / "megatron"), str(root / "megatron" / "hf"), "--port", "0", "--ws-port", "0"],  # as documented
        env={"DEVICE": "cpu", "MASTER_PORT": str(free_port()), "PYTHON": sys.executable})
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
