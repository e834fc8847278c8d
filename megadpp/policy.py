"""Policies: given the actions that are ready on a pipeline rank, pick the one to run. Plain functions of
data, shared by the runtime (megadpp/runtime.py) and the simulator (megadpp/simulator.py).

Both run a ready forward before a ready backward: the activation cap (megadpp/progress.py) is what
turns forwards into backwards, and with the default cap (what 1F1B holds) a pipeline whose inputs
arrive on time runs exactly megatron-core's 1F1B order. They differ in which forward or backward:
- depth-first pushes a microbatch on through later model chunks before starting new ones, and runs
  the oldest microbatch's backward first: activations are freed soonest;
- breadth-first runs groups of ``stages`` microbatches on one chunk before the next chunk (megatron-core's
  interleaved table order): fewer switches between chunks, transfers batched per chunk.
Without a virtual pipeline (one chunk) the two coincide.
"""

from megadpp.actions import FORWARD


def depth_first(stages):
    def choose(ready):
        return min(ready, key=lambda a: (0, -a.chunk, a.microbatch) if a.kind == FORWARD else (1, a.microbatch, a.chunk))

    return choose


def breadth_first(stages):
    def choose(ready):
        return min(ready, key=lambda a: (0 if a.kind == FORWARD else 1, a.microbatch // stages,
                                         a.chunk if a.kind == FORWARD else -a.chunk, a.microbatch))

    return choose


POLICIES = {"depth-first": depth_first, "breadth-first": breadth_first}
