"""Hugging Face Llama-family checkpoints converted to ours compute the same logits and greedy tokens
at TP1 and TP2 x PP2, convert back to the same tensors, and bad input is one line with exit code 2."""

import glob
import json

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from launch import assert_succeeded, run_script, torchrun

VOCAB = 300  # not a multiple of 128: the converted embedding carries padding rows
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=False)
LLAMA3 = (LlamaConfig, LlamaForCausalLM, dict(
    max_position_embeddings=16384, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}))
QWEN2 = (Qwen2Config, Qwen2ForCausalLM, dict(max_position_embeddings=256, rope_theta=1000000.0))
PROMPTS = [[5, 17, 3, 250, 42, 42, 7, 99], [280, 1, 64, 64, 12, 9, 150, 31], [8, 8, 8, 200, 77, 3, 14, 299]]
NEW_TOKENS = 16
CONVERT = "tools/checkpoint/convert.py"


def _word_tokenizer(directory):
    """A word-level tokenizer over w0..w299, so that "w5 w17" is exactly the ids [5, 17]."""
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2"}))


def _hf_model(directory, family, seed):
    config_class, model_class, extra = family
    torch.manual_seed(seed)
    model = model_class(config_class(**SHAPE, **extra, architectures=[model_class.__name__])).eval()
    model.save_pretrained(directory, max_shard_size="100KB")  # several shards
    assert len(glob.glob(str(directory / "*.safetensors"))) > 2
    _word_tokenizer(directory)
    return model


def _convert(hf_dir, out, *flags):
    result = run_script(CONVERT, ["--model-type", "GPT", "--loader", "llama_mistral", "--saver", "core",
                                  "--checkpoint-type", "hf", "--model-size", "llama3", "--load-dir", hf_dir,
                                  "--save-dir", out, *flags])
    assert_succeeded(result)
    return result


def _hf_reference(model):
    prompts = torch.tensor(PROMPTS)
    with torch.no_grad():
        logits = model(prompts).logits
        tokens = prompts
        for _ in range(NEW_TOKENS):
            tokens = torch.cat([tokens, model(tokens).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return logits, tokens


def _ours(tmp_path, checkpoint, nproc, tp, pp):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([" ".join(f"w{i}" for i in ids) for ids in PROMPTS]))
    output = tmp_path / f"ours_tp{tp}_pp{pp}.pt"
    model_args = (checkpoint / "model_args.txt").read_text().split()
    result = torchrun(nproc, "tools/checkpoint/generate_greedy.py", model_args + [
        "--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp, "--device", "cpu",
        "--seq-length", 64, "--prompts-json", prompts, "--max-new-tokens", NEW_TOKENS, "--output", output])
    assert_succeeded(result)
    return torch.load(output)


def _assert_same_numbers(ours, hf_logits, hf_tokens):
    assert ours["logits"].shape == hf_logits.shape
    relative = (ours["logits"] - hf_logits).abs().max() / hf_logits.abs().max()
    assert relative < 1e-4, relative
    assert ours["tokens"].tolist() == hf_tokens.tolist()


def _tensors(directory):
    tensors = {}
    for path in glob.glob(str(directory / "*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """A tiny Llama 3 (rope scaling, GQA, untied) converted for TP2 x PP2."""
    root = tmp_path_factory.mktemp("llama3")
    model = _hf_model(root / "hf", LLAMA3, seed=0)
    converted = _convert(root / "hf", root / "megatron", "--target-tensor-parallel-size", "2",
                         "--target-pipeline-parallel-size", "2")
    return root, model, converted


def test_conversion_reports_each_shard_and_the_flags_to_load_it(llama3):
    root, _, converted = llama3
    shards = len(glob.glob(str(root / "hf" / "*.safetensors")))
    assert sum(line.startswith("shard ") and "GB/s" in line for line in converted.stdout.splitlines()) == shards
    flags = (root / "megatron" / "model_args.txt").read_text()
    for flag in ("--num-layers 4", "--swiglu", "--num-query-groups 2", "--rotary-base 500000",
                 "--use-rope-scaling --rope-scaling-factor 8.0", "--tokenizer-type HuggingFaceTokenizer"):
        assert flag in flags
    assert (root / "megatron" / "latest_checkpointed_iteration.txt").read_text() == "1"


def test_llama3_at_tp2_pp2_computes_the_hf_logits_and_greedy_tokens(llama3, tmp_path):
    root, model, _ = llama3
    _assert_same_numbers(_ours(tmp_path, root / "megatron", 4, 2, 2), *_hf_reference(model))


def test_converting_back_gives_the_original_tensors_and_a_model_transformers_loads(llama3, tmp_path):
    root, model, _ = llama3
    result = run_script(CONVERT, ["--model-type", "GPT", "--loader", "core", "--saver", "hf",
                                  "--load-dir", root / "megatron", "--save-dir", tmp_path / "back",
                                  "--max-shard-size-gb", "0.0001"])
    assert_succeeded(result)
    original, back = _tensors(root / "hf"), _tensors(tmp_path / "back")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    prompts = torch.tensor(PROMPTS)
    with torch.no_grad():
        assert torch.equal(reloaded(prompts).logits, model(prompts).logits)


def test_qwen2_with_qkv_bias_at_tp1_computes_the_hf_logits_and_greedy_tokens(tmp_path):
    model = _hf_model(tmp_path / "hf", QWEN2, seed=1)
    _convert(tmp_path / "hf", tmp_path / "megatron")
    assert "--add-qkv-bias" in (tmp_path / "megatron" / "model_args.txt").read_text()
    _assert_same_numbers(_ours(tmp_path, tmp_path / "megatron", 1, 1, 1), *_hf_reference(model))


def _convert_error(hf_dir, out, *flags):
    result = run_script(CONVERT, ["--model-type", "GPT", "--loader", "llama_mistral", "--saver", "core",
                                  "--load-dir", hf_dir, "--save-dir", out, *flags])
    assert result.returncode == 2, result.stderr[-3000:]
    return result.stderr.strip().splitlines()


def test_bad_input_is_one_line_and_an_existing_checkpoint_is_never_overwritten(llama3, tmp_path):
    root, _, _ = llama3
    assert _convert_error(tmp_path / "absent", tmp_path / "out") == [
        f"convert.py: error: --load-dir {tmp_path / 'absent'} is not a directory"]
    assert _convert_error(root / "hf", tmp_path / "out", "--target-tensor-parallel-size", "3") == [
        "convert.py: error: --target-tensor-parallel-size 3 does not divide the model's 4 attention heads"]
    assert _convert_error(root / "hf", tmp_path / "out", "--target-pipeline-parallel-size", "3") == [
        "convert.py: error: --target-pipeline-parallel-size 3 does not divide the model's 4 layers"]
    before = sorted(p.name for p in (root / "megatron").iterdir())
    assert _convert_error(root / "hf", root / "megatron") == [
        f"convert.py: error: --save-dir {root / 'megatron'} already holds a checkpoint; it is never "
        f"overwritten: name a new directory"]
    assert sorted(p.name for p in (root / "megatron").iterdir()) == before
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert _convert_error(gpt2, tmp_path / "out") == [
        f"convert.py: error: {gpt2 / 'config.json'}: architecture GPT2LMHeadModel is not supported; "
        f"supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"]
    assert not (tmp_path / "out").exists()
