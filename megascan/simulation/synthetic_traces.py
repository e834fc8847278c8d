"""Synthetic MegaScan trace directories in the per-rank format of docs/megascan_trace_format.md, with
their ground truth, for tests/test_aggregate.py and bench/aggregate_scale.py.

Every iteration is one GPT training step on a DP x PP x TP layout, laid out on one global clock in
GPipe order: per microbatch and stage, each layer's attention and MLP forward and backward, each
ending in a tensor-parallel all-reduce; activations sent to the next stage on the pipeline group and
gradients to the previous one on the world group (as megatron-core does on gloo); then the
data-parallel gradient all-reduce, the embedding all-reduce between first and last stage, and the
grad-norm all-reduce over the model-parallel group. Members of a collective finish it together
(within FINISH_JITTER_US) after arriving up to ARRIVAL_SPREAD_US apart. Each rank writes times on its
own clock: ``local = global + (rate - 1) * (global - BASE_US) + offset_us``.
"""

import json
import os
import random
from dataclasses import dataclass, field

BASE_US = 1_763_788_435_000_000.0  # global time of the first traced iteration's start
LAYER_US = 1_500.0  # an attention or MLP forward; backward takes twice as long
TRANSFER_US = 80.0  # a pipeline send
ALLREDUCE_US = 40.0
FINISH_JITTER_US = 0.5  # spread of one collective's finish across its members
ARRIVAL_SPREAD_US = 30.0
TRACE_INTERVAL = 5
ACTIVATION_BYTES = 8 * 1024 * 1024
NVML = {"sm_clock_mhz": 1980, "mem_clock_mhz": 3201, "power_w": 412.3, "temperature_c": 51, "throttle_reasons": []}


