"""The critical path of each traced iteration, through the dependency graph the trace holds.

Program order joins each rank's operations; each collective instance or transfer joins its members:
it finishes only after its last member arrived. So the iteration's last finish is explained
backwards: that operation waited for its last arrival (the transfer itself ran from that arrival to
the finish), and the last arrival got there after its own work since its previous finish, which in
turn waited for its own last arrival, and so on back to the iteration's start. Ranks that arrived
early are not on the path: they only waited.

The path alternates two kinds of segment and covers the iteration exactly, end to end:
- own work of one rank: the gap before its arrival (RankTimelines.gap of the arriving record);
- a transfer: from an operation's last arrival to its finish on the rank the path continues from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megascan.detection.rank_timelines import NO_RECORD, RankTimelines


@dataclass
class CriticalPath:
    iteration: int
    start: float  # global us
    end: float
    work: list = field(default_factory=list)  # record numbers whose own-work gap lies on the path
    transfers: list = field(default_factory=list)  # (finishing record, last-arrival record) per transfer segment

    @property
    def length_us(self) -> float:
        return self.end - self.start


def _walk(timelines, iteration, last):
    """The path of one iteration, from its record with the latest finish back to the iteration's start."""
    path = CriticalPath(iteration, start=float(timelines.start[last]), end=float(timelines.end[last]))
    record, seen = last, set()
    while record != NO_RECORD and record not in seen:  # equal timestamps could otherwise loop
        seen.add(record)
        arrival = timelines.last_arrival.get(int(timelines.instance[record]), record)
        path.transfers.append((record, arrival))
        path.work.append(arrival)
        path.start = float(timelines.start[arrival] - timelines.gap[arrival])
        record = int(timelines.prev[arrival])
    return path


def critical_paths(timelines: RankTimelines) -> list[CriticalPath]:
    """CriticalPath of every iteration that has finished records, in iteration order."""
    finished = ~np.isnan(timelines.end) & (timelines.iteration >= 0)
    paths = []
    for iteration in np.unique(timelines.iteration[finished]).tolist():
        candidates = np.flatnonzero(finished & (timelines.iteration == iteration))
        paths.append(_walk(timelines, iteration, int(candidates[np.argmax(timelines.end[candidates])])))
    return paths
