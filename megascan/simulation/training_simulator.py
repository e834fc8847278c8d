"""Runs the ranks of a DP x TP x PP job on one global clock, step by step (megascan/simulation/one_f_one_b.py), so
that every delay travels the way it would on real GPUs: a collective finishes only after its last
member arrives, a transfer starts only once both sides have posted it. A slow GPU therefore makes its
TP peers wait inside all-reduces, its pipeline neighbours wait in exchanges and its DP replicas wait
in the gradient all-reduce; a slow link stretches the transfers over it; a hung rank stops and the
others block wherever they first need it.

Each rank has a host beside its GPU: the host issues the work (taking ``host_cost`` of the GPU's nominal
time for it), the GPU runs it once issued, never before. A GPU-bound job's hosts run ahead (the default);
in a host-bound job, or on a rank whose host is slow (``host_slow``: data loading, a busy CPU), the GPU
idles between launches: its work arrives late although its kernels are not longer. Every op record keeps
the host's issue time (``host``) beside the GPU's arrival (``start``), as real traces do.

Noise (``Stalls``): besides each kernel sequence's small jitter, a GPU now and then loses a time slice (another
process, a clock dip, a page fault): a few of a window's kernel sequences take up to several layer halves longer,
on any rank, at random. That is the noise a window judged alone must not take for a slow GPU.

``simulate_window`` returns what each rank recorded (events and ops in global microseconds) and, for
ranks that never finished, where they stopped.
"""

from collections import deque
from dataclasses import dataclass, field

from megascan.simulation.one_f_one_b import ACTIVATION_BYTES, stage_program
from megascan.simulation.synthetic_traces import MegatronRankOrder, layout_groups

LAYER_HALF_US = 1_500.0  # one layer half's forward on a GPU of speed 1
COMPUTE_JITTER = 0.005  # relative spread of one kernel sequence's time on one GPU
COMM_JITTER = 0.05
FINISH_JITTER_US = 0.5  # members of one collective see it finish this far apart
P2P_LATENCY_US = 10.0
P2P_BYTES_PER_US = 40_000.0  # 40 GB/s between stages
ITERATION_GAP_US = 200.0  # host work between two iterations
LAUNCH_US = 5.0  # from the host issuing work to an idle GPU starting it
GPU_BOUND_HOST_COST = 0.3  # a host issues a layer half's kernels in this share of the GPU's time for them


@dataclass
class Layout(MegatronRankOrder):
    dp: int
    tp: int
    pp: int
    microbatches: int
    layers_per_stage: int

    def groups(self):
        """(group table {id: {"ranks", "role"}}, {rank: {role: group id}})."""
        return layout_groups(self)


@dataclass(frozen=True)
class Stalls:
    """Time slices lost at random: each kernel sequence, with probability ``chance``, runs longer by a time drawn
    uniformly from ``low_us`` to ``high_us``."""

    chance: float
    low_us: float
    high_us: float


@dataclass
class Faults:
    speed: dict  # rank -> time factor of its compute (1.0 nominal; a slow GPU 1.2-1.6)
    slow_links: dict = field(default_factory=dict)  # (src, dst) -> time factor of its transfers
    hang: tuple | None = None  # (rank, iteration, step index in that iteration's program): it stops before that step
    # host time to issue work, per unit of its nominal GPU time (> 1: host-bound)
    host_cost: float = GPU_BOUND_HOST_COST
    host_slow: dict = field(default_factory=dict)  # rank -> factor on its host's time (a slow host, not a slow GPU)
    # The GPU time of work a host may have issued ahead of its GPU (None: no limit). A real launch queue is
    # bounded: once it is full the host blocks until its GPU drains it, so a slow GPU paces its host's issues
    # (back-pressure) although the host itself is fast.
    launch_queue_us: float | None = None
    stalls: Stalls | None = None  # noise on every rank (module docstring); None: only the kernels' jitter


@dataclass
class RankRecord:
    events: list = field(default_factory=list)  # (name, iteration, microbatch, layer, start, end)
    ops: list = field(default_factory=list)  # dicts: op, kind, group, seq, peer, bytes, iteration, ..., start, end
    stuck: bool = False  # never finished the window


class _Pending:
    """One collective instance or one transfer: who has arrived, and the records to complete."""

    __slots__ = ("arrivals", "records")

    def __init__(self):
        self.arrivals, self.records = {}, {}


class _RankState:
    __slots__ = ("exchange_end", "host", "iteration", "open", "pc", "rank", "steps", "time", "waiting")

    def __init__(self, rank, steps, start):
        self.rank, self.steps, self.pc, self.time, self.iteration = rank, steps, 0, start, None
        self.host = start  # when the host has issued everything so far (``time`` is the GPU's)
        self.open = {}  # enclosing event name -> its start
        self.waiting = 0  # transfers of the current exchange not yet complete ...
        self.exchange_end = 0.0  # ... and when the completed ones ended


