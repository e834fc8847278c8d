"""MegaDPP's schedule as data, checked without processes: the policies on the simulator (the same code the
runtime runs) never deadlock, whatever the delays, layout and activation cap, and always produce valid
torch.distributed.pipelining schedules; the flags refuse bad combinations in one line."""

import concurrent.futures
import itertools
import os
import random
import subprocess
import sys

import pytest
from helpers.launch import TINY_GPT, run_script
from torch.distributed.pipelining.schedules import _Action, _validate_schedule

from megadpp.actions import StageLayout
from megadpp.iteration_model import CostModel
from megadpp.policy import POLICIES
from megadpp.prediction import predict, predict_transient
from megadpp.runtime import default_caps
from megadpp.simulator import simulate
from megadpp.static_orders import static_order


def _as_torch(orders, stages):
    return {r: [_Action.from_str(a.to_str(r, stages)) for a in order] for r, order in orders.items()}


LAYOUTS = [(stages, chunks, microbatches) for stages, chunks, microbatches
           in itertools.product((2, 3, 4), (1, 2, 3), (1, 2, 6)) if chunks == 1 or microbatches % stages == 0]


@pytest.mark.parametrize("policy", POLICIES)
def test_no_deadlock_and_valid_schedules_under_random_delays(policy):
    rng = random.Random(0)
    for (stages, chunks, microbatches), seed in itertools.product(LAYOUTS, range(4)):
        cost = CostModel(transfer_ms=rng.uniform(0, 2), jitter_ms=rng.uniform(0, 5), seed=seed,
                         straggler_stage=rng.randrange(stages), straggler_link=rng.randrange(stages),
                         straggler_ms=rng.uniform(0, 10), straggler_probability=rng.random())
        caps = default_caps(stages, chunks, microbatches, stages) if seed % 2 else [1 + seed % 3] * stages
        result = simulate(stages, chunks, microbatches, cost, policy=policy, caps=caps)
        assert all(len(order) == 2 * chunks * microbatches for order in result.orders.values())
        _validate_schedule(_as_torch(result.orders, stages), stages, stages * chunks, microbatches)
        if seed % 2:  # the cap holds, but for the oldest microbatch's own chunks
            assert result.peak_in_flight <= max(caps) + chunks - 1


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("stages, chunks, microbatches", [(2, 1, 4), (4, 1, 8), (8, 1, 16), (2, 2, 8), (4, 2, 16),
                                                          (8, 4, 32), (16, 2, 64)])
def test_healthy_pipeline_runs_the_static_order_and_is_no_slower(policy, stages, chunks, microbatches):
    """On time, DPP runs megatron-core's 1F1B / interleaved 1F1B order (the short waits a healthy static
    order has are not taken for lateness), so it takes at most the static schedule's time."""
    cost = CostModel(transfer_ms=0.05)
    static = {r: static_order(r, stages, chunks, microbatches) for r in range(stages)}
    caps = default_caps(stages, chunks, microbatches, stages)
    result = simulate(stages, chunks, microbatches, cost, policy=policy, caps=caps)
    assert result.orders == static
    assert result.makespan_ms <= simulate(stages, chunks, microbatches, cost, static_orders=static).makespan_ms


@pytest.mark.parametrize("policy", POLICIES)
def test_late_input_makes_the_rank_deviate(policy):
    """A slow link (+3 forward times on every transfer from stage 1) is lateness: the ranks leave the static
    order and, their sends asynchronous, finish sooner than interleaved 1F1B."""
    stages, chunks, microbatches = 4, 2, 16
    cost = CostModel(transfer_ms=0.05, straggler_link=1, straggler_ms=3.0)
    static = {r: static_order(r, stages, chunks, microbatches) for r in range(stages)}
    result = simulate(stages, chunks, microbatches, cost, policy=policy,
                      caps=default_caps(stages, chunks, microbatches, stages))
    assert result.orders != static
    assert result.makespan_ms < simulate(stages, chunks, microbatches, cost, static_orders=static).makespan_ms


