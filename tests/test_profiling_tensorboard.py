"""--tensorboard-dir writes the log line's scalars (read back from the event files) and
--profile --use-pytorch-profiler writes a trace and a summary for the profiled ranks only."""

import json
import re

import pytest
from helpers.launch import PLUGINS, TINY_GPT, assert_succeeded, gpt_data_args, lm_losses, run_script, torchrun
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

PER_ITERATION_TAGS = {"lm loss", "learning-rate", "grad-norm", "batch-size"}
LOG_LINE_TAGS = {"iteration-time", "throughput", "tokens-per-second", "skipped-iterations", "peak-host-rss-bytes"}


def _scalars(directory):
    """{tag: {step: value}} of the TensorBoard event files in ``directory``."""
    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def _event_files(directory):
    return list(directory.glob("events.out.tfevents.*"))


def test_scalars_of_the_log_line_and_the_evaluations_are_written_by_the_last_rank(gpt_data, tmp_path):
    result = torchrun(2, "pretrain_gpt.py", TINY_GPT + gpt_data_args(gpt_data) + [
        "--pipeline-model-parallel-size", "2", "--train-iters", "5", "--log-interval", "2",
        "--eval-interval", "2", "--eval-iters", "1", "--split", "90,5,5", "--tensorboard-dir", tmp_path,
        "--manual-gc", "--manual-gc-interval", "2"])
    assert_succeeded(result)
    assert ("manual garbage collection: the automatic collector is off; a full collection every 2 iterations, and "
            "before each evaluation") in result.stdout
    assert len(_event_files(tmp_path)) == 1  # one writer: the last rank
    scalars = _scalars(tmp_path)
    evaluation_tags = {f"lm loss {label}{suffix}" for label in ("validation", "test") for suffix in ("", " ppl")}
    assert set(scalars) == PER_ITERATION_TAGS | LOG_LINE_TAGS | evaluation_tags
    for tag in PER_ITERATION_TAGS:  # iteration 5 comes after the last log line: written at the end
        assert sorted(scalars[tag]) == [1, 2, 3, 4, 5], tag
    for tag in LOG_LINE_TAGS | {"lm loss validation", "lm loss validation ppl"}:
        assert sorted(scalars[tag]) == [2, 4], tag
    assert sorted(scalars["lm loss test"]) == [5]

    logged = lm_losses(result.stdout)  # each line: the average over its two iterations
    for iteration in (2, 4):
        average = (scalars["lm loss"][iteration - 1] + scalars["lm loss"][iteration]) / 2
        assert average == pytest.approx(logged[iteration], rel=1e-5)
    test_loss = float(re.search(r"test loss at iteration 5 \| lm loss value: (\S+)", result.stdout).group(1))
    assert scalars["lm loss test"][5] == pytest.approx(test_loss, rel=1e-5)
    assert set(scalars["batch-size"].values()) == {8} and set(scalars["skipped-iterations"].values()) == {0}


def test_pytorch_profiler_writes_a_trace_and_a_summary_for_the_chosen_rank_only(gpt_data, tmp_path):
    result = torchrun(2, "pretrain_gpt.py", TINY_GPT + gpt_data_args(gpt_data) + [
        "--train-iters", "4", "--profile", "--use-pytorch-profiler", "--profile-step-start", "2",
        "--profile-step-end", "4", "--profile-ranks", "1",
        "--tensorboard-dir", tmp_path, "--tensorboard-log-interval", "2"])
    assert_succeeded(result)
    traces = list(tmp_path.glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank1"], traces
    trace = traces[0]
    assert f"rank 1: torch.profiler trace of iterations 2-3 written to {trace}" in result.stdout

    events = json.loads(trace.read_text())["traceEvents"]
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
    assert len(steps) == 2  # iterations 2 and 3: [start, end)
    assert any(e.get("name") == "aten::mm" for e in events)

    summary = trace.with_name(trace.name.replace(".pt.trace.json", ".summary.txt")).read_text()
    assert summary.startswith("torch.profiler on rank 1, iterations 2-3: top operators by self CPU time")
    assert "Self CPU" in summary and "aten::mm" in summary

    scalars = _scalars(tmp_path)  # the trace shares the directory with the scalars
    assert sorted(scalars["lm loss"]) == [2, 4] and sorted(scalars["iteration-time"]) == [1, 2, 3, 4]


def test_sigterm_writes_the_pending_scalars_before_exit(tmp_path):
    env = {"MEGATRON_PLUGINS": "failing_plugin", "PYTHONPATH": str(PLUGINS)}
    result = run_script("pretrain_gpt.py", TINY_GPT + [
        "--mock-data", "--vocab-size", "1000", "--train-iters", "8", "--log-interval", "8",
        "--sigterm-at-iteration", "2", "--tensorboard-dir", tmp_path], env=env)
    assert_succeeded(result)
    assert "SIGTERM received: stopping at iteration 3" in result.stdout
    scalars = _scalars(tmp_path)  # no log line came: everything was pending
    assert set(scalars) == PER_ITERATION_TAGS and sorted(scalars["lm loss"]) == [1, 2, 3]
