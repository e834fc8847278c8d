"""Read a directory of MegaScan per-rank trace files (docs/megascan_trace_format.md).

A real directory is rarely perfect: a rank was killed mid-line, a file is missing, files of an older run
were copied in, a rank stopped early. Each of those is said in ``problems`` and the rest is still read,
because the files that are there are exactly the evidence needed to find out what went wrong.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import orjson

from megascan.aggregate.trace_records import ComputeEvent, OpRecord

# The writer's file name (megascan.session.trace_file_name); matched here so that reading traces needs
# neither torch nor megatron.
TRACE_FILE = re.compile(r"^benchmark-data-(\d+)-pipeline-(\d+)-tensor-(\d+)\.json$")
TRACE_FILE_TEMPLATE = "benchmark-data-{dp}-pipeline-{pp}-tensor-{tp}.json"
_METADATA_KEYS = ("run_id", "rank", "world_size", "coords", "layout")
_LINE_KEYS = {"window": ("window", "iterations", "groups", "events", "ops"),
              "issued": ("window", "groups", "ops")}
_OP_KEYS = {"window": ("op", "kind", "group", "seq", "peer", "start_us", "end_us"),
            "issued": ("op", "kind", "group", "seq", "peer", "host_us")}
_OP_KINDS = ("collective", "send", "recv")
_EVENT_KEYS = ("name", "start_us", "end_us")
_LISTED = 8  # name at most this many ranks or files in one problem line
# How tools/aggregate.py's merged timeline begins (chrome_trace.py): its process is named after the run
_MERGED_TIMELINE = re.compile(rb'^\{"displayTimeUnit":"ms","traceEvents":\[\s*\{"ph":"M","name":"process_name",'
                              rb'"pid":1,"args":\{"name":"MegaScan run ([^"]+)"')


class TraceDirectoryError(Exception):
    """The directory holds nothing that can be merged."""


@dataclass
class RankFile:
    """One rank's usable lines, their op records and events compacted (OpRecords, ComputeEvents)."""

    path: str
    metadata: dict
    windows: dict = field(default_factory=dict)  # window number -> its `window` line
    stalled: dict = field(default_factory=dict)  # window number without a `window` line -> issued facts

    @property
    def rank(self) -> int:
        return self.metadata["rank"]

    @property
    def coords(self) -> dict[str, int]:
        return self.metadata["coords"]

    def iterations(self) -> list[int]:
        return sorted(i for line in self.windows.values() for i in line["iterations"])

    def issued_only(self) -> bool:
        """The rank's last window has only `issued` lines: it never finished it."""
        return bool(self.stalled) and max(self.stalled) > max(self.windows, default=-1)

    def ops(self) -> Iterator[OpRecord]:
        """Every op record: those of complete windows (GPU times), then those only issued (host times)."""
        for window in (self.windows, self.stalled):
            for line in window.values():
                yield from line["ops"]


@dataclass
class TraceDirectory:
    run_id: str
    layout: dict
    world_size: int
    files: dict  # rank -> RankFile, one run only
    problems: list
    absent: dict = field(default_factory=dict)  # layout position without a usable trace -> why, e.g. DP0-PP1-TP1


def describe(items: Iterable, noun: str) -> str:
    """'ranks 3, 5' or 'ranks 0, 1, ... and 40 more': short enough for one line at any scale."""
    items = list(items)
    shown = ", ".join(str(item) for item in items[:_LISTED])
    more = f" and {len(items) - _LISTED} more" if len(items) > _LISTED else ""
    return f"{noun}{'' if len(items) == 1 else 's'} {shown}{more}"


def coords_name(coords: dict[str, int]) -> str:
    """DP{d}-PP{p}-TP{t}: a rank's layout position as the trace files and reports name it."""
    return f"DP{coords['dp']}-PP{coords['pp']}-TP{coords['tp']}"


def _parse_line(text):
    try:
        record = orjson.loads(text)  # 2.4 times the stdlib's speed: a thousand ranks' files are ~150 MB
    except ValueError:  # orjson.JSONDecodeError is a ValueError
        return None
    return record if isinstance(record, dict) else None


def _has_axes(value):
    return isinstance(value, dict) and all(isinstance(value.get(axis), int) for axis in ("dp", "pp", "tp"))


def _valid_metadata(record):
    return (record is not None and record.get("type") == "metadata" and record.get("format") == "megascan"
            and record.get("version") == 1 and all(key in record for key in _METADATA_KEYS)
            and _has_axes(record["coords"]) and _has_axes(record["layout"]))