def test_prediction_matches_the_measured_static_time_and_models_the_job():
    """bench/dpp_side_by_side.py --predict: the solved cost reproduces the measured static time; a slow link
    is predicted to favour DPP; uneven stages get their layers' share; a loaded GPU its solved slow-down."""
    even = [4, 4, 4, 4]
    healthy = predict(even, 1, 16, static_ms=500.0)
    assert healthy.static_ms == pytest.approx(500.0, rel=1e-3) and healthy.stage_scale == (1, 1, 1, 1)
    link = predict(even, 2, 16, static_ms=900.0, link_delay=(1, 20.0, 0.3))
    assert link.static_ms == pytest.approx(900.0, rel=1e-3)
    assert all(ms < 0.9 * link.static_ms for ms in link.dpp_ms.values())
    uneven = predict([9, 6, 6, 6], 1, 16, static_ms=600.0)
    assert uneven.stage_scale == pytest.approx((9 / 6.75, 6 / 6.75, 6 / 6.75, 6 / 6.75))
    assert 0.85 * uneven.static_ms < uneven.bound_ms < min(uneven.dpp_ms.values())
    loaded = predict(even, 1, 16, static_ms=700.0, forward_ms=healthy.forward_ms, slow_stage=2)
    assert loaded.forward_ms == healthy.forward_ms and loaded.stage_scale[2] > 1.2
    assert loaded.stage_scale[:2] == (1, 1) and loaded.static_ms == pytest.approx(700.0, rel=1e-3)


# Measured on four H100s (docs/benchmarks.md, MegaDPP speed): GPT 1.3B, 16 microbatches, 20 ms on 30 % of one stage's
# sends: (stages, chunks, the delayed stage, static ms healthy, static ms with the slow link, DPP ms with it)
H100_SLOW_LINK = {"PP4": (4, 1, 1, 438.3, 570.5, 0.99 * 570.5), "PP2 + virtual pipeline": (2, 2, 0, 884.4, 1066.6,
                                                                                          0.87 * 1066.6)}


@pytest.mark.parametrize("layout", H100_SLOW_LINK)
def test_a_slow_links_prediction_from_the_healthy_forward_matches_the_gpu(layout):
    """The static schedule's link delay is its sender's host sleeping while its GPU still runs the sending action's
    kernels. Given the healthy run's forward time, the prediction solves how much of each delay that hides (about
    half, at both layouts) and then puts DPP within 5 % of its measured time; the forward time solved from the slowed
    static run alone put it 10 % too fast."""
    stages, chunks, stage, healthy_ms, static_ms, dpp_ms = H100_SLOW_LINK[layout]
    layers = [24 // stages] * stages
    forward_ms = predict(layers, chunks, 16, healthy_ms).forward_ms
    found = predict(layers, chunks, 16, static_ms, link_delay=(stage, 20.0, 0.3), forward_ms=forward_ms)
    assert found.static_ms == pytest.approx(static_ms, rel=1e-3) and 0.4 < found.host_overlap < 0.6
    assert all(ms == pytest.approx(dpp_ms, rel=0.05) for ms in found.dpp_ms.values()), found.dpp_ms
    alone = predict(layers, chunks, 16, static_ms, link_delay=(stage, 20.0, 0.3))
    assert alone.host_overlap is None and all(ms < 0.93 * dpp_ms for ms in alone.dpp_ms.values())


def test_transient_prediction_weighs_the_loaded_iterations():
    """A GPU loaded for a quarter of the iterations: the healthy and the loaded static times give the forward time
    and the slow-down, and every prediction is the quarter-weighted mean of the two cases'."""
    even = [4, 4, 4, 4]
    healthy = predict(even, 1, 16, 500.0)
    loaded = predict(even, 1, 16, 700.0, forward_ms=healthy.forward_ms, slow_stage=1)
    transient = predict_transient(even, 1, 16, 500.0, 700.0, 0.25, slow_stage=1)
    assert transient.static_ms == pytest.approx(0.75 * 500.0 + 0.25 * 700.0, rel=1e-3)
    assert transient.stage_scale == loaded.stage_scale and transient.stage_scale[1] > 1.2
    for policy, ms in transient.dpp_ms.items():
        assert ms == pytest.approx(0.75 * healthy.dpp_ms[policy] + 0.25 * loaded.dpp_ms[policy])


def test_fault_injection_draws_agree_across_processes():
    """A slow link's delays are drawn by the sender under a static schedule and by the receiver under DPP:
    every process must draw the same, whatever its str hash seed."""
    code = ("from megadpp.fault_injection import _Draws; "
            "print([_Draws(7)(1, 'F', c, m) for c in (0, 1) for m in range(4)])")
    outputs = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed}, check=True,
                              capture_output=True, text=True, timeout=300).stdout for seed in ("1", "2")}
    assert len(outputs) == 1, outputs


