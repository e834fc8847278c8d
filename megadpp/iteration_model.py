"""A discrete-event model of one training iteration of a pipeline, which the simulator (megadpp/simulator.py)
runs with megatron-core's static orders or with a DPP policy, and the policy itself (megadpp/policy.py) runs
with the static orders to learn how long a healthy pipeline waits.

Cost model: a chunk's forward takes ``forward_ms / chunks`` on its rank (backward ``backward_ratio`` times
that; ``stage_scale``, one factor per pipeline rank, makes stages uneven: more layers, a slower GPU), every
transfer ``transfer_ms``; ``jitter_ms`` adds a uniform random delay in [0, jitter_ms) to every compute; one
straggler stage adds ``straggler_ms`` to a forward there (as --dpp-delay-stage does) with probability
``straggler_probability``, one straggler link the same to transfers leaving that stage. Random draws
depend only on (seed, what, stage, microbatch), so every schedule meets the same delays.
On a GPU a static schedule's link delay is its sender's host sleeping before the send (megadpp/fault_injection.py)
while the GPU still runs the kernels that host queued for the action whose output it sends: ``host_overlap`` is
the share of that action's compute the sleep overlaps, so such a message is late by only the rest of the delay.
DPP's delay is held back on the receiving side from the message's arrival and overlaps nothing (0, the default).
DPP's sends never block a rank (its transport is asynchronous). megatron-core's static schedules wait for
their sends: each step exchanges the output of its compute together with the receives of the next forward
and backward (``send_forward_recv_backward`` and friends) and waits for all of them, so a send completes
only once the receiving rank has posted the matching receive, which it does when it finishes the compute
before its next forward / backward of that kind. ``blocking_sends`` models that rendezvous.
"""

import random
from dataclasses import dataclass

from megadpp.actions import BACKWARD, FORWARD, StageLayout, peak_in_flight

LOSS = "loss"  # the last stage's own "input" to a backward: its forward computed the loss


@dataclass(frozen=True)
class CostModel:
    forward_ms: float = 1.0
    backward_ratio: float = 2.0
    transfer_ms: float = 0.1
    jitter_ms: float = 0.0
    straggler_stage: int | None = None
    straggler_link: int | None = None
    straggler_ms: float = 0.0
    straggler_probability: float = 1.0
    seed: int = 0
    stage_scale: tuple[float, ...] | None = None  # per pipeline rank: its compute times this (None: all 1)
    host_overlap: float = 0.0  # share of the sending action's compute that a straggler link's delay overlaps

    def _draw(self, *key):
        return random.Random(hash((self.seed, *key))).random()

    def compute_ms(self, pp_rank, chunks, action):
        kind = 0 if action.kind == FORWARD else 1
        base = self.forward_ms / chunks * (1.0 if kind == 0 else self.backward_ratio)
        if self.stage_scale is not None:
            base *= self.stage_scale[pp_rank]
        key = (pp_rank, action.chunk, kind, action.microbatch)
        extra = self.jitter_ms * self._draw(0, *key)
        if kind == 0 and pp_rank == self.straggler_stage and self._draw(1, *key) < self.straggler_probability:
            extra += self.straggler_ms
        return base + extra

    def transfer_time_ms(self, pp_rank, action, compute_ms):
        """The transfer of ``action``'s output, which took ``compute_ms`` to compute."""
        kind = 0 if action.kind == FORWARD else 1
        extra = 0.0
        if pp_rank == self.straggler_link and self._draw(2, pp_rank, action.chunk, kind, action.microbatch) < \
                self.straggler_probability:
            extra = max(self.straggler_ms - self.host_overlap * compute_ms, 0.0)
        return self.transfer_ms + extra


class StaticRank:
    """A rank that runs a fixed order."""

    def __init__(self, order):
        self.order, self.position = order, 0

    def posted(self, kind):
        """The action whose input this rank has a receive posted for: its next one of that kind."""
        return next((a for a in self.order[self.position:] if a.kind == kind), None)

    def done(self):
        return self.position == len(self.order)

    def next_choice(self, free_at, arrival):
        action = self.order[self.position]
        arrived = arrival(action)
        return None if arrived is None else (max(free_at, arrived), action)

    def record(self, action, duration):
        self.position += 1