def _add_issued(stalled, line):
    facts = stalled.setdefault(line["window"], {"window": line["window"], "iteration": None, "groups": {}, "ops": []})
    facts["iteration"] = line.get("iteration", facts["iteration"])
    facts["groups"].update(line["groups"])
    facts["ops"].extend(line["ops"])  # each issued line holds only what was issued since the one before


def compacted(line: dict) -> dict:
    """A parsed window or issued line with its op records and events as OpRecords and ComputeEvents, the form
    merging reads (trace_records.py): from the files, or gathered from the ranks during the run."""
    compact = {**line, "ops": [OpRecord(op, line["window"]) for op in line["ops"]]}
    if "events" in line:
        compact["events"] = [ComputeEvent(event) for event in line["events"]]
    return compact


def _event_fields(event):
    """The values of _EVENT_KEYS (None where missing)."""
    return event.get("name"), event.get("start_us"), event.get("end_us")


def _unusable(kind, line):
    """Why a window or issued line cannot be used (a key or record the matching relies on is missing), or None."""
    missing = [key for key in _LINE_KEYS[kind] if key not in line]
    if missing:
        return f"lacks {', '.join(missing)}"
    op_keys = _OP_KEYS[kind]
    required = set(op_keys)  # key checks as set operations: a thousand ranks' files hold a million records
    for op in line["ops"]:
        if (not required <= op.keys() or op["kind"] not in _OP_KINDS
                or (op["kind"] != "collective") == (op["peer"] is None)):
            return f"has an op record without {', '.join(op_keys)} or with an unknown kind/peer: {str(op)[:120]}"
    for event in line.get("events", ()):
        if None in _event_fields(event):
            return f"has an event without {', '.join(_EVENT_KEYS)}: {str(event)[:120]}"
    return None


def _read_rank_file(path, problems):
    """The file's usable lines, or None (said in ``problems``) when it has no valid metadata line."""
    name = os.path.basename(path)
    with open(path, "rb") as handle:
        lines = [(number, text) for number, text in enumerate(handle, 1) if text.strip()]
    metadata = _parse_line(lines[0][1]) if lines else None
    if not _valid_metadata(metadata):
        problems.append(f"{name}: no valid metadata line (empty, cut off or not a MegaScan version 1 trace); "
                        f"file skipped")
        return None
    rank_file = RankFile(path, metadata)
    issued = []
    for number, text in lines[1:]:
        record = _parse_line(text)
        if record is None:
            if number == lines[-1][0]:
                problems.append(f"{name}: last line cut off (the rank stopped while writing it); skipped it, "
                                f"so rank {rank_file.rank} lacks that window")
            else:
                problems.append(f"{name}: line {number} is not valid JSON; skipped it")
            continue
        kind = record.get("type")
        why = _unusable(kind, record) if kind in _LINE_KEYS else f"has unknown type {kind!r}"
        if why:
            problems.append(f"{name}: line {number} {why}; skipped it")
        elif kind == "window":
            rank_file.windows[record["window"]] = record
        else:
            issued.append(record)
    for line in issued:
        if line["window"] not in rank_file.windows:  # a window line supersedes the window's issued lines
            _add_issued(rank_file.stalled, line)
    rank_file.windows = {number: compacted(line) for number, line in rank_file.windows.items()}
    rank_file.stalled = {number: compacted(line) for number, line in rank_file.stalled.items()}
    coords = metadata["coords"]
    named = dict(zip(("dp", "pp", "tp"), map(int, TRACE_FILE.match(name).groups())))
    if named != {axis: coords.get(axis) for axis in named}:
        problems.append(f"{name}: metadata says {coords_name(coords)}; the metadata is used")
    return rank_file


def _keep_one_run(rank_files, problems):
    by_run = {}
    for rank_file in rank_files:
        by_run.setdefault(rank_file.metadata["run_id"], []).append(rank_file)
    # The run with the most files; among equals the latest (run ids start with their start time).
    run_id = max(by_run, key=lambda run: (len(by_run[run]), run))
    for other, files in sorted(by_run.items()):
        if other != run_id:
            names = [os.path.basename(f.path) for f in files]
            problems.append(f"{len(files)} file(s) of another run ({other}) ignored, keeping run {run_id} "
                            f"({len(by_run[run_id])} files): {describe(names, 'file')}")
    return run_id, by_run[run_id]


def _by_rank(rank_files, problems):
    files = {}
    for rank_file in rank_files:
        if rank_file.rank in files:
            problems.append(f"{os.path.basename(rank_file.path)}: rank {rank_file.rank} again (also in "
                            f"{os.path.basename(files[rank_file.rank].path)}); file skipped")
        else:
            files[rank_file.rank] = rank_file
    return dict(sorted(files.items()))


