"""Hugging Face Llama-family checkpoints converted to ours compute the same logits and greedy tokens
at the converted layout and at others, fine-tune from where the HF model is, convert back to the same
tensors, and bad input is one line with exit code 2."""

import contextlib
import fcntl
import glob
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from helpers.hf_tokenizer import write_word_tokenizer
from helpers.launch import (
    REPO,
    assert_succeeded,
    child_env,
    free_port,
    kill_process_tree,
    lm_losses,
    run_script,
    torchrun,
)
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from safetensors.torch import load_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from megatron.training.errors import UserError
from megatron.training.save_dir.conversion_output import written_atomically
from megatron.training.tokenizer.build import vocab_size_with_padding

VOCAB = 300  # not a multiple of 128: the converted embedding carries padding rows
SHAPE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": VOCAB, "tie_word_embeddings": False}
LLAMA3 = (LlamaConfig, LlamaForCausalLM, {
    "max_position_embeddings": 16384, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}})
QWEN2 = (Qwen2Config, Qwen2ForCausalLM, {"max_position_embeddings": 256, "rope_theta": 1000000.0})
# As small Qwen2 models are: the output layer is the embedding.
QWEN2_TIED = (Qwen2Config, Qwen2ForCausalLM, {"max_position_embeddings": 256, "rope_theta": 1000000.0,
                                              "tie_word_embeddings": True})
MISTRAL = (MistralConfig, MistralForCausalLM, {"max_position_embeddings": 256, "rope_theta": 1000000.0,
                                               "sliding_window": None})
PROMPTS = [[5, 17, 3, 250, 42, 42, 7, 99], [280, 1, 64, 64, 12, 9, 150, 31], [8, 8, 8, 200, 77, 3, 14, 299]]
NEW_TOKENS = 16
CONVERT = "tools/checkpoint/convert.py"


def _hf_model(directory, family, seed):
    config_class, model_class, extra = family
    torch.manual_seed(seed)
    model = model_class(config_class(**{**SHAPE, **extra}, architectures=[model_class.__name__])).eval()
    model.save_pretrained(directory, max_shard_size="100KB")  # several shards
    assert len(glob.glob(str(directory / "*.safetensors"))) > 2
    write_word_tokenizer(directory, VOCAB)
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


def _convert_back(checkpoint, out, *flags):
    result = run_script(CONVERT, ["--model-type", "GPT", "--loader", "core", "--saver", "hf", "--load-dir", checkpoint,
                                  "--save-dir", out, "--max-shard-size-gb", "0.0001", *flags])
    assert_succeeded(result)
    return _tensors(out)


def _assert_round_trip(root, model, tmp_path):
    """Our checkpoint converted back holds the original tensors, and transformers computes the same with it."""
    original, back = _tensors(root / "hf"), _convert_back(root / "megatron", tmp_path / "back")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    reloaded = type(model).from_pretrained(tmp_path / "back").eval()
    prompts = torch.tensor(PROMPTS)
    with torch.no_grad():
        assert torch.equal(reloaded(prompts).logits, model(prompts).logits)


def _converted(tmp_path_factory, name, family, seed, *flags):
    root = tmp_path_factory.mktemp(name)
    model = _hf_model(root / "hf", family, seed)
    return root, model, _convert(root / "hf", root / "megatron", *flags)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """A tiny Llama 3 (rope scaling, GQA, untied) converted for TP2 x PP2."""
    return _converted(tmp_path_factory, "llama3", LLAMA3, 0, "--target-tensor-parallel-size", "2",
                      "--target-pipeline-parallel-size", "2")


@pytest.fixture(scope="module")
def qwen2_tied(tmp_path_factory):
    """A tiny Qwen2 with tied embeddings and QKV bias, converted for TP2."""
    return _converted(tmp_path_factory, "qwen2_tied", QWEN2_TIED, 2, "--target-tensor-parallel-size", "2")


_SHARD_LINE = re.compile(r"shard (\d+)/(\d+) (\S+): (\d+) tensors, ([0-9.]+) GB in [0-9.]+ s \(([0-9.]+) GB/s\)")


