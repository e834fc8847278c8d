"""Stages (b) and (c, waits): who waits for whom in synchronous groups.

A collective cannot finish before its last member arrives, so every member waits from its own
arrival until the last arrival: the last one imposes those waits. A point-to-point transfer
pairs a send and a recv; whichever side posts later makes the other wait. A slow rank arrives
last and waits least; a victim lags too (it waited elsewhere) but is not the last in every group
it joins. Each synchronous group (a collective's process group, or a pipeline link) is scored
separately, so "slowest member of every group it joins" can be checked.
"""

from collections import defaultdict
from dataclasses import dataclass, field

from megascan.detection.robust import median

@dataclass
class GroupWaits:
    """Waits inside one synchronous group, over all its traced instances."""

    name: str  # e.g. "tp [2, 3]" or "p2p 1->3"
    members: tuple
    instances: int = 0
    imposed: dict = field(default_factory=lambda: defaultdict(float))  # rank -> wait it caused (us)
    waited: dict = field(default_factory=lambda: defaultdict(float))  # rank -> wait it suffered (us)
    last: dict = field(default_factory=lambda: defaultdict(int))  # rank -> times it arrived last
    transfer_us: list = field(default_factory=list)  # end - last arrival, per instance

    def slowest(self):
        return max(self.members, key=lambda rank: self.imposed[rank] - self.waited[rank])


def _add_instance(group, arrivals, ends):
    last_rank = max(arrivals, key=arrivals.get)
    last_arrival = arrivals[last_rank]
    group.instances += 1
    group.last[last_rank] += 1
    for rank, arrival in arrivals.items():
        wait = last_arrival - arrival
        group.waited[rank] += wait
        group.imposed[last_rank] += wait
    if ends:
        group.transfer_us.append(max(median(ends) - last_arrival, 0.0))


def group_waits(merged):
    """Group name -> GroupWaits, for every collective group with 2+ members and every p2p link."""
    groups = {}
    for instance in merged.instances:
        records = {rank: r for rank, r in instance.records.items() if rank in merged.ranks}
        if instance.missing or len(records) < 2 or any(r.get("issued_only") for r in records.values()):
            continue  # hangs are stage (d); an incomplete instance says nothing about waits
        if instance.kind == "collective":
            members = tuple(sorted(records))
            name = f"{instance.role} {list(members)}"
        else:
            members = (instance.src, instance.dst)
            name = f"p2p {instance.src}->{instance.dst}"
        group = groups.setdefault(name, GroupWaits(name, members))
        ends = [r["end"] for r in records.values() if r.get("end") is not None]
        _add_instance(group, {rank: r["start"] for rank, r in records.items()}, ends)
    return groups


def rank_waits(groups):
    """rank -> imposed and waited totals (us), all waiting in its groups, instances where it came
    last, the groups it joined and those it was the slowest member of, and the transfer times
    (finish - last arrival) of its groups' instances."""
    totals = defaultdict(lambda: {"imposed_us": 0.0, "waited_us": 0.0, "groups_waited_us": 0.0, "last": 0,
                                  "instances": 0, "groups": [], "slowest_in": [], "transfer_us": []})
    for group in groups.values():
        slowest = group.slowest()
        group_waited = sum(group.waited.values())
        for rank in group.members:
            entry = totals[rank]
            entry["groups_waited_us"] += group_waited  # all waiting in its groups: its share is imposed / this
            entry["imposed_us"] += group.imposed[rank]
            entry["waited_us"] += group.waited[rank]
            entry["last"] += group.last[rank]
            entry["instances"] += group.instances
            entry["transfer_us"] += group.transfer_us
            entry["groups"].append(group.name)
            if rank == slowest and group.imposed[rank] > group.waited[rank]:
                entry["slowest_in"].append(group.name)
    return totals
