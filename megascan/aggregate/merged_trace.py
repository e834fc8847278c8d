"""The merged, clock-aligned trace of a run: what the Chrome trace, the SQLite export and detection
(megascan/detection) read.

All times here are global microseconds: the reference rank's wall clock, to which every other rank's
clock was fitted, then shifted where the fit left a transfer or a collective running backwards
(causality.py). A rank that could not be aligned is listed in ``unaligned`` with the reason and is
absent from ``ranks`` and from every instance's ``records``: its times would be on a clock nobody knows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from megascan.aggregate.alignment import align_ranks
from megascan.aggregate.causality import CausalityCheck, causal_clocks
from megascan.aggregate.loading import TraceDirectory, coords_name, load_directory
from megascan.aggregate.matching import group_table, match_records


@dataclass
class RankTrace:
    rank: int
    coords: dict  # {"dp", "pp", "tp"}
    host: str
    device_index: object  # local CUDA device, None on CPU
    device_name: str
    timer: str  # "cuda_event" or "host_clock"
    path: str
    metadata: dict
    windows: list  # window numbers present (with a window line or only issued lines)
    iterations: list  # traced iterations of its complete windows, sorted
    nvml: list  # [(window, NVML reading)] where one was taken
    clock: object  # RankClock: its wall clock -> global time
    events: list  # ComputeEvents of the file, their start and end in global microseconds
    issued_only: bool  # its last window has only issued lines: it never finished that window


@dataclass(slots=True)  # a million of them at thousands of ranks: no dict each
class OpInstance:
    id: int
    kind: str  # "collective" or "p2p"
    group: str  # process group id
    role: str  # the group's role: tp, pp, dp, ...
    op: str  # process-group method, e.g. "allreduce" (p2p: the send's, else the recv's)
    seq: int
    participants: list  # global ranks expected: the group's ranks, or [src, dst]
    records: dict  # rank -> OpRecord, its start, end and host (its host's issue) in global us (None: unknown)
    missing: list  # merged ranks expected here that never recorded it
    src: object = None  # p2p only
    dst: object = None  # p2p only
    iteration: object = None
    bytes: object = None


@dataclass
class MergedTrace:
    run_id: str
    layout: dict  # the run's metadata layout: dp, pp, tp, vp, ...
    ranks: dict  # rank -> RankTrace, aligned ranks only
    unaligned: dict  # rank -> why it could not be aligned
    instances: list  # OpInstance, ids 0..n-1 in this order
    problems: list  # what was missing, cut off, ignored or not aligned, one line each
    reference_rank: int | None = None  # whose clock is global time
    absent: dict = field(default_factory=dict)  # layout position (DP0-PP1-TP1) without a usable trace -> why
    causality: CausalityCheck = field(default_factory=CausalityCheck)  # what ran backwards after the fit

    @cached_property
    def _ranks_by_coords(self):
        return {(t.coords["dp"], t.coords["pp"], t.coords["tp"]): t for t in self.ranks.values()}

    def rank_at(self, dp: int, pp: int, tp: int) -> RankTrace | None:
        """The RankTrace at layout position (dp, pp, tp), None if it is not merged."""
        return self._ranks_by_coords.get((dp, pp, tp))


def _global(clock, times, window):
    """Local microseconds of one window (None: unknown) -> global microseconds (None kept), all at once."""
    local = np.array([np.nan if t is None else t for t in times], dtype=np.float64)
    return [None if math.isnan(t) else t for t in clock.to_global(local, window).tolist()]


def _add_global_times(rank_file, clock):
    """Sets the global times of the rank's events and op records (records are shared with instances)."""
    events = []
    for window, line in rank_file.windows.items():
        timed = line["events"] + line["ops"]
        for item, start, end in zip(timed, _global(clock, [i.start_us for i in timed], window),
                                    _global(clock, [i.end_us for i in timed], window)):
            item.start, item.end = start, end
        # When the host issued each op (on the same host clock the window's times were placed on): None
        # in traces that predate the field.
        for op, host in zip(line["ops"], _global(clock, [op.host_us for op in line["ops"]], window)):
            op.host = host
        events += line["events"]
    for window, line in rank_file.stalled.items():
        for op, start in zip(line["ops"], _global(clock, [op.host_us for op in line["ops"]], window)):
            op.start, op.end, op.issued_only = start, None, True
    return events


