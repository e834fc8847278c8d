"""PyTorch's flight-recorder dumps as a second witness of a hang: the last collective each rank entered and
completed, per process group, matched by sequence number across ranks.

Each process group numbers its collectives (and, apart, its point-to-point operations) in the order its
members enter them, the same numbers on every member. So in a hang the members of a stalled group split
in two: those that entered the group's latest number and wait in it (blocked), and those that never
entered it (behind). A rank behind that waits in nothing itself is hung; so is a rank that left no dump
while others are blocked (a stopped or dead process writes none). Point-to-point numbers are only used to
say what a rank waits in: the two sides of a pipeline exchange need not count alike.

Dumps are read from the trace directory (``flight-recorder-<rank>.pkl``, written by MegaScan when a window
stalls) and from NCCL's own dumps on timeout (``<prefix><rank>``, ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``);
of two for one rank the newer counts. They are pickles: read with an unpickler that builds plain data
only (no class is ever looked up, so a crafted file cannot run code). Environment: docs/megascan_aggregate.md.
"""

from __future__ import annotations

import glob
import io
import json
import os
import pickle
import re
from dataclasses import asdict, dataclass, field

OWN_DUMP = re.compile(r"^flight-recorder-(\d+)\.pkl$")
NCCL_DUMP_PREFIX = "nccl_trace_rank_"  # PyTorch's default TORCH_NCCL_DEBUG_INFO_TEMP_FILE is /tmp/nccl_trace_rank_
COMPLETED = "completed"


class FlightRecorderError(Exception):
    """A dump that cannot be read; the message names the file and what is wrong."""


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which no flight-recorder dump holds")


def load_dump(path: str) -> dict:
    """One dump (pickle, or the JSON of ``_dump_nccl_trace_json``) as plain data; FlightRecorderError if unreadable."""
    try:
        with open(path, "rb") as source:
            data = source.read()
    except OSError as error:
        raise FlightRecorderError(f"{path}: cannot read it ({error.strerror or error})") from None
    try:
        dump = json.loads(data) if data[:1] == b"{" else _PlainDataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, IndexError) as error:
        raise FlightRecorderError(f"{path}: not a PyTorch flight-recorder dump ({error})") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list):
        raise FlightRecorderError(f"{path}: not a PyTorch flight-recorder dump (no list of entries)")
    return dump


def find_dumps(directory: str, nccl_prefix: str | None = None) -> dict[int, str]:
    """rank -> the newest dump of that rank: MegaScan's in ``directory``, and NCCL's ``<prefix><rank>`` files
    (``nccl_prefix`` a path prefix; by default PyTorch's file name prefix inside ``directory``)."""
    candidates: dict[int, list[str]] = {}
    for name in os.listdir(directory):
        match = OWN_DUMP.match(name)
        if match:
            candidates.setdefault(int(match.group(1)), []).append(os.path.join(directory, name))
    prefix = nccl_prefix or os.path.join(directory, NCCL_DUMP_PREFIX)
    for path in glob.glob(glob.escape(prefix) + "*"):
        suffix = path[len(prefix):]
        if suffix.isdigit():
            candidates.setdefault(int(suffix), []).append(path)
    return {rank: max(paths, key=os.path.getmtime) for rank, paths in sorted(candidates.items())}


@dataclass
class Progress:
    """How far one rank got in one process group's collectives (or point-to-point operations)."""

    entered: int  # the highest sequence number it entered (0: none in its buffer)
    entered_op: str
    completed: int | None  # the highest it saw complete (None: this backend does not record completion)


def _is_p2p(entry):
    """Point-to-point; coalesced pipeline exchanges carry only a p2p number even where is_p2p says False."""
    return bool(entry.get("is_p2p")) or (not entry.get("collective_seq_id") and (entry.get("p2p_seq_id") or 0) > 0)


def rank_progress(dump: dict, records_completion: bool) -> dict[tuple[str, str], Progress]:
    """(group name, "collective" or "p2p") -> Progress, from one dump's entries; ``records_completion``:
    whether the job's backend records completion (else Progress.completed stays None)."""
    progress: dict[tuple[str, str], Progress] = {}
    for entry in dump["entries"]:
        p2p = _is_p2p(entry)
        seq = entry.get("p2p_seq_id" if p2p else "collective_seq_id", 0) or 0
        key = (str(entry.get("process_group", ("?",))[0]), "p2p" if p2p else "collective")
        known = progress.setdefault(key, Progress(0, "", 0 if records_completion else None))
        if seq > known.entered:
            known.entered, known.entered_op = seq, str(entry.get("profiling_name", "?"))
        if entry.get("state") == COMPLETED and seq > (known.completed or 0):
            known.completed = seq
    return progress


def _group_members(dumps, world_size):
    """group name -> its ranks: from the dumps' process-group configuration where it lists them; the default
    group holds every rank; any other group, at least the ranks whose buffers hold its operations."""
    members = {}
    for dump in dumps.values():
        for name, config in (dump.get("pg_config") or {}).items():
            try:
                ranks = json.loads(config.get("ranks", "[]")) if isinstance(config, dict) else []
            except ValueError:
                ranks = []
            if ranks:
                members[str(name)] = sorted(int(rank) for rank in ranks)
            elif isinstance(config, dict) and config.get("desc") == "default_pg":
                members[str(name)] = list(range(world_size))
    for rank, dump in dumps.items():
        for entry in dump["entries"]:
            name = str(entry.get("process_group", ("?",))[0])
            if name == "0" and name not in members:  # PyTorch numbers the default group 0
                members[name] = list(range(world_size))
            if rank not in members.setdefault(name, [rank]):
                members[name] = sorted({*members[name], rank})
    return members


