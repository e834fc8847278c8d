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

import json
from collections.abc import Iterable, Iterator
from json.encoder import encode_basestring

import numpy as np

from megascan.aggregate.loading import coords_name
from megascan.aggregate.merged_trace import MergedTrace, OpInstance
from megatron.training.atomic_file import replaced_on_success

_PID = 1  # the run's one process
_FIRST_TID = _PID + 1
_EXTRA_TRACK_WORD = {"compute": "depth", "collectives": "overlap", "p2p": "overlap"}  # "compute (depth 1)"
_INSIDE_US = 0.001  # flow points sit this far inside their slice, so that viewers bind them to it
_encode = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
# Slices and flows, a million and more at a thousand ranks, are written as JSON text straight from these
# templates (numbers are finite floats and ints, strings go through the encoder): building a dict per
# event and encoding it took most of the time of writing the trace.
_SLICE = '{{"ph":"X","name":{},"cat":{},"pid":{},"tid":{},"ts":{!r},"dur":{!r},"args":{}}}'
_FLOW_START = '{{"ph":"s","pid":{},"tid":{},"ts":{!r},"name":{},"cat":"flow.{}","id":{}}}'
_OP_FIELDS = ("peer", "bytes", "dtype", "iteration", "microbatch", "chunk", "phase")
_FLOW_END = '{{"ph":"f","bp":"e","pid":{},"tid":{},"ts":{!r},"name":{},"cat":"flow.{}","id":{}}}'


def _lanes(intervals):
    """A lane per (start, end), no two overlapping in one lane; a slice nested in another goes deeper."""
    bounds = np.array(intervals, dtype=np.float64).reshape(-1, 2)
    order = np.lexsort((-bounds[:, 1], bounds[:, 0]))
    if np.all(bounds[order[1:], 0] >= bounds[order[:-1], 1]):  # one after the other (ops, mostly): one lane
        return [0] * len(intervals)
    lanes, lane_ends = [0] * len(intervals), []
    for index in order.tolist():
        start, end = intervals[index]
        lane = next((lane for lane, last in enumerate(lane_ends) if last <= start), len(lane_ends))
        if lane == len(lane_ends):
            lane_ends.append(end)
        lane_ends[lane] = end
        lanes[index] = lane
    return lanes


def _end(item):
    return item["start"] if item["end"] is None else item["end"]


def _spans(items, origin):
    """[(ts, dur)] rounded to nanoseconds such that ts + dur is the rounded end: adjacent slices stay apart."""
    starts = np.array([item["start"] for item in items], dtype=np.float64) - origin
    ends = np.array([_end(item) for item in items], dtype=np.float64) - origin
    ts = np.round(starts, 3)
    return zip(ts.tolist(), np.round(np.round(ends, 3) - ts, 3).tolist())


def _json(value):
    """A JSON value as text: the common kinds directly, the rest through the encoder."""
    if value is None:
        return "null"
    kind = type(value)
    if kind is int:
        return str(value)
    if kind is str:
        return encode_basestring(value)
    return _encode(value)


def _tracks(family, items, first_tid, label, names):
    """Thread id per item (timed dicts) of one track family, from ``first_tid`` on; adds the tracks used
    to ``names`` (their names start with the rank's ``label``)."""
    tids = []
    for lane in _lanes([(item["start"], _end(item)) for item in items]):
        tids.append(first_tid + lane)
        track = family if lane == 0 else f"{family} ({_EXTRA_TRACK_WORD[family]} {lane})"
        names[first_tid + lane] = f"{label} {track}"
    return tids


def _thread_names(names):
    for tid, name in sorted(names.items()):
        yield {"ph": "M", "name": "thread_name", "pid": _PID, "tid": tid, "args": {"name": name}}
        yield {"ph": "M", "name": "thread_sort_index", "pid": _PID, "tid": tid, "args": {"sort_index": tid}}