def test_conversion_reports_each_shard_and_prints_and_writes_the_flags_to_load_it(llama3):
    root, _, converted = llama3
    shards = sorted(path.name for path in (root / "hf").glob("*.safetensors"))
    reported = [_SHARD_LINE.fullmatch(line).groups() for line in converted.stdout.splitlines()
                if line.startswith("shard ")]
    assert sorted(name for _, _, name, _, _, _ in reported) == shards
    assert {(int(total)) for _, total, _, _, _, _ in reported} == {len(shards)}
    original = _tensors(root / "hf")
    assert sum(int(count) for _, _, _, count, _, _ in reported) == len(original)
    total_gb = sum(t.numel() * 4 for t in original.values()) / 1e9
    assert math.isclose(sum(float(gb) for _, _, _, _, gb, _ in reported), total_gb, abs_tol=1e-3 * len(shards))
    written = (root / "megatron" / "model_args.txt").read_text().strip()
    lines = converted.stdout.splitlines()
    announced = next(i for i, line in enumerate(lines) if "load it with these pretrain_gpt.py flags" in line)
    assert lines[announced + 1] == written  # printed as written
    for flag in ("--num-layers 4", "--swiglu", "--num-query-groups 2", "--rotary-base 500000",
                 "--use-rope-scaling --rope-scaling-factor 8.0", "--untie-embeddings-and-output-weights",
                 "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
                 f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {root / 'megatron' / 'hf'}",
                 f"--load {root / 'megatron'}"):
        assert flag in written
    assert (root / "megatron" / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert (root / "megatron" / "iter_0000001" / "metadata.json").is_file()  # megatron-core's checkpoint


def test_llama3_at_tp2_pp2_computes_the_hf_logits_and_greedy_tokens(llama3, tmp_path):
    root, model, _ = llama3
    _assert_same_numbers(_ours(tmp_path, root / "megatron", 4, 2, 2), *_hf_reference(model))


def test_converting_back_gives_the_original_tensors_and_a_model_transformers_loads(llama3, tmp_path):
    root, model, _ = llama3
    _assert_round_trip(root, model, tmp_path)


def _periodic_dataset(directory, period, documents):
    """An indexed dataset whose every training sample is the same tokens: documents of whole periods
    of one random pattern, so that a sample (starting at a multiple of the sequence length, a
    multiple of the period) is the pattern repeated whatever the shuffle."""
    pattern = torch.randint(3, VOCAB, (period,), generator=torch.Generator().manual_seed(5))
    prefix = str(directory / "periodic")
    builder = IndexedDatasetBuilder(prefix + ".bin")
    for number in range(documents):
        document = pattern.repeat(4 + number % 3)
        builder.add_document(document, [document.numel()])
    builder.finalize(prefix + ".idx")
    return prefix, pattern


def test_finetuning_the_converted_checkpoint_at_tp1_pp1_starts_at_the_hf_loss(llama3, tmp_path):
    """pretrain_gpt.py with exactly the written flags and --finetune loads the TP2 x PP2 checkpoint at
    TP1 x PP1: its first loss is the HF model's loss on the same tokens, and training goes on."""
    root, model, _ = llama3
    seq_length, period = 32, 8
    prefix, pattern = _periodic_dataset(tmp_path, period, documents=40)
    model_args = (root / "megatron" / "model_args.txt").read_text().split()
    layout = model_args.index("--tensor-model-parallel-size")
    model_args[layout + 1] = "1"
    model_args[model_args.index("--pipeline-model-parallel-size") + 1] = "1"
    result = torchrun(1, "pretrain_gpt.py", model_args + [
        "--finetune", "--data-path", prefix, "--split", "100,0,0", "--seq-length", seq_length,
        "--micro-batch-size", 2, "--global-batch-size", 2, "--train-iters", 4, "--lr", "1e-3",
        "--lr-decay-style", "constant", "--eval-iters", 0, "--log-interval", 1, "--device", "cpu",
        "--use-cpu-initialization", "--num-workers", 0])
    assert_succeeded(result)
    losses = lm_losses(result.stdout)
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(loss) for loss in losses.values())
    tokens = pattern.repeat(seq_length // period + 1)[: seq_length + 1]
    with torch.no_grad():
        hf_logits = model(tokens[None, :-1]).logits[0]
    # Training's softmax also spans the rows that pad the vocabulary (zeros: logit 0), which
    # raise the loss by at most log(padded / vocabulary); generation never picks them.
    padded = vocab_size_with_padding(VOCAB, 128, 2)  # as converted, for TP2
    padding_logits = torch.zeros(seq_length, padded - VOCAB)
    hf_loss = torch.nn.functional.cross_entropy(torch.cat([hf_logits, padding_logits], 1), tokens[1:]).item()
    assert math.isclose(losses[1], hf_loss, rel_tol=1e-5), (losses, hf_loss)
    unpadded_loss = torch.nn.functional.cross_entropy(hf_logits, tokens[1:]).item()
    assert unpadded_loss < losses[1] < unpadded_loss + math.log(padded / VOCAB)
    assert losses[4] < losses[1]


def test_qwen2_with_qkv_bias_converted_at_tp1_computes_the_hf_logits_at_tp2(tmp_path):
    model = _hf_model(tmp_path / "hf", QWEN2, seed=1)
    _convert(tmp_path / "hf", tmp_path / "megatron")
    assert "--add-qkv-bias" in (tmp_path / "megatron" / "model_args.txt").read_text()
    _assert_same_numbers(_ours(tmp_path, tmp_path / "megatron", 2, 2, 1), *_hf_reference(model))


def test_qwen2_with_tied_embeddings_stays_tied_and_converted_at_tp2_computes_the_hf_logits_at_pp2(
        qwen2_tied, tmp_path):
    root, model, _ = qwen2_tied
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    written = (root / "megatron" / "model_args.txt").read_text()
    assert "--untie-embeddings-and-output-weights" not in written and "--add-qkv-bias" in written
    _assert_same_numbers(_ours(tmp_path, root / "megatron", 2, 1, 2), *_hf_reference(model))


def test_qwen2_with_tied_embeddings_converts_back_tied(qwen2_tied, tmp_path):
    root, model, _ = qwen2_tied
    assert "lm_head.weight" not in _tensors(root / "hf")  # transformers saves a tied model so
    _assert_round_trip(root, model, tmp_path)


def test_mistral_at_tp1_computes_the_hf_logits_and_greedy_tokens(tmp_path):
    model = _hf_model(tmp_path / "hf", MISTRAL, seed=3)
    _convert(tmp_path / "hf", tmp_path / "megatron")
    _assert_same_numbers(_ours(tmp_path, tmp_path / "megatron", 1, 1, 1), *_hf_reference(model))


def test_bf16_conversion_holds_the_bf16_cast_of_every_tensor(llama3, tmp_path):
    root, _, _ = llama3
    _convert(root / "hf", tmp_path / "bf16", "--bf16")
    assert " --bf16 " in (tmp_path / "bf16" / "model_args.txt").read_text()
    back = _convert_back(tmp_path / "bf16", tmp_path / "back", "--bf16")
    for name, tensor in _tensors(root / "hf").items():
        assert back[name].dtype == torch.bfloat16 and torch.equal(back[name], tensor.to(torch.bfloat16)), name


def _convert_error(hf_dir, out, *flags, loader="llama_mistral", saver="core"):
    result = run_script(CONVERT, ["--model-type", "GPT", "--loader", loader, "--saver", saver,
                                  "--load-dir", hf_dir, "--save-dir", out, *flags])
    assert result.returncode == 2, result.stderr[-3000:]
    return result.stderr.strip().splitlines()


def test_bad_layouts_and_an_existing_checkpoint_are_one_line_and_nothing_is_overwritten(llama3, tmp_path):
    root, _, _ = llama3
    assert _convert_error(root / "hf", tmp_path / "out", "--target-tensor-parallel-size", "3") == [
        "convert.py: error: --target-tensor-parallel-size 3 does not divide the model's 4 attention heads"]
    assert _convert_error(root / "hf", tmp_path / "out", "--target-tensor-parallel-size", "4") == [
        "convert.py: error: --target-tensor-parallel-size 4 does not divide the model's 2 query groups"]
    assert _convert_error(root / "hf", tmp_path / "out", "--target-pipeline-parallel-size", "3") == [
        "convert.py: error: --target-pipeline-parallel-size 3 does not divide the model's 4 layers"]
    before = sorted(p.name for p in (root / "megatron").iterdir())
    assert _convert_error(root / "hf", root / "megatron") == [
        (f"convert.py: error: --save-dir {root / 'megatron'} already holds a checkpoint; it is never "
        f"overwritten: name a new directory")]
    assert sorted(p.name for p in (root / "megatron").iterdir()) == before
    assert not (tmp_path / "out").exists()


def test_missing_or_unsupported_input_is_one_line_naming_it(llama3, tmp_path):
    root, _, _ = llama3
    out = tmp_path / "out"
    assert _convert_error(tmp_path / "absent", out) == [
        f"convert.py: error: --load-dir {tmp_path / 'absent'} is not a directory"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _convert_error(empty, out) == [
        f"convert.py: error: --load-dir {empty}: no config.json (a Hugging Face model directory holds one)"]
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(root / "hf" / "config.json", no_weights)
    assert _convert_error(no_weights, out) == [
        (f"convert.py: error: --load-dir {no_weights}: no model.safetensors nor model.safetensors.index.json "
        f"(only safetensors checkpoints are read)")]
    lacking_a_shard = tmp_path / "lacking_a_shard"
    shutil.copytree(root / "hf", lacking_a_shard)
    last_shard = max(lacking_a_shard.glob("model-*.safetensors"))
    last_shard.unlink()
    assert _convert_error(lacking_a_shard, out) == [
        f"convert.py: error: --load-dir {lacking_a_shard}: {last_shard.name} is listed in the index but missing"]
    damaged = tmp_path / "damaged"
    shutil.copytree(root / "hf", damaged)
    shard = max(damaged.glob("model-*.safetensors"))
    content = shard.read_bytes()
    header = json.loads(content[8:8 + int.from_bytes(content[:8], "little")])
    header.pop("__metadata__", None)
    last_tensor = max(header, key=lambda name: header[name]["data_offsets"][1])  # the one a cut-off end cuts
    shard.write_bytes(content[:-1])
    assert _convert_error(damaged, out) == [f"convert.py: error: {shard} is truncated: it ends inside {last_tensor}"]
    shard.write_bytes(b"\xff" * 64)
    assert _convert_error(damaged, out) == [
        f"convert.py: error: {shard} is not a safetensors file (its header does not parse)"]
    assert _convert_error(root / "hf", out, "--tokenizer-model", tmp_path / "absent") == [
        f"convert.py: error: --tokenizer-model {tmp_path / 'absent'} does not exist"]
    misdescribed = tmp_path / "misdescribed"
    shutil.copytree(root / "hf", misdescribed)
    config = json.loads((misdescribed / "config.json").read_text())
    (misdescribed / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    assert _convert_error(misdescribed, out) == [
        ("convert.py: error: model.layers.0.mlp.gate_proj.weight has shape (96, 64), which does not fit the model "
        "config.json describes (decoder.layers.mlp.linear_fc1.weight (128, 64))")]
    windowed = tmp_path / "windowed"  # Mistral's sliding window was dropped: logits diverged past it
    shutil.copytree(root / "hf", windowed)
    (windowed / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"],
                                                      "sliding_window": 8}))
    assert _convert_error(windowed, out) == [
        (f"convert.py: error: {windowed / 'config.json'}: sliding-window attention (sliding_window 8, "
        f"max_position_embeddings {config['max_position_embeddings']}) is not supported: the converted model "
        f"would attend beyond the window")]
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert _convert_error(gpt2, out) == [
        (f"convert.py: error: {gpt2 / 'config.json'}: architecture GPT2LMHeadModel is not supported; "
        f"supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM")]
    assert _convert_error(empty, out, loader="core", saver="hf") == [
        f"convert.py: error: --load-dir {empty} holds no checkpoint (no latest_checkpointed_iteration.txt)"]
    assert not out.exists()


def _blocked_conversion(hf_dir, out):
    """A conversion whose stdout is a full pipe: it blocks on its first progress line, which it prints while
    writing in its staging directory, and stays there until signalled (it cannot end first)."""
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)  # the smallest pipe: quick to fill
    os.set_blocking(write_end, False)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(write_end, b"\n" * 4096)
    os.set_blocking(write_end, True)  # the child shares the flag: it must wait, not fail
    # A suite started in the background by a script ignores SIGINT, and a child would inherit that; a child
    # of a process that handles it starts with the default.
    previous_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(
            [sys.executable, str(REPO / CONVERT), "--model-type", "GPT", "--loader", "llama_mistral", "--saver",
             "core", "--load-dir", str(hf_dir), "--save-dir", str(out), "--target-tensor-parallel-size", "2",
             "--target-pipeline-parallel-size", "2"],
            cwd=REPO, env=child_env({"MASTER_PORT": str(free_port())}), stdout=write_end, stderr=subprocess.PIPE,
            text=True)
    finally:
        signal.signal(signal.SIGINT, previous_handler)
        os.close(write_end)
    return process, read_end


