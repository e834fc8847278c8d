"""The loop calls every hook of the plugin contract, in order, and only for enabled plugins."""

import json

from helpers.launch import PLUGINS, TINY_GPT, assert_succeeded, gpt_data_args, lm_losses, run_script, torchrun

PLUGIN_ENV = {"MEGATRON_PLUGINS": "recording_plugin", "PYTHONPATH": str(PLUGINS)}
MOCK = ["--mock-data", "--vocab-size", "1000", "--train-iters", "3"]


def test_every_hook_is_called_and_the_supplied_schedule_runs(gpt_data, tmp_path):
    flags = TINY_GPT + gpt_data_args(gpt_data) + ["--train-iters", "3", "--pipeline-model-parallel-size", "2"]
    plain = torchrun(2, "pretrain_gpt.py", flags, env=PLUGIN_ENV)  # plugin installed, not enabled
    assert_succeeded(plain)
    assert list(tmp_path.iterdir()) == []
    recorded = torchrun(2, "pretrain_gpt.py", flags + ["--record-hooks-to", tmp_path], env=PLUGIN_ENV)
    assert_succeeded(recorded)
    assert lm_losses(recorded.stdout) == lm_losses(plain.stdout)
    for rank in (0, 1):
        calls = json.loads((tmp_path / f"rank{rank}.json").read_text())
        reported = [["lm loss"]] if rank == 1 else [[]]  # only the last stage holds losses
        expected = [["validate_args"], ["after_setup", 1, "ChainedOptimizer", "OptimizerParamScheduler"]]
        for iteration in (1, 2, 3):
            expected += [["iteration_begin", iteration], ["wrapped", False], ["schedule", False],
                         ["iteration_end", iteration, *reported]]
        expected.append(["train_end", 3])
        assert calls == expected


def test_plugin_validation_error_is_one_line(tmp_path):
    result = run_script("pretrain_gpt.py", TINY_GPT + MOCK + ["--record-hooks-to", tmp_path / "missing"],
                        env=PLUGIN_ENV)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"pretrain_gpt.py: error: --record-hooks-to: {tmp_path / 'missing'} is not a directory"]


def test_unknown_plugin_module_is_one_line():
    result = run_script("pretrain_gpt.py", TINY_GPT + MOCK, env={"MEGATRON_PLUGINS": "no_such_plugin_module"})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "MEGATRON_PLUGINS: cannot import plugin module 'no_such_plugin_module'" in lines[0]


def test_a_run_that_fails_with_loader_workers_alive_exits(gpt_data):
    # Loader workers ignore SIGTERM; without care, exiting on an exception waits for them forever.
    env = {"MEGATRON_PLUGINS": "failing_plugin", "PYTHONPATH": str(PLUGINS)}
    flags = TINY_GPT + gpt_data_args(gpt_data) + ["--train-iters", "5", "--num-workers", "2",
                                                  "--fail-at-iteration", "2"]
    result = run_script("pretrain_gpt.py", flags, env=env, timeout=90)
    assert result.returncode == 1
    assert result.stderr.rstrip().endswith("RuntimeError: failing_plugin: failed at iteration 2"), result.stderr[-2000:]
