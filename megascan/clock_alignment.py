"""Put every rank's timestamps on one global clock.

Each rank times events with its own clock: ``local = rate * global + offset``, where the offset
(seconds apart across hosts) and the rate (drift, tens of ppm) are unknown. Wall-clock anchors
give a first guess good to milliseconds. The refinement uses what the trace itself proves: the
participants of one collective finish it together. With ``T_k`` the global finish time of
collective instance ``k`` and ``end[r, k]`` its local finish time on rank ``r``,

    end[r, k] = rate_r * T_k + offset_r      for every participant r of k,

which ``ClockAligner`` solves by alternating robust fits: ``T_k`` as the median over the
participants of their current global estimates, then each rank's (rate, offset) as a
Huber-weighted line through its (T_k, end[r, k]) points. The reference rank fixes the gauge
(rate 1, offset 0). A rank that shares no collective with the reference, directly or through
other ranks, cannot be aligned: it is reported with the reason instead of being merged.
"""

from dataclasses import dataclass, field

import numpy as np

_HUBER_US = 20.0  # residuals past this count linearly: a late return is an outlier, not a shift


@dataclass
class RankClock:
    rate: float  # local microseconds per global microsecond
    offset_us: float  # local reading at global time 0
    residual_us: float  # median |misfit| of this rank's collective finishes after alignment
    collectives: int  # how many collective finishes the fit used

    def to_global(self, local_us):
        return (np.asarray(local_us, dtype=np.float64) - self.offset_us) / self.rate

    @property
    def drift_ppm(self):
        return (self.rate - 1.0) * 1e6


@dataclass
class Alignment:
    reference_rank: int
    clocks: dict  # rank -> RankClock
    unaligned: dict = field(default_factory=dict)  # rank -> reason


def _connected_to(reference, instances):
    """Ranks linked to ``reference`` through shared collective instances."""
    linked, frontier = {reference}, [reference]
    neighbours = {}
    for ends in instances.values():
        for rank in ends:
            neighbours.setdefault(rank, set()).update(ends)
    while frontier:
        for other in neighbours.get(frontier.pop(), ()):
            if other not in linked:
                linked.add(other)
                frontier.append(other)
    return linked


def _huber_line(x, y, iterations=5):
    """Robust (slope, intercept) of y over x, x centred for conditioning."""
    x_mean = x.mean()
    xc = x - x_mean
    weights = np.ones_like(x)
    for _ in range(iterations):
        w_sum = weights.sum()
        mx, my = (weights * xc).sum() / w_sum, (weights * y).sum() / w_sum
        var = (weights * (xc - mx) ** 2).sum()
        slope = (weights * (xc - mx) * (y - my)).sum() / var if var > 0 else 1.0
        intercept_c = my - slope * mx
        residual = np.abs(y - (slope * xc + intercept_c))
        weights = np.where(residual <= _HUBER_US, 1.0, _HUBER_US / np.maximum(residual, 1e-12))
    return slope, intercept_c - slope * x_mean


class ClockAligner:
    """Solves per-rank (rate, offset) from collective finish times; see the module docstring."""

    def __init__(self, reference_rank=0, max_iterations=50, tolerance_us=1e-3):
        self.reference_rank = reference_rank
        self.max_iterations = max_iterations
        self.tolerance_us = tolerance_us

    def align(self, instances, initial_offsets_us=None):
        """``instances``: {instance id: {rank: local finish time in us}} for collectives seen by
        two or more ranks. ``initial_offsets_us``: {rank: wall-clock anchor estimate of the
        offset}; missing ranks start at 0."""
        instances = {k: ends for k, ends in instances.items() if len(ends) >= 2}
        all_ranks = {rank for ends in instances.values() for rank in ends}
        all_ranks.update(initial_offsets_us or {})
        linked = _connected_to(self.reference_rank, instances)
        unaligned = {rank: f"shares no collective with rank {self.reference_rank} or the ranks aligned to it"
                     for rank in sorted(all_ranks - linked)}
        ranks = sorted(linked)
        if ranks == [self.reference_rank]:  # the reference itself took part in no collective
            return Alignment(self.reference_rank, {self.reference_rank: RankClock(1.0, 0.0, float("nan"), 0)},
                             unaligned)
        usable = {k: {r: t for r, t in ends.items() if r in linked} for k, ends in instances.items()}
        usable = {k: ends for k, ends in usable.items() if len(ends) >= 2}
        keys = list(usable)
        rate = {r: 1.0 for r in ranks}
        offset = {r: float((initial_offsets_us or {}).get(r, 0.0)) for r in ranks}
        offset[self.reference_rank], rate[self.reference_rank] = 0.0, 1.0
        # Every linked rank has at least one instance (that is how it got linked).
        members = {r: [(i, usable[k][r]) for i, k in enumerate(keys) if r in usable[k]] for r in ranks}
        for _ in range(self.max_iterations):
            finish = np.array([np.median([(t - offset[r]) / rate[r] for r, t in usable[k].items()]) for k in keys])
            fitted = {}
            for r in ranks:
                index, local = map(np.array, zip(*members[r]))
                fitted[r] = _huber_line(finish[index], local.astype(np.float64))
            # Every rank, the reference too, was fitted to the consensus frame; re-express all in the
            # reference's clock, so that the frame cannot settle away from it.
            ref_rate, ref_offset = fitted[self.reference_rank]
            change = 0.0
            for r, (fit_rate, fit_offset) in fitted.items():
                new_rate, new_offset = fit_rate / ref_rate, fit_offset - fit_rate * ref_offset / ref_rate
                change = max(change, abs(new_offset - offset[r]), abs(new_rate - rate[r]) * np.abs(finish).max())
                rate[r], offset[r] = new_rate, new_offset
            if change < self.tolerance_us:
                break
        clocks = {}
        for r in ranks:
            index, local = map(np.array, zip(*members[r]))
            misfit = np.abs(local - (rate[r] * finish[index] + offset[r]))
            clocks[r] = RankClock(rate[r], offset[r], float(np.median(misfit)), len(index))
        return Alignment(self.reference_rank, clocks, unaligned)