def _staging_dirs(out):
    return sorted(out.parent.glob(f".{out.name}.converting-*"))


def _wait_for_staging_dir(process, out):
    deadline = time.monotonic() + 300
    while not _staging_dirs(out):
        with contextlib.suppress(subprocess.TimeoutExpired):  # the poll's interval: ends early if the process does
            process.wait(timeout=0.05)
            pytest.fail(f"the conversion into {out} ended before writing: {process.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline


def test_an_interrupted_conversion_leaves_nothing_and_a_second_into_the_same_save_dir_refuses_at_start(
        llama3, tmp_path):
    """SIGTERM and Ctrl-C remove the output being written (and the folders made for it) with one line; a
    second conversion into a --save-dir being written refuses before converting, naming the first; what a
    SIGKILLed conversion left is removed by the next conversion into that parent, whose result is whole."""
    root, _, _ = llama3
    killed_out, terminated_out, interrupted_out = tmp_path / "out", tmp_path / "t" / "a" / "out", tmp_path / "i" / "out"
    conversions = {out: _blocked_conversion(root / "hf", out) for out in (killed_out, terminated_out, interrupted_out)}
    try:
        for out, (process, _) in conversions.items():
            _wait_for_staging_dir(process, out)
        killed = conversions[killed_out][0]
        with pytest.raises(UserError) as refused, written_atomically(str(killed_out)):
            pytest.fail("a second conversion into the same --save-dir went on")
        assert str(refused.value).startswith(
            f"--save-dir {killed_out}: another conversion (pid {killed.pid} on host {socket.gethostname()}) is "
            f"writing it, in {_staging_dirs(killed_out)[0]}; wait for it to finish or choose another --save-dir")
        for out, number in ((terminated_out, signal.SIGTERM), (interrupted_out, signal.SIGINT)):
            process = conversions[out][0]
            process.send_signal(number)
            stderr = process.communicate(timeout=60)[1]
            assert process.returncode == 128 + number
            assert stderr.strip().splitlines()[-1] == (f"convert.py: error: interrupted by {number.name}; nothing "
                                                       f"was written to --save-dir {out}"), stderr[-3000:]
        assert sorted(tmp_path.iterdir()) == [tmp_path / ".out.converting", *_staging_dirs(killed_out)]
        killed.kill()
        killed.wait()
        assert _staging_dirs(killed_out)  # left behind, with the claim
    finally:
        for process, read_end in conversions.values():
            if process.poll() is None:
                kill_process_tree(process.pid)
                process.wait()
            os.close(read_end)
    left = _staging_dirs(killed_out)[0]
    result = _convert(root / "hf", killed_out, "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size",
                      "2")
    assert f"removed {left}, left by a conversion that no longer runs (pid {killed.pid})" in result.stdout
    assert sorted(tmp_path.iterdir()) == [killed_out]
    for path in (root / "megatron").rglob("*"):  # the same files as the uninterrupted conversion's
        if path.is_file() and path.name not in (".metadata", "model_args.txt"):  # (DCP's holds a random id)
            assert (killed_out / path.relative_to(root / "megatron")).read_bytes() == path.read_bytes(), path


def test_a_full_disk_in_either_direction_is_one_line_and_leaves_nothing(llama3, tmp_path):
    """A write refused midway (a file-size limit: EFBIG, which torch's and safetensors' writers report
    without its errno, as they do ENOSPC) names --save-dir, and the output and folders made for it are gone."""
    root, _, _ = llama3
    forward, back = tmp_path / "forward" / "out", tmp_path / "back" / "out"
    commands = {forward: ["--loader", "llama_mistral", "--saver", "core", "--load-dir", root / "hf"],
                back: ["--loader", "core", "--saver", "hf", "--load-dir", root / "megatron"]}
    limited = ["bash", "-c", 'ulimit -f 16 && exec "$@"', "bash"]  # files of at most 16 KiB
    processes = {out: subprocess.Popen([*limited, sys.executable, str(REPO / CONVERT), "--model-type", "GPT",
                                        *map(str, flags), "--save-dir", str(out)],
                                       cwd=REPO, env=child_env({"MASTER_PORT": str(free_port())}),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for out, flags in commands.items()}
    for out, process in processes.items():
        stderr = process.communicate(timeout=300)[1]
        assert process.returncode == 2 and "Traceback" not in stderr, stderr[-3000:]
        assert stderr.strip().splitlines()[-1] == (
            f"convert.py: error: --save-dir {out}: writing in {out.parent} failed (File too large); nothing was "
            f"written: free space there or choose another --save-dir")
    assert list(tmp_path.iterdir()) == []