@dataclass
class LastEntered:
    group: str
    kind: str
    seq: int
    operation: str
    state: str


def last_entered(dump: dict) -> LastEntered | None:
    """The operation a rank entered last (its newest entry), in any group."""
    if not dump["entries"]:
        return None
    entry = max(dump["entries"], key=lambda e: (e.get("time_created_ns") or 0, e.get("record_id") or 0))
    p2p = _is_p2p(entry)
    return LastEntered(str(entry.get("process_group", ("?",))[0]), "p2p" if p2p else "collective",
                       entry.get("p2p_seq_id" if p2p else "collective_seq_id", 0) or 0,
                       str(entry.get("profiling_name", "?")), str(entry.get("state", "?")))


@dataclass
class StalledGroup:
    group: str
    kind: str  # "collective" or "p2p"
    members: list
    frontier: int  # the highest sequence number any member entered
    operation: str  # its name
    waiting: list  # members that entered it and did not see it complete
    completed: dict  # waiting member -> the highest number it saw complete
    behind: dict  # member -> the highest number it entered (None: no dump); collective groups only


@dataclass
class FlightRecorderWitness:
    dumps: dict  # rank -> path
    without_dump: list
    records_completion: bool  # NCCL's dumps say what completed; gloo's do not
    last: dict = field(default_factory=dict)  # rank -> LastEntered
    stalled: list = field(default_factory=list)
    hung: list = field(default_factory=list)
    blocked: list = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    def to_text(self, traced_hung: list | None = None) -> str:
        lines = [f"NCCL flight recorder (second witness): dumps of {len(self.dumps)} rank(s)"
                 + (f"; none from rank(s) {self.without_dump}" if self.without_dump else "")]
        lines += [f"   rank {rank} entered last: group {e.group} {e.kind} #{e.seq} ({e.operation}, {e.state})"
                  for rank, e in sorted(self.last.items())]
        if not self.records_completion:
            lines.append(f"   this backend records no completion, so who waits cannot be told from its dumps; "
                         f"hung (left no dump): {self.hung or 'none'}")
        elif not self.stalled:
            lines.append("   no process group is stalled in them (every member reached each group's latest operation)")
        for group in self.stalled:
            head = (f"   group {group.group} {group.kind} #{group.frontier} ({group.operation}, members "
                    f"{group.members}): entered and not completed by " + ", ".join(
                        f"{rank} (completed up to #{group.completed[rank]})" for rank in group.waiting))
            if group.behind:
                head += "; not entered by " + ", ".join(
                    f"{rank} (no dump)" if seq is None else f"{rank} (last entered #{seq})"
                    for rank, seq in sorted(group.behind.items()))
            lines.append(head)
        if self.stalled:
            lines.append(f"   hung: {self.hung or 'none named'}; blocked: {self.blocked}")
        if traced_hung is not None:
            verdict = "agrees with" if sorted(traced_hung) == self.hung else "differs from"
            lines.append(f"   this {verdict} the traces (hung there: {sorted(traced_hung) or 'none'})")
        return "\n".join(lines)


def witness(paths: dict[int, str], world_size: int = 0) -> FlightRecorderWitness:
    """Read the dumps (rank -> path) of one job and say which process groups stalled, who is hung, who blocked."""
    dumps = {rank: load_dump(path) for rank, path in paths.items()}
    world_size = max([world_size, *(rank + 1 for rank in dumps)])
    records_completion = any(entry.get("state") in ("started", COMPLETED)
                             for dump in dumps.values() for entry in dump["entries"])
    result = FlightRecorderWitness(dict(paths), [rank for rank in range(world_size) if rank not in dumps],
                                   records_completion)
    result.last = {rank: entry for rank, dump in dumps.items() if (entry := last_entered(dump))}
    if not records_completion:
        result.hung = list(result.without_dump) if dumps else []
        return result
    members = _group_members(dumps, world_size)
    progress = {rank: rank_progress(dump, records_completion) for rank, dump in dumps.items()}
    for name, kind in sorted({key for table in progress.values() for key in table}):
        stalled = _stalled_group(name, kind, members.get(name, []), progress)
        if stalled:
            result.stalled.append(stalled)
    result.blocked = sorted({rank for group in result.stalled for rank in group.waiting})
    behind = {rank for group in result.stalled for rank in group.behind}
    if result.stalled:
        behind |= set(result.without_dump)
    result.hung = sorted(behind - set(result.blocked))
    return result


def _stalled_group(name, kind, members, progress):
    """The StalledGroup of one group's operations of one kind, or None where none of its members waits."""
    reached = {rank: progress[rank][(name, kind)] for rank in members
               if rank in progress and (name, kind) in progress[rank]}
    if not reached:
        return None
    frontier = max(p.entered for p in reached.values())
    operation = next(p.entered_op for p in reached.values() if p.entered == frontier)
    waiting = [rank for rank, p in reached.items() if p.entered == frontier and (p.completed or 0) < frontier]
    if not waiting:
        return None
    behind = {}
    if kind == "collective":
        behind = {rank: p.entered for rank, p in reached.items() if p.entered < frontier}
        behind.update({rank: None for rank in members if rank not in progress})
    return StalledGroup(name, kind, members, frontier, operation, waiting,
                        {rank: reached[rank].completed or 0 for rank in waiting}, behind)
