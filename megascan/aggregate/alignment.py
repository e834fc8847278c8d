"""Put every rank on the reference rank's clock with ClockAligner (megascan/clock_alignment.py).

The times in the files are already each rank's wall clock; the refinement fits each rank's offset
and drift to the finishes of collective instances that every member finished (a collective ends
together on all its members). Point-to-point transfers are not used: a send may finish long before
its recv.

ClockAligner's alternating fit converges slowly from far away: on layouts of two-member groups
(TP2, embedding pairs) it needs hundreds of iterations from wall clocks 1 ms apart, and each costs a
median per instance. So it starts from a first guess taken from the trace itself: offsets propagated
outward from the reference, rank by rank, as the median gap to finishes of already placed members
(good to a few microseconds of jitter per hop, whatever the wall clocks said).

The fit is only as good as the finishes are simultaneous. Where they scatter by far more than the
clocks can drift (gloo on an oversubscribed CPU host: members return from one collective up to
milliseconds apart), the fitted rates turn noise into thousands of ppm of "drift" and would shift
a rank's times by milliseconds; then the wall clocks, which are never that wrong, are used as they are.
"""

import math
import statistics

from megascan.clock_alignment import Alignment, ClockAligner, RankClock

# Finishes used per process group, evenly spread over its instances: a rank gets about twenty over the
# whole trace, plenty for two numbers (offset, drift) against microseconds of jitter. ClockAligner's
# time grows with the instances it is given (a median each, per iteration) and with ranks x instances;
# all of them (42,000 for 1024 ranks in bench/aggregate_scale.py) would take several times as long.
FINISHES_PER_GROUP = 8
MAX_DRIFT_PPM = 200.0  # beyond any quartz oscillator's error, let alone an NTP-disciplined clock's


def _finished_by_all(instance):
    return (instance.kind == "collective" and not instance.missing and len(instance.records) >= 2
            and all(record.get("end_us") is not None for record in instance.records.values()))


def _spread(items, count):
    if len(items) <= count:
        return items
    step = (len(items) - 1) / (count - 1)
    return [items[round(i * step)] for i in range(count)]


def _alignment_input(instances):
    """{instance id: {rank: local finish}}, at most FINISHES_PER_GROUP instances of each group."""
    by_group = {}
    for instance in instances:
        if _finished_by_all(instance):
            by_group.setdefault(instance.group, []).append(instance)
    return {instance.id: {rank: record["end_us"] for rank, record in instance.records.items()}
            for members in by_group.values() for instance in _spread(members, FINISHES_PER_GROUP)}


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


def _first_guess(reference, finishes):
    """{rank: offset from the reference's clock} for the ranks linked to it; see the module docstring."""
    instances_of = {}
    for key, ends in finishes.items():
        for rank in ends:
            instances_of.setdefault(rank, []).append(key)
    offsets, placed_last = {reference: 0.0}, [reference]
    while placed_last:
        gaps = {}
        for key in sorted({key for rank in placed_last for key in instances_of.get(rank, ())}):
            ends = finishes[key]
            finish = statistics.median(t - offsets[rank] for rank, t in ends.items() if rank in offsets)
            for rank, t in ends.items():
                if rank not in offsets:
                    gaps.setdefault(rank, []).append(t - finish)
        offsets.update((rank, statistics.median(rank_gaps)) for rank, rank_gaps in gaps.items())
        placed_last = list(gaps)
    return offsets


def _wall_clocks(ranks, finishes):
    """Each rank's own wall clock as its global clock, with its residual against the members' median finish."""
    misfits = {rank: [] for rank in ranks}
    for ends in finishes.values():
        consensus = statistics.median(ends.values())
        for rank, finish in ends.items():
            misfits[rank].append(abs(finish - consensus))
    return {rank: RankClock(1.0, 0.0, statistics.median(misfits[rank]) if misfits[rank] else math.nan,
                            len(misfits[rank])) for rank in ranks}


def align_ranks(instances, ranks, problems):
    """Alignment of ``ranks`` (clocks map a rank's wall-clock microseconds to the reference rank's);
    says in ``problems`` when the refinement was rejected."""
    finishes = _alignment_input(instances)
    if not finishes and len(ranks) > 1:
        problems.append("no collective was finished by all its members (did the run stop in its first trace "
                        "window?): wall clocks used as they are, exact on one host, not across hosts")
        return Alignment(min(ranks), _wall_clocks(ranks, finishes), {})
    reference = _reference_rank(ranks, finishes)
    # Fit on times relative to the earliest finish: drift multiplies time, and microseconds since 1970
    # would make a ppm of drift look like hours of offset to the fit's convergence test.
    base = min((t for ends in finishes.values() for t in ends.values()), default=0.0)
    relative = {key: {rank: t - base for rank, t in ends.items()} for key, ends in finishes.items()}
    first_guess = _first_guess(reference, relative)
    fitted = ClockAligner(reference_rank=reference).align(relative, {rank: first_guess.get(rank, 0.0) for rank in ranks})
    # local - base = rate * (global - base) + offset  <=>  local = rate * global + offset + base * (1 - rate)
    clocks = {rank: RankClock(c.rate, c.offset_us + base * (1.0 - c.rate), c.residual_us, c.collectives)
              for rank, c in fitted.clocks.items()}
    implausible = {rank: c for rank, c in clocks.items() if abs(c.drift_ppm) > MAX_DRIFT_PPM}
    if implausible:
        worst = max(implausible, key=lambda rank: abs(implausible[rank].drift_ppm))
        problems.append(f"clock refinement rejected, wall clocks used as they are: it gave rank {worst} a drift "
                        f"of {clocks[worst].drift_ppm:.0f} ppm (no real clock drifts over {MAX_DRIFT_PPM:.0f}); "
                        f"collective finishes scatter too much ({clocks[worst].residual_us:.0f} us) to measure drift")
        clocks = _wall_clocks(list(clocks), finishes)
    return Alignment(reference, clocks, fitted.unaligned)
