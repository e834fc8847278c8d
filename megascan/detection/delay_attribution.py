"""Charge the time on each iteration's critical path to whoever made it long.

Every own-work segment on the path is measured against what the rank's peers of the same role take
for the same work (the median of the others with the same role key, RankTimelines): its excess, which
may be negative, is charged to that rank. A victim's segments on the path are as long as its peers',
so it is charged nothing however long it waited; waiting itself is never on the path. Transfer
segments of pipeline transfers are measured the same way against the same transfer on other links and
charged to the link (a slow link shows there, and no rank is charged for it).

The iteration's length is then the path's expected length plus every charge: the charges say how much
longer each culprit made the iteration.

Where the trace has the host's issue times beside the GPU's (CUDA events), each record's own work splits
into the time its GPU waited for its host to issue the op (RankTimelines.host_wait) and the rest, the
GPU's; each part is measured against the same part on the peers, so the delay a rank caused splits into
what its host added and what its GPU added. The run's own noise (noise.py) says which delays are real.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from megascan.detection.critical_path import CriticalPath
from megascan.detection.noise import RunNoise, estimate_noise
from megascan.detection.rank_timelines import NO_RECORD, RankTimelines
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
    caused_records: int = 0  # the operations at which others waited for it
    # caused_us split by who set the pace: its host (the GPU waited for launches) or its GPU; nan where the
    # trace has no host issue times (host-timed: host and device are one clock)
    caused_host_us: float = float("nan")
    caused_device_us: float = float("nan")
    launch_wait_share: float = float("nan")  # share of its own work in which its GPU waited for its host's launches
    launch_wait_share_of_peers: float = float("nan")  # the same share on the other ranks of its stage (median)
    # The share of its own work that the trace measured: the rest spans collectives it did not record
    # (--trace-tp-microbatches). The delays above are scaled up from the measured part (_extrapolate).
    measured_share: float = 1.0

    @property
    def own_ratio(self) -> float:
        return self.own_us / self.peers_us if self.peers_us > 0 else float("nan")

    @property
    def split_known(self) -> bool:
        return not np.isnan(self.caused_host_us)

    @property
    def host_side(self) -> bool:
        """Whether its host, not its GPU, set the pace of the delay it caused."""
        return self.split_known and self.caused_host_us > self.caused_device_us


@dataclass
class DelayAttribution:
    path_us: float  # all critical paths together
    iterations: int
    ranks: dict  # rank -> RankDelay
    links: dict = field(default_factory=dict)  # (src, dst) -> excess of its transfers on the critical paths (us)
    noise: RunNoise = field(default_factory=RunNoise)


def _add_masked(timelines, awaited, comparable, excess, ranks):
    """RankDelay.masked_us: each record's excess, by the rank that arrived last at its operation."""
    waited_for = np.where(awaited != NO_RECORD, timelines.rank[awaited], -1)
    behind = comparable & (waited_for >= 0) & (waited_for != timelines.rank)
    pairs, pair_of = np.unique(np.stack([timelines.rank[behind], waited_for[behind]]), axis=1, return_inverse=True)
    totals = np.bincount(pair_of.ravel(), weights=excess[behind], minlength=pairs.shape[1])
    for (rank, other), total in zip(pairs.T.tolist(), totals.tolist()):
        ranks[rank].masked_us[other] = total


def attribute_delays(timelines: RankTimelines, paths: list[CriticalPath],
                     compute_ratios: dict[int, float], tp_sampled: frozenset[int] = frozenset()) -> DelayAttribution:
    """DelayAttribution of the critical paths (module docstring). ``compute_ratios``: rank -> its compute over
    what other ranks take for identical operations; it measures the work of a rank no other rank shares its
    pipeline stage with (DP1 x TP1), whose expected work is then its own divided by that ratio. ``tp_sampled``:
    the ranks that recorded only some microbatches' tensor-parallel collectives (_extrapolate)."""
    expected_gap = medians_of_others(timelines.gap, timelines.role_key)
    alone = np.isnan(expected_gap)
    ratio = np.array([compute_ratios.get(rank, np.nan) for rank in timelines.rank[alone].tolist()], dtype=np.float64)
    expected_gap[alone] = timelines.gap[alone] / ratio
    expected_gap[timelines.opaque] = np.nan  # not own work: it holds unmeasured waits; nobody is charged for it
    ranks = {}
    comparable = ~np.isnan(expected_gap)
    own: np.ndarray | list[float] = (np.bincount(timelines.rank[comparable], weights=timelines.gap[comparable])
                                     if comparable.any() else [])
    peers: np.ndarray | list[float] = (np.bincount(timelines.rank[comparable], weights=expected_gap[comparable])
                                       if comparable.any() else [])
    without_peers = set(timelines.rank[alone].tolist())
    for rank in np.unique(timelines.rank).tolist():
        delay = ranks[rank] = RankDelay(rank, stage_peers=rank not in without_peers)
        if rank < len(own):
            delay.own_us, delay.peers_us = float(own[rank]), float(peers[rank])
    awaited = timelines.arrival_awaited()
    transfer = timelines.transfer_time(awaited)
    expected_transfer = medians_of_others(transfer, timelines.role_key)
    charged_links: defaultdict[tuple[int, int], float] = defaultdict(float)  # (src, dst) -> its excess (us)
    # Each iteration's measured length less what was charged for it: what its measured part took unslowed.
    # Own work that spans unrecorded collectives (--trace-tp-microbatches) is left out: nobody is charged for
    # it, so its jitter cannot add up in anyone's delay, and a slow rank's varying excess there must not raise
    # the bar that its measured excess has to clear.
    expected_lengths = []
    for path in paths:
        charged = unmeasured = 0.0
        for record in path.work:
            delay = ranks[int(timelines.rank[record])]
            delay.path_us += timelines.gap[record]
            if timelines.opaque[record]:
                unmeasured += timelines.gap[record]
            if comparable[record]:
                delay.charged_us += timelines.gap[record] - expected_gap[record]
                charged += timelines.gap[record] - expected_gap[record]
        for finishing, _ in path.transfers:
            instance = timelines.instances[timelines.instance[finishing]]
            excess = transfer[finishing] - expected_transfer[finishing]
            if instance.kind == "p2p" and not np.isnan(excess):
                charged_links[instance.src, instance.dst] += float(excess)
                charged += float(excess)
        expected_lengths.append(path.length_us - unmeasured - charged)
    # Off the iteration's path too, the work before an operation that others waited for delayed them: a
    # slow GPU in the DP replica that was not the slowest still held its own replica back.
    waited_for = np.fromiter(timelines.last_arrival.values(), dtype=np.int64, count=len(timelines.last_arrival))
    waited_for = waited_for[comparable[waited_for]]
    caused = np.bincount(timelines.rank[waited_for], weights=timelines.gap[waited_for] - expected_gap[waited_for])
    records = np.bincount(timelines.rank[waited_for])
    for rank, delay in ranks.items():
        delay.caused_us = float(caused[rank]) if rank < len(caused) else 0.0
        delay.caused_records = int(records[rank]) if rank < len(records) else 0
    _split_host_and_device(timelines, waited_for, ranks)
    _add_masked(timelines, awaited, comparable, timelines.gap - expected_gap, ranks)
    _extrapolate(timelines, {rank: ranks[rank] for rank in tp_sampled if rank in ranks})
    return DelayAttribution(sum(path.length_us for path in paths), len(paths), ranks, dict(charged_links),
                            estimate_noise(timelines, expected_gap, expected_lengths))


