"""--use-checkpoint-args: checkpoints record their model and tokenizer flags, and the generation tools read them
from --load, so that a converted Llama 3 serves with --load and the layout alone (its greedy tokens, through the
OpenAI client, equal transformers'); a training checkpoint's recorded flags parse back to the same model."""

import json

import openai
import pytest
import torch
from helpers.generation_server import TINY_SERVER, GenerationServer
from helpers.launch import REPO, TINY_GPT, assert_succeeded, run_script
from test_hf_conversion import LLAMA3, _convert, _hf_model

from megatron.inference.model_setup import setup_for_generation
from megatron.training.arguments import build_parser, parse_args
from megatron.training.checkpoint_model import MODEL_FLAGS, model_flags
from megatron.training.errors import ArgumentError
from megatron.training.validate_args import validate_args

PROMPT = [5, 17, 3, 250, 42]


def test_recorded_flags_parse_back_to_the_same_model():
    training = ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "0", "--mock-data"]
    args = parse_args(training + TINY_SERVER, "pretrain_gpt.py")
    validate_args(args, world_size=1)
    recorded = model_flags(args, build_parser("checkpoint"))
    again = parse_args(training + recorded, "pretrain_gpt.py")
    validate_args(again, world_size=1)
    for name in [*MODEL_FLAGS, "seq_length", "init_method_std", "tokenizer_type", "vocab_file", "merge_file"]:
        assert getattr(again, name) == getattr(args, name), name


def test_use_checkpoint_args_needs_load():
    with pytest.raises(ArgumentError, match="--use-checkpoint-args needs --load"):
        setup_for_generation(["--use-checkpoint-args", "--device", "cpu"], "run_text_generation_server.py",
                             lambda args: None)


def test_a_trained_checkpoint_generates_from_load_alone(tmp_path):
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(REPO / "datasets/gpt/vocab.json"),
                 "--merge-file", str(REPO / "datasets/gpt/merges.txt")]
    assert_succeeded(run_script("pretrain_gpt.py", TINY_GPT + tokenizer + ["--mock-data", "--train-iters", "3",
                                                                        "--save", str(tmp_path / "ckpt")]))
    (tmp_path / "prompts.json").write_text(json.dumps(["Hello world, this is"]))
    common = ["--load", str(tmp_path / "ckpt"), "--prompts-json", str(tmp_path / "prompts.json"),
              "--max-new-tokens", "6", "--device", "cpu"]
    model_flags = TINY_GPT[:TINY_GPT.index("--micro-batch-size")] + ["--hidden-dropout", "0",
                                                                      "--attention-dropout", "0"]
    for name, flags in [("given", model_flags + tokenizer), ("recorded", ["--use-checkpoint-args"])]:
        assert_succeeded(run_script("tools/checkpoint/generate_greedy.py",
                                    common + flags + ["--output", str(tmp_path / f"{name}.pt")]))
    given, recorded = (torch.load(tmp_path / f"{name}.pt") for name in ("given", "recorded"))
    assert torch.equal(given["tokens"], recorded["tokens"]) and torch.equal(given["logits"], recorded["logits"])


def test_converted_llama_serves_from_load_alone(tmp_path):
    model = _hf_model(tmp_path / "hf", LLAMA3, seed=1)
    _convert(tmp_path / "hf", tmp_path / "megatron")
    server = GenerationServer(1, ["--load", str(tmp_path / "megatron"), "--use-checkpoint-args", "--device", "cpu"])
    try:
        client = openai.OpenAI(base_url=server.rest + "/v1", api_key="unused", max_retries=0, timeout=300)
        answer = client.completions.create(model="megatron", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=1)
    finally:
        server.stop()
    with torch.no_grad():
        expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0].tolist()[len(PROMPT):]
    got = [int(token[1:]) for token in answer.choices[0].logprobs.tokens]  # the word tokenizer's w<id>
    assert len(got) > 3 and got == expected[:len(got)]
    assert len(got) == len(expected) or got[-1] == 2  # stopped early only at the eos (w2)
