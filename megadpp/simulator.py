"""Simulate one training iteration of a pipeline (megadpp/iteration_model.py: the cost model and the
discrete events): the static schedules replay their fixed orders, DPP asks the same policy code the
runtime asks (megadpp/policy.py) at the moment a rank becomes free. bench/dpp_simulate.py drives it.
"""

from megadpp.actions import StageLayout
from megadpp.iteration_model import replay_static_orders, run_iteration
from megadpp.policy import StaticFirstPolicy
from megadpp.progress import StageProgress


class _DynamicRank:
    """Asks the policy what the runtime asks it, at the simulated moments the runtime would: when the rank
    becomes free, when an input arrives, and when its deadline for the static order's next action passes."""

    def __init__(self, progress, policy):
        self.progress, self.policy = progress, policy

    def done(self):
        return self.progress.done()

    def next_choice(self, free_at, arrival):
        candidates = self.progress.candidates()
        known = sorted((arrived, a) for a in candidates if (arrived := arrival(a)) is not None)
        deadline = self.policy.deadline(candidates, free_at)
        # The moments at which the answer can change: each arrival (none before free_at) and the deadline.
        moments = sorted({max(free_at, arrived) for arrived, _ in known} | ({deadline} if known else set()))
        for moment in moments:
            ready = [a for arrived, a in known if arrived <= moment]
            action = self.policy.choose(ready, candidates, self.progress.oldest_unfinished(), free_at, moment)
            if action is not None:
                return moment, action
        return None

    def record(self, action, duration):
        self.progress.record(action)
        self.policy.ran(duration)


def simulate(stages, chunks, microbatches, cost, *, static_orders=None, policy=None, caps=None,
             blocking_sends=None):
    """Run one iteration either with fixed ``static_orders`` (pp rank -> actions) or with the DPP
    ``policy`` of that name (megadpp/policy.py) under per-rank activation ``caps``. ``blocking_sends``
    defaults to True for static orders. An iteration_model.SimulationResult."""
    blocking_sends = static_orders is not None if blocking_sends is None else blocking_sends
    if static_orders is not None:
        return replay_static_orders(stages, chunks, cost, static_orders, blocking_sends)
    layouts = [StageLayout(r, stages, chunks) for r in range(stages)]
    ranks = [_DynamicRank(StageProgress(layouts[r], microbatches, caps[r]),
                          StaticFirstPolicy(policy, layouts[r], microbatches)) for r in range(stages)]
    return run_iteration(stages, chunks, cost, ranks, blocking_sends)