class MegatronRankOrder:
    """Global ranks of a layout with ``dp``, ``pp``, ``tp`` attributes, in megatron-core's default order."""

    @property
    def world_size(self):
        return self.dp * self.pp * self.tp

    def rank(self, dp, pp, tp):
        """tp fastest, then dp, then pp."""
        return tp + self.tp * (dp + self.dp * pp)

    def coords(self, rank):
        return {"dp": rank // self.tp % self.dp, "pp": rank // (self.tp * self.dp), "tp": rank % self.tp}


@dataclass
class SyntheticRun(MegatronRankOrder):
    directory: str
    dp: int
    pp: int
    tp: int
    run_id: str
    windows: list  # traced iterations of each window
    clocks: dict  # rank -> (rate, offset_us)
    truth: dict = field(default_factory=dict)  # op_key of each op record -> the operation it belongs to

    def path(self, rank):
        c = self.coords(rank)
        return os.path.join(self.directory, f"benchmark-data-{c['dp']}-pipeline-{c['pp']}-tensor-{c['tp']}.json")

    def local(self, rank, global_us):
        rate, offset = self.clocks.get(rank, (1.0, 0.0))
        return global_us + (rate - 1.0) * (global_us - BASE_US) + offset

    def to_global(self, rank, local_us):
        rate, offset = self.clocks.get(rank, (1.0, 0.0))
        return BASE_US + (local_us - BASE_US - offset) / rate

    def operations(self):
        """The true operations: operation -> set of ranks that recorded it."""
        members = {}
        for (rank, *_), operation in self.truth.items():
            members.setdefault(operation, set()).add(rank)
        return members


def layout_groups(run):
    """(group table {id: {"ranks", "role"}}, per rank {role: group id}) of a MegatronRankOrder."""
    table, of_rank = {}, {rank: {} for rank in range(run.world_size)}

    def add(role, ranks):
        group_id = str(len(table))
        table[group_id] = {"ranks": ranks, "role": role}
        for rank in ranks:
            of_rank[rank][role] = group_id

    add("world", list(range(run.world_size)))
    d, p, t = range(run.dp), range(run.pp), range(run.tp)
    for dp in d:
        for pp in p:
            add("tp", [run.rank(dp, pp, tp) for tp in t])
    for pp in p:
        for tp in t:
            add("dp_cp", [run.rank(dp, pp, tp) for dp in d])
    for dp in d:
        for tp in t:
            add("pp", [run.rank(dp, pp, tp) for pp in p])
            if run.pp > 1:
                add("embd", [run.rank(dp, 0, tp), run.rank(dp, run.pp - 1, tp)])
        add("mp", sorted(run.rank(dp, pp, tp) for pp in p for tp in t))
    return table, of_rank


class _StageSchedule:
    """One iteration of one pipeline stage on the global clock: events and ops (group by role, peer by stage)."""

    def __init__(self, run, stage, layers, microbatches, start):
        self.run, self.stage, self.events, self.ops = run, stage, [], []
        per_stage = layers // run.pp
        self.layers = [stage * per_stage + i + 1 for i in range(per_stage)]
        forward_us = 2 * LAYER_US * per_stage
        slot_f, slot_b = forward_us + TRANSFER_US + 100, 2 * forward_us + TRANSFER_US + 100
        backward_start = start + 100 + (microbatches + run.pp - 1) * slot_f
        for m in range(microbatches):
            self._forward(m, start + 100 + (m + stage) * slot_f)
            self._backward(m, backward_start + (m + run.pp - 1 - stage) * slot_b)
        self._optimizer(backward_start + (microbatches + run.pp - 1) * slot_b + 100)
        self.events.append(("iteration", None, None, start, self.end))

    def _layer(self, name, m, layer, start, duration, phase):
        self.events.append((name, m, layer, start, start + duration))
        if self.run.tp > 1:
            self._collective("allreduce", "tp", start + duration - 5, phase, m, ACTIVATION_BYTES, (name, layer))

    def _collective(self, op, role, finish, phase, m, nbytes, what):
        self.ops.append({"op": op, "kind": "collective", "role": role, "peer": None, "finish": finish,
                         "phase": phase, "microbatch": m, "bytes": nbytes, "what": what})

    def _p2p(self, kind, peer_stage, role, start, phase, m):
        self.ops.append({"op": kind, "kind": kind, "role": role, "peer": peer_stage, "start": start,
                         "finish": start + TRANSFER_US + (0 if kind == "send" else 20), "phase": phase,
                         "microbatch": m, "bytes": ACTIVATION_BYTES, "what": m})

    def _forward(self, m, start):
        if self.stage > 0:
            self._p2p("recv", self.stage - 1, "pp", start - TRANSFER_US - 20, "forward-recv", m)
        t = start
        for layer in self.layers:
            self._layer("attention-forward", m, layer, t, LAYER_US, "forward")
            self._layer("mlp-forward", m, layer, t + LAYER_US, LAYER_US, "forward")
            t += 2 * LAYER_US
        self.events.append(("forward", m, None, start, t))
        if self.stage == self.run.pp - 1:
            self.events.append(("loss", m, None, t, t + 20))
        else:
            self._p2p("send", self.stage + 1, "pp", t, "forward-send", m)

    def _backward(self, m, start):
        if self.stage < self.run.pp - 1:
            self._p2p("recv", self.stage + 1, "world", start - TRANSFER_US - 20, "backward-recv", m)
        t = start
        for layer in reversed(self.layers):
            self._layer("mlp-backward", m, layer, t, 2 * LAYER_US, "backward")
            self._layer("attention-backward", m, layer, t + 2 * LAYER_US, 2 * LAYER_US, "backward")
            t += 4 * LAYER_US
        self.events.append(("backward", m, None, start, t))
        if self.stage > 0:
            self._p2p("send", self.stage - 1, "world", t, "backward-send", m)

    def _optimizer(self, start):
        run = self.run
        if run.dp > 1:
            self._collective("allreduce_coalesced", "dp_cp", start + 300, "all-grads-sync", None, 64 * ACTIVATION_BYTES,
                             "grads")
        if run.pp > 1 and self.stage in (0, run.pp - 1):
            self._collective("allreduce", "embd", start + 450, "embedding-grads-all-reduce", None, ACTIVATION_BYTES,
                             "embedding")
        if run.pp * run.tp > 1:
            self._collective("allreduce", "mp", start + 700, "optimizer", None, 4, "grad-norm")
        self.events.append(("optimizer", None, None, start + 500, start + 1500))
        self.end = start + 1600


def _rank_lines(run, rank, schedules, groups, rng):
    """Per traced iteration: (events, ops) of this rank on its own clock, ops in issue order with seqs."""
    table, of_rank = groups
    coords = run.coords(rank)
    lines = []
    for iteration, schedule in schedules[coords["pp"]]:
        events = [{"name": name, "cat": "compute", "iteration": iteration, "microbatch": m,
                   "chunk": None if m is None else 0, "layer": layer, "start_us": run.local(rank, start),
                   "end_us": run.local(rank, end)} for name, m, layer, start, end in schedule.events]
        ops = []
        for op in schedule.ops:
            group = of_rank[rank][op["role"]]
            if op["kind"] == "collective":
                finish = op["finish"] + rng.gauss(0.0, FINISH_JITTER_US)
                start = finish - ALLREDUCE_US - rng.uniform(0.0, ARRIVAL_SPREAD_US)
                peer, operation = None, (group, iteration, op["what"], op["phase"], op["microbatch"])
            else:
                start, finish = op["start"], op["finish"]
                peer = run.rank(coords["dp"], op["peer"], coords["tp"])
                src, dst = (rank, peer) if op["kind"] == "send" else (peer, rank)
                operation = (group, iteration, "p2p", src, dst, op["what"])
            ops.append((start, {"op": op["op"], "kind": op["kind"], "group": group, "seq": None, "peer": peer,
                                "bytes": op["bytes"], "dtype": "bfloat16", "iteration": iteration,
                                "microbatch": op["microbatch"], "chunk": None if op["microbatch"] is None else 0,
                                "phase": op["phase"], "start_us": run.local(rank, start),
                                "end_us": run.local(rank, finish)}, operation))
        lines.append((iteration, events, ops))
    return lines


def op_key(rank, op):
    """How the ground truth names an op record: (rank, group, kind, peer, seq)."""
    return rank, op["group"], op["kind"], op["peer"], op["seq"]


def _number_ops(run, rank, lines):
    """Sequence numbers in issue order: per group for collectives, per (group, kind, peer) for p2p."""
    counters = {}
    for _, _, ops in lines:
        ops.sort(key=lambda item: item[0])
        for _, op, operation in ops:
            counter = op["group"] if op["kind"] == "collective" else (op["group"], op["kind"], op["peer"])
            op["seq"] = counters.get(counter, 0)
            counters[counter] = op["seq"] + 1
            run.truth[op_key(rank, op)] = operation


def window_groups(table, ops):
    return {op["group"]: table[op["group"]] for op in ops}


def _issued(window, iteration, ops, table):
    issued = [{**{k: v for k, v in op.items() if k not in ("start_us", "end_us")},
               "host_us": round(op["start_us"] - 5.0, 1)} for op in ops]
    return {"type": "issued", "window": window, "iteration": iteration, "groups": window_groups(table, ops),
            "ops": issued}


def write_run(directory, dp=2, pp=2, tp=2, layers=4, microbatches=4, windows=((4, 5), (9, 10)), clocks=None,
              run_id="20261122-051355-3fa2c1", hang_rank=None, superseded_issued=False, seed=0):
    """Writes one run's per-rank files into ``directory``; returns its SyntheticRun (with ground truth).

    ``hang_rank``: the last window never finishes: every rank leaves two `issued` lines for it (the
    writer adds one every 5 s), the hung rank having stopped in its first forward and the others a few
    layers later. ``superseded_issued``: each finished window's line follows an `issued` line for it,
    as when a window stalled for a while and then finished."""
    os.makedirs(directory, exist_ok=True)
    run = SyntheticRun(directory, dp, pp, tp, run_id, [list(w) for w in windows], dict(clocks or {}))
    groups = layout_groups(run)
    table = groups[0]
    period = _StageSchedule(run, 0, layers, microbatches, 0.0).end + 5_000.0
    first = windows[0][0]
    schedules = {stage: [(i, _StageSchedule(run, stage, layers, microbatches, BASE_US + (i - first) * period))
                         for w in windows for i in w] for stage in range(pp)}
    hang_at = BASE_US + (windows[-1][0] - first) * period + 100 + 1.5 * LAYER_US
    reached = set()
    for rank in range(run.world_size):
        lines = _rank_lines(run, rank, schedules, groups, random.Random(seed * 1_000_003 + rank))
        _number_ops(run, rank, lines)
        by_iteration = {iteration: (events, [op for _, op, _ in ops]) for iteration, events, ops in lines}
        out = [_metadata(run, rank, microbatches)]
        for w in windows:
            number = (w[0] - 1) // TRACE_INTERVAL
            ops = [op for i in w for op in by_iteration[i][1]]
            if hang_rank is not None and w == windows[-1]:
                stop = hang_at if rank == hang_rank else hang_at + 3 * LAYER_US
                ops = [op for op in ops if run.to_global(rank, op["start_us"]) < stop]
                out += [_issued(number, w[0], ops[:len(ops) // 2], table),
                        _issued(number, w[0], ops[len(ops) // 2:], table)]
            else:
                if superseded_issued:
                    out.append(_issued(number, w[0], ops[:3], table))
                out.append({"type": "window", "window": number, "iterations": list(w), "complete": True,
                            "clock": {"source": "cuda_event", "anchor_uncertainty_us": 5.0},
                            "groups": window_groups(table, ops), "nvml": NVML,
                            "events": [e for i in w for e in by_iteration[i][0]], "ops": ops})
            reached.update(op_key(rank, op) for op in ops)
        write_lines(run.path(rank), out)
    run.truth = {key: operation for key, operation in run.truth.items() if key in reached}  # ops never issued: none
    return run


def _metadata(run, rank, microbatches):
    return {"type": "metadata", "format": "megascan", "version": 1, "run_id": run.run_id, "rank": rank,
            "world_size": run.world_size, "coords": run.coords(rank),
            "layout": {"dp": run.dp, "pp": run.pp, "tp": run.tp, "vp": 1, "sequence_parallel": False,
                       "distributed_optimizer": False, "micro_batch_size": 1,
                       "global_batch_size": microbatches * run.dp, "num_microbatches": microbatches},
            "host": f"node-{rank // 8}", "device": "cuda", "device_index": rank % 8, "device_name": "NVIDIA H200",
            "timer": "cuda_event", "granularity": "full", "trace_interval": TRACE_INTERVAL,
            "continuous_trace_iterations": len(run.windows[0]), "train_iters": 100}


def read_lines(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle]


def write_lines(path, lines):
    with open(path, "w") as handle:
        handle.writelines(json.dumps(line, separators=(",", ":")) + "\n" for line in lines)
