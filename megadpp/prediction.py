"""What the simulator (megadpp/simulator.py) predicts for a measured side-by-side run
(bench/dpp_side_by_side.py): the same pipeline, microbatches and injected delays, with the one cost it cannot
know solved from the measurement itself, so that the simulated static schedule takes as long as the measured
one. Then DPP's simulated time on those costs is the prediction printed beside DPP's measured time.

The unknown is either the forward time of one microbatch (healthy, slow link, uneven stages: the layers of
each stage set their relative costs) or, given that forward time from a healthy run of the same job
(``forward_ms``), the slow-down of one stage (``slow_stage``: a GPU that shares its time with another job) or,
with a slow link, how much of its delay the static schedule hides (``host_overlap``, iteration_model.py): its
sender's host sleeps while the GPU still runs the kernels queued before the send. Solved that way, the model
matched the GPU: on four H100s (GPT 1.3B, 20 ms on 30 % of one stage's sends) the static schedule hid half of each
sending action's compute (0.55 at PP4, 0.49 at PP2 with a virtual pipeline), and the DPP times predicted from
the healthy run's forward came within 1-4 % of the measured ones, where a forward time solved from the slowed static
run alone predicted them 10 % too fast.
The simulator's makespan covers the pipeline alone; the optimizer step and the gradient synchronisation are
folded into the solved cost, which makes the predicted ratio a little closer to 1 than the pipeline's own.

A straggler that comes and goes (a competing job on one GPU for some iterations: ``predict_transient``) is the
two cases in turn: the forward time solved from the static schedule's unloaded iterations, the stage's slow-down
from its loaded ones, and each schedule's prediction the mean of its healthy and slowed makespans, weighted by the
share of loaded iterations.
"""

import statistics
from dataclasses import dataclass

from megadpp.iteration_model import CostModel
from megadpp.policy import POLICIES
from megadpp.runtime import default_caps
from megadpp.simulator import simulate
from megadpp.static_orders import static_order

TRANSFER_MS = 0.2  # one activation between neighbouring GPUs of a host (16 MiB over NVLink); small either way
SEEDS = 5  # delay draws averaged, the same draws for every schedule
# A host that ran this many actions' compute ahead of its GPU hides a whole delay of that size; past it, the static
# schedule would be faster than its healthy run
MAX_OVERLAP = 4.0


@dataclass
class Prediction:
    forward_ms: float  # one stage's forward of one microbatch at the mean stage size
    stage_scale: tuple  # per pipeline rank: its compute relative to that
    static_ms: float  # the simulated static schedule (equal to the measured one, by construction)
    dpp_ms: dict  # policy -> simulated DPP makespan
    bound_ms: float  # the busiest stage's own compute: no schedule of these costs finishes sooner
    # Share of a sending action's compute that the static schedule's link delay overlaps; None where not solved
    host_overlap: float | None = None


class _Pipeline:
    def __init__(self, stages, chunks, microbatches, link_delay):
        self.stages, self.chunks, self.microbatches = stages, chunks, microbatches
        self.link = {}
        if link_delay is not None:
            stage, ms, probability = link_delay
            self.link = dict(straggler_link=stage, straggler_ms=ms, straggler_probability=probability)
        self.orders = {r: static_order(r, stages, chunks, microbatches) for r in range(stages)}
        self.caps = default_caps(stages, chunks, microbatches, stages)

    def makespan(self, forward_ms, stage_scale, policy=None, host_overlap=0.0):
        spans = []
        for seed in range(SEEDS):
            cost = CostModel(forward_ms=forward_ms, transfer_ms=TRANSFER_MS, stage_scale=stage_scale, seed=seed,
                             host_overlap=host_overlap, **self.link)
            result = simulate(self.stages, self.chunks, self.microbatches, cost,
                              static_orders=None if policy else self.orders, policy=policy, caps=self.caps)
            spans.append(result.makespan_ms)
        return statistics.mean(spans)


def _solve(makespan_of, target_ms, low, high):
    """The x in [low, high] whose (increasing) makespan_of(x) is target_ms, by bisection."""
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if makespan_of(middle) < target_ms else (low, middle)
    return (low + high) / 2


def predict(stage_layers, chunks, microbatches, static_ms, link_delay=None, forward_ms=None, slow_stage=None):
    """``stage_layers``: the decoder layers of each pipeline rank; ``link_delay``: (sending stage, ms,
    probability) of --dpp-delay-link, or None; ``forward_ms`` with ``slow_stage`` or ``link_delay``: see the
    module's text."""
    pipeline = _Pipeline(len(stage_layers), chunks, microbatches, link_delay)
    mean = statistics.mean(stage_layers)
    layer_scale = tuple(n / mean for n in stage_layers)
    scale, overlap = layer_scale, None
    if slow_stage is not None:
        def slowed(factor):
            return tuple(s * factor if stage == slow_stage else s for stage, s in enumerate(layer_scale))

        scale = slowed(_solve(lambda k: pipeline.makespan(forward_ms, slowed(k)), static_ms, 1.0, 100.0))
    elif forward_ms is not None and link_delay is not None:
        # The makespan falls as the overlap grows: solve on its negative
        overlap = _solve(lambda k: -pipeline.makespan(forward_ms, scale, host_overlap=k), -static_ms, 0.0, MAX_OVERLAP)
    else:
        forward_ms = _solve(lambda f: pipeline.makespan(f, scale), static_ms, 1e-3, static_ms)
    busiest = microbatches * forward_ms * (1 + CostModel().backward_ratio) * max(scale)
    return Prediction(forward_ms, scale, pipeline.makespan(forward_ms, scale, host_overlap=overlap or 0.0),
                      {policy: pipeline.makespan(forward_ms, scale, policy) for policy in POLICIES}, busiest, overlap)


def predict_transient(stage_layers, chunks, microbatches, healthy_static_ms, loaded_static_ms, loaded_share,
                      slow_stage):
    """The static schedule's mean iteration over its unloaded (``healthy_static_ms``) and loaded
    (``loaded_static_ms``) iterations, ``loaded_share`` of them loaded, with the load on ``slow_stage``'s GPU."""
    healthy = predict(stage_layers, chunks, microbatches, healthy_static_ms)
    loaded = predict(stage_layers, chunks, microbatches, loaded_static_ms, forward_ms=healthy.forward_ms,
                     slow_stage=slow_stage)

    def mean(of_healthy, of_loaded):
        return (1 - loaded_share) * of_healthy + loaded_share * of_loaded

    return Prediction(healthy.forward_ms, loaded.stage_scale, mean(healthy.static_ms, loaded.static_ms),
                      {policy: mean(healthy.dpp_ms[policy], loaded.dpp_ms[policy]) for policy in POLICIES},
                      mean(healthy.bound_ms, loaded.bound_ms))
