"""Policies: which of the actions that are ready on a pipeline rank runs next. Plain code on data, shared by
the runtime (megadpp/runtime.py, which measures time in seconds) and the simulator (megadpp/simulator.py,
in its cost model's unit): both ask ``choose`` the same questions. The policy reads how long a healthy
pipeline waits off the static order run on the iteration model (megadpp/iteration_model.py), which the
simulator shares.

A pipeline rank follows megatron-core's static order (1F1B, or interleaved 1F1B with a virtual pipeline,
megadpp/static_orders.py) for as long as that order's next action is ready, and so runs exactly that order
when the pipeline is healthy. It deviates only when that action is late: not ready by its deadline,
which is as long as a healthy pipeline keeps this rank waiting for it (the compute part times
``1 + SLACK``, each transfer on the way counted as ``TRANSFER_ACTIONS`` actions) plus ``PATIENCE_ACTIONS``
actions, in units of the mean duration of the actions this rank ran so far in the iteration. Then it runs
the best ready action by its fallback preference among those at most ``LOOKAHEAD`` places further on in
the static order, or of the oldest microbatch it has not finished (which the deadlock argument of
docs/megadpp.md needs to be runnable).

Why a look-ahead: when a stage is slow, the ranks around it see late inputs too; if they ran whatever
was ready they would feed the slow stage in another order than the one its own static order expects,
and it would deviate as well, up to 1.36x interleaved 1F1B's time in simulation. Work from a little
further on fills the wait without reordering the pipeline.

Why wait at all: even a healthy static order has gaps (rank 0 of an interleaved pipeline waits for a
microbatch to go once around the ring before its next chunk). A greedy schedule fills them with a later
ready action, which cannot be taken back once the awaited input arrives; with a virtual pipeline those
delays pile up along the critical path (up to 1.6x interleaved 1F1B's time in simulation at PP16). How
long a healthy pipeline waits is read off the static order itself, run on the simulator with unit costs.

The fallbacks, when the static order's next action is late:
- depth-first pushes a microbatch on through later model chunks before starting new ones, and runs
  the oldest microbatch's backward first: activations are freed soonest;
- breadth-first runs groups of ``stages`` microbatches on one chunk before the next chunk (megatron-core's
  interleaved table order): fewer switches between chunks, transfers batched per chunk.
Both run a ready forward before a ready backward (the activation cap, megadpp/progress.py, is what turns
forwards into backwards). Without a virtual pipeline (one chunk) the two coincide.
"""

import functools

from megadpp.actions import FORWARD
from megadpp.iteration_model import CostModel, replay_static_orders
from megadpp.static_orders import static_order

PATIENCE_ACTIONS = 1.0  # mean action durations awaited beyond a healthy pipeline's wait
SLACK = 0.5  # share by which the compute part of a wait may exceed a healthy one (uneven stages)
LOOKAHEAD = 4  # how far on in the static order a late rank may take work from
TRANSFER_ACTIONS = 0.25  # what a transfer may cost a healthy pipeline, in mean action durations


def _depth_first_key(stages):
    return lambda a: (0, -a.chunk, a.microbatch) if a.kind == FORWARD else (1, a.microbatch, a.chunk)


def _breadth_first_key(stages):
    return lambda a: (0 if a.kind == FORWARD else 1, a.microbatch // stages,
                      a.chunk if a.kind == FORWARD else -a.chunk, a.microbatch)


FALLBACKS = {"depth-first": _depth_first_key, "breadth-first": _breadth_first_key}
POLICIES = sorted(FALLBACKS)


class StaticFirstPolicy:
    """One pipeline rank's policy for one iteration."""

    def __init__(self, name, layout, microbatches, group_size=None):
        order = static_order(layout.pp_rank, layout.stages, layout.chunks, microbatches, group_size)
        self.position = {action: index for index, action in enumerate(order)}
        self.expected_wait = _healthy_waits(layout.stages, layout.chunks, microbatches, group_size)[layout.pp_rank]
        self.fallback = FALLBACKS[name](layout.stages)
        self.ran_count, self.ran_total = 0, 0.0

    def static_next(self, candidates):
        """The candidate the static order runs first: its next action not run yet (each stream runs in
        microbatch order, so that action is always the next of its stream, a candidate unless the
        activation cap holds it back)."""
        return min(candidates, key=self.position.__getitem__)

    def deadline(self, candidates, free_since):
        """Until when a rank free since ``free_since`` waits for the static order's next action."""
        if not self.ran_count:
            return free_since
        actions = self.expected_wait[self.static_next(candidates)] + PATIENCE_ACTIONS
        return free_since + actions * self.ran_total / self.ran_count

    def ran(self, duration):
        """Tell the policy how long an action took (its deadlines scale with the mean)."""
        self.ran_count += 1
        self.ran_total += duration

    def choose(self, ready, candidates, oldest, free_since, now):
        """The action to run ``now``, or None to keep waiting; the rank has been free since ``free_since``
        and ``oldest`` is the oldest microbatch it has not finished (progress.py)."""
        if not ready:
            return None
        expected = self.static_next(candidates)
        if expected in ready:
            return expected
        if now < self.deadline(candidates, free_since):
            return None
        limit = self.position[expected] + LOOKAHEAD
        allowed = [a for a in ready if self.position[a] <= limit or a.microbatch == oldest]
        return min(allowed, key=self.fallback) if allowed else None


@functools.lru_cache(maxsize=32)
def _healthy_waits(stages, chunks, microbatches, group_size):
    """pp rank -> {action: how long a healthy pipeline running the static order waits before it, in mean
    action durations}: every forward of a chunk costs the same, backwards twice that, sends are
    asynchronous, and each transfer on the path to the awaited input counts ``TRANSFER_ACTIONS``."""
    orders = {r: static_order(r, stages, chunks, microbatches, group_size) for r in range(stages)}

    def idle(transfer):
        return replay_static_orders(stages, chunks, CostModel(transfer_ms=transfer), orders, blocking_sends=False).idle

    # Transfers that the wait is made of: how much it grows per unit of transfer time.
    probe = 1e-3
    mean = CostModel().forward_ms / chunks * (1 + CostModel().backward_ratio) / 2
    compute, probed = idle(0.0), idle(probe)
    waits = {}
    for r in range(stages):
        waits[r] = {action: waited / mean * (1 + SLACK) + max(0.0, (later - waited) / probe) * TRANSFER_ACTIONS
                    for action, waited, later in zip(orders[r], compute[r], probed[r])}
    return waits
