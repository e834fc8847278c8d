"""Charge the time on each iteration's critical path to whoever made it long.

Every own-work segment on the path is measured against what the rank's peers of the same role take
for the same work (the median of the others with the same role key, RankTimelines): its excess, which
may be negative, is charged to that rank. A victim's segments on the path are as long as its peers',
so it is charged nothing however long it waited; waiting itself is never on the path. Transfer
segments of pipeline transfers are measured the same way against the same transfer on other links and
charged to the link (a slow link shows there, and no rank is charged for it).

The iteration's length is then the path's expected length plus every charge: the charges say how much
longer each culprit made the iteration.
"""

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from megascan.detection.rank_timelines import NO_RECORD
from megascan.detection.robust import medians_of_others


@dataclass
class RankDelay:
    rank: int
    path_us: float = 0.0  # its own work on the critical paths
    charged_us: float = 0.0  # that work's excess over its peers' (what it added to the iterations)
    caused_us: float = 0.0  # its excess before operations where others waited for it (the delay it caused)
    # Its excess before operations in which it waited for another rank, by that rank: the delay it would cause
    # if that rank were not slower still (two slow TP peers: the slower one arrives last every time).
    masked_us: dict = field(default_factory=dict)
    own_us: float = 0.0  # all its own work that has peers to compare with ...
    peers_us: float = 0.0  # ... and what its peers take for the same work
    stage_peers: bool = True  # False: no rank shares its stage; its work was measured by its compute ratio

    @property
    def own_ratio(self):
        return self.own_us / self.peers_us if self.peers_us > 0 else float("nan")


@dataclass
class DelayAttribution:
    path_us: float  # all critical paths together
    iterations: int
    ranks: dict  # rank -> RankDelay
    links: dict = field(default_factory=dict)  # (src, dst) -> excess of its transfers on the critical paths (us)


def _transfer_times(timelines, awaited):
    """Per record: its finish minus its instance's last arrival (nan where unknown)."""
    arrival = np.where(awaited != NO_RECORD, timelines.start[awaited], np.nan)
    return np.maximum(timelines.end - arrival, 0.0)


def _add_masked(timelines, awaited, comparable, excess, ranks):
    """RankDelay.masked_us: each record's excess, by the rank that arrived last at its operation."""
    waited_for = np.where(awaited != NO_RECORD, timelines.rank[awaited], -1)
    behind = comparable & (waited_for >= 0) & (waited_for != timelines.rank)
    pairs, pair_of = np.unique(np.stack([timelines.rank[behind], waited_for[behind]]), axis=1, return_inverse=True)
    totals = np.bincount(pair_of.ravel(), weights=excess[behind], minlength=pairs.shape[1])
    for (rank, other), total in zip(pairs.T.tolist(), totals.tolist()):
        ranks[rank].masked_us[other] = total


def attribute_delays(timelines, paths, compute_ratios):
    """DelayAttribution of the critical paths (module docstring). ``compute_ratios``: rank -> its compute over
    what other ranks take for identical operations; it measures the work of a rank no other rank shares its
    pipeline stage with (DP1 x TP1), whose expected work is then its own divided by that ratio."""
    expected_gap = medians_of_others(timelines.gap, timelines.role_key)
    alone = np.isnan(expected_gap)
    ratio = np.array([compute_ratios.get(rank, np.nan) for rank in timelines.rank[alone].tolist()], dtype=np.float64)
    expected_gap[alone] = timelines.gap[alone] / ratio
    ranks = {}
    comparable = ~np.isnan(expected_gap)
    own = np.bincount(timelines.rank[comparable], weights=timelines.gap[comparable]) if comparable.any() else []
    peers = np.bincount(timelines.rank[comparable], weights=expected_gap[comparable]) if comparable.any() else []
    without_peers = set(timelines.rank[alone].tolist())
    for rank in np.unique(timelines.rank).tolist():
        delay = ranks[rank] = RankDelay(rank, stage_peers=rank not in without_peers)
        if rank < len(own):
            delay.own_us, delay.peers_us = float(own[rank]), float(peers[rank])
    awaited = timelines.arrival_awaited()
    transfer = _transfer_times(timelines, awaited)
    expected_transfer = medians_of_others(transfer, timelines.role_key)
    charged_links = defaultdict(float)
    for path in paths:
        for record in path.work:
            delay = ranks[int(timelines.rank[record])]
            delay.path_us += timelines.gap[record]
            if comparable[record]:
                delay.charged_us += timelines.gap[record] - expected_gap[record]
        for finishing, _ in path.transfers:
            instance = timelines.instances[timelines.instance[finishing]]
            excess = transfer[finishing] - expected_transfer[finishing]
            if instance.kind == "p2p" and not np.isnan(excess):
                charged_links[instance.src, instance.dst] += float(excess)
    # Off the iteration's path too, the work before an operation that others waited for delayed them: a
    # slow GPU in the DP replica that was not the slowest still held its own replica back.
    waited_for = np.fromiter(timelines.last_arrival.values(), dtype=np.int64, count=len(timelines.last_arrival))
    waited_for = waited_for[comparable[waited_for]]
    caused = np.bincount(timelines.rank[waited_for], weights=timelines.gap[waited_for] - expected_gap[waited_for])
    for rank, delay in ranks.items():
        delay.caused_us = float(caused[rank]) if rank < len(caused) else 0.0
    _add_masked(timelines, awaited, comparable, timelines.gap - expected_gap, ranks)
    return DelayAttribution(sum(path.length_us for path in paths), len(paths), ranks, dict(charged_links))
