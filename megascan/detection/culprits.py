"""Name the slow ranks from the delay attribution, with their evidence.

A rank is a culprit when its own work is slower than its peers' (the GPU is slow, not only late) and
that excess is what others waited for (it delayed them) beyond the run's own noise (noise.py): every
rank that meets both is named, so two slow GPUs are both named, whichever of them set the iteration's
pace. A victim's own work is as fast as its peers', and a healthy GPU that happens to be the slowest of
its group is only a few percent slower, so neither passes both tests. Its slowness must also stand out of the noise
of the samples behind it (MIN_EXCESS_SIGMAS): a healthy GPU that lost a couple of time slices in a short trace can
measure as slow as a slow one, but only in those few samples.

A rank whose delay its host set is not a slow GPU: where the trace has the host's issue times, the delay
it caused splits into its host's part (its GPU sat idle waiting for launches: data loading, Python, a busy CPU)
and its GPU's (its work ran longer, including while its host was blocked on the GPU's full launch queue, which
is the GPU's back-pressure, not the host's pace); where the host's part is the larger, the rank is listed as
host-bound, apart from the suspects. A host-timed trace (CPU) has one clock for both; there, own work slower
than the peers' while the rank's traced compute (its layers) is not, lies outside the model's compute:
host-bound as well.
"""

from __future__ import annotations

from megascan.aggregate.merged_trace import MergedTrace
from megascan.detection.delay_attribution import DelayAttribution
from megascan.detection.report import DELAY_PREFIX, Suspect
from megascan.detection.waits import GroupWaits

# Own compute this many times what its peers take for the same work. Healthy GPUs of one model agree
# within a few percent (+-3 % in megascan/simulation/simulated_traces.py; a healthy H200 pair in docs/benchmarks.md
# differed by 1.10x with one host lagging), a 1.2x slow GPU measures 1.15x or more against peers up to
# 3 % faster. CPU processes sharing an oversubscribed host (tests, --device cpu) differ by far more: a
# healthy rank of an 8-process DP2 x TP2 x PP2 run on 2 cores measured 2.28x its peers over one 2-iteration
# window (the scheduler's share, not the rank's work). The tests slow a rank 8x: one slowed 4x measured 2.5-3.3x
# there (descheduled peers' outliers raise the means it is compared with); 4 of 17 runs of the test failed.
SLOW_RATIO = {"cuda_event": 1.12, "host_clock": 3.0}
# Where the trace measured under half of a rank's own work (--trace-tp-microbatches: one microbatch of each TP
# rank's iteration) its delays are extrapolated from that sample (delay_attribution), and so is the sample's
# spread: over one 2-iteration window (96 layer samples), a healthy H200 of a TP2 pair measured up to 1.21x its
# peer while a GPU under a competing load at duty 0.5 measured 1.30-1.45x (2 x H200, GPT 1.3B, 2026-11-29).
SLOW_RATIO_SAMPLED = 1.25
# The excess others waited for, as a share of the traced iterations: a healthy GPU's few percent of
# excess, on the work it happens to be last at, come to under 3 % of an iteration; a 1.2x culprit's
# to 5 % or more. Below this a rank delayed nobody measurably, however slow.
MIN_CAUSED_SHARE = 0.01
# How many standard errors a slow rank's compute excess must stand out of the noise of the samples behind it
# (compute.py: its own samples' spread and its peers'). A slow GPU is slower at every kernel, or, under a competing
# load, loses time slices in many of them; a healthy GPU that now and then loses one (another process, a clock dip)
# has its excess in those few samples, and k lapses of like size stand only sqrt(k) out: 3 needs at least 9, where
# ordinary noise lost 1-2 per rank in a window of 2 iterations. In a DP2 x PP2 x TP2 job of an independent
# simulator, a healthy rank that lost two in one window measured 1.15x its peers there and stood 1.3 out; the
# culprit, 1.3x slower, stood 18.6 and 61.8 out; GPUs under a competing load on real GPUs 4.3-21.9 in a window
# (tests/data). Over a whole run a healthy rank's lapses average out and a slow GPU's excess grows with the samples.
MIN_EXCESS_SIGMAS = 3.0
TOP_GROUPS = 3


def _slowness(rank, compute, delay):
    """Compute of identical operations where the trace has them (GPU time), else own work between syncs."""
    return compute[rank]["ratio"] if rank in compute else delay.own_ratio


def _stands_out(compute):
    """Whether a rank's compute excess (its compute.compute_slowness entry) stands out of the noise by
    MIN_EXCESS_SIGMAS. A rank without compute samples to compare (its own work between synchronisations measured
    instead) has no samples to hold to it."""
    return compute is None or compute["excess_sigmas"] >= MIN_EXCESS_SIGMAS


