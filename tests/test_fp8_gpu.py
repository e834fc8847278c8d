"""FP8 training on a GPU with FP8 tensor cores (skipped elsewhere): what the CPU tests cannot show.

GPT 345M on the sample corpus, 300 iterations, the real pretrain_gpt.py with its defaults (CUDA graphs): each FP8
format and recipe, and FP8 under --compile-transformer-layers, keeps every logged loss within 1 % (relative) of the bf16
run's and every grad norm within 10 %, all finite. A checkpoint an FP8 run saved at iteration 150 trains on in bf16,
and a bf16 one in FP8, with the same losses as the runs that went straight through.
"""

import functools
import importlib.util
import math
import re

import pytest
import torch
from helpers.launch import assert_succeeded, gpt_data_args, torchrun

FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [pytest.mark.skipif(not FP8_GPU, reason="needs a GPU of compute capability 8.9 or newer"),
              pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao (the [fp8] extra)")]

ITERATIONS, HALF, LOG_INTERVAL = 300, 150, 10
GPT_345M = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
            "--max-position-embeddings", "1024", "--micro-batch-size", "4", "--global-batch-size", "8", "--bf16",
            "--lr", "0.00015", "--min-lr", "1.0e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "10",
            "--weight-decay", "1e-2", "--clip-grad", "1.0", "--adam-beta2", "0.95", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--device", "cuda", "--log-interval", str(LOG_INTERVAL), "--eval-iters", "0",
            "--train-iters", str(ITERATIONS)]
LOGGED = re.compile(r"iteration +(\d+)/.*?lm loss: ([0-9.Ee+-]+|nan|inf).*?grad norm: ([0-9.Ee+-]+|nan|inf)")
DEFAULT_FP8 = ["--fp8-format", "hybrid"]


def _train(data, *flags):
    """{iteration: (loss, grad norm)} of a run, every logged iteration present and finite."""
    result = torchrun(1, "pretrain_gpt.py", GPT_345M + gpt_data_args(data) + [str(flag) for flag in flags])
    assert_succeeded(result)
    logged = {int(i): (float(loss), float(norm)) for i, loss, norm in LOGGED.findall(result.stdout)}
    resumed_at = HALF if "--load" in flags else 0
    assert sorted(logged) == list(range(resumed_at + LOG_INTERVAL, ITERATIONS + 1, LOG_INTERVAL)), result.stdout[-3000:]
    assert all(math.isfinite(loss) and math.isfinite(norm) for loss, norm in logged.values()), logged
    return result, logged


@functools.cache
def _bf16(data, save_dir):
    """The bf16 run, saving at iteration 150 (and 300) for the FP8 run that resumes from it."""
    return _train(data, "--save", save_dir, "--save-interval", HALF)[1]


def _latest_is_the_half(save_dir):
    """Makes iteration 150's checkpoint the one --load resumes (a run saves at its end too)."""
    (save_dir / "latest_checkpointed_iteration.txt").write_text(str(HALF))
    return save_dir


def _assert_follows(logged, reference):
    for iteration, (loss, norm) in logged.items():
        expected_loss, expected_norm = reference[iteration]
        assert loss == pytest.approx(expected_loss, rel=0.01), (iteration, loss, expected_loss)
        assert norm == pytest.approx(expected_norm, rel=0.10), (iteration, norm, expected_norm)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("fp8_gpu_checkpoints")


@pytest.mark.parametrize("fp8", [["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
                                 ["--fp8-format", "hybrid", "--fp8-recipe", "rowwise"],
                                 ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"],
                                 ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"],
                                 DEFAULT_FP8 + ["--compile-transformer-layers"]],
                         ids=["hybrid_tensorwise", "hybrid_rowwise", "e4m3_tensorwise", "e4m3_rowwise", "compiled"])
def test_fp8_losses_and_grad_norms_follow_bf16s(gpt_data, checkpoints, fp8):
    result, logged = _train(gpt_data, *fp8)
    assert "linear GEMMs of the layers in FP8" in result.stdout and "CUDA graphs: local" in result.stdout
    _assert_follows(logged, _bf16(gpt_data, checkpoints / "bf16"))


def test_a_checkpoint_trains_on_across_fp8_and_bf16(gpt_data, checkpoints):
    bf16 = _bf16(gpt_data, checkpoints / "bf16")
    _, fp8 = _train(gpt_data, *DEFAULT_FP8, "--save", checkpoints / "fp8", "--save-interval", HALF)
    _, fp8_then_bf16 = _train(gpt_data, "--load", _latest_is_the_half(checkpoints / "fp8"))
    _assert_follows(fp8_then_bf16, bf16)
    _, bf16_then_fp8 = _train(gpt_data, *DEFAULT_FP8, "--load", _latest_is_the_half(checkpoints / "bf16"))
    _assert_follows(bf16_then_fp8, fp8)
