"""MegaFBD: forward and backward instances compute the losses of a normal run with full recomputation.

Real pretrain_gpt.py launches under torchrun (gloo, CPU). Each FBD launch covers several cases at once
to keep the launches few: the reference is one normal process with --recompute-granularity full
--recompute-method uniform, which every layout reproduces (tests/test_parallel_layouts.py).
"""

import argparse
import concurrent.futures
import functools
import json
import shutil
import subprocess
import sys

import pytest
import torch
from helpers.launch import (
    PLUGINS,
    REPO,
    TINY_GPT,
    assert_succeeded,
    gpt_data_args,
    lm_losses,
    preempted_run,
    run_script,
    torchrun,
    torchrun_command,
)

from megafbd.arguments import placement as declared_placement
from megafbd.batch_transfer import pack, unpack
from megafbd.layout import BACKWARD, FORWARD, InstanceLayout
from megafbd.weight_sync import checksum
from megascan.aggregate.merged_trace import load_and_merge
from megatron.training.frozen_args import FrozenArgs, FrozenArgsError
from megatron.training.placement import Launch, configuration_at

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
    normal_bf16 = train(1, "--bf16", "--train-iters", RESUME_AT)
    bf16 = train(2, *FBD, "--bf16", "--fbd-forward-device", "cpu", "--train-iters", RESUME_AT)
    return {"normal": normal, "pp2": pp2, "normal_bf16": normal_bf16, "bf16": bf16, "root": root, "data": gpt_data}


def _assert_losses_equal(result, reference, iterations):
    losses, expected = lm_losses(result.stdout), lm_losses(reference.stdout)
    assert sorted(losses) == list(iterations), result.stdout[-2000:]
    for iteration in iterations:
        assert losses[iteration] == pytest.approx(expected[iteration], rel=RELATIVE_TOLERANCE), (
            f"iteration {iteration}: {losses[iteration]} vs normal full-recompute run {expected[iteration]}")


def _forward_reports(result):
    return [line for line in result.stdout.splitlines() if line.startswith("megafbd: forward instance")]


def _report_of_stage(reports, stage):
    (report,) = [line for line in reports if line.startswith(f"megafbd: forward instance (stage {stage},")]
    return report


def test_pp2_staleness_0_gives_the_losses_of_a_normal_run_and_identical_weights(runs):
    _assert_losses_equal(runs["pp2"], runs["normal"], range(1, ITERATIONS + 1))
    reports = _forward_reports(runs["pp2"])
    # Stage 0: checksums after iterations 2, 4, 6 and at the end all matched (a mismatch stops the run). Stage 1, the
    # last, runs no forward: no weights travel there.
    stage_0, stage_1 = (_report_of_stage(reports, stage) for stage in (0, 1))
    assert f"{ITERATIONS} iterations, weights checked 4 times" in stage_0, reports
    assert f"{ITERATIONS} iterations, no weights (the last stage runs no forward)" in stage_1, reports
    # The forward instances read the data: the token batches at stage 0, the labels at stage 1 (4 microbatches
    # an iteration); each backward instance received its stage's batches instead of reading them.
    batches = ITERATIONS * 4
    assert all(f"{batches} batches read and sent" in r for r in reports), reports
    backward = [line for line in runs["pp2"].stdout.splitlines() if line.startswith("megafbd: backward instance")]
    assert len(backward) == 2 and all(f"{batches} batches received" in line for line in backward), backward


def test_pp1_forward_instance_reads_the_batches_its_backward_partner_trains_on(runs):
    # At PP1 the only stage is first and last: the forward instance reads every batch and sends it on.
    (report,) = _forward_reports(runs["bf16"])
    assert f"{RESUME_AT * 4} batches read and sent" in report, report