def _waits_caused(rank, groups):
    caused = sorted(((group.imposed[rank], group) for group in groups.values() if group.imposed.get(rank)),
                    key=lambda item: -item[0])
    return "; ".join(f"{group.name}: {us / 1e3:.1f} ms (last in {group.last.get(rank, 0)} of {group.instances})"
                     for us, group in caused[:TOP_GROUPS]) + (f"; {len(caused) - TOP_GROUPS} more groups"
                                                              if len(caused) > TOP_GROUPS else "")


def _added_us(attribution, delay):
    """What its own work on the critical paths made the iterations longer (never all of them)."""
    return min(max(delay.charged_us, 0.0), 0.99 * attribution.path_us)


def _evidence(rank, attribution, compute, delay, groups):
    path, added = attribution.path_us, _added_us(attribution, delay)
    estimated = (f"; estimated from the {100 * delay.measured_share:.0f}% of its own work the trace measured (the "
                 f"rest spans tensor-parallel collectives that --trace-tp-microbatches left unrecorded)"
                 if delay.measured_share < 0.99 else "")
    lines = [(f"{DELAY_PREFIX}it made the {attribution.iterations} traced iterations {added / 1e3:.1f} ms "
              f"longer than its peers' speed would have: the job ran {path / (path - added):.2f}x slower over them"
              f"{estimated}"),
             (f"others waited for it: its own work before the operations others waited for took "
              f"{delay.caused_us / 1e3:.1f} ms longer than its peers of the same role take for the same work "
              f"({100 * delay.caused_us / path:.1f}% of the traced iterations' {path / 1e3:.1f} ms)"),
             f"critical path: {100 * delay.path_us / path:.0f}% of it is this rank's own work"]
    if rank in compute:
        lines.append(f"compute: its own compute took {compute[rank]['ratio']:.2f}x what the other ranks take for "
                     f"the same operations (theirs: {compute[rank]['others_ratio']:.2f}x; "
                     f"{compute[rank]['samples']} samples; its excess stands {compute[rank]['excess_sigmas']:.1f} "
                     f"standard errors out of their noise)")
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


def _split_evidence(delay):
    host_ms = delay.caused_host_us / 1e3
    # A slow GPU has work queued more often than its peers', so it waits for launches less: a negative host part.
    host = (f"{host_ms:.1f} ms came from its GPU waiting for its host's launches longer than its peers' GPUs"
            if host_ms >= 0 else
            f"its GPU waited for its host's launches {-host_ms:.1f} ms less than its peers' (its host was not late)")
    return (f"host or GPU: of the {delay.caused_us / 1e3:.1f} ms others waited for it, {host}, and "
            f"{delay.caused_device_us / 1e3:.1f} ms came from its GPU running longer; its GPU waited for launches "
            f"{100 * delay.launch_wait_share:.0f}% of its own work between synchronisations (its peers: "
            f"{100 * delay.launch_wait_share_of_peers:.0f}%)")


def _host_bound_evidence(rank, compute, delay):
    if delay.split_known:
        return (f"host-bound: its GPU waited for its own host's launches {100 * delay.launch_wait_share:.0f}% of "
                f"its own work between synchronisations (its peers: {100 * delay.launch_wait_share_of_peers:.0f}%); "
                f"of the delay it caused, {delay.caused_host_us / 1e3:.1f} ms was its host's and "
                f"{delay.caused_device_us / 1e3:.1f} ms its GPU's: not a slow GPU")
    return (f"host-bound: its own work between synchronisations took {delay.own_ratio:.2f}x its peers' while its "
            f"traced compute took {compute[rank]['ratio']:.2f}x: the excess lies outside the model's layers "
            f"(data loading, host work between layers); on a host-timed trace host and device share one clock")


def _classify(rank, delay, compute, threshold, floor_us):
    """"slow_rank", "host_bound" or None for a rank whose caused delay is beyond the noise (``floor_us``).
    With the host's issue times, the part named must itself be beyond the noise: a rank of a host-bound job
    whose peers' hosts ran ahead while they waited is late against them, by neither its host nor its GPU."""
    slow_work = _slowness(rank, compute, delay) >= threshold
    slow_outside_compute = rank in compute and delay.own_ratio >= threshold
    if delay.split_known:
        if delay.host_side and delay.caused_host_us >= floor_us and (slow_work or slow_outside_compute):
            return "host_bound"
        return "slow_rank" if slow_work and delay.caused_device_us >= floor_us else None
    if slow_work and _launch_wait_explains(delay, _slowness(rank, compute, delay)):
        return "host_bound"
    if slow_work:
        return "slow_rank"
    return "host_bound" if slow_outside_compute else None


