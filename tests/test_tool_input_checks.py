"""Issue 53: the checkpoint tools (generate_greedy.py, convert.py) check their inputs and outputs before loading
anything, and refuse them in one line (the real commands, each case forked after the imports:
tests/helpers/fork_runner.py)."""

import json
import os
import shutil

import pytest
import torch
from helpers.generation_server import TINY_SERVER
from helpers.hf_tokenizer import write_word_tokenizer
from helpers.launch import REPO, assert_succeeded, run_script, run_script_cases
from transformers import LlamaConfig, LlamaForCausalLM

GREEDY = "tools/checkpoint/generate_greedy.py"


def test_generate_greedy_refuses_its_prompts_and_output_before_loading(tmp_path):
    """These used to end in a trace after the checkpoint had loaded (the output's after generating). ``--load`` is
    an empty directory, refused when loading starts: each case must be refused before it."""
    load = tmp_path / "checkpoints"
    load.mkdir()
    good, bad = tmp_path / "prompts.json", tmp_path / "bad.json"
    good.write_text('["The cat sat"]')
    bad.write_text('["The cat sat",\n "A dog ran"')
    missing_dir = tmp_path / "results" / "out.pt"
    cases = {
        (tmp_path / "nowhere.json", tmp_path / "out.pt"):
            f"--prompts-json {tmp_path / 'nowhere.json'}: no such file; give a JSON list of strings",
        (bad, tmp_path / "out.pt"):
            f"--prompts-json {bad}:2: not valid JSON (Expecting ',' delimiter); give a JSON list of strings",
        (good, missing_dir): (f"--output {missing_dir}: its directory {missing_dir.parent} does not exist; "
                              f"create it or give a path in an existing directory"),
    }
    results = run_script_cases(GREEDY, [(TINY_SERVER + ["--load", load, "--prompts-json", prompts, "--output", output],
                                         None) for prompts, output in cases])
    for result, expected in zip(results, cases.values()):
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        lines = result.stderr.strip().splitlines()
        assert lines[-1].startswith(f"generate_greedy.py: error: {expected}"), lines[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "checkpoints", "prompts.json"]


CONVERT = "tools/checkpoint/convert.py"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny Llama (2 layers) in Hugging Face form and converted to our checkpoint."""
    root = tmp_path_factory.mktemp("converted")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                         max_position_embeddings=64, architectures=["LlamaForCausalLM"]))
    model.save_pretrained(root / "hf")
    write_word_tokenizer(root / "hf", 300)
    assert_succeeded(run_script(CONVERT, ["--model-type", "GPT", "--loader", "llama_mistral", "--saver", "core",
                                          "--load-dir", root / "hf", "--save-dir", root / "core"]))
    return root


def _config_with(source, root, name, **changes):
    folder = root / name
    folder.mkdir()
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


def _damaged_copy(checkpoint, root, name, damage):
    copy = root / name
    shutil.copytree(checkpoint, copy)
    shard = sorted((copy / "iter_0000001").glob("*.distcp"))[0]
    damage(shard)
    return copy, shard


def test_convert_to_hf_refuses_a_config_or_checkpoint_that_does_not_fit_and_a_shard_size_of_none(converted,
                                                                                                   tmp_path):
    """A config of another layer count, hidden size or head count, and a checkpoint with a shard file deleted or
    cut short, ended in a CheckpointingException trace (or a model from a damaged checkpoint); --max-shard-size-gb
    0 and -1 were taken (a -1 run once aborted with exit 134 after writing)."""
    root, core = converted, converted / "core"
    missing, missing_shard = _damaged_copy(core, tmp_path, "missing", os.remove)
    short, short_shard = _damaged_copy(core, tmp_path, "short", lambda shard: os.truncate(shard, 10))
    mismatch = "--hf-config-dir: {config}/config.json does not describe the checkpoint {core}/iter_0000001: {what}"
    cases = [
        (core, ["--hf-config-dir", _config_with(root / "hf", tmp_path, "layers", num_hidden_layers=3)],
         mismatch.format(config=tmp_path / "layers", core=core, what="--num-layers 2 in the checkpoint, 3 in the "
                                                                      "config; give the config")),
        (core, ["--hf-config-dir", _config_with(root / "hf", tmp_path, "hidden", hidden_size=128)],
         mismatch.format(config=tmp_path / "hidden", core=core, what="--hidden-size 64 in the checkpoint, 128 in "
                                                                      "the config;")),
        (core, ["--hf-config-dir", _config_with(root / "hf", tmp_path, "heads", num_attention_heads=8)],
         mismatch.format(config=tmp_path / "heads", core=core, what="--num-attention-heads 4 in the checkpoint, 8 "
                                                                     "in the config;")),
        (missing, [], f"--load-dir: checkpoint {missing}/iter_0000001 is damaged: {missing_shard} is missing; "
                      f"no other iteration is saved there: give another --load-dir"),
        (short, [], f"--load-dir: checkpoint {short}/iter_0000001 is damaged: {short_shard} is cut short (10 of "),
        (core, ["--max-shard-size-gb", "0"], "--max-shard-size-gb must be a positive size in GB (e.g. 5), got 0"),
        (core, ["--max-shard-size-gb", "-1"], "--max-shard-size-gb must be a positive size in GB (e.g. 5), got -1"),
    ]
    before = sorted(p.name for p in tmp_path.iterdir())
    results = run_script_cases(CONVERT, [(["--model-type", "GPT", "--loader", "core", "--saver", "hf", "--load-dir",
                                           load, "--save-dir", tmp_path / f"out{i}", *flags], None)
                                         for i, (load, flags, _) in enumerate(cases)],
                               env={"PYTHONPATH": str(REPO / "tools/checkpoint")})
    for result, (_, _, expected) in zip(results, cases):
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert result.stderr.strip().splitlines() == [result.stderr.strip().splitlines()[-1]], result.stderr
        assert result.stderr.strip().startswith(f"convert.py: error: {expected}"), result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no staging directory