def test_trace_records_both_kinds_and_fbd_messages_as_matched_flows(runs):
    """Both kinds write one trace (launch-wide ranks: 0-1 backward, 2-3 forward); FBD's own messages are
    p2p ops whose sends and receives the aggregation matches and draws as flows."""
    trace_dir = runs["root"] / "trace"
    kinds = {}
    for path in sorted(trace_dir.glob("benchmark-data-*.json")):
        metadata = json.loads(path.read_text().splitlines()[0])
        assert metadata["world_size"] == 4 and metadata["layout"]["tp"] == 2, metadata  # TP1 backward + TP1 forward
        kinds[metadata["rank"]] = metadata["instance_kind"]
    assert kinds == {0: BACKWARD, 1: BACKWARD, 2: FORWARD, 3: FORWARD}
    result = subprocess.run([sys.executable, str(REPO / "tools/aggregate.py"), "-b", str(trace_dir), "-d"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "ranks: 4 merged of 4 loaded" in result.stdout and "MegaScan detection:" in result.stdout, result.stdout

    merged = load_and_merge(str(trace_dir))
    messages = [i for i in merged.instances if i.group.startswith("megafbd/")]
    assert messages and all(i.kind == "p2p" and sorted(i.records) == sorted((i.src, i.dst)) for i in messages), [
        (i.group, i.seq, sorted(i.records)) for i in messages if len(i.records) != 2]
    by_channel = {}
    for instance in messages:
        by_channel.setdefault(instance.group.rsplit("/", 1)[1], set()).add((instance.src, instance.dst))
    # Traced iterations 3 and 6: stage 0's weights (backward -> forward partner; stage 1's forward instance runs
    # no forward and gets none), token batch and labels (forward ->
    # backward partner at each stage), stage 1's input, activations (forward 0 -> 1), input gradients (backward 1 -> 0).
    assert by_channel == {"weights": {(0, 2)}, "batch": {(2, 0), (3, 1)}, "stage-input": {(3, 1)},
                          "activation": {(2, 3)}, "input-grad": {(1, 0)}}, by_channel
    per_iteration = {i.group.rsplit("/", 1)[1]: 0 for i in messages}
    for instance in messages:
        per_iteration[instance.group.rsplit("/", 1)[1]] += 1
    assert per_iteration == {"weights": 2, "batch": 16, "stage-input": 8, "activation": 8, "input-grad": 8}
    assert {i.records[i.dst].microbatch for i in messages if not i.group.endswith("weights")} == {0, 1, 2, 3}
    flows = [e for e in json.loads((trace_dir / "benchmark.json").read_text())["traceEvents"]
             if e.get("cat") == "flow.p2p" and e["ph"] == "s"]
    assert len(flows) == len(messages)  # one arrow per message: FBD's are the run's only point-to-point ops


@pytest.mark.parametrize("layout, nproc, flags", [
    ("dp2_distributed_optimizer", 4, ["--use-distributed-optimizer"]),
    ("tp2", 4, ["--tensor-model-parallel-size", 2]),
])
def test_layout_gives_the_losses_of_a_normal_run(runs, layout, nproc, flags):
    result = _train(runs["data"], nproc, *FBD, *flags, "--train-iters", RESUME_AT)
    _assert_losses_equal(result, runs["normal"], range(1, RESUME_AT + 1))
    assert len(_forward_reports(result)) == nproc // 2


def test_bf16_with_the_forward_instance_on_cpu_gives_the_losses_of_a_normal_bf16_run(runs):
    _assert_losses_equal(runs["bf16"], runs["normal_bf16"], range(1, RESUME_AT + 1))
    assert "forward instances (TP1 x PP1 x DP1, cpu)" in runs["bf16"].stdout


def test_pp2_with_dropout_gives_the_losses_of_a_normal_pp2_run_with_dropout(runs):
    # The loss comes from the backward instance's own forward (the forward instances run without dropout);
    # per stage it draws its masks in the normal run's order (microbatch 0, 1, ...) from the normal run's
    # seeds, and the recomputation replays them in both runs.
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--pipeline-model-parallel-size", 2,
               "--train-iters", RESUME_AT]
    normal = _train(runs["data"], 2, *dropout)
    result = _train(runs["data"], 4, *FBD, *dropout)
    _assert_losses_equal(result, normal, range(1, RESUME_AT + 1))
    assert lm_losses(normal.stdout)[1] != pytest.approx(lm_losses(runs["normal"].stdout)[1], rel=1e-4)  # dropout is on


def test_staleness_1_ending_after_a_check_step_checks_each_step_against_its_own_weights(runs):
    # At the end the forward instance loads two steps (2, a check step, and 3): step 2 is compared before 3 replaces it.
    result = _train(runs["data"], 4, *FBD, "--pipeline-model-parallel-size", 2, "--fbd-weight-staleness", 1,
                    "--train-iters", 3)
    report = _report_of_stage(_forward_reports(result), 0)  # the last stage's forward instance holds no weights
    assert "3 iterations, weights checked 2 times" in report, report


def test_weights_that_drift_apart_stop_the_run_with_one_line_naming_the_stage(gpt_data):
    env = {"MEGATRON_PLUGINS": "weight_drift_plugin", "PYTHONPATH": str(PLUGINS)}
    result = torchrun(4, "pretrain_gpt.py", TINY_GPT + gpt_data_args(gpt_data) + RECOMPUTE + FBD + [
        "--pipeline-model-parallel-size", "2", "--train-iters", "3", "--drift-weights-at-iteration", "3"], env=env)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("pretrain_gpt.py: error: ")]
    assert len(lines) == 1 and lines[0].startswith(
        "pretrain_gpt.py: error: megafbd: the forward and backward weights of pipeline stage 0 (data-parallel "
        "replica 0, backward link rank 0) differ after iteration 2"), result.stderr[-3000:]


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
    # Both forward instances stopped on the backward instances' word, stage 0's weights checked at the end.
    reports = [line for line in log.splitlines() if line.startswith("megafbd: forward instance")]
    assert f"{saved} iterations, weights checked" in _report_of_stage(reports, 0), log[-3000:]
    assert f"{saved} iterations, no weights" in _report_of_stage(reports, 1), log[-3000:]


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