def _launch_wait_explains(delay, slowness):
    """For a rank without peers to split against (alone in its stage), measured by its compute ratio: whether
    its GPU waited for launches long enough to explain all its excess (1 - 1/ratio of its own work)."""
    return delay.launch_wait_share >= 1.0 - 1.0 / slowness  # False where unknown (nan)


def find_culprits(merged: MergedTrace, attribution: DelayAttribution, compute: dict[int, dict],
                  groups: dict[str, GroupWaits], nvml: dict[int, list[str]]) -> tuple[list[Suspect], list[Suspect]]:
    """(suspects, host-bound ranks): Suspect (kind "slow_rank") per culprit, the most delay first: first the
    ranks whose excess others waited for, then slow ranks whose excess only a slower culprit hid (it waited
    for that one); Suspect (kind "host_bound") per rank whose host set the pace of the delay it caused."""
    path = attribution.path_us
    if path <= 0:
        return [], []
    threshold = {rank: max(SLOW_RATIO.get(trace.timer, SLOW_RATIO["cuda_event"]),
                           SLOW_RATIO_SAMPLED if attribution.ranks[rank].measured_share < 0.5 else 0.0)
                 for rank, trace in merged.ranks.items() if rank in attribution.ranks}
    standing = {rank for rank in attribution.ranks if _stands_out(compute.get(rank))}
    slow = {rank: delay for rank, delay in attribution.ranks.items()
            if _slowness(rank, compute, delay) >= threshold[rank] and not delay.host_side and rank in standing}
    # The noise floor scales with a delay extrapolated from the measured part of the work (delay_attribution).
    floors = {rank: max(MIN_CAUSED_SHARE * path,
                        attribution.noise.floor_us(attribution.iterations, delay.caused_records)
                        / delay.measured_share)
              for rank, delay in attribution.ranks.items()}
    kinds = {rank: kind for rank, delay in attribution.ranks.items() if delay.caused_us >= floors[rank]
             and (kind := _classify(rank, delay, compute, threshold[rank], floors[rank]))
             and (kind != "slow_rank" or rank in standing)}
    named = {rank for rank, kind in kinds.items() if kind == "slow_rank"}
    masked = {rank for rank, delay in slow.items() if rank not in named
              and sum(us for other, us in delay.masked_us.items() if other in named) >= MIN_CAUSED_SHARE * path}
    suspects, host_bound = [], []
    for rank in named | masked:
        trace, delay = merged.ranks[rank], attribution.ranks[rank]
        evidence = _evidence(rank, attribution, compute, delay, groups)
        if rank in masked:
            evidence.insert(1, _masked_evidence(delay, named, attribution))
        if delay.split_known:
            evidence.insert(1, _split_evidence(delay))
        score = max(delay.caused_us, sum(us for other, us in delay.masked_us.items() if other in named)) / path
        suspects.append(Suspect(rank, trace.coords, trace.host, trace.device_index, "slow_rank", score,
                                evidence + nvml.get(rank, []), _added_us(attribution, delay)))
    for rank in (rank for rank, kind in kinds.items() if kind == "host_bound"):
        trace, delay = merged.ranks[rank], attribution.ranks[rank]
        evidence = [_host_bound_evidence(rank, compute, delay)] + _evidence(rank, attribution, compute, delay, groups)
        host_bound.append(Suspect(rank, trace.coords, trace.host, trace.device_index, "host_bound",
                                  delay.caused_us / path, evidence))
    return _by_score(suspects), _by_score(host_bound)


def _by_score(suspects):
    return sorted(suspects, key=lambda suspect: -suspect.score)


def find_victims(merged: MergedTrace, waits: dict[int, dict[int, float]], culprits: set[int],
                 path_us: float) -> list[dict]:
    """The report's victims: the ranks that waited for a suspect directly, at least MIN_CAUSED_SHARE of the
    traced iterations (ranks further along wait for those victims, and everyone waits in pipeline bubbles)."""
    victims = []
    for rank, per_rank in sorted(waits.items()):
        for_culprits = {other: us for other, us in per_rank.items()
                        if other in culprits and us >= MIN_CAUSED_SHARE * path_us}
        if rank in culprits or not for_culprits:
            continue
        victims.append({"rank": rank, "coords": merged.ranks[rank].coords, "waited_us": sum(for_culprits.values()),
                        "waited_for": sorted(for_culprits),
                        "note": "waited " + ", ".join(f"{us / 1e3:.1f} ms for rank {other}"
                                                      for other, us in sorted(for_culprits.items()))
                                + f" ({sum(per_rank.values()) / 1e3:.1f} ms in all synchronous operations)"})
    return victims
