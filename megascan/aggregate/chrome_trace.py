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

import json

from megascan.aggregate.atomic_file import replaced_on_success
from megascan.aggregate.loading import coords_name

_PID = 1  # the run's one process
_FIRST_TID = _PID + 1
_EXTRA_TRACK_WORD = {"compute": "depth", "collectives": "overlap", "p2p": "overlap"}  # "compute (depth 1)"
_INSIDE_US = 0.001  # flow points sit this far inside their slice, so that viewers bind them to it
_encode = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def _lanes(intervals):
    """A lane per (start, end), no two overlapping in one lane; a slice nested in another goes deeper."""
    lanes, lane_ends = [0] * len(intervals), []
    for index in sorted(range(len(intervals)), key=lambda i: (intervals[i][0], -intervals[i][1])):
        start, end = intervals[index]
        lane = next((lane for lane, last in enumerate(lane_ends) if last <= start), len(lane_ends))
        if lane == len(lane_ends):
            lane_ends.append(end)
        lane_ends[lane] = end
        lanes[index] = lane
    return lanes


def _end(item):
    return item["start"] if item["end"] is None else item["end"]


def _span(item, origin):
    """(ts, dur) rounded to nanoseconds such that ts + dur is the rounded end: adjacent slices stay apart."""
    ts = round(item["start"] - origin, 3)
    return ts, round(round(_end(item) - origin, 3) - ts, 3)


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


def _op_slice(rank, tid, instance, record, origin):
    duration = _end(record) - record["start"]
    args = {"instance": instance.id, "group": instance.group, "role": instance.role, "seq": instance.seq,
            "peer": record.get("peer"), "bytes": record.get("bytes"), "dtype": record.get("dtype"),
            "iteration": record.get("iteration"), "microbatch": record.get("microbatch"),
            "chunk": record.get("chunk"), "phase": record.get("phase")}
    if record.get("issued_only"):
        args["end"] = "unknown: only issued (the window never finished)"
    elif record["end"] is None:
        args["end"] = "unknown: the rank never waited for it"
    elif duration > 0 and record.get("bytes"):
        args["bandwidth_GBps"] = round(record["bytes"] / duration / 1e3, 3)
    if instance.missing:
        args["missing_ranks"] = instance.missing
    if instance.kind == "p2p":
        name = f"{record['op']} {'to' if rank == instance.src else 'from'} {record.get('peer')}"
    else:
        name = f"{record['op']} {instance.role}"
    ts, dur = _span(record, origin)
    return {"ph": "X", "name": name, "cat": instance.kind, "pid": _PID, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _event_slice(tid, event, origin):
    ts, dur = _span(event, origin)
    return {"ph": "X", "name": event["name"], "cat": event.get("cat", "compute"), "pid": _PID, "tid": tid,
            "ts": ts, "dur": dur, "args": {key: event.get(key) for key in ("iteration", "microbatch", "chunk", "layer")}}


def _rank_slices(trace, first_tid, records, origin, tid_of):
    """The rank's track names and slices, its tracks numbered from ``first_tid``; records each op's track
    in ``tid_of``. Returns the next free thread id after the generator is exhausted."""
    rank, label, names = trace.rank, f"{coords_name(trace.coords)} (rank {trace.rank})", {}
    tids = _tracks("compute", trace.events, first_tid, label, names)
    slices = [_event_slice(tid, event, origin) for tid, event in zip(tids, trace.events)]
    for family in ("collectives", "p2p"):
        ops = [(instance, record) for instance, record in records if (instance.kind == "p2p") == (family == "p2p")]
        tids = _tracks(family, [record for _, record in ops], max(names, default=first_tid - 1) + 1, label, names)
        for tid, (instance, record) in zip(tids, ops):
            tid_of[rank, instance.id] = tid
            slices.append(_op_slice(rank, tid, instance, record, origin))
    yield from _thread_names(names)
    yield from slices
    return max(names, default=first_tid - 1) + 1


def _inside(record, at_end):
    """A point inside the record's slice: just after its start or just before its end."""
    inset = min(_INSIDE_US, (_end(record) - record["start"]) / 2)
    return record["end"] - inset if at_end and record["end"] is not None else record["start"] + inset


def _flow_pairs(instance):
    """(from rank, to rank) arrows: send -> recv; last arrival -> every other member of a collective."""
    if instance.kind == "p2p":
        return [(instance.src, instance.dst)] if len(instance.records) == 2 else []
    last = max(instance.records, key=lambda rank: instance.records[rank]["start"])
    return [(last, rank) for rank in instance.records if rank != last]


def _flows(instances, origin, tid_of):
    """Flow start/finish pairs; one that would finish before it starts is left out (viewers drop it
    silently): only contradictory traces leave one after causality.py, and the summary counts them."""
    flow_id = 0
    for instance in instances:
        for source, target in _flow_pairs(instance):
            start = round(_inside(instance.records[source], False) - origin, 3)
            finish = round(_inside(instance.records[target], True) - origin, 3)
            if finish < start:
                continue
            flow_id += 1
            common = {"name": instance.op, "cat": f"flow.{instance.kind}", "id": flow_id}
            yield {"ph": "s", "pid": _PID, "tid": tid_of[source, instance.id], "ts": start, **common}
            yield {"ph": "f", "bp": "e", "pid": _PID, "tid": tid_of[target, instance.id], "ts": finish, **common}


def time_origin(merged):
    """The earliest start of any merged event or op (global microseconds): the trace's time 0."""
    starts = [e["start"] for t in merged.ranks.values() for e in t.events]
    starts += [r["start"] for i in merged.instances for r in i.records.values()]
    return min(starts, default=0.0)


def chrome_trace_events(merged, origin):
    """Every trace event, streamed: the run's process, each rank's tracks and slices in layout order,
    then the flows."""
    records = {rank: [] for rank in merged.ranks}
    for instance in merged.instances:
        for rank, record in instance.records.items():
            records[rank].append((instance, record))
    layout = merged.layout
    yield {"ph": "M", "name": "process_name", "pid": _PID, "args": {
        "name": f"MegaScan run {merged.run_id} (DP{layout['dp']} x PP{layout['pp']} x TP{layout['tp']})"}}
    tid_of, next_tid = {}, _FIRST_TID
    layout_order = sorted(merged.ranks.values(), key=lambda t: (t.coords["dp"], t.coords["pp"], t.coords["tp"]))
    for trace in layout_order:
        next_tid = yield from _rank_slices(trace, next_tid, records[trace.rank], origin, tid_of)
    yield from _flows(merged.instances, origin, tid_of)


def write_chrome_trace(merged, path):
    """Writes the merged trace to ``path`` (atomically) as {"traceEvents": [...], "otherData": {...}}."""
    origin = time_origin(merged)
    other = {"run_id": merged.run_id, "layout": merged.layout, "reference_rank": merged.reference_rank,
             "time_origin_us": origin, "unaligned": {str(r): why for r, why in merged.unaligned.items()},
             "problems": merged.problems}
    with replaced_on_success(path) as temporary, open(temporary, "w") as out:
        out.write('{"displayTimeUnit":"ms","traceEvents":[\n')
        separator = ""
        for event in chrome_trace_events(merged, origin):
            out.write(separator + _encode(event))
            separator = ",\n"
        out.write('\n],"otherData":' + _encode(other) + "}\n")
