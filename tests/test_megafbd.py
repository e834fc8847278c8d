"""MegaFBD: forward and backward instances compute the losses of a normal run with full recomputation.

Real pretrain_gpt.py launches under torchrun (gloo, CPU). Each FBD launch covers several cases at once
to keep the launches few: the reference is one normal process with --recompute-granularity full
--recompute-method uniform, which every layout reproduces (tests/test_parallel_layouts.py).
"""

import concurrent.futures
import functools
import json
import shutil
import subprocess
import sys

import pytest
import torch

from launch import (REPO, TINY_GPT, assert_succeeded, gpt_data_args, lm_losses,
                    preempted_run, run_script, torchrun, torchrun_command)
from megafbd.layout import BACKWARD, FORWARD, InstanceLayout
from megafbd.weight_sync import checksum

ITERATIONS = 6
RESUME_AT = 3
RELATIVE_TOLERANCE = 1e-5
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
FBD = ["--forward-backward-disaggregating", "--fbd-checksum-interval", "2"]
TRACKER = "latest_checkpointed_iteration.txt"


def _train(data, nproc, *flags):
    result = torchrun(nproc, "pretrain_gpt.py", TINY_GPT + gpt_data_args(data) + RECOMPUTE + list(map(str, flags)))
    assert_succeeded(result)
    return result


def _checkpoint_at(source, iteration, destination):
    """A copy of ``source`` whose latest checkpoint is ``iteration`` (to resume mid-run)."""
    destination.mkdir()
    shutil.copytree(source / f"iter_{iteration:07d}", destination / f"iter_{iteration:07d}")
    (destination / TRACKER).write_text(str(iteration))
    return destination


@pytest.fixture(scope="module")
def runs(gpt_data, tmp_path_factory):
    """The normal reference run and the FBD runs, each saving at RESUME_AT; launched once for all tests."""
    root = tmp_path_factory.mktemp("megafbd")
    train = functools.partial(_train, gpt_data)
    normal = train(1, "--train-iters", ITERATIONS, "--save", root / "normal", "--save-interval", RESUME_AT)
    pp2 = train(4, *FBD, "--pipeline-model-parallel-size", 2, "--train-iters", ITERATIONS,
                "--save", root / "fbd", "--save-interval", RESUME_AT,
                "--trace", "--trace-dir", root / "trace", "--trace-interval", 3, "--continuous-trace-iterations", 1)
    return {"normal": normal, "pp2": pp2, "root": root, "data": gpt_data}


def _assert_losses_equal(result, reference, iterations):
    losses, expected = lm_losses(result.stdout), lm_losses(reference.stdout)
    assert sorted(losses) == list(iterations), result.stdout[-2000:]
    for iteration in iterations:
        assert losses[iteration] == pytest.approx(expected[iteration], rel=RELATIVE_TOLERANCE), (
            f"iteration {iteration}: {losses[iteration]} vs normal full-recompute run {expected[iteration]}")


def _forward_reports(result):
    return [line for line in result.stdout.splitlines() if line.startswith("megafbd: forward instance")]


def test_pp2_staleness_0_gives_the_losses_of_a_normal_run_and_identical_weights(runs):
    _assert_losses_equal(runs["pp2"], runs["normal"], range(1, ITERATIONS + 1))
    reports = _forward_reports(runs["pp2"])
    # Checksums after iterations 2, 4, 6 and at the end all matched (a mismatch stops the run).
    assert len(reports) == 2 and all(f"{ITERATIONS} iterations, weights checked 4 times" in r for r in reports), reports