def _why_absent(directory, name, read):
    """Why the layout position of trace file ``name`` has no usable trace."""
    if not os.path.exists(os.path.join(directory, name)):
        return f"{name}: no such file"
    if name not in read:
        return f"{name}: no valid metadata line (empty, cut off or not a MegaScan version 1 trace)"
    return f"{name}: not used (a file of another run, or its metadata names a rank or position read already)"


def _report_missing(directory, layout, world_size, files, read, problems):
    """Says in ``problems`` which layout positions and ranks lack a usable trace; {position: why} of the former."""
    expected = [dict(zip(("dp", "pp", "tp"), c))
                for c in itertools.product(range(layout["dp"]), range(layout["pp"]), range(layout["tp"]))]
    if len(expected) != world_size:
        problems.append(f"metadata world_size {world_size} is not DP{layout['dp']} x PP{layout['pp']} x "
                        f"TP{layout['tp']}; expected ranks taken from world_size")
    present = {tuple(f.coords[axis] for axis in ("dp", "pp", "tp")) for f in files.values()}
    absent = [c for c in expected if (c["dp"], c["pp"], c["tp"]) not in present]
    why = {coords_name(c): _why_absent(directory, TRACE_FILE_TEMPLATE.format(**c), read) for c in absent}
    if absent:
        named = [f"{position} ({reason})" for position, reason in why.items()]
        problems.append(f"no usable trace for {len(absent)} of {len(expected)} layout positions: "
                        f"{describe(named, 'position')}")
    ranks_without = sorted(set(range(world_size)) - set(files))
    if ranks_without:
        problems.append(f"no trace for {describe(ranks_without, 'rank')} of world size {world_size}")
    return why


def _report_unequal_progress(files, problems):
    counts = {rank: f.iterations() for rank, f in files.items()}
    most = max(counts.values(), key=len)
    behind = {}
    for rank, iterations in counts.items():
        if len(iterations) < len(most):
            behind.setdefault(tuple(iterations), []).append(rank)
    for iterations, ranks in behind.items():
        lacking = sorted(set(most) - set(iterations))
        stalled = [rank for rank in ranks if files[rank].issued_only()]
        note = f"; {describe(stalled, 'rank')} only issued ops of the last window (stalled)" if stalled else ""
        problems.append(f"unequal traced iterations: {describe(ranks, 'rank')} have {len(iterations)} "
                        f"({len(files[ranks[0]].windows)} window(s)) where others have {len(most)}; "
                        f"missing {describe(lacking, 'iteration')}{note}")


def _merged_timeline_of(path):
    """The run a merged timeline written by tools/aggregate.py shows ('<run_id> (DP2 x PP2 x TP2)'), or None."""
    try:
        with open(path, "rb") as handle:
            match = _MERGED_TIMELINE.match(handle.read(512))
    except OSError:
        return None
    return match and match.group(1).decode(errors="replace")


def _no_trace_files(directory):
    """Why a directory without rank trace files cannot be merged: one line, naming a merged timeline it holds
    instead (a copy of another run's output is no trace of this one)."""
    merged = [(name, run) for name in sorted(os.listdir(directory)) if name.endswith(".json")
              and (run := _merged_timeline_of(os.path.join(directory, name)))]
    if merged:
        name, run = merged[0]
        return (f"{directory} holds no {TRACE_FILE_TEMPLATE} file, only {name}, the merged timeline of run {run}; "
                f"pass the --trace-dir whose rank traces the run wrote")
    return f"no {TRACE_FILE_TEMPLATE} files in {directory}; pass the --trace-dir of the traced run"


def load_directory(directory: str) -> TraceDirectory:
    """The usable rank files of one run in ``directory``; raises TraceDirectoryError when there are none."""
    if not os.path.isdir(directory):
        raise TraceDirectoryError(f"{directory} is not a directory; pass the --trace-dir of the traced run")
    names = sorted(name for name in os.listdir(directory) if TRACE_FILE.match(name))
    if not names:
        raise TraceDirectoryError(_no_trace_files(directory))
    problems: list[str] = []
    read = [_read_rank_file(os.path.join(directory, name), problems) for name in names]
    read = [rank_file for rank_file in read if rank_file is not None]
    if not read:
        raise TraceDirectoryError(f"none of the {len(names)} trace files in {directory} is usable: {problems[0]}")
    run_id, kept = _keep_one_run(read, problems)
    files = _by_rank(kept, problems)
    first = next(iter(files.values())).metadata
    layout, world_size = first["layout"], first["world_size"]
    absent = _report_missing(directory, layout, world_size, files, {os.path.basename(f.path) for f in read},
                             problems)
    _report_unequal_progress(files, problems)
    return TraceDirectory(run_id, layout, world_size, files, problems, absent)
