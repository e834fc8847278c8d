"""A part of the merged trace, for a timeline that stays usable at scale (``--ranks``, ``--iterations``).

A thousand ranks' full timeline is a few hundred megabytes of JSON, which Perfetto loads slowly and
chrome://tracing not at all; the ranks and iterations being looked at usually fit in a few percent of
it. The part keeps every instance's id, so its slices name the same instances as the full trace, the
SQLite export and the detection report. Arrows are drawn among the ranks kept (a collective's from the
last of them to arrive).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from megascan.aggregate.loading import describe
from megascan.aggregate.merged_trace import MergedTrace, OpInstance
from megascan.aggregate.trace_records import ComputeEvent, OpRecord

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_SPANS_LISTED = 8  # name at most this many spans of numbers in one line


class SubsetError(ValueError):
    """A --ranks or --iterations value that cannot be used: ``flag`` and a one-line reason."""

    def __init__(self, flag: str, reason: str):
        super().__init__(reason)
        self.flag = flag


def parse_numbers(text: str, flag: str) -> set[int]:
    """'0-7,12' -> {0, ..., 7, 12}; raises SubsetError for ``flag`` on anything else."""
    numbers: set[int] = set()
    for part in text.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise SubsetError(flag, f"'{text}' is not a list of numbers and ranges like 0-7,12")
        low, high = int(match.group(1)), int(match.group(2) or match.group(1))
        if high < low:
            raise SubsetError(flag, f"'{text}': range {low}-{high} runs backwards")
        numbers.update(range(low, high + 1))
    return numbers


def spans_text(numbers: list[int]) -> str:
    """Sorted numbers in the flags' own syntax, e.g. [0, 1, 2, 7] -> '0-2,7'; the first few spans and how many more."""
    spans: list[list[int]] = []  # [low, high] each
    for number in numbers:
        if spans and number == spans[-1][1] + 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    shown = ",".join(str(low) if low == high else f"{low}-{high}" for low, high in spans[:_SPANS_LISTED])
    return shown + (f" and {len(spans) - _SPANS_LISTED} more spans" if len(spans) > _SPANS_LISTED else "")


def traced_iterations(merged: MergedTrace) -> set[int]:
    return {i for trace in merged.ranks.values() for i in trace.iterations}


def left_out(merged: MergedTrace, ranks: set[int] | None, iterations: set[int] | None) -> list[str]:
    """One line per flag for what --ranks and --iterations asked for that the merged trace does not hold, which the
    Chrome trace therefore leaves out (none where it holds all of it)."""
    lines = []
    if ranks is not None and (missing := sorted(ranks - set(merged.ranks))):
        lines.append(f"--ranks: not in the merged trace, so left out of the Chrome trace: {spans_text(missing)} "
                     f"(merged: {spans_text(sorted(merged.ranks))})")
    traced = traced_iterations(merged)
    if iterations is not None and (missing := sorted(iterations - traced)):
        lines.append(f"--iterations: not traced, so left out of the Chrome trace: {spans_text(missing)} "
                     f"(traced: {spans_text(sorted(traced))})")
    return lines


def _kept(item, ranks, iterations, rank):
    return rank in ranks and (iterations is None or item.iteration in iterations)


def restricted(merged: MergedTrace, keep: Callable[[ComputeEvent | OpRecord, int], bool],
               renumber: bool = False) -> MergedTrace:
    """The MergedTrace with only the events and op records for which ``keep(item, rank)`` holds (ranks left with
    nothing stay, without events); instances left without records dropped. ``renumber``: instance ids 0..n-1, as
    detection indexes them, rather than the whole trace's."""
    traces = {rank: dataclasses.replace(trace, events=[e for e in trace.events if keep(e, rank)])
              for rank, trace in merged.ranks.items()}
    instances: list[OpInstance] = []
    for instance in merged.instances:
        records = {rank: record for rank, record in instance.records.items() if keep(record, rank)}
        if records:
            changed = {"id": len(instances)} if renumber else {}
            instances.append(dataclasses.replace(instance, records=records, **changed))
    return dataclasses.replace(merged, ranks=traces, instances=instances)


def trace_subset(merged: MergedTrace, ranks: set[int] | None = None,
                 iterations: set[int] | None = None) -> MergedTrace:
    """The MergedTrace restricted to ``ranks`` and ``iterations`` (None: all); SubsetError if that leaves nothing."""
    if ranks is not None and not ranks & set(merged.ranks):
        raise SubsetError("--ranks", f"none of them is in the merged trace ({describe(sorted(merged.ranks), 'rank')})")
    ranks = set(merged.ranks) if ranks is None else ranks & set(merged.ranks)
    known = traced_iterations(merged)
    if iterations is not None and not iterations & known:
        raise SubsetError("--iterations", f"none of them was traced ({describe(sorted(known), 'iteration')} were)")
    part = restricted(merged, lambda item, rank: _kept(item, ranks, iterations, rank))
    return dataclasses.replace(part, ranks={rank: trace for rank, trace in part.ranks.items() if rank in ranks})
