"""Put every rank on the reference rank's clock with ClockAligner (megascan/clock_alignment.py).

The times in the files are already each rank's wall clock, placed there by an anchor per trace window;
the refinement fits each rank's offset in each window, and its drift where it shows, to the finishes of
the collective instances that every member finished (a collective ends together on all its members):
all of them, so the residuals reported are those of every finish, not of a sample. Point-to-point
transfers are not used: a send may finish long before its recv. Ranks with a host timer on the
reference's host read the very same clock: they are not fitted. A rank with a host timer that shares
no collective with the aligned ranks (MegaFBD's forward instances at TP1 take part in none) is still
on the reference's clock when it runs on the reference's host: the reference's times are that host's
wall clock (CUDA events anchored to it, within their anchor uncertainty).

The fit is only as good as the finishes are simultaneous. Where they scatter by far more than the
clocks can drift (gloo on an oversubscribed CPU host: members return from one collective up to
milliseconds apart), fitted rates would turn noise into thousands of ppm of "drift" and shift a rank's
times by milliseconds; then the wall clocks, which are never that wrong, are used as they are.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING

from megascan.clock_alignment import Alignment, ClockAligner, RankClock

if TYPE_CHECKING:  # merged_trace imports this module
    from megascan.aggregate.merged_trace import OpInstance

MAX_DRIFT_PPM = 200.0  # beyond any quartz oscillator's error, let alone an NTP-disciplined clock's


def _finished_by_all(instance):
    return (instance.kind == "collective" and not instance.missing and len(instance.records) >= 2
            and all(record.end_us is not None for record in instance.records.values()))


def _alignment_input(instances):
    """({instance id: {rank: local finish}}, {instance id: trace window}) of the instances finished by all."""
    finished = [instance for instance in instances if _finished_by_all(instance)]
    return ({instance.id: {rank: record.end_us for rank, record in instance.records.items()}
             for instance in finished},
            {instance.id: next(iter(instance.records.values())).window for instance in finished})


def _reference_rank(ranks, finishes):
    """The lowest rank of the largest set of ranks linked by shared collectives: the reference."""
    parent = {rank: rank for rank in ranks}

    def root(rank):
        while parent[rank] != rank:
            parent[rank] = parent[parent[rank]]
            rank = parent[rank]
        return rank

    for ends in finishes.values():
        first, *others = ends
        for other in others:
            parent[root(other)] = root(first)
    members = {}
    for rank in ranks:
        members.setdefault(root(rank), []).append(rank)
    return min(max(members.values(), key=lambda group: (len(group), -min(group))))


def _wall_clocks(ranks, finishes):
    """Each rank's own wall clock as its global clock, with its residual against the members' median finish."""
    misfits = {rank: [] for rank in ranks}
    for ends in finishes.values():
        consensus = statistics.median(ends.values())
        for rank, finish in ends.items():
            misfits[rank].append(abs(finish - consensus))
    return {rank: RankClock(1.0, 0.0, statistics.median(misfits[rank]) if misfits[rank] else math.nan,
                            len(misfits[rank])) for rank in ranks}


def _sharing_reference_clock(reference, clock_sources):
    """Ranks that read the reference's own clock: a host timer on the reference's host."""
    host, timer = (clock_sources or {}).get(reference, (None, None))
    if timer != "host_clock":
        return set()
    return {rank for rank, source in clock_sources.items() if source == (host, timer)}


def _on_reference_wall_clock(reference, clock_sources):
    """Ranks with a host timer on the reference's host: they read the wall clock the reference's times are on."""
    host = (clock_sources or {}).get(reference, (None, None))[0]
    return {rank for rank, source in (clock_sources or {}).items() if source == (host, "host_clock")}


def align_ranks(instances: list[OpInstance], ranks: list[int], problems: list[str],
                clock_sources: dict[int, tuple[str | None, str | None]] | None = None) -> Alignment:
    """Alignment of ``ranks`` (clocks map a rank's wall-clock microseconds to the reference rank's);
    ``clock_sources``: {rank: (host, timer)}. Says in ``problems`` when the refinement was rejected."""
    finishes, windows = _alignment_input(instances)
    if not finishes and len(ranks) > 1:
        problems.append("no collective was finished by all its members (did the run stop in its first trace "
                        "window?): wall clocks used as they are, exact on one host, not across hosts")
        return Alignment(min(ranks), _wall_clocks(ranks, finishes), {})
    reference = _reference_rank(ranks, finishes)
    # Fit on times relative to the earliest finish: drift multiplies time, and microseconds since 1970
    # would make a ppm of drift look like hours of offset.
    base = min((t for ends in finishes.values() for t in ends.values()), default=0.0)
    relative = {key: {rank: t - base for rank, t in ends.items()} for key, ends in finishes.items()}
    fitted = ClockAligner(reference_rank=reference).align(
        relative, {rank: 0.0 for rank in ranks}, windows, _sharing_reference_clock(reference, clock_sources))
    # local - base = rate * (global - base) + offset  <=>  local = rate * global + offset + base * (1 - rate)
    clocks = {rank: RankClock(c.rate, c.offset_us + base * (1.0 - c.rate), c.residual_us, c.collectives,
                              c.window_offsets_us) for rank, c in fitted.clocks.items()}
    implausible = {rank: c for rank, c in clocks.items() if abs(c.drift_ppm) > MAX_DRIFT_PPM}
    if implausible:
        worst = max(implausible, key=lambda rank: abs(implausible[rank].drift_ppm))
        problems.append(f"clock refinement rejected, wall clocks used as they are: it gave rank {worst} a drift "
                        f"of {clocks[worst].drift_ppm:.0f} ppm (no real clock drifts over {MAX_DRIFT_PPM:.0f}); "
                        f"collective finishes scatter too much ({clocks[worst].residual_us:.0f} us) to measure drift")
        clocks = _wall_clocks(list(clocks), finishes)
    unaligned = dict(fitted.unaligned)
    for rank in sorted(_on_reference_wall_clock(reference, clock_sources) & set(unaligned)):
        clocks[rank] = RankClock(1.0, 0.0, math.nan, 0)
        del unaligned[rank]
    return Alignment(reference, clocks, unaligned)