@dataclass
class SimulationResult:
    makespan_ms: float
    peak_in_flight: int  # the most activations any rank held at once
    orders: dict  # pp rank -> the actions it ran, in order
    idle: dict  # pp rank -> how long it was idle before each of those actions


def replay_static_orders(stages, chunks, cost, static_orders, blocking_sends=True):
    """One iteration with fixed ``static_orders`` (pp rank -> actions)."""
    return run_iteration(stages, chunks, cost, [StaticRank(static_orders[r]) for r in range(stages)], blocking_sends)


def run_iteration(stages, chunks, cost, ranks, blocking_sends):
    """One iteration of ``ranks`` (pp rank -> an object that says what it runs next: ``done()``,
    ``next_choice(free_at, arrival)`` -> (when, action) or None, ``record(action, duration)``, and with
    ``blocking_sends`` ``posted(kind)``: the action whose input it has a receive posted for)."""
    layouts = [StageLayout(r, stages, chunks) for r in range(stages)]
    arrivals = {}  # (pp rank, kind, chunk, microbatch) -> when the input of that action is there
    free_at = [0.0] * stages  # None while the rank waits for one of its sends to be received
    last_finish = [0.0] * stages  # when a rank's latest compute ended: it posts its next receives then
    held = {}  # arrivals key -> (sending rank, when the send was posted, transfer time): blocking sends
    orders = {r: [] for r in range(stages)}
    idle = {r: [] for r in range(stages)}

    def complete_held_sends():
        for key in list(held):
            dest, kind, chunk, microbatch = key
            consumer = ranks[dest].posted(kind)
            if consumer is not None and (consumer.chunk, consumer.microbatch) == (chunk, microbatch):
                sender, sent, transfer = held.pop(key)
                arrivals[key] = free_at[sender] = max(sent, last_finish[dest]) + transfer

    def arrival_for(pp_rank):
        layout = layouts[pp_rank]

        def arrival(action):
            if action.kind == FORWARD and layout.is_first(action.chunk):
                return 0.0
            if action.kind == BACKWARD and layout.is_last(action.chunk):
                return arrivals.get((pp_rank, LOSS, action.chunk, action.microbatch))
            return arrivals.get((pp_rank, action.kind, action.chunk, action.microbatch))

        return arrival

    arrival_functions = [arrival_for(r) for r in range(stages)]
    while not all(rank.done() for rank in ranks):
        complete_held_sends()
        choices = [(choice, r) for r, rank in enumerate(ranks) if not rank.done() and free_at[r] is not None
                   and (choice := rank.next_choice(free_at[r], arrival_functions[r]))]
        if not choices:
            raise RuntimeError("simulated pipeline deadlocked")  # the progress rules make this unreachable
        (start, action), r = min(choices, key=lambda item: (item[0][0], item[1]))
        duration = cost.compute_ms(r, chunks, action)
        finish = start + duration
        idle[r].append(start - last_finish[r])
        free_at[r] = last_finish[r] = finish
        ranks[r].record(action, duration)
        orders[r].append(action)
        key = _message_key(layouts[r], action)
        if key is None:
            if layouts[r].is_last(action.chunk) and action.kind == FORWARD:  # the loss is computed here
                arrivals[(r, LOSS, action.chunk, action.microbatch)] = finish
        elif blocking_sends:
            held[key], free_at[r] = (r, finish, cost.transfer_time_ms(r, action, duration)), None
        else:
            arrivals[key] = finish + cost.transfer_time_ms(r, action, duration)
    complete_held_sends()
    peak = max(peak_in_flight(order) for order in orders.values())
    return SimulationResult(max(free_at), peak, orders, idle)




def _message_key(layout, action):
    """Where an action's output goes: the arrivals key of the action it feeds, or None (no message)."""
    if action.kind == FORWARD:
        if layout.is_last(action.chunk):
            return None
        peer, chunk = layout.downstream(action.chunk)
    else:
        if layout.is_first(action.chunk):
            return None
        peer, chunk = layout.upstream(action.chunk)
    return peer, action.kind, chunk, action.microbatch