@pytest.mark.parametrize("kind, directory", [("backward", "trace"), ("forward", "trace/forward")])
def test_trace_records_both_kinds_and_each_merges_and_is_checked(runs, kind, directory):
    trace_dir = runs["root"] / directory
    files = sorted(trace_dir.glob("benchmark-data-*.json"))
    assert len(files) == 2
    for path in files:
        metadata = json.loads(path.read_text().splitlines()[0])
        assert metadata["instance_kind"] == kind and metadata["world_size"] == 2, metadata
    result = subprocess.run([sys.executable, str(REPO / "tools/aggregate.py"), "-b", str(trace_dir), "-d"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    # Detection runs over the kind's world (whether it names a suspect depends on the shared machine's load;
    # the forward world at TP1 has no collective to align clocks on, which the merge warns about).
    assert "ranks: 2 merged of 2 loaded" in result.stdout and "MegaScan detection:" in result.stdout, result.stdout
    assert (trace_dir / "benchmark.json").is_file()


@pytest.mark.parametrize("layout, nproc, flags", [
    ("dp2_distributed_optimizer", 4, ["--use-distributed-optimizer"]),
    ("tp2", 4, ["--tensor-model-parallel-size", 2]),
])
def test_layout_gives_the_losses_of_a_normal_run(runs, layout, nproc, flags):
    result = _train(runs["data"], nproc, *FBD, *flags, "--train-iters", RESUME_AT)
    _assert_losses_equal(result, runs["normal"], range(1, RESUME_AT + 1))
    assert len(_forward_reports(result)) == nproc // 2


def test_bf16_with_the_forward_instance_on_cpu_gives_the_losses_of_a_normal_bf16_run(runs):
    normal = _train(runs["data"], 1, "--bf16", "--train-iters", RESUME_AT)
    result = _train(runs["data"], 2, *FBD, "--bf16", "--fbd-forward-device", "cpu", "--train-iters", RESUME_AT)
    _assert_losses_equal(result, normal, range(1, RESUME_AT + 1))
    assert "forward instances (TP1 x PP1 x DP1, cpu)" in result.stdout


def test_weights_that_drift_apart_stop_the_run_with_one_line_naming_the_stage(gpt_data):
    env = {"MEGATRON_PLUGINS": "weight_drift_plugin", "PYTHONPATH": str(REPO / "tests/plugins")}
    result = torchrun(2, "pretrain_gpt.py", TINY_GPT + gpt_data_args(gpt_data) + RECOMPUTE + FBD + [
        "--train-iters", "3", "--drift-weights-at-iteration", "3"], env=env)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("pretrain_gpt.py: error: ")]
    assert len(lines) == 1 and lines[0].startswith(
        "pretrain_gpt.py: error: megafbd: the forward and backward weights of pipeline stage 0 (data-parallel "
        "replica 0, backward link rank 0) differ at the end (iteration 3)"), result.stderr[-3000:]


def test_normal_checkpoint_resumes_an_fbd_run_at_tp2_ignoring_forward_tp_with_sequence_parallel(runs, tmp_path):
    # 6 processes: per stage two TP2 backward processes and one TP1 forward process.
    load = _checkpoint_at(runs["root"] / "normal", RESUME_AT, tmp_path / "from_normal")
    result = _train(runs["data"], 6, *FBD, "--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2,
                    "--ignore-forward-tensor-parallel", "--sequence-parallel", "--train-iters", ITERATIONS,
                    "--load", load)
    _assert_losses_equal(result, runs["normal"], range(RESUME_AT + 1, ITERATIONS + 1))
    assert "forward instances (TP1 x PP2 x DP1, cpu)" in result.stdout


def test_fbd_checkpoint_resumes_a_normal_run(runs, tmp_path):
    load = _checkpoint_at(runs["root"] / "fbd", RESUME_AT, tmp_path / "from_fbd")
    result = _train(runs["data"], 1, "--train-iters", ITERATIONS, "--load", load)
    _assert_losses_equal(result, runs["normal"], range(RESUME_AT + 1, ITERATIONS + 1))


def test_staleness_1_trains_and_sigterm_stops_both_kinds_with_a_checkpoint(runs, tmp_path):
    save = tmp_path / "ckpt"
    command = torchrun_command(4, "pretrain_gpt.py", TINY_GPT + gpt_data_args(runs["data"]) + RECOMPUTE + FBD + [
        "--fbd-weight-staleness", "1", "--pipeline-model-parallel-size", "2", "--train-iters", "10000",
        "--save", str(save)])
    log = preempted_run(command, "iteration        8/")
    assert "SIGTERM received: stopping at iteration" in log, log[-3000:]
    losses = lm_losses(log)
    assert max(losses[i] for i in (6, 7, 8)) < losses[1] - 0.3, losses
    saved = int((save / TRACKER).read_text())
    assert saved >= 8 and (save / f"iter_{saved:07d}").is_dir()
    # Both forward instances stopped on the backward instances' word, their weights checked at the end.
    assert sum(f"{saved} iterations, weights checked" in line for line in log.splitlines()) == 2, log[-3000:]


MOCK = ["--mock-data", "--vocab-size", "1000", "--train-iters", "3"]
ERRORS = {
    "process count": (FBD + ["--pipeline-model-parallel-size", "2"], "3",
                      "--forward-backward-disaggregating at TP1 x PP2 needs 4 processes per data-parallel replica "
                      "(2 backward + 2 forward) but 3 were launched; launch a multiple of 4 (e.g. 8 for DP2)"),
    "process count ignoring forward TP": (
        FBD + ["--tensor-model-parallel-size", "2", "--ignore-forward-tensor-parallel"], "4",
        "needs 3 processes per data-parallel replica (2 backward + 1 forward (--ignore-forward-tensor-parallel))"),
    "virtual pipeline": (FBD + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
                         "4", "--forward-backward-disaggregating does not support a virtual pipeline"),
    "sub-flag without the flag": (["--fbd-weight-staleness", "1"], "1",
                                  "--fbd-weight-staleness need --forward-backward-disaggregating"),
    "overlapped parameter gather": (FBD + ["--use-distributed-optimizer", "--overlap-param-gather"], "2",
                                    "cannot be combined with --overlap-param-gather"),
    "forward on a GPU of a CPU run": (FBD + ["--fbd-forward-device", "cuda"], "2",
                                      "--fbd-forward-device cuda needs --device cuda"),
    "checksum interval": (FBD + ["--fbd-checksum-interval", "0"], "2", "--fbd-checksum-interval must be >= 1"),
}


@pytest.fixture(scope="module")
def error_results():
    # Each run spends seconds importing megatron-core: run them side by side.
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(run_script, "pretrain_gpt.py", TINY_GPT + MOCK + flags, {"WORLD_SIZE": size},
                                     timeout=300)
                   for name, (flags, size, _) in ERRORS.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("case", list(ERRORS))
def test_launch_mistake_gives_one_clear_line(case, error_results):
    result, expected = error_results[case], ERRORS[case][2]
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("pretrain_gpt.py: error: ") and expected in lines[0], lines[0]


def test_layout_splits_backward_first_and_links_tp_backward_ranks_to_one_tp1_forward_rank():
    layout = InstanceLayout.for_launch(tensor=2, pipeline=2, forward_tensor=1, launched=12)  # DP2
    assert (layout.backward_size, layout.forward_size, layout.data) == (8, 4, 2)
    assert [layout.kind(r) for r in (0, 7, 8, 11)] == [BACKWARD, BACKWARD, FORWARD, FORWARD]
    # Backward rank 5: tensor 1, replica 0, stage 1 (megatron-core's order); its forward: stage 1, replica 0.
    link = layout.link(5)
    assert link.backward_members == (4, 5) and link.forward_member == 8 + 2
    assert layout.link(10) == link and link.link_rank(10) == link.forward_link_rank == 2
    assert InstanceLayout.for_launch(tensor=2, pipeline=2, forward_tensor=1, launched=10) is None


def test_checksum_sees_a_single_bit_and_a_swap():
    weights = [torch.randn(64, dtype=torch.bfloat16), torch.randn(8, 8)]
    reference = checksum(weights)
    flipped = [weights[0].clone(), weights[1]]
    flipped[0].view(torch.int16)[3] ^= 1
    swapped = [weights[0].flip(0), weights[1]]
    assert not torch.equal(checksum(flipped), reference) and not torch.equal(checksum(swapped), reference)
    assert torch.equal(checksum([w.clone() for w in weights]), reference)
