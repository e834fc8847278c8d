"""Every parallel layout trains, its loss falls, and it computes the single-rank losses.

Each layout runs the real pretrain_gpt.py under torchrun (gloo, CPU) on the sample data with
the same seed. Initialization does not depend on the layout (--use-cpu-initialization) and
dropout is off, so TP/PP/DP/virtual-pipeline/distributed-optimizer runs must reproduce the
TP1/PP1 losses up to float reassociation.
"""

import functools

import pytest
from helpers.launch import TINY_GPT, assert_succeeded, gpt_data_args, lm_losses, torchrun

ITERATIONS = 12
COMPARED_ITERATIONS = 4
RELATIVE_TOLERANCE = 1e-3

LAYOUTS = {
    "single": (1, []),
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "dp2": (2, []),
    "tp2_pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "tp2_dp2_distributed_optimizer_overlap": (4, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
                                                  "--overlap-grad-reduce", "--overlap-param-gather"]),
    "pp2_uneven": (2, ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3"]),
    "pp2_virtual": (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
    "tp2_sequence_parallel": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "tp2_sequence_parallel_comm_overlap": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                               "--tp-comm-overlap"]),
    "pp2_recompute_full": (2, ["--pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
                               "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
    "tp2_recompute_selective": (2, ["--tensor-model-parallel-size", "2", "--recompute-granularity", "selective"]),
}


@functools.cache
def _losses(layout, data_prefix):
    nproc, flags = LAYOUTS[layout]
    result = torchrun(nproc, "pretrain_gpt.py",
                      TINY_GPT + gpt_data_args(data_prefix) + ["--train-iters", str(ITERATIONS)] + flags)
    assert_succeeded(result)
    losses = lm_losses(result.stdout)
    assert sorted(losses) == list(range(1, ITERATIONS + 1)), result.stdout[-2000:]
    return losses


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_and_loss_falls(layout, gpt_data):
    losses = _losses(layout, str(gpt_data))
    first, last_three = losses[1], [losses[i] for i in range(ITERATIONS - 2, ITERATIONS + 1)]
    assert max(last_three) < first - 0.5, losses


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "single"])
def test_layout_matches_single_rank_losses(layout, gpt_data):
    reference, losses = _losses("single", str(gpt_data)), _losses(layout, str(gpt_data))
    for iteration in range(1, COMPARED_ITERATIONS + 1):
        assert losses[iteration] == pytest.approx(reference[iteration], rel=RELATIVE_TOLERANCE), (
            f"iteration {iteration}: {layout} {losses[iteration]} vs single rank {reference[iteration]}")
