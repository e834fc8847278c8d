"""Which op records, on different ranks, are the same operation.

Sequence numbers make this a lookup, not a search: a collective instance is (group, seq) on every
member, and the k-th send from A to B on a group is the k-th recv of B from A on it (both carry k as
``seq``). One pass over all records into a dict keyed that way matches them in linear time. The
counters run across windows, so records of different windows, and `issued` records of a stalled
window, match the same way.
"""

from __future__ import annotations

from megascan.aggregate.loading import RankFile
from megascan.aggregate.trace_records import OpRecord

InstanceKey = tuple  # ("collective", group, seq) or ("p2p", group, seq, src, dst)


def instance_key(rank: int, op: OpRecord) -> InstanceKey:
    """("collective", group, seq) or ("p2p", group, seq, src, dst); equal on every member."""
    if op.kind == "collective":
        return "collective", op.group, op.seq
    src, dst = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
    return "p2p", op.group, op.seq, src, dst


def match_records(files: dict[int, RankFile], problems: list[str]) -> dict[InstanceKey, dict[int, OpRecord]]:
    """{instance key: {rank: op record}}, instances in order of first appearance (ranks ascending)."""
    instances: dict[InstanceKey, dict[int, OpRecord]] = {}
    repeated = 0
    for rank, rank_file in files.items():
        for op in rank_file.ops():
            records = instances.setdefault(instance_key(rank, op), {})
            if rank in records:
                repeated += 1
            else:
                records[rank] = op
    if repeated:
        problems.append(f"{repeated} op record(s) repeat a (group, seq) their rank already recorded; "
                        f"the first record of each is kept")
    return instances


def group_table(files: dict[int, RankFile]) -> dict[str, dict]:
    """Group id -> {"ranks": [...], "role": ...}, from every window and issued line of every rank."""
    groups: dict[str, dict] = {}
    for rank_file in files.values():
        for window in (rank_file.windows, rank_file.stalled):
            for line in window.values():
                for group_id, group in line["groups"].items():
                    groups.setdefault(group_id, group)
    return groups