def _op_args(instance, record, cache):
    """The op slice's args as JSON text; the parts shared by many records are built once."""
    shared = cache.get(instance.id)
    if shared is None:
        shared = cache[instance.id] = (f'{{"instance":{instance.id},"group":{_json(instance.group)},'
                                       f'"role":{_json(instance.role)},"seq":{_json(instance.seq)}')
    fields = (record.get("peer"), record.get("bytes"), record.get("dtype"), record.get("iteration"),
              record.get("microbatch"), record.get("chunk"), record.get("phase"))
    own = cache.get(fields)
    if own is None:
        own = cache[fields] = ",".join(f'"{key}":{_json(value)}' for key, value in zip(_OP_FIELDS, fields))
    extra = ""
    duration = _end(record) - record["start"]
    if record.get("issued_only"):
        extra = ',"end":"unknown: only issued (the window never finished)"'
    elif record["end"] is None:
        extra = ',"end":"unknown: the rank never waited for it"'
    elif duration > 0 and record.get("bytes"):
        extra = f',"bandwidth_GBps":{round(record["bytes"] / duration / 1e3, 3)!r}'
    if instance.missing:
        extra += f',"missing_ranks":{_encode(instance.missing)}'
    return f"{shared},{own}{extra}}}"


def _op_name(rank, instance, record, cache):
    if instance.kind == "p2p":
        key = (record["op"], rank == instance.src, record.get("peer"))
        text = cache.get(key)
        if text is None:
            text = cache[key] = _json(f"{key[0]} {'to' if key[1] else 'from'} {key[2]}")
        return text
    key = (record["op"], instance.role)
    text = cache.get(key)
    if text is None:
        text = cache[key] = _json(f"{key[0]} {key[1]}")
    return text


def _flow_points(records, origin):
    """Per record: (point just after its start, point just before its end) where flows bind to its slice."""
    starts = np.array([record["start"] for record in records], dtype=np.float64)
    ends = np.array([_end(record) for record in records], dtype=np.float64)
    inset = np.minimum(_INSIDE_US, (ends - starts) / 2)
    return zip(np.round(starts + inset - origin, 3).tolist(), np.round(ends - inset - origin, 3).tolist())


def _op_slices(rank, tids, ops, origin, cache, arrows):
    """Slices (JSON text) of one rank's op records [(instance, record)] on their tracks, each followed by the
    ends of its flow arrows that bind to it (Arrows)."""
    records = [record for _, record in ops]
    texts = []
    for tid, (instance, record), (ts, dur), (after_start, before_end) in zip(
            tids, ops, _spans(records, origin), _flow_points(records, origin)):
        texts.append(_SLICE.format(_op_name(rank, instance, record, cache), _json(instance.kind), _PID, tid, ts, dur,
                                   _op_args(instance, record, cache)))
        if instance.id in arrows.source:
            texts += arrows.ends(rank, tid, instance, after_start, before_end)
    return texts


def _event_slices(tids, events, origin, cache):
    """Slices (JSON text) of one rank's compute events on their tracks."""
    for tid, event, (ts, dur) in zip(tids, events, _spans(events, origin)):
        fields = (event["name"], event.get("cat", "compute"), event.get("iteration"), event.get("microbatch"),
                  event.get("chunk"), event.get("layer"))
        text = cache.get(fields)
        if text is None:  # name, cat and args: the same for the same layer and microbatch on many ranks
            text = cache[fields] = (f'{_json(fields[0])},"cat":{_json(fields[1])},"pid":{{}},"tid":{{}},"ts":{{!r}},'
                                    f'"dur":{{!r}},"args":{{{{"iteration":{_json(fields[2])},'
                                    f'"microbatch":{_json(fields[3])},"chunk":{_json(fields[4])},'
                                    f'"layer":{_json(fields[5])}}}}}}}}}')
        yield '{"ph":"X","name":' + text.format(_PID, tid, ts, dur)


