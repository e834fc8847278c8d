"""Who waits for whom in synchronous groups: the "waits it caused" evidence and the victims list.

A collective cannot finish before its last member arrives, so every member waits from its own
arrival until the last arrival: the last one imposes those waits. A point-to-point transfer pairs a
send and a recv; whichever side posts later makes the other wait. Each synchronous group (a
collective's process group, or a pipeline link) is counted separately. Computed on the complete
instances of RankTimelines, all at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megascan.detection.rank_timelines import NO_RECORD, RankTimelines


@dataclass
class GroupWaits:
    """Waits inside one synchronous group, over all its traced instances."""

    name: str  # e.g. "tp [2, 3]" or "p2p 1->3"
    instances: int = 0
    imposed: dict = field(default_factory=dict)  # rank -> wait it caused (us)
    waited: dict = field(default_factory=dict)  # rank -> wait it suffered (us)
    last: dict = field(default_factory=dict)  # rank -> times it arrived last


def _group_name(instance):
    if instance.kind == "p2p":
        return f"p2p {instance.src}->{instance.dst}"
    return f"{instance.role} {sorted(instance.records)}"


def _sums(keys, values):
    """{key: sum of values}, for integer keys."""
    unique, inverse = np.unique(keys, return_inverse=True)
    return dict(zip(unique.tolist(), np.bincount(inverse.ravel(), weights=values, minlength=len(unique)).tolist()))


def group_waits(timelines: RankTimelines) -> dict[str, GroupWaits]:
    """Group name -> GroupWaits, for every synchronous group with a complete instance."""
    numbers: dict[str, int] = {}  # group name -> its number
    group_of_instance: dict[int, int] = {}  # instance id -> its group's number
    for instance_id in timelines.last_arrival:
        group_of_instance[instance_id] = numbers.setdefault(_group_name(timelines.instances[instance_id]), len(numbers))
    groups = [GroupWaits(name) for name in numbers]
    if not groups:
        return {}
    instance_ids = np.fromiter(group_of_instance, dtype=np.int64, count=len(group_of_instance))
    group_at = np.full(len(timelines.instances), -1, dtype=np.int64)
    group_at[instance_ids] = np.fromiter(group_of_instance.values(), dtype=np.int64, count=len(instance_ids))
    awaited = timelines.arrival_awaited()
    complete = awaited != NO_RECORD
    group, rank, last = group_at[timelines.instance[complete]], timelines.rank[complete], awaited[complete]
    wait = timelines.start[last] - timelines.start[complete]
    span = int(timelines.rank.max()) + 1
    for key, us in _sums(group * span + rank, wait).items():
        groups[key // span].waited[key % span] = us
    for key, us in _sums(group * span + timelines.rank[last], wait).items():
        groups[key // span].imposed[key % span] = us
    last_records = np.fromiter(timelines.last_arrival.values(), dtype=np.int64, count=len(instance_ids))
    last_group = group_at[instance_ids]
    for key, count in _sums(last_group * span + timelines.rank[last_records], np.ones(len(last_records))).items():
        groups[key // span].last[key % span] = int(count)
    for key, count in zip(*np.unique(last_group, return_counts=True)):
        groups[key].instances = int(count)
    return {group.name: group for group in groups}


def waited_for(timelines: RankTimelines) -> dict[int, dict[int, float]]:
    """rank -> {rank it waited for: us}: at each complete instance, from its arrival to the last arrival."""
    last = timelines.arrival_awaited()
    waiting = (last != NO_RECORD) & (last != np.arange(len(last)))
    waiter, waited = timelines.rank[waiting], timelines.rank[last[waiting]]
    span = int(timelines.rank.max(initial=0)) + 1
    totals: dict[int, dict[int, float]] = {}
    for key, us in _sums(waiter * span + waited, timelines.start[last[waiting]] - timelines.start[waiting]).items():
        totals.setdefault(key // span, {})[key % span] = us
    return totals
