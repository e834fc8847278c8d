"""Name the slow ranks from the delay attribution, with their evidence.

A rank is a culprit when its own work is slower than its peers' (the GPU is slow, not only late) and
that excess is what others waited for (it delayed them): every rank that meets both is named, so two
slow GPUs are both named, whichever of them set the iteration's pace. A victim's own work is as fast
as its peers', and a healthy GPU that happens to be the slowest of its group is only a few percent
slower, so neither passes both tests.
"""

from megascan.detection.report import Suspect

# Own compute this many times what its peers take for the same work. Healthy GPUs of one model agree
# within a few percent (+-3 % in tests/simulated_traces.py; a healthy H200 pair in docs/benchmarks.md
# differed by 1.10x with one host lagging), a 1.2x slow GPU measures 1.15x or more against peers up to
# 3 % faster. CPU processes sharing an oversubscribed host (tests, --device cpu) differ by up to ~1.5x.
SLOW_RATIO = {"cuda_event": 1.12, "host_clock": 2.0}
# The excess others waited for, as a share of the traced iterations: a healthy GPU's few percent of
# excess, on the work it happens to be last at, come to under 3 % of an iteration; a 1.2x culprit's
# to 5 % or more. Below this a rank delayed nobody measurably, however slow.
MIN_CAUSED_SHARE = 0.01
TOP_GROUPS = 3


def _slowness(rank, compute, delay):
    """Compute of identical operations where the trace has them (GPU time), else own work between syncs."""
    return compute[rank]["ratio"] if rank in compute else delay.own_ratio


def _waits_caused(rank, groups):
    caused = sorted(((group.imposed[rank], group) for group in groups.values() if group.imposed.get(rank)),
                    key=lambda item: -item[0])
    return "; ".join(f"{group.name}: {us / 1e3:.1f} ms (last in {group.last.get(rank, 0)} of {group.instances})"
                     for us, group in caused[:TOP_GROUPS]) + (f"; {len(caused) - TOP_GROUPS} more groups"
                                                              if len(caused) > TOP_GROUPS else "")


def _evidence(rank, attribution, compute, delay, groups):
    path = attribution.path_us
    lines = [f"delay it caused: its own work before the operations others waited for took "
             f"{delay.caused_us / 1e3:.1f} ms longer than its peers of the same role take for the same work "
             f"({100 * delay.caused_us / path:.1f}% of the {attribution.iterations} traced iterations' "
             f"{path / 1e3:.1f} ms)",
             f"critical path: {100 * delay.path_us / path:.0f}% of it is this rank's own work, which made the "
             f"iterations {max(delay.charged_us, 0.0) / 1e3:.1f} ms longer than its peers' speed would have"]
    if rank in compute:
        lines.append(f"compute: its own compute took {compute[rank]['ratio']:.2f}x what the other ranks take for "
                     f"the same operations (theirs: {compute[rank]['others_ratio']:.2f}x; "
                     f"{compute[rank]['samples']} samples)")
    if delay.stage_peers:
        lines.append(f"own work between synchronisations: {delay.own_ratio:.2f}x what its peers of the same "
                     f"pipeline stage take")
    else:
        lines.append("own work between synchronisations: no other rank shares its pipeline stage, so it is "
                     "measured by its compute ratio")
    waits = _waits_caused(rank, groups)
    if waits:
        lines.append(f"waits it caused: {waits}")
    return lines


def _masked_evidence(delay, named, attribution):
    behind = {rank: us for rank, us in delay.masked_us.items() if rank in named and us > 0}
    return (f"masked: its own work before the operations in which it waited for slower culprit(s) "
            f"{sorted(behind)} took {sum(behind.values()) / 1e3:.1f} ms longer than its peers' "
            f"({100 * sum(behind.values()) / attribution.path_us:.1f}% of the traced iterations): it will hold "
            f"the job back once they are fixed")


def find_culprits(merged, attribution, compute, groups, nvml):
    """Suspect (kind "slow_rank") per culprit, the most delay first: first the ranks whose excess others waited
    for, then slow ranks whose excess only a slower culprit hid (it waited for that one)."""
    path = attribution.path_us
    if path <= 0:
        return []
    slow = {rank: delay for rank, delay in attribution.ranks.items()
            if _slowness(rank, compute, delay) >= SLOW_RATIO.get(merged.ranks[rank].timer, SLOW_RATIO["cuda_event"])}
    named = {rank for rank, delay in slow.items() if delay.caused_us >= MIN_CAUSED_SHARE * path}
    masked = {rank for rank, delay in slow.items() if rank not in named
              and sum(us for other, us in delay.masked_us.items() if other in named) >= MIN_CAUSED_SHARE * path}
    suspects = []
    for rank in named | masked:
        trace, delay = merged.ranks[rank], slow[rank]
        evidence = _evidence(rank, attribution, compute, delay, groups)
        if rank in masked:
            evidence.insert(1, _masked_evidence(delay, named, attribution))
        score = max(delay.caused_us, sum(us for other, us in delay.masked_us.items() if other in named)) / path
        suspects.append(Suspect(rank, trace.coords, trace.host, trace.device_index, "slow_rank", score,
                                evidence + nvml.get(rank, [])))
    return sorted(suspects, key=lambda suspect: -suspect.score)


def find_victims(merged, waits, culprits, path_us):
    """The report's victims: the ranks that waited for a suspect directly, at least MIN_CAUSED_SHARE of the
    traced iterations (ranks further along wait for those victims, and everyone waits in pipeline bubbles)."""
    victims = []
    for rank, per_rank in sorted(waits.items()):
        for_culprits = {other: us for other, us in per_rank.items() if other in culprits and us >= MIN_CAUSED_SHARE * path_us}
        if rank in culprits or not for_culprits:
            continue
        victims.append({"rank": rank, "coords": merged.ranks[rank].coords, "waited_us": sum(for_culprits.values()),
                        "note": "waited " + ", ".join(f"{us / 1e3:.1f} ms for rank {other}"
                                                      for other, us in sorted(for_culprits.items()))
                                + f" ({sum(per_rank.values()) / 1e3:.1f} ms in all synchronous operations)"})
    return victims
