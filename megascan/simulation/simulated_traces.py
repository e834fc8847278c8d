"""Simulated GPT training runs (DP x TP x PP, 1F1B; megascan/simulation/training_simulator.py) written as MegaScan
per-rank trace files (docs/megascan_trace_format.md), with their ground truth: which GPUs were slow,
which link, which rank hung and which ranks were left blocked. For tests/test_detection_scenarios.py,
bench/detection_scale.py and bench/aggregate_scale.py.

Clocks are those of a GPU cluster: each host's wall clock is off by a few milliseconds (NTP) and
drifts by up to tens of ppm; a window's CUDA-event times are placed on the host's clock by a per-window
anchor good to a few microseconds (megascan/timing.py), and between anchors they run at the host's
rate give or take a ppm of the GPU's own oscillator. Rank r's reading at true time t in window w:

    local = t + offset[host] + drift[host] * (anchor[w] - T0) + rate[r] * (t - anchor[w]) + anchor_error[r, w]

with rate[r] = drift[host] + gpu_ppm[r]. Ranks on one host share its clock, so between them only the
anchors and the GPUs' ppm differ.
"""

import os
import random
from dataclasses import dataclass, field

from megascan.simulation.one_f_one_b import stage_program
from megascan.simulation.synthetic_traces import window_groups, write_lines
from megascan.simulation.training_simulator import (
    GPU_BOUND_HOST_COST,
    Faults,
    Layout,
    Stalls,
    WindowSimulation,
    compute_speeds,
)

T0_US = 1_763_788_435_000_000.0  # true time of the first traced iteration's start
TRACE_INTERVAL = 5


@dataclass
class Scenario:
    """One case: the layout, the faults (ranks, factors) and the clocks; ``seed`` draws the rest."""

    name: str
    dp: int
    tp: int
    pp: int
    microbatches: int = 4
    layers_per_stage: int = 2
    windows: tuple = ((4, 5), (9, 10))
    seed: int = 0
    speed_spread: float = 0.03  # every GPU within +-3 % of nominal
    culprits: dict = field(default_factory=dict)  # rank -> compute time factor
    slow_links: dict = field(default_factory=dict)  # (src, dst) -> transfer time factor
    hang: tuple | None = None  # (rank, iteration, kind of step[, occurrence]): see hang_step; in the last window
    hung_writes_issued: bool = True  # False: stopped whole (SIGSTOP), its writer too
    lookahead: float = 0.5  # chance that a blocked rank's host issued 1-3 further operations before it blocked
    gpus_per_host: int = 8
    host_offset_us: float = 3_000.0
    host_drift_ppm: float = 20.0
    gpu_ppm: float = 1.0
    anchor_error_us: float = 5.0
    host_cost: float = GPU_BOUND_HOST_COST  # > 1: a host-bound job (training_simulator.py)
    host_slow: dict = field(default_factory=dict)  # rank -> factor on its host's time: a host-bound rank
    launch_queue_us: float | None = None  # GPU time its host may run ahead of each GPU (training_simulator.py)
    stalls: Stalls | None = None  # time slices lost at random on every rank (training_simulator.py)

    @property
    def layout(self):
        return Layout(self.dp, self.tp, self.pp, self.microbatches, self.layers_per_stage)


@dataclass
class SimulatedRun:
    scenario: Scenario
    directory: str
    layout: Layout
    hung: set  # ranks that stopped on their own
    blocked: set  # ranks that never finished because they waited, directly or not, on a hung rank
    clock: "HostClocks"
    instances: int  # operations (collective instances and transfers) recorded