def test_default_cap_is_what_1f1b_holds():
    assert default_caps(4, 1, 8, 4) == [4, 3, 2, 1]
    assert default_caps(4, 1, 2, 4) == [2, 2, 2, 1]


def test_stage_layout_neighbours():
    layout = StageLayout(pp_rank=0, stages=2, chunks=2)
    assert layout.upstream(1) == (1, 0) and layout.downstream(0) == (1, 0) and layout.upstream(0) is None
    assert StageLayout(1, 2, 2).downstream(0) == (0, 1) and StageLayout(1, 2, 2).downstream(1) is None


MOCK = TINY_GPT + ["--mock-data", "--vocab-size", "1000", "--train-iters", "3"]
BAD = {
    "dpp without a pipeline": ([], "--use-dpp needs --pipeline-model-parallel-size 2 or more (got 1)"),
    "cap without dpp": (["--dpp-max-inflight", "2"], "--dpp-max-inflight acts on the dynamic pipeline schedule"),
    "cap below one": (["--pipeline-model-parallel-size", "2", "--dpp-max-inflight", "0"],
                      "--dpp-max-inflight must be at least 1, got 0"),
    "delayed stage outside the pipeline": (["--pipeline-model-parallel-size", "2", "--dpp-delay-stage", "2"],
                                           "--dpp-delay-stage 2 is not a pipeline stage of this job (0..1)"),
    "bad node address": (["--pipeline-model-parallel-size", "2", "--node-ips", "10.0.0.1,nodeB"],
                         "--node-ips: 'nodeB' is not an IP address"),
}


@pytest.fixture(scope="module")
def refused():
    def run(case):
        use_dpp = [] if case == "cap without dpp" else ["--use-dpp"]
        return run_script("pretrain_gpt.py", MOCK + use_dpp + BAD[case][0], env={"WORLD_SIZE": "2"}, timeout=600)

    # Each run spends seconds importing megatron-core: run them side by side.
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(BAD)) as pool:
        return dict(zip(BAD, pool.map(run, BAD)))


@pytest.mark.parametrize("case", list(BAD))
def test_bad_combination_gives_one_line(case, refused):
    result, expected = refused[case], BAD[case][1]
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert expected in lines[0], lines[0]


@pytest.mark.parametrize("flags, expected", [
    (["--prediction-slow-stage", "1"], "--prediction-slow-stage needs --prediction-forward-ms"),
    (["--prediction-forward-ms", "7.5"], "--prediction-forward-ms needs --prediction-slow-stage or --dpp-delay-link"),
], ids=["slow stage without the healthy forward", "healthy forward with nothing to solve"])
def test_side_by_side_prediction_flags_that_do_not_go_together_are_refused_before_the_job_starts(flags, expected):
    result = run_script("bench/dpp_side_by_side.py", ["--predict", *flags])
    assert result.returncode == 2 and expected in result.stderr.strip().splitlines()[-1], result.stderr