def _rank_slices(trace, first_tid, records, origin, arrows, cache):
    """The rank's track names and slices (JSON text), its tracks numbered from ``first_tid``, and the next
    free thread id."""
    rank, label, names = trace.rank, f"{coords_name(trace.coords)} (rank {trace.rank})", {}
    slices = list(_event_slices(_tracks("compute", trace.events, first_tid, label, names), trace.events, origin,
                                cache))
    for family in ("collectives", "p2p"):
        ops = [(instance, record) for instance, record in records if (instance.kind == "p2p") == (family == "p2p")]
        tids = _tracks(family, [record for _, record in ops], max(names, default=first_tid - 1) + 1, label, names)
        slices += _op_slices(rank, tids, ops, origin, cache, arrows)
    return [_encode(event) for event in _thread_names(names)] + slices, max(names, default=first_tid - 1) + 1


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
            if instance.kind == "p2p" and len(instance.records) == 2:
                self.source[instance.id] = instance.src
            elif instance.kind != "p2p" and len(instance.records) > 1:
                self.source[instance.id] = max(instance.records, key=lambda rank: instance.records[rank]["start"])
            else:
                continue
            start = _inside(instance.records[self.source[instance.id]], at_end=False)
            self.backwards.update((instance.id, target) for target, record in instance.records.items()
                                  if target != self.source[instance.id] and _inside(record, at_end=True) < start)

    def ends(self, rank: int, tid: int, instance: OpInstance, after_start: float, before_end: float) -> list[str]:
        """The flow events (JSON text) that bind to ``rank``'s slice of ``instance`` on track ``tid``."""
        name = _json(instance.op)
        if rank != self.source[instance.id]:
            if (instance.id, rank) in self.backwards:
                return []
            return [_FLOW_END.format(_PID, tid, before_end, name, instance.kind, instance.id * self.span + rank)]
        return [_FLOW_START.format(_PID, tid, after_start, name, instance.kind, instance.id * self.span + target)
                for target in instance.records if target != rank and (instance.id, target) not in self.backwards]


def _inside(record, at_end):
    """Where a flow binds to the record's slice: just after its start or just before its end (as _flow_points)."""
    inset = min(_INSIDE_US, (_end(record) - record["start"]) / 2)
    return _end(record) - inset if at_end else record["start"] + inset


def time_origin(merged: MergedTrace) -> float:
    """The earliest start of any merged event or op (global microseconds): the trace's time 0."""
    starts = [e["start"] for t in merged.ranks.values() for e in t.events]
    starts += [r["start"] for i in merged.instances for r in i.records.values()]
    return min(starts, default=0.0)


def chrome_trace_events(merged: MergedTrace, origin: float) -> Iterator[list[str]]:
    """Every trace event as JSON text, a list at a time: the run's one process, then each rank's tracks and
    slices in layout order, each op slice followed by the ends of its flows."""
    records = {rank: [] for rank in merged.ranks}
    for instance in merged.instances:
        for rank, record in instance.records.items():
            records[rank].append((instance, record))
    layout = merged.layout
    yield [_encode({"ph": "M", "name": "process_name", "pid": _PID, "args": {
        "name": f"MegaScan run {merged.run_id} (DP{layout['dp']} x PP{layout['pp']} x TP{layout['tp']})"}})]
    arrows = Arrows(merged.instances, merged.ranks)
    layout_order = sorted(merged.ranks.values(), key=lambda t: (t.coords["dp"], t.coords["pp"], t.coords["tp"]))
    cache, next_tid = {}, _FIRST_TID  # cache: JSON text of args parts that many records share
    for trace in layout_order:
        texts, next_tid = _rank_slices(trace, next_tid, records[trace.rank], origin, arrows, cache)
        yield texts

def write_chrome_trace(merged: MergedTrace, path: str) -> None:
    """Writes the merged trace to ``path`` (atomically) as {"traceEvents": [...], "otherData": {...}}."""
    origin = time_origin(merged)
    other = {"run_id": merged.run_id, "layout": merged.layout, "reference_rank": merged.reference_rank,
             "time_origin_us": origin, "unaligned": {str(r): why for r, why in merged.unaligned.items()},
             "problems": merged.problems}
    with replaced_on_success(path) as temporary, open(temporary, "w") as out:
        out.write('{"displayTimeUnit":"ms","traceEvents":[')
        separator = "\n"
        for events in chrome_trace_events(merged, origin):
            out.write(separator + ",\n".join(events))
            separator = ",\n"
        out.write('\n],"otherData":' + _encode(other) + "}\n")
