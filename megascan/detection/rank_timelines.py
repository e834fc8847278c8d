"""Each rank's synchronisation points in order, and the rank's own work between them.

A rank's op records are the points where it met other ranks (a collective, a send or recv). Between
the finish of one and the arrival at the next, the rank did its own work (kernels, the host issuing
them): nobody else could make that time shorter or longer. Every record therefore gets:

- ``prev``: the rank's record it last finished before arriving here (-1 at the start of an iteration);
- ``gap``: its own work since then (arrival - that finish, or - the iteration's start);
- ``role key``: what the same work is called on the rank's peers of the same role. Ranks of one
  pipeline stage (its TP peers and DP replicas) run the same program, so the n-th all-reduce on a
  TP group in iteration i, or the n-th send to the next stage, is the same point on all of them
  whatever the group ids. The key is (stage, iteration, role, kind, peer offset, n);
- ``host``: when the rank's host issued it, where the trace times the device apart from the host
  (CUDA events). The GPU cannot reach an op before its host issued it: of the own work before an
  arrival that the GPU reached right after the issue, the part from the previous finish to the issue is time
  the GPU waited for launches (``host_wait``), the rest the GPU's own (``device_work``);
- ``opaque``: whether the rank passed synchronisations it did not record (``--trace-tp-microbatches``)
  since its previous record: its gap then holds waits nobody measured, so it is not its own work.

Records are held in flat numpy arrays indexed by record number, because a 1024-rank trace has
hundreds of thousands of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megascan.aggregate.merged_trace import MergedTrace

NO_RECORD = -1
# An op that the GPU reached this long after its host issued it found the GPU busy with work launched earlier (a
# launch reaches an idle GPU within microseconds; the host and device clocks agree to about 10 us once aligned).
PENDING_WORK_US = 100.0


@dataclass
class RankTimelines:
    instances: list  # the merged trace's OpInstances, by id
    rank: np.ndarray  # record number -> rank
    start: np.ndarray  # arrival, global us
    end: np.ndarray  # finish on this rank, global us (nan: never waited for it)
    instance: np.ndarray  # record number -> instance id
    iteration: np.ndarray  # -1 where the record names none
    role_key: np.ndarray  # record number -> id of its role key (same work on same-role peers)
    prev: np.ndarray  # record number -> the rank's previous finished record in this iteration, or NO_RECORD
    gap: np.ndarray  # own work before arriving (us)
    last_arrival: dict  # instance id -> record number of its last member to arrive (complete instances)
    host: np.ndarray  # record number -> host issue time, global us (nan: unknown, or host-timed: one clock)
    stage: np.ndarray  # record number -> its rank's pipeline stage
    opaque: np.ndarray  # record number -> its gap spans unrecorded synchronisations (module docstring)

    def host_wait(self) -> np.ndarray:
        """Per record: the part of its own work before arriving in which its GPU waited for its host to
        issue the op (from the previous finish to the issue; nan where the host's issue time is unknown).

        Only where the GPU reached the op as soon as it was issued: a GPU that reached it long after the issue
        was still running work launched before it, and so was never idle for its host. A host that issues late
        because it blocked on its GPU's full launch queue is paced by that GPU (back-pressure), not the reverse."""
        waited = np.clip(self.host - (self.start - self.gap), 0.0, self.gap)
        return np.where(self.start - self.host > PENDING_WORK_US, 0.0, waited)

    def device_work(self) -> np.ndarray:
        """Per record: the rest of its own work, its GPU's: from the issue (or the previous finish) to arriving."""
        return self.gap - self.host_wait()

    def transfer_time(self, awaited: np.ndarray) -> np.ndarray:
        """Per record: the operation's own transfer, from its instance's last arrival (``awaited``, as
        arrival_awaited gives it) to this record's finish (nan where unknown)."""
        arrival = np.where(awaited != NO_RECORD, self.start[awaited], np.nan)
        return np.maximum(self.end - arrival, 0.0)

    def arrival_awaited(self) -> np.ndarray:
        """Per record: the record number of its instance's last arrival, what it waited for (NO_RECORD where
        the instance is incomplete); the last arrival itself points to itself."""
        last_of = np.full(len(self.instances), NO_RECORD, dtype=np.int64)
        last_of[np.fromiter(self.last_arrival, dtype=np.int64, count=len(self.last_arrival))] = np.fromiter(
            self.last_arrival.values(), dtype=np.int64, count=len(self.last_arrival))
        return last_of[self.instance]


KIND_CODES = {"collective": 0, "send": 1, "recv": 2}


def _reached_records(merged):
    """The records that were reached (not only issued) as rows (rank, start, end, instance, iteration, kind,
    peer offset, host issue time, unrecorded ops before it), and which instances are complete (every member
    finished them)."""
    values, ranks, nan = [], merged.ranks, np.nan  # one flat list: a tuple per record would double the memory
    split = {rank for rank, trace in ranks.items() if trace.timer != "host_clock"}  # device clock beside host
    complete = np.zeros(len(merged.instances), dtype=bool)
    for instance in merged.instances:
        whole, number = not instance.missing, instance.id
        for rank, record in instance.records.items():
            if record.issued_only or rank not in ranks:
                whole = False
                continue
            end, peer, iteration, host = record.end, record.peer, record.iteration, record.host
            values += (rank, record.start, nan if end is None else end, number,
                       -1 if iteration is None else iteration, KIND_CODES[record.kind],
                       0 if peer is None else peer - rank, nan if host is None or rank not in split else host,
                       record.unrecorded_before or 0)
        complete[number] = whole
    return np.array(values, dtype=np.float64).reshape(-1, 9), complete


def _iteration_began(merged, rank, iteration, start):
    """Per record: when its rank's ``iteration`` event began (the record's own start where there is none)."""
    events = [(r, e.iteration, e.start) for r, trace in merged.ranks.items() for e in trace.events
              if e.name == "iteration" and isinstance(e.iteration, int)]
    if not events:
        return start.copy()
    keys = np.array([r * 2**32 + i for r, i, _ in events], dtype=np.int64)
    order = np.argsort(keys)
    keys, began = keys[order], np.array([s for _, _, s in events], dtype=np.float64)[order]
    wanted = rank * 2**32 + iteration
    at = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
    return np.where(keys[at] == wanted, began[at], start)


def _prev_and_gap(rank, start, end, iteration, began):
    """prev and gap (module docstring) of records sorted by rank, then arrival."""
    prev = np.full(len(start), NO_RECORD, dtype=np.int64)
    _, first = np.unique(rank, return_index=True)
    for lo, hi in zip(first, list(first[1:]) + [len(start)]):
        ends = end[lo:hi]
        finished = np.flatnonzero(~np.isnan(ends))
        by_end = finished[np.argsort(ends[finished], kind="stable")]
        # The finish each arrival followed: this rank's latest finish at or before it.
        position = np.searchsorted(ends[by_end], start[lo:hi], side="right") - 1
        if len(by_end):
            prev[lo:hi] = np.where(position >= 0, lo + by_end[np.maximum(position, 0)], NO_RECORD)
    same_iteration = (prev != NO_RECORD) & (iteration[prev] == iteration)
    prev = np.where(same_iteration, prev, NO_RECORD)
    since = np.where(same_iteration, end[prev], began)
    return prev, np.maximum(start - since, 0.0)


def _starts(values):
    """Per element of a sorted array: whether it differs from the one before (starts a run)."""
    new = np.ones(len(values), dtype=bool)
    new[1:] = values[1:] != values[:-1]
    return new


def _ids(columns):
    """Each row's number among the distinct rows of equal-length integer ``columns``."""
    order = np.lexsort(columns[::-1])
    stacked = np.stack(columns)[:, order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = np.any(stacked[:, 1:] != stacked[:, :-1], axis=0)
    ids = np.empty(len(order), dtype=np.int64)
    ids[order] = np.cumsum(new) - 1
    return ids


def _role_keys(rank, stage, iteration, role, kind, offset):
    """The id of each record's role key (module docstring); records sorted by rank, then arrival."""
    signature = _ids([rank, iteration, role, kind, offset])
    order = np.lexsort((np.arange(len(rank)), signature))  # by signature, then arrival
    group_start = np.maximum.accumulate(np.where(_starts(signature[order]), np.arange(len(order)), 0))
    occurrence = np.empty(len(order), dtype=np.int64)
    occurrence[order] = np.arange(len(order)) - group_start
    # Same stage, same signature but the rank, same occurrence: the same work on a peer.
    return _ids([stage, iteration, role, kind, offset, occurrence])


def _last_arrivals(instance, start, complete):
    """instance id -> record number of its last arrival, for complete instances."""
    chosen = np.flatnonzero(complete[instance])
    order = chosen[np.lexsort((start[chosen], instance[chosen]))]
    last = order[_starts(instance[order][::-1])[::-1]]  # the last of each instance's run
    return dict(zip(instance[last].tolist(), last.tolist()))


def build_timelines(merged: MergedTrace) -> RankTimelines:
    """RankTimelines of every merged rank (see the module docstring)."""
    rows, complete = _reached_records(merged)
    rows = rows[np.lexsort((rows[:, 1], rows[:, 0]))]
    rank, start, end = rows[:, 0].astype(np.int64), rows[:, 1], rows[:, 2]
    instance, iteration = rows[:, 3].astype(np.int64), rows[:, 4].astype(np.int64)
    roles: dict[str, int] = {}  # role -> its number
    role_of = np.array([roles.setdefault(i.role, len(roles)) for i in merged.instances], dtype=np.int64)
    pp = {r: trace.coords["pp"] for r, trace in merged.ranks.items()}
    stage = np.array([pp[r] for r in rank.tolist()], dtype=np.int64)
    prev, gap = _prev_and_gap(rank, start, end, iteration, _iteration_began(merged, rank, iteration, start))
    role_key = _role_keys(rank, stage, iteration, role_of[instance], rows[:, 5].astype(np.int64),
                          rows[:, 6].astype(np.int64))
    return RankTimelines(merged.instances, rank, start, end, instance, iteration, role_key, prev, gap,
                         _last_arrivals(instance, start, complete), rows[:, 7], stage, rows[:, 8] > 0)
