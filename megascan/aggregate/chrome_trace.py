"""The merged trace as Chrome Trace Event JSON, for Perfetto (ui.perfetto.dev) or chrome://tracing.

Every rank's tracks are threads of one process, named ``DP{d}-PP{p}-TP{t} (rank r) <track>`` and
numbered in layout order. One process, because the Perfetto UI orders processes by how busy they
are (process_sort_index is ignored: ranks of the last stage came first), while it orders the threads
of a process by thread id. Thread ids start at 2: Perfetto takes the thread whose id equals its pid
for the process's main thread and lists it first, and puts tid 0 events on that main thread too.
Compute events, collectives and point-to-point ops each have their own track, and where slices of
one kind nest or overlap (an iteration holds forwards, a forward holds layers; asynchronous
collectives overlap) they spread over further tracks of that kind, because a track must not hold
overlapping slices. Flows link each send to its recv, and inside each collective the last member to
arrive to every other member's finish: the arrow points from the rank the others waited for.
Times are microseconds since the earliest merged event. Format: docs/megascan_aggregate.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import orjson

from megascan.aggregate.loading import coords_name
from megascan.aggregate.merged_trace import MergedTrace, OpInstance
from megascan.aggregate.trace_records import OpRecord
from megatron.training.atomic_file import replaced_on_success

_PID = 1  # the run's one process
_FIRST_TID = _PID + 1
_EXTRA_TRACK_WORD = {"compute": "depth", "collectives": "overlap", "p2p": "overlap"}  # "compute (depth 1)"
_INSIDE_US = 0.001  # flow points sit this far inside their slice, so that viewers bind them to it


@dataclass
class _Shared:
    """What many slices share, one object each: op slice names, compute slice args."""
    names: dict = field(default_factory=dict)
    event_args: dict = field(default_factory=dict)


def _bounds(items):
    """(starts, ends) of events or op records as arrays; an op whose end is unknown ends where it starts."""
    starts = np.array([item.start for item in items], dtype=np.float64)
    ends = np.array([item.end for item in items], dtype=np.float64)  # None -> nan
    unknown = np.isnan(ends)
    ends[unknown] = starts[unknown]
    return starts, ends


def _lanes(starts, ends):
    """A lane per slice, no two overlapping in one lane; a slice nested in another goes deeper."""
    order = np.lexsort((-ends, starts))
    if np.all(starts[order[1:]] >= ends[order[:-1]]):  # one after the other (ops, mostly): one lane
        return np.zeros(len(starts), dtype=np.int64)
    lanes, lane_ends = np.zeros(len(starts), dtype=np.int64), []
    for index, start, end in zip(order.tolist(), starts[order].tolist(), ends[order].tolist()):
        for lane, last in enumerate(lane_ends):
            if last <= start:
                lane_ends[lane] = end
                break
        else:
            lane = len(lane_ends)
            lane_ends.append(end)
        lanes[index] = lane
    return lanes


def _end(item):
    return item.start if item.end is None else item.end


def _spans(starts, ends, origin):
    """[(ts, dur)] rounded to nanoseconds such that ts + dur is the rounded end: adjacent slices stay apart."""
    ts = np.round(starts - origin, 3)
    return zip(ts.tolist(), np.round(np.round(ends - origin, 3) - ts, 3).tolist())


def _tracks(family, starts, ends, first_tid, label, names):
    """Thread id per slice of one track family, from ``first_tid`` on; adds the tracks used to ``names``
    (their names start with the rank's ``label``)."""
    lanes = _lanes(starts, ends)
    for lane in np.unique(lanes).tolist():
        track = family if lane == 0 else f"{family} ({_EXTRA_TRACK_WORD[family]} {lane})"
        names[first_tid + lane] = f"{label} {track}"
    return (lanes + first_tid).tolist()


def _thread_names(names):
    for tid, name in sorted(names.items()):
        yield {"ph": "M", "name": "thread_name", "pid": _PID, "tid": tid, "args": {"name": name}}
        yield {"ph": "M", "name": "thread_sort_index", "pid": _PID, "tid": tid, "args": {"sort_index": tid}}


def _op_args(instance, record):
    args = {"instance": instance.id, "group": instance.group, "role": instance.role, "seq": instance.seq,
            "peer": record.peer, "bytes": record.bytes, "dtype": record.dtype, "iteration": record.iteration,
            "microbatch": record.microbatch, "chunk": record.chunk, "phase": record.phase}
    if record.issued_only:
        args["end"] = "unknown: only issued (the window never finished)"
    elif record.end is None:
        args["end"] = "unknown: the rank never waited for it"
    elif record.end > record.start and record.bytes:
        args["bandwidth_GBps"] = round(record.bytes / (record.end - record.start) / 1e3, 3)
    if instance.missing:
        args["missing_ranks"] = instance.missing
    return args


def _op_name(rank, instance, record, names):
    """The slice's name, one string object per distinct name (``names``)."""
    if instance.kind == "p2p":
        key = (record.op, rank == instance.src, record.peer)
        name = names.get(key)
        if name is None:
            name = names[key] = f"{key[0]} {'to' if key[1] else 'from'} {key[2]}"
        return name
    key = (record.op, instance.role)
    name = names.get(key)
    if name is None:
        name = names[key] = f"{key[0]} {key[1]}"
    return name


def _flow_points(starts, ends, origin):
    """Per slice: (point just after its start, point just before its end) where flows bind to it."""
    inset = np.minimum(_INSIDE_US, (ends - starts) / 2)
    return zip(np.round(starts + inset - origin, 3).tolist(), np.round(ends - inset - origin, 3).tolist())


def _op_slices(rank, family, ops, first_tid, label, names, origin, shared, arrows):
    """Slices of one rank's op records [(instance, record)] of one track family, each followed by the ends of
    its flow arrows that bind to it (Arrows)."""
    starts, ends = _bounds([record for _, record in ops])
    tids = _tracks(family, starts, ends, first_tid, label, names)
    slices = []
    for tid, (instance, record), (ts, dur), (after_start, before_end) in zip(
            tids, ops, _spans(starts, ends, origin), _flow_points(starts, ends, origin)):
        slices.append({"ph": "X", "name": _op_name(rank, instance, record, shared.names), "cat": instance.kind,
                       "pid": _PID, "tid": tid, "ts": ts, "dur": dur, "args": _op_args(instance, record)})
        if instance.id in arrows.source:
            slices += arrows.ends(rank, tid, instance, after_start, before_end)
    return slices


def _event_slices(events, first_tid, label, names, origin, shared):
    """Slices of one rank's compute events on their tracks."""
    starts, ends = _bounds(events)
    tids = _tracks("compute", starts, ends, first_tid, label, names)
    for tid, event, (ts, dur) in zip(tids, events, _spans(starts, ends, origin)):
        fields = (event.iteration, event.microbatch, event.chunk, event.layer)
        args = shared.event_args.get(fields)
        if args is None:  # the same for the same layer and microbatch on many ranks
            args = shared.event_args[fields] = dict(zip(("iteration", "microbatch", "chunk", "layer"), fields))
        yield {"ph": "X", "name": event.name, "cat": "compute" if event.cat is None else event.cat, "pid": _PID,
               "tid": tid, "ts": ts, "dur": dur, "args": args}


def _rank_slices(trace, first_tid, records, origin, arrows, shared):
    """The rank's track names and slices, its tracks numbered from ``first_tid``, and the next free thread id."""
    rank, label, names = trace.rank, f"{coords_name(trace.coords)} (rank {trace.rank})", {}
    slices = list(_event_slices(trace.events, first_tid, label, names, origin, shared))
    for family in ("collectives", "p2p"):
        ops = [(instance, record) for instance, record in records if (instance.kind == "p2p") == (family == "p2p")]
        slices += _op_slices(rank, family, ops, max(names, default=first_tid - 1) + 1, label, names, origin, shared,
                             arrows)
    return list(_thread_names(names)) + slices, max(names, default=first_tid - 1) + 1


class Arrows:
    """Flow arrows: send -> recv, and in a collective its last arrival -> every other member. Each end is written
    beside its own slice, so no table of all slices is kept; an arrow's id is its instance and target rank.
    An arrow that would finish before it starts is left out (viewers drop it silently): only contradictory
    traces leave one after causality.py, and the summary counts them."""

    def __init__(self, instances: list[OpInstance], ranks: Iterable[int]):
        self.span = max(ranks, default=0) + 1
        self.source = {}  # instance id -> the rank its arrows start at
        self.backwards = set()  # (instance id, target rank) of arrows left out
        for instance in instances:
            records = instance.records
            if instance.kind == "p2p" and len(records) == 2:
                source = instance.src
            elif instance.kind != "p2p" and len(records) > 1:
                source = max(records, key=lambda rank: records[rank].start)
            else:
                continue
            self.source[instance.id] = source
            start = _inside(records[source], at_end=False)
            for target, record in records.items():  # a loop, not a generator: a million instances at scale
                if target != source and _inside(record, at_end=True) < start:
                    self.backwards.add((instance.id, target))

    def ends(self, rank: int, tid: int, instance: OpInstance, after_start: float, before_end: float) -> list[dict]:
        """The flow events that bind to ``rank``'s slice of ``instance`` on track ``tid``."""
        category = "flow." + instance.kind
        if rank != self.source[instance.id]:
            if (instance.id, rank) in self.backwards:
                return []
            return [{"ph": "f", "bp": "e", "pid": _PID, "tid": tid, "ts": before_end, "name": instance.op,
                     "cat": category, "id": instance.id * self.span + rank}]
        return [{"ph": "s", "pid": _PID, "tid": tid, "ts": after_start, "name": instance.op, "cat": category,
                 "id": instance.id * self.span + target}
                for target in instance.records if target != rank and (instance.id, target) not in self.backwards]


def _inside(record, at_end):
    """Where a flow binds to the record's slice: just after its start or just before its end (as _flow_points)."""
    inset = min(_INSIDE_US, (_end(record) - record.start) / 2)
    return _end(record) - inset if at_end else record.start + inset


def time_origin(merged: MergedTrace) -> float:
    """The earliest start of any merged event or op (global microseconds): the trace's time 0."""
    starts = [e.start for t in merged.ranks.values() for e in t.events]
    starts += [r.start for i in merged.instances for r in i.records.values()]
    return min(starts, default=0.0)


def chrome_trace_events(merged: MergedTrace, origin: float) -> Iterator[list[dict]]:
    """Every trace event, a list at a time: the run's one process, then each rank's tracks and
    slices in layout order, each op slice followed by the ends of its flows."""
    records: dict[int, list[tuple[OpInstance, OpRecord]]] = {rank: [] for rank in merged.ranks}
    for instance in merged.instances:
        for rank, record in instance.records.items():
            records[rank].append((instance, record))
    layout = merged.layout
    yield [{"ph": "M", "name": "process_name", "pid": _PID, "args": {
        "name": f"MegaScan run {merged.run_id} (DP{layout['dp']} x PP{layout['pp']} x TP{layout['tp']})"}}]
    arrows = Arrows(merged.instances, merged.ranks)
    layout_order = sorted(merged.ranks.values(), key=lambda t: (t.coords["dp"], t.coords["pp"], t.coords["tp"]))
    shared, next_tid = _Shared(), _FIRST_TID
    for trace in layout_order:
        events, next_tid = _rank_slices(trace, next_tid, records[trace.rank], origin, arrows, shared)
        yield events


def write_chrome_trace(merged: MergedTrace, path: str) -> None:
    """Writes the merged trace to ``path`` (atomically) as {"traceEvents": [...], "otherData": {...}}.
    Millions of events at thousands of ranks: plain dicts, encoded by orjson a rank's list at a time (a call
    per event took six times as long; JSON text formatted in Python, or the stdlib's encoder, longer still)."""
    origin = time_origin(merged)
    other = {"run_id": merged.run_id, "layout": merged.layout, "reference_rank": merged.reference_rank,
             "time_origin_us": origin, "unaligned": {str(r): why for r, why in merged.unaligned.items()},
             "problems": merged.problems}
    with replaced_on_success(path) as temporary, open(temporary, "wb") as out:
        out.write(b'{"displayTimeUnit":"ms","traceEvents":[')
        separator = b"\n"
        for events in filter(None, chrome_trace_events(merged, origin)):  # a rank may have nothing to show
            out.write(separator + orjson.dumps(events)[1:-1])  # the list's items, without its brackets
            separator = b",\n"
        out.write(b'\n],"otherData":' + orjson.dumps(other) + b"}\n")