def test_declared_placement_gives_a_forward_process_its_own_world_and_a_read_only_configuration():
    """MegaFBD declares the split (TP2 backward with sequence parallelism on GPUs, TP1 forward on the CPU) and
    the loop builds each process's configuration from it: nobody rewrites the flags."""
    flags = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, sequence_parallel=True,
                               ignore_forward_tensor_parallel=True, device="cuda", fbd_forward_device="cpu",
                               distributed_backend="nccl", world_size=2, train_iters=5)
    placement = declared_placement(FrozenArgs(flags), Launch(rank=2, size=3))
    assert [(w.kind, w.first_rank, w.size, w.trains) for w in placement.worlds] == [
        (BACKWARD, 0, 2, True), (FORWARD, 2, 1, False)]
    forward = configuration_at(flags, placement)
    assert (forward.device, forward.distributed_backend, forward.tensor_model_parallel_size, forward.sequence_parallel,
            forward.world_size, forward.train_iters) == ("cpu", "gloo", 1, False, 1, 5)
    backward = configuration_at(flags, declared_placement(FrozenArgs(flags), Launch(rank=1, size=3)))
    assert vars(backward) == vars(flags)
    with pytest.raises(FrozenArgsError):
        forward.tensor_model_parallel_size = 2


def test_checksum_sees_a_single_bit_and_a_swap():
    weights = [torch.randn(64, dtype=torch.bfloat16), torch.randn(8, 8)]
    reference = checksum(weights)
    flipped = [weights[0].clone(), weights[1]]
    flipped[0].view(torch.int16)[3] ^= 1
    swapped = [weights[0].flip(0), weights[1]]
    assert not torch.equal(checksum(flipped), reference) and not torch.equal(checksum(swapped), reference)
    assert torch.equal(checksum([w.clone() for w in weights]), reference)


def test_a_batch_survives_packing_with_its_keys_dtypes_and_shapes():
    batch = {"tokens": torch.randint(0, 1000, (2, 64)), "labels": torch.randint(0, 1000, (2, 64)),
             "loss_mask": torch.rand(2, 64), "attention_mask": torch.rand(2, 1, 64, 64) > 0.5,
             "padding": torch.randn(3, dtype=torch.bfloat16)}
    received = unpack(pack(batch))
    assert list(received) == list(batch)
    for key, value in batch.items():
        assert received[key].dtype == value.dtype and torch.equal(received[key], value), key