class HostClocks:
    """Each rank's reading of true time in each window (module docstring), and the reference's."""

    def __init__(self, scenario, rng):
        hosts = range((scenario.layout.world_size + scenario.gpus_per_host - 1) // scenario.gpus_per_host)
        self.per_host = scenario.gpus_per_host
        self.offset = {h: rng.uniform(-scenario.host_offset_us, scenario.host_offset_us) for h in hosts}
        self.drift = {h: rng.uniform(-scenario.host_drift_ppm, scenario.host_drift_ppm) * 1e-6 for h in hosts}
        self.rate = {r: self.drift[r // self.per_host] + rng.uniform(-scenario.gpu_ppm, scenario.gpu_ppm) * 1e-6
                     for r in range(scenario.layout.world_size)}
        self.anchor_error_us, self.rng = scenario.anchor_error_us, rng
        self.anchors, self.errors = {}, {}

    def open_window(self, window, anchor):
        self.anchors[window] = anchor
        self.errors[window] = {r: self.rng.uniform(-self.anchor_error_us, self.anchor_error_us) for r in self.rate}

    def wall(self, rank, t):
        """The host's wall clock (issued lines' host times)."""
        host = rank // self.per_host
        return t + self.offset[host] + self.drift[host] * (t - T0_US)

    def local(self, rank, window, t):
        anchor = self.anchors[window]
        return self.wall(rank, anchor) + (1.0 + self.rate[rank]) * (t - anchor) + self.errors[window][rank]

    def true_time(self, rank, window, local):
        anchor = self.anchors[window]
        return anchor + (local - self.errors[window][rank] - self.wall(rank, anchor)) / (1.0 + self.rate[rank])

    def reference(self, window, t):
        """What aligned times should read: rank 0's clock in that window."""
        return self.local(0, window, t)


def hang_step(layout, rank, which, occurrence=0):
    """Index, in ``rank``'s program of one iteration, of the ``occurrence``-th step of a kind: "tp" (a
    tensor-parallel all-reduce), "send", "recv" (an exchange holding one), "grads" (the DP gradient
    all-reduce), "embedding", "grad-norm", or "start" (before its first operation)."""
    if which == "start":
        return 0
    roles = {"tp": "tp", "grads": "dp_cp", "embedding": "embd", "grad-norm": "mp"}
    program = stage_program(layout.coords(rank)["pp"], layout.pp, layout.microbatches,
                            list(range(1, layout.layers_per_stage + 1)), layout.dp, layout.tp)
    return [i for i, step in enumerate(program)
            if (step[0] == "collective" and step[1] == roles.get(which))
            or (step[0] == "exchange" and any(kind == which for kind, _ in step[1]))][occurrence]


def _instance_key(rank, op):
    if op["kind"] == "collective":
        return op["group"], op["seq"]
    return (op["group"], op["seq"]) + ((rank, op["peer"]) if op["kind"] == "send" else (op["peer"], rank))


def simulate(scenario, directory):
    """Runs the scenario and writes one trace file per rank into ``directory``; returns its SimulatedRun."""
    os.makedirs(directory, exist_ok=True)
    rng = random.Random(scenario.seed)
    layout = scenario.layout
    hang = scenario.hang and (scenario.hang[0], scenario.hang[1],
                              hang_step(layout, scenario.hang[0], *scenario.hang[2:]))
    faults = Faults(compute_speeds(layout.world_size, scenario.speed_spread, scenario.culprits, rng),
                    dict(scenario.slow_links), hang, scenario.host_cost, dict(scenario.host_slow),
                    scenario.launch_queue_us, scenario.stalls)
    clock = HostClocks(scenario, rng)
    table, _ = layout.groups()
    lines = {rank: [_metadata(scenario, rank)] for rank in range(layout.world_size)}
    hung = {scenario.hang[0]} if scenario.hang else set()
    counters, start, instances, stuck = {}, T0_US, set(), set()
    for number, iterations in enumerate(scenario.windows):
        window = (iterations[0] - 1) // TRACE_INTERVAL
        simulation = WindowSimulation(layout, faults, iterations, start, counters, rng)
        records = simulation.run()
        stuck = {rank for rank, record in records.items() if record.stuck}
        clock.open_window(window, start)
        for rank, record in records.items():
            if rank not in stuck:
                lines[rank].append(_window_line(clock, rank, window, iterations, record, table))
                continue
            if rank not in hung and rng.random() < scenario.lookahead:
                simulation.issue_ahead(rank, rng.randint(1, 3))
            if rank not in hung or scenario.hung_writes_issued:
                lines[rank] += _issued_lines(clock, rank, window, iterations[0], record.ops, table)
        instances.update(_instance_key(rank, op) for rank, record in records.items() for op in record.ops)
        if stuck or number + 1 == len(scenario.windows):
            break
        end = max(event[5] for record in records.values() for event in record.events)
        untraced = scenario.windows[number + 1][0] - iterations[-1] - 1
        start = end + untraced * (end - start) / len(iterations)  # the iterations between windows, untraced
    for rank, rank_lines in lines.items():
        write_lines(_path(directory, layout, rank), rank_lines)
    return SimulatedRun(scenario, str(directory), layout, hung, stuck - hung, clock, len(instances))


def _path(directory, layout, rank):
    c = layout.coords(rank)
    return os.path.join(directory, f"benchmark-data-{c['dp']}-pipeline-{c['pp']}-tensor-{c['tp']}.json")


def _metadata(scenario, rank):
    layout = scenario.layout
    return {"type": "metadata", "format": "megascan", "version": 1, "run_id": f"sim-{scenario.name}-{scenario.seed}",
            "rank": rank, "world_size": layout.world_size, "coords": layout.coords(rank),
            "layout": {"dp": layout.dp, "pp": layout.pp, "tp": layout.tp, "vp": 1, "sequence_parallel": False,
                       "distributed_optimizer": False, "micro_batch_size": 1,
                       "global_batch_size": layout.microbatches * layout.dp, "num_microbatches": layout.microbatches},
            "host": f"node-{rank // scenario.gpus_per_host}", "device": "cuda",
            "device_index": rank % scenario.gpus_per_host,
            "device_name": "NVIDIA H200", "timer": "cuda_event", "granularity": "full",
            "trace_interval": TRACE_INTERVAL, "continuous_trace_iterations": len(scenario.windows[0]),
            "train_iters": 10_000}


def _window_line(clock, rank, window, iterations, record, table):
    def local(t):
        return round(clock.local(rank, window, t), 3)

    events = [{"name": name, "cat": "compute", "iteration": iteration, "microbatch": microbatch,
               "chunk": None if microbatch is None else 0, "layer": layer, "start_us": local(start),
               "end_us": local(end)}
              for name, iteration, microbatch, layer, start, end in record.events]
    ops = [{**{k: v for k, v in op.items() if k not in ("start", "end", "host")}, "start_us": local(op["start"]),
            "end_us": local(op["end"]), "host_us": round(clock.wall(rank, op["host"]), 1)} for op in record.ops]
    return {"type": "window", "window": window, "iterations": list(iterations), "complete": True,
            "clock": {"source": "cuda_event", "anchor_uncertainty_us": clock.anchor_error_us},
            "groups": window_groups(table, ops), "nvml": None, "events": events, "ops": ops}


def _issued_lines(clock, rank, window, iteration, ops, table):
    """What a stalled rank's writer appends: its issued ops on the host's clock, in two lines (one every 5 s)."""
    issued = [{**{k: v for k, v in op.items() if k not in ("start", "end", "host")},
               "host_us": round(clock.wall(rank, op["start"] - 20.0), 1)} for op in ops]
    half = len(issued) // 2
    return [{"type": "issued", "window": window, "iteration": iteration, "groups": window_groups(table, part),
             "ops": part}
            for part in (issued[:half], issued[half:]) if part]
