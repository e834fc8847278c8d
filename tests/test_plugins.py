"""The loop calls every hook of the plugin contract, in order, and only for enabled plugins; the contract's
run context: the read-only configuration, request_stop, and the transfer-trace sink."""

import argparse
import json
import tracemalloc

import pytest
from helpers.launch import PLUGINS, TINY_GPT, assert_succeeded, gpt_data_args, lm_losses, run_script, torchrun

from megatron.training.frozen_args import FrozenArgs, FrozenArgsError
from megatron.training.placement import Launch, Placement
from megatron.training.plugins import PluginRegistry
from megatron.training.run_context import RunContext
from megatron.training.transfer_trace import TransferChannel, TransferLabel, TransferTrace

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
        expected = [["validate_args"], ["placement", 2],
                    ["after_setup", 1, "ChainedOptimizer", "OptimizerParamScheduler"]]
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


def test_request_stop_ends_a_real_run_after_that_iteration_with_a_checkpoint(gpt_data, tmp_path):
    """A plugin's request_stop: the loop ends after that iteration (not --train-iters), saves there, logs the
    first reason once, and on_train_end sees where it ended."""
    env = {"MEGATRON_PLUGINS": "stopping_plugin", "PYTHONPATH": str(PLUGINS)}
    flags = TINY_GPT + gpt_data_args(gpt_data) + ["--train-iters", "6", "--stop-at-iteration", "2",
                                                  "--save", tmp_path / "ckpt", "--stop-record", tmp_path / "end"]
    result = run_script("pretrain_gpt.py", flags, env=env)
    assert_succeeded(result)
    assert sorted(lm_losses(result.stdout)) == [1, 2]
    assert result.stdout.count("stopping_plugin:") == 1 and "stopping_plugin: stop at iteration 2\n" in result.stdout
    assert (tmp_path / "ckpt/latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (tmp_path / "end").read_text() == "2 stopping_plugin: stop at iteration 2"


def _context(**flags):
    args = FrozenArgs(argparse.Namespace(**flags))
    return RunContext(args, Placement.single_world(Launch(0, 1), argparse.Namespace(
        tensor_model_parallel_size=1, sequence_parallel=False, device="cpu")), TransferTrace())


class _Writer:
    """Writes the configuration from a hook, as plugins did to stop training or change the layout."""

    def validate_args(self, args):
        args.cuda_graph_impl = "none"

    def on_iteration_end(self, context, iteration, metrics):
        context.args.train_iters = iteration


class _Normaliser:
    def validate_args(self, args):
        return {"cuda_graph_impl": "none", "cuda_graph_note": "off: normalised"}


def test_a_plugin_writing_the_configuration_gets_a_clear_error_and_validation_normalises_by_returning():
    context = _context(train_iters=10)
    registry = PluginRegistry([_Writer()])
    registry.select_enabled(argparse.Namespace())
    with pytest.raises(FrozenArgsError, match=r"^cannot set args\.train_iters: the configuration is read-only "
                                              r"once validated: .* context\.request_stop\(reason\)$"):
        registry.on_iteration_end(context, 3, {})
    assert context.args.train_iters == 10
    with pytest.raises(FrozenArgsError, match=r"^cannot delete args\.train_iters"):
        del context.args.train_iters

    namespace = argparse.Namespace(cuda_graph_impl="local")
    with pytest.raises(FrozenArgsError, match=r"^cannot set args\.cuda_graph_impl: .* returning the values from "
                                              r"validate_args"):
        PluginRegistry([_Writer()]).validate_args(namespace)
    PluginRegistry([_Normaliser()]).validate_args(namespace)
    assert vars(namespace) == {"cuda_graph_impl": "none", "cuda_graph_note": "off: normalised"}


class _ListRecorder:
    def __init__(self):
        self.started, self.ended = [], []

    def start(self, op, channel, peer, nbytes, dtype, seq, start_ns, label):
        self.started.append((op, channel.name, peer, nbytes, dtype, seq, start_ns, label))
        return len(self.started) - 1

    def end(self, token, end_ns):
        self.ended.append((token, end_ns))


def test_a_transfer_reported_with_no_recorder_costs_nothing_and_raises_nothing_and_one_installed_gets_all():
    sink, channel = TransferTrace(), TransferChannel("megadpp-pp", (0, 1), "pp")
    assert not sink.recording

    def report_some(count):
        tokens = []
        for seq in range(count):
            tokens.append(sink.start("send", channel, 1, 256, "float32", seq, label=TransferLabel(microbatch=seq)))
            sink.end(tokens[-1])
            sink.report("recv", channel, 1, 256, None, seq, start_ns=5, end_ns=9, label=("forward-recv", seq, 0))
        return tokens

    report_some(10)  # whatever a first call allocates once
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tokens = report_some(1000)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert tokens == [None] * 1000
    assert kept <= 8 * 1000 + 1024, kept  # the test's own list of tokens: the sink keeps nothing

    recorder = _ListRecorder()
    sink.install(recorder)
    assert sink.recording
    report_some(2)
    assert [s[:6] for s in recorder.started] == [
        ("send", "megadpp-pp", 1, 256, "float32", 0), ("recv", "megadpp-pp", 1, 256, None, 0),
        ("send", "megadpp-pp", 1, 256, "float32", 1), ("recv", "megadpp-pp", 1, 256, None, 1)]
    assert recorder.started[1][6:] == (5, ("forward-recv", 0, 0)) and recorder.ended[1] == (1, 9)
    assert [token for token, _ in recorder.ended] == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="a recorder is installed already"):
        sink.install(_ListRecorder())
