"""How much a job's timing varies on its own, estimated from the run itself: the yardstick a rank's caused
delay must exceed before anyone is named.

Two spreads, both robust (1.4826 x the median absolute deviation, the standard deviation of a normal sample):
from iteration to iteration (the critical paths' measured lengths less what was charged to anyone on them, so
that a slow rank whose slowness varies does not raise the bar it must clear), and from peer to peer (each
record's own work against the same work on its peers of the same role, where there are at least three of
them). A rank that delayed others is named only if what it caused exceeds twice both: the spread of the traced
iterations' sum and the peers' spread over the operations at which it was waited for. A healthy rank that is
last now and then, by the run's ordinary jitter, stays below that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megascan.detection.rank_timelines import RankTimelines

_MAD_TO_SIGMA = 1.4826
# How many spreads a delay must stand out by. A healthy rank last at an operation is late by about one
# peer spread there; twice that is beyond what the jitter of the run explains.
NOISE_SPREADS = 2.0
MIN_PEERS = 3


def _robust_spread(values):
    values = np.asarray(values, dtype=np.float64)
    values = values[~np.isnan(values)]
    if len(values) < 2:
        return 0.0
    return float(_MAD_TO_SIGMA * np.median(np.abs(values - np.median(values))))


@dataclass
class RunNoise:
    iteration_spread_us: float = 0.0  # of one iteration's measured length (where delays can be charged)
    peer_spread_us: float = 0.0  # of one record's own work against its peers'

    def floor_us(self, iterations: int, records: int) -> float:
        """The delay that the run's own noise could explain, over ``iterations`` and ``records`` operations: a
        sum of n iterations' deviations spreads sqrt(n) times one's; a rank last at an operation by chance is
        late there by about one peer spread, and such lateness only adds up."""
        return NOISE_SPREADS * max(self.iteration_spread_us * math.sqrt(iterations), self.peer_spread_us * records)


def estimate_noise(timelines: RankTimelines, expected_gap: np.ndarray, iteration_us: list[float]) -> RunNoise:
    """RunNoise of a run: ``expected_gap`` is each record's peers' own work (nan where it has none), ``iteration_us``
    each iteration's measured length less its charges. The peers'
    spread is taken where at least MIN_PEERS ranks did the same work: between two peers every difference is
    both ranks' deviation at once, so a slow rank would make its own yardstick (a TP2 stage of a small job)."""
    comparable = ~np.isnan(expected_gap)
    members = np.bincount(timelines.role_key)[timelines.role_key]
    usable = comparable & (members >= MIN_PEERS)
    return RunNoise(_robust_spread(iteration_us), _robust_spread(timelines.gap[usable] - expected_gap[usable]))
