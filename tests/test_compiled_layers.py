"""--compile-transformer-layers: the layers under torch.compile compute the eager single rank's losses and grad
norms, whole (one rank: one graph that every layer reuses) and broken around tensor parallelism's collectives (TP2
with sequence parallelism); the real pretrain_gpt.py under torchrun, gloo, CPU."""

import functools
import re

import pytest
from helpers.launch import TINY_GPT, assert_succeeded, gpt_data_args, torchrun

ITERATIONS = 4
LOGGED = re.compile(r"iteration +(\d+)/.*?lm loss: ([0-9.Ee+-]+).*?grad norm: ([0-9.Ee+-]+)")


@functools.cache
def _eager_single_rank(data_prefix):
    return _run(1, [], data_prefix)[1]


def _run(nproc, flags, data_prefix, env=None):
    result = torchrun(nproc, "pretrain_gpt.py", TINY_GPT + gpt_data_args(data_prefix) +
                      ["--train-iters", str(ITERATIONS), "--lr-warmup-iters", "1"] + flags, env=env)
    assert_succeeded(result)
    logged = {int(i): (float(loss), float(norm)) for i, loss, norm in LOGGED.findall(result.stdout)}
    assert sorted(logged) == list(range(1, ITERATIONS + 1)), result.stdout[-2000:]
    return result, logged


@pytest.mark.parametrize("nproc, layout", [(1, []), (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])],
                         ids=["single", "tp2_sp"])
def test_compiled_layers_compute_the_eager_losses(nproc, layout, gpt_data):
    eager = _eager_single_rank(str(gpt_data))
    result, compiled = _run(nproc, layout + ["--compile-transformer-layers"], str(gpt_data),
                            env={"TORCH_LOGS": "recompiles,graph_breaks"})
    assert "layers under torch.compile" in result.stdout, result.stdout[-2000:]
    for iteration, (loss, norm) in eager.items():
        assert compiled[iteration] == pytest.approx((loss, norm), rel=1e-3), (iteration, compiled, eager)
    if nproc == 1:  # under TP the graph breaks around each collective, and megatron-core's first calls recompile
        logs = result.stdout + result.stderr
        assert "Graph break" not in logs, logs[-4000:]  # megatron-core's warnings no longer break it
        assert "Recompiling" not in logs, logs[-4000:]  # the four layers share one compiled graph