def _rank_trace(rank_file, clock):
    metadata = rank_file.metadata
    return RankTrace(
        rank=rank_file.rank, coords=metadata["coords"], host=metadata.get("host"),
        device_index=metadata.get("device_index"), device_name=metadata.get("device_name"),
        timer=metadata.get("timer"), path=rank_file.path, metadata=metadata,
        windows=sorted(set(rank_file.windows) | set(rank_file.stalled)), iterations=rank_file.iterations(),
        nvml=[(w, line["nvml"]) for w, line in sorted(rank_file.windows.items()) if line.get("nvml")],
        clock=clock, events=_add_global_times(rank_file, clock), issued_only=rank_file.issued_only())


def _instance(index, key, records, groups, loaded):
    kind, group_id, seq = key[:3]
    group = groups.get(group_id, {})
    if kind == "p2p":
        src, dst = key[3:]
        participants = [src, dst]
        first = records.get(src) or records[dst]
    else:
        src = dst = None
        participants = group.get("ranks") or sorted(records)
        first = next(iter(records.values()))
    return OpInstance(id=index, kind=kind, group=group_id, role=group.get("role"), op=first.op, seq=seq,
                      participants=participants, records=records,
                      missing=[r for r in participants if r in loaded and r not in records],
                      src=src, dst=dst, iteration=first.iteration, bytes=first.bytes)


def _keep_aligned(instances, aligned):
    """Instances restricted to aligned ranks (dropped when none is left), renumbered 0..n-1."""
    kept = []
    for instance in instances:
        instance.records = {rank: record for rank, record in instance.records.items() if rank in aligned}
        if instance.records:
            instance.missing = [rank for rank in instance.missing if rank in aligned]
            instance.id = len(kept)
            kept.append(instance)
    return kept


def load_and_merge(directory: str) -> MergedTrace:
    """Read every per-rank trace file in ``directory``, match ops, align clocks: the MergedTrace.
    Raises loading.TraceDirectoryError when the directory holds nothing usable."""
    return merge(load_directory(directory))


def merge(loaded: TraceDirectory) -> MergedTrace:
    """The MergedTrace of a loading.TraceDirectory: read from files, or gathered from the ranks during the run
    (online detection)."""
    files, problems = loaded.files, list(loaded.problems)
    groups = group_table(files)
    instances = [_instance(index, key, records, groups, files)
                 for index, (key, records) in enumerate(match_records(files, problems).items())]
    alignment = align_ranks(instances, list(files), problems,
                            {rank: (f.metadata.get("host"), f.metadata.get("timer")) for rank, f in files.items()})
    for rank, reason in alignment.unaligned.items():
        problems.append(f"rank {rank} ({coords_name(files[rank].coords)}) not aligned, so not merged into "
                        f"the timeline: {reason}")
    ranks = {rank: _rank_trace(files[rank], clock) for rank, clock in sorted(alignment.clocks.items())}

    def retime(rank, clock):
        ranks[rank] = _rank_trace(files[rank], clock)
    _, causality = causal_clocks(instances, alignment.clocks, alignment.reference_rank, retime)
    return MergedTrace(run_id=loaded.run_id, layout=loaded.layout, ranks=ranks, unaligned=alignment.unaligned,
                       instances=_keep_aligned(instances, ranks) if alignment.unaligned else instances,
                       problems=problems,
                       reference_rank=alignment.reference_rank, absent=loaded.absent, causality=causality)
