"""Each rank's synchronisation points in order, and the rank's own work between them.

A rank's op records are the points where it met other ranks (a collective, a send or recv). Between
the finish of one and the arrival at the next, the rank did its own work (kernels, the host issuing
them): nobody else could make that time shorter or longer. Every record therefore gets:

- ``prev``: the rank's record it last finished before arriving here (-1 at the start of an iteration);
- ``gap``: its own work since then (arrival - that finish, or - the iteration's start);
- ``role key``: what the same work is called on the rank's peers of the same role. Ranks of one
  pipeline stage (its TP peers and DP replicas) run the same program, so the n-th all-reduce on a
  TP group in iteration i, or the n-th send to the next stage, is the same point on all of them
  whatever the group ids. The key is (stage, iteration, role, kind, peer offset, n).

Records are held in flat numpy arrays indexed by record number, because a 1024-rank trace has
hundreds of thousands of them.
"""

from dataclasses import dataclass

import numpy as np

NO_RECORD = -1


@dataclass
class RankTimelines:
    records: list  # record number -> (rank, OpInstance, op record dict)
    rank: np.ndarray  # record number -> rank
    start: np.ndarray  # arrival, global us
    end: np.ndarray  # finish on this rank, global us (nan: never waited for it)
    instance: np.ndarray  # record number -> instance id
    iteration: np.ndarray  # -1 where the record names none
    role_key: np.ndarray  # record number -> id of its role key (same work on same-role peers)
    prev: np.ndarray  # record number -> the rank's previous finished record in this iteration, or NO_RECORD
    gap: np.ndarray  # own work before arriving (us)
    last_arrival: dict  # instance id -> record number of its last member to arrive (complete instances)

    def rank_records(self):
        """rank -> its record numbers in arrival order."""
        order = np.lexsort((self.start, self.rank))
        ranks, first = np.unique(self.rank[order], return_index=True)
        return dict(zip(ranks.tolist(), np.split(order, first[1:])))


def _iteration_starts(merged):
    return {(rank, event.get("iteration")): event["start"] for rank, trace in merged.ranks.items()
            for event in trace.events if event["name"] == "iteration"}


def _collect(merged):
    """The records that were reached (not only issued), grouped per rank, and each instance's last arrival."""
    per_rank, last_arrival = {rank: [] for rank in merged.ranks}, {}
    for instance in merged.instances:
        complete = not instance.missing
        latest = None
        for rank, record in instance.records.items():
            if record.get("issued_only") or rank not in per_rank:
                complete = False
                continue
            per_rank[rank].append((record["start"], instance, record))
            if latest is None or record["start"] > latest[0]:
                latest = (record["start"], rank, record)
        if complete and latest is not None:
            last_arrival[instance.id] = latest[2]
    return per_rank, last_arrival


def _role_keys(rank, stage, items, keys):
    """The id of each record's role key (module docstring), numbering new keys in ``keys``."""
    occurrences, ids = {}, []
    for _, instance, record in items:
        peer = record.get("peer")
        signature = (record.get("iteration"), instance.role, record["kind"], None if peer is None else peer - rank)
        occurrence = occurrences.get(signature, 0)
        occurrences[signature] = occurrence + 1
        ids.append(keys.setdefault((stage, *signature, occurrence), len(keys)))
    return ids


def _rank_columns(rank, items, iteration_start):
    """start, end, iteration, prev (index within ``items``) and gap of one rank's records in arrival order."""
    start = np.array([item[0] for item in items], dtype=np.float64)
    end = np.array([np.nan if r["end"] is None else r["end"] for _, _, r in items], dtype=np.float64)
    iteration = np.array([-1 if r.get("iteration") is None else r["iteration"] for _, _, r in items], dtype=np.int64)
    finished = np.flatnonzero(~np.isnan(end))
    by_end = finished[np.argsort(end[finished], kind="stable")]
    # The finish each arrival followed: this rank's latest finish at or before it, in the same iteration.
    position = np.searchsorted(end[by_end], start, side="right") - 1
    prev = np.where(position >= 0, by_end[np.maximum(position, 0)] if len(by_end) else 0, NO_RECORD)
    same_iteration = (prev != NO_RECORD) & (iteration[prev] == iteration)
    prev = np.where(same_iteration, prev, NO_RECORD)
    iteration_began = np.array([iteration_start.get((rank, r.get("iteration")), s) for s, _, r in items],
                               dtype=np.float64)
    since = np.where(same_iteration, end[prev], iteration_began)
    return start, end, iteration, prev, np.maximum(start - since, 0.0)


def build_timelines(merged):
    """RankTimelines of every merged rank (see the module docstring)."""
    per_rank, last_record = _collect(merged)
    iteration_start = _iteration_starts(merged)
    keys, records, columns = {}, [], []
    for rank, items in per_rank.items():
        if not items:
            continue
        items.sort(key=lambda item: item[0])
        start, end, iteration, prev, gap = _rank_columns(rank, items, iteration_start)
        prev = np.where(prev == NO_RECORD, NO_RECORD, prev + len(records))
        instance = np.array([item[1].id for item in items], dtype=np.int64)
        role_key = np.array(_role_keys(rank, merged.ranks[rank].coords["pp"], items, keys), dtype=np.int64)
        columns.append((np.full(len(items), rank, dtype=np.int64), start, end, instance, iteration, role_key, prev, gap))
        records += [(rank, instance, record) for _, instance, record in items]
    number = {id(record): index for index, (_, _, record) in enumerate(records)}
    types = (np.int64, np.float64, np.float64, np.int64, np.int64, np.int64, np.int64, np.float64)
    joined = [np.concatenate(column) for column in zip(*columns)] or [np.zeros(0, dtype=kind) for kind in types]
    return RankTimelines(records, *joined,
                         last_arrival={instance: number[id(record)] for instance, record in last_record.items()})