class WindowSimulation:
    """One trace window: every rank runs its iterations' programs from ``start`` (global microseconds)."""

    def __init__(self, layout, faults, iterations, start, counters, rng):
        self.layout, self.faults, self.rng = layout, faults, rng
        self.table, self.group_of = layout.groups()
        self.counters = counters  # (rank, counter key) -> next sequence number; runs across windows
        self.records = {rank: RankRecord() for rank in range(layout.world_size)}
        self.pending = {}
        per_stage = layout.layers_per_stage
        programs = {stage: stage_program(stage, layout.pp, layout.microbatches,
                                         [stage * per_stage + i + 1 for i in range(per_stage)], layout.dp, layout.tp)
                    for stage in range(layout.pp)}
        self.states = {}
        for rank in range(layout.world_size):
            steps = []
            for iteration in iterations:
                program = programs[layout.coords(rank)["pp"]]
                if faults.hang and faults.hang[:2] == (rank, iteration):
                    program = program[:faults.hang[2]] + [("stop",)]
                steps += [("iteration", iteration), *program, ("end", "iteration", None),
                          ("compute", None, None, None, ITERATION_GAP_US / LAYER_HALF_US)]
            self.states[rank] = _RankState(rank, steps, start + rng.uniform(0.0, 50.0))

    def run(self):
        ready = deque(self.states.values())
        while ready:
            ready.extend(self._advance(ready.popleft()))
        for rank, state in self.states.items():
            self.records[rank].stuck = state.pc < len(state.steps)
        return self.records

    def _advance(self, state):
        """Runs ``state``'s rank until it blocks or ends; returns the other ranks it unblocked."""
        woken = []
        events = self.records[state.rank].events
        speed = self.faults.speed.get(state.rank, 1.0)
        host_cost = self.faults.host_cost * self.faults.host_slow.get(state.rank, 1.0) * LAYER_HALF_US
        while state.pc < len(state.steps):
            step = state.steps[state.pc]
            kind = step[0]
            if kind == "compute":
                start = self._launched(state)
                state.host += step[4] * host_cost
                # The kernels run as they are issued: the GPU's own time, or the host's issuing, whichever is longer.
                end = max(start + step[4] * speed * (1.0 + self.rng.gauss(0.0, COMPUTE_JITTER)) * LAYER_HALF_US
                          + self._stalled_us(), state.host + LAUNCH_US)
                if self.faults.launch_queue_us is not None:  # a full queue: the host waits for room in it
                    state.host = max(state.host, end - self.faults.launch_queue_us)
                if step[1] is not None:
                    events.append((step[1], state.iteration, step[2], step[3], start, end))
                state.time = end
            elif kind == "iteration":
                state.iteration = step[1]
                state.open["iteration"] = state.time
            elif kind == "begin":
                state.open[step[1]] = state.time
            elif kind == "end":
                events.append((step[1], state.iteration, step[2], None, state.open.pop(step[1]), state.time))
                if step[1] == "iteration":  # the host waits for its GPU once an iteration (the loss, the grad norm)
                    state.host = max(state.host, state.time)
            elif kind == "stop":
                return woken
            elif not (self._collective if kind == "collective" else self._exchange)(state, step, woken):
                return woken  # blocked: whoever completes the operation wakes it
            state.pc += 1
        return woken

    def _stalled_us(self):
        """The time slice a kernel sequence lost (Stalls), or 0; draws nothing without stalls, so that a run without
        them is the same run at the same seed as before they existed."""
        stalls = self.faults.stalls
        if stalls is None or self.rng.random() >= stalls.chance:
            return 0.0
        return self.rng.uniform(stalls.low_us, stalls.high_us)

    @staticmethod
    def _launched(state):
        """The GPU reaches the next work once it is done with the last and the host has issued it."""
        state.time = max(state.time, state.host + LAUNCH_US)
        return state.time

    def issue_ahead(self, rank, count):
        """Records of the next ``count`` operations after the one ``rank`` is blocked in, issued by its host
        while its stream waits (a GPU job's host runs ahead of its stream); never reached, so no end."""
        state = self.states[rank]
        issued_at = state.time
        for step in [s for s in state.steps[state.pc + 1:] if s[0] in ("collective", "exchange")][:count]:
            issued_at += 10.0
            state.time = issued_at  # records take their start from the state's clock
            if step[0] == "collective":
                group = self.group_of[rank][step[1]]
                self._record(state, (group, self._seq(rank, group)), step[2], "collective", group, None, step[5],
                             step[3], step[4])
            else:
                for kind, peer, key, phase in self._transfers(state, step):
                    self._record(state, key, kind, kind, self.group_of[rank]["pp"], peer, ACTIVATION_BYTES, phase,
                                 step[2])

    def _seq(self, rank, key):
        seq = self.counters.get((rank, key), 0)
        self.counters[rank, key] = seq + 1
        return seq

    def _record(self, state, key, op, kind, group, peer, nbytes, phase, microbatch):
        record = {"op": op, "kind": kind, "group": group, "seq": key[-1], "peer": peer, "bytes": nbytes,
                  "dtype": "bfloat16", "iteration": state.iteration, "microbatch": microbatch,
                  "chunk": None if microbatch is None else 0, "phase": phase, "start": state.time, "end": None,
                  "host": min(state.host, state.time)}
        self.records[state.rank].ops.append(record)
        return record

    def _arrive(self, state, key, op, kind, group, peer, nbytes, phase, microbatch):
        """This rank's record of an operation, issued now; returns the operation's pending arrivals."""
        self._launched(state)
        record = self._record(state, key, op, kind, group, peer, nbytes, phase, microbatch)
        pending = self.pending.setdefault(key, _Pending())
        pending.arrivals[state.rank] = state.time
        pending.records[state.rank] = record
        return pending

    def _collective(self, state, step, woken):
        """Arrives at a collective; True if that completed it (this rank was the last to arrive)."""
        _, role, op, phase, microbatch, nbytes, cost = step
        group = self.group_of[state.rank][role]
        key = (group, self._seq(state.rank, group))
        pending = self._arrive(state, key, op, "collective", group, None, nbytes, phase, microbatch)
        members = self.table[group]["ranks"]
        if len(pending.arrivals) < len(members):
            return False
        del self.pending[key]
        finish = max(pending.arrivals.values()) + cost * (1.0 + abs(self.rng.gauss(0.0, COMM_JITTER)))
        for member in members:
            pending.records[member]["end"] = self.states[member].time = (
                finish + abs(self.rng.gauss(0.0, FINISH_JITTER_US)))
            if member != state.rank:
                self.states[member].pc += 1
                woken.append(self.states[member])
        return True

    def _exchange(self, state, step, woken):
        """Posts an exchange's transfers; True if all of them completed now."""
        state.waiting, state.exchange_end = len(step[1]), self._launched(state)
        for kind, peer, key, phase in self._transfers(state, step):
            pending = self._arrive(state, key, kind, kind, self.group_of[state.rank]["pp"], peer, ACTIVATION_BYTES,
                                   phase, step[2])
            if len(pending.arrivals) == 2:
                del self.pending[key]
                self._transfer(*key[:2], pending, state, woken)
        if state.waiting:
            return False
        state.time = state.exchange_end
        return True

    def _transfers(self, state, step):
        """(kind, peer rank, (src, dst, seq), phase) of each transfer of an exchange step, numbering them."""
        coords = self.layout.coords(state.rank)
        group = self.group_of[state.rank]["pp"]
        for kind, peer_stage in step[1]:
            peer = self.layout.rank(coords["dp"], peer_stage, coords["tp"])
            forward = (peer_stage > coords["pp"]) == (kind == "send")
            src, dst = (state.rank, peer) if kind == "send" else (peer, state.rank)
            yield kind, peer, (src, dst, self._seq(state.rank, (group, kind, peer))), \
                f"{'forward' if forward else 'backward'}-{kind}"

    def _transfer(self, src, dst, pending, poster, woken):
        """Both sides have posted: the data moves, and each side's exchange may be complete."""
        duration = (P2P_LATENCY_US + ACTIVATION_BYTES / P2P_BYTES_PER_US) * self.faults.slow_links.get((src, dst), 1.0)
        end = max(pending.arrivals.values()) + duration * (1.0 + abs(self.rng.gauss(0.0, COMM_JITTER)))
        for rank in (src, dst):
            # The sender's stream resumes once the data has left, a hair before the receiver has it.
            finish = end if rank == dst else end - abs(self.rng.gauss(0.0, FINISH_JITTER_US))
            pending.records[rank]["end"] = finish
            state = self.states[rank]
            state.exchange_end = max(state.exchange_end, finish)
            state.waiting -= 1
            if state.waiting == 0 and state is not poster:
                state.time = state.exchange_end
                state.pc += 1
                woken.append(state)


def compute_speeds(world_size, spread, culprits, rng):
    """rank -> compute time factor: every GPU within +-spread of nominal, culprits slower by their factor."""
    return {rank: (1.0 + rng.uniform(-spread, spread)) * culprits.get(rank, 1.0) for rank in range(world_size)}

