"""MegaFBD on GPUs (skipped without them): what the CPU tests cannot show.

One GPU: the backward instance on the GPU and its forward instance on the CPU (gloo between them),
traced: the losses are the normal GPU run's, and the one trace merges the CUDA-event ranks with the
host-clock ones and matches MegaFBD's messages between them. Four GPUs: PP2 with both kinds on GPUs
and dropout 0.1: the forward instances draw the backward instances' masks from the CUDA generator.
"""

import json
import subprocess
import sys

import pytest
import torch
from helpers.launch import REPO, TINY_GPT, assert_succeeded, gpt_data_args, lm_losses, torchrun

from megascan.aggregate.merged_trace import load_and_merge

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
ITERATIONS = 4


def _train(data, nproc, *flags):
    result = torchrun(nproc, "pretrain_gpt.py", TINY_GPT + gpt_data_args(data) + RECOMPUTE + [
        "--device", "cuda", "--train-iters", str(ITERATIONS), *map(str, flags)])
    assert_succeeded(result)
    return result


def _assert_losses_equal(result, reference):
    losses, expected = lm_losses(result.stdout), lm_losses(reference.stdout)
    assert sorted(losses) == list(range(1, ITERATIONS + 1)), result.stdout[-2000:]
    for iteration, loss in losses.items():
        assert loss == pytest.approx(expected[iteration], rel=1e-5), (iteration, loss, expected[iteration])


@pytest.mark.skipif(GPUS < 1, reason="needs a GPU")
def test_gpu_backward_with_cpu_forward_gives_the_normal_losses_and_one_merged_trace(gpt_data, tmp_path):
    normal = _train(gpt_data, 1)
    trace_dir = tmp_path / "trace"
    result = _train(gpt_data, 2, "--forward-backward-disaggregating", "--fbd-forward-device", "cpu",
                    "--trace", "--trace-dir", trace_dir, "--trace-interval", 2, "--continuous-trace-iterations", 1)
    _assert_losses_equal(result, normal)
    timers = {json.loads(p.read_text().splitlines()[0])["timer"] for p in trace_dir.glob("benchmark-data-*.json")}
    assert timers == {"cuda_event", "host_clock"}
    aggregate = subprocess.run([sys.executable, str(REPO / "tools/aggregate.py"), "-b", str(trace_dir), "-d"],
                               capture_output=True, text=True, timeout=300, cwd=REPO)
    assert aggregate.returncode == 0 and "ranks: 2 merged of 2 loaded" in aggregate.stdout, aggregate.stdout
    messages = [i for i in load_and_merge(str(trace_dir)).instances if i.group.startswith("megafbd/")]
    channels = {i.group.rsplit("/", 1)[1] for i in messages}
    # PP1: the only stage is the last, whose forward instance runs no forward: batches travel, weights do not.
    assert channels == {"batch"} and all(len(i.records) == 2 for i in messages), channels


@pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs (PP2: 2 backward and 2 forward instances, one GPU each)")
def test_pp2_dropout_on_gpus_gives_the_losses_of_a_normal_run_with_dropout(gpt_data):
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--pipeline-model-parallel-size", 2]
    normal = _train(gpt_data, 2, *dropout)
    _assert_losses_equal(_train(gpt_data, 4, "--forward-backward-disaggregating", *dropout), normal)