def _split_host_and_device(timelines, waited_for, ranks):
    """RankDelay.caused_host_us / caused_device_us and the launch-wait shares, where host issue times are known.

    The host's part of an excess is the excess of the time its GPU sat idle waiting for launches
    (``RankTimelines.host_wait``), the GPU's part its device work's excess. Not the host's issue intervals: a host
    blocked on its slow GPU's full launch queue issues as late as that GPU lets it (back-pressure)."""
    device, wait = timelines.device_work(), timelines.host_wait()
    known = ~np.isnan(wait)
    if not known.any():
        return
    expected_host, expected_device = np.full(len(known), np.nan), np.full(len(known), np.nan)
    expected_host[known] = medians_of_others(wait[known], timelines.role_key[known])
    expected_device[known] = medians_of_others(device[known], timelines.role_key[known])
    caused = waited_for[~np.isnan(expected_host[waited_for])]
    span = int(timelines.rank.max()) + 1
    host_excess = np.bincount(timelines.rank[caused], weights=wait[caused] - expected_host[caused],
                              minlength=span)
    device_excess = np.bincount(timelines.rank[caused], weights=device[caused] - expected_device[caused],
                                minlength=span)
    timed = ~np.isnan(wait) & ~timelines.opaque
    waited = np.bincount(timelines.rank[timed], weights=wait[timed], minlength=span)
    own = np.bincount(timelines.rank[timed], weights=timelines.gap[timed], minlength=span)
    stage = np.zeros(span, dtype=np.int64)
    stage[timelines.rank] = timelines.stage
    with_host = [rank for rank in ranks if own[rank] > 0]
    shares = np.array([waited[rank] / own[rank] for rank in with_host])
    split = np.bincount(timelines.rank[caused], minlength=span)  # caused records with peers to split against
    for rank, share, others in zip(with_host, shares, medians_of_others(shares, stage[with_host])):
        delay = ranks[rank]
        if split[rank]:
            delay.caused_host_us, delay.caused_device_us = float(host_excess[rank]), float(device_excess[rank])
        delay.launch_wait_share, delay.launch_wait_share_of_peers = float(share), float(others)


def _extrapolate(timelines, ranks):
    """Scale each rank's delays from the own work the trace measured to all its own work.

    With --trace-tp-microbatches only some microbatches' tensor-parallel collectives are recorded; the rest of
    a TP rank's iteration is opaque (its gaps hold waits nobody measured) and is charged to nobody, so a slow
    TP peer's delays would count only the measured few percent of the iteration. The microbatches are alike,
    so the measured part is a sample of the whole: its excess per unit of own work holds for the opaque part
    too. A victim's opaque gaps hold its waits, but its measured excess is nil, and so stays its estimate.
    Only there: other unrecorded operations (a data-parallel rank's) do not make the measured part a sample."""
    unrecorded = np.bincount(timelines.rank[timelines.opaque], weights=timelines.gap[timelines.opaque])
    for rank, delay in ranks.items():
        opaque_us = float(unrecorded[rank]) if rank < len(unrecorded) else 0.0
        if opaque_us <= 0.0 or delay.own_us <= 0.0:
            continue
        delay.measured_share = delay.own_us / (delay.own_us + opaque_us)
        scale = 1.0 / delay.measured_share
        delay.charged_us *= scale
        delay.caused_us *= scale
        delay.caused_host_us *= scale
        delay.caused_device_us *= scale
        delay.masked_us = {other: us * scale for other, us in delay.masked_us.items()}
