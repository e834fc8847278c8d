"""Find the slow GPU, slow link or hung rank in a merged MegaScan trace (``tools/aggregate.py -d``).

A true culprit is the slowest member of every synchronous group it joins, while a victim only
lags because it waits. The stages: (a) compute of identical operations across ranks,
(b) arrival order and waits inside collectives, (c) pipeline links and waits across them,
(d) hangs from sequence numbers, (e) NVML readings. ``detect`` combines them into suspects.
"""

from megascan.detection.compute import compute_slowness
from megascan.detection.coverage import unjudged_ranks
from megascan.detection.hangs import find_hangs
from megascan.detection.links import link_stats
from megascan.detection.nvml_evidence import nvml_evidence
from megascan.detection.report import Report, Suspect
from megascan.detection.robust import median
from megascan.detection.waits import group_waits, rank_waits

# Own compute this many times what the other ranks take for the same operations. Healthy GPUs agree
# within 10%; CPU processes sharing an oversubscribed host (tests, --device cpu) differ by up to ~1.5x.
SLOW_COMPUTE_RATIO = {"cuda_event": 1.25, "host_clock": 2.0}
IMPOSED_FRACTION = 0.05  # peers waited on it for at least 5% of its traced time ...
IMPOSED_OVER_WAITED = 2.0  # ... at least twice what it waited for them ...
WAIT_SHARE = 0.6  # ... and it caused most of the waiting in the groups it joins
P2P_ONLY_IMPOSED_FRACTION = 0.2  # pipeline bubbles alone make a stage look late: ask for more


def _traced_time_us(trace):
    return sum(e["end"] - e["start"] for e in trace.events if e["name"] == "iteration") or 1.0


def _slow_rank_evidence(rank, trace, compute, waits):
    """(score, evidence lines) of one rank; score 0 when it is not a culprit.

    Where its compute can be compared with other ranks', a culprit must be slow there and make
    its peers wait; waits alone can come from the host (data loading, logging) of a healthy GPU.
    """
    evidence, score = [], 0.0
    slow = compute.get(rank)
    if slow:
        if slow["ratio"] < SLOW_COMPUTE_RATIO.get(trace.timer, SLOW_COMPUTE_RATIO["cuda_event"]):
            return 0.0, []
        score += slow["ratio"] - 1.0
        evidence.append(f"compute: its own compute took {slow['ratio']:.2f}x what the other ranks take for the "
                        f"same operations (theirs: {slow['others_ratio']:.2f}x; {slow['samples']} samples)")
    entry = waits.get(rank)
    if not entry or not entry["groups"]:
        return score, evidence
    traced = _traced_time_us(trace)
    imposed = entry["imposed_us"] / traced
    # The insight: a culprit is the slowest member of the groups it joins, the one the waiting in
    # them is for. Counting groups is brittle in pipelines (the first stage always arrives last at
    # the embedding all-reduce after the last backward), so it is weighed by time: the culprit caused
    # most of the waiting in its groups. Without comparable compute it must also lead every group.
    share = entry["imposed_us"] / max(entry["groups_waited_us"], 1.0)
    leads = share >= WAIT_SHARE and (slow is not None or len(entry["slowest_in"]) == len(entry["groups"]))
    only_p2p = all(name.startswith("p2p") for name in entry["groups"])
    needed = P2P_ONLY_IMPOSED_FRACTION if only_p2p else IMPOSED_FRACTION
    if leads and imposed >= needed and entry["imposed_us"] >= IMPOSED_OVER_WAITED * entry["waited_us"]:
        score += imposed
        evidence.append(f"waits: last to arrive in {entry['last']} of {entry['instances']} synchronous "
                        f"operations; peers waited {entry['imposed_us'] / 1e3:.1f} ms on it "
                        f"({100 * imposed:.0f}% of its traced time, {100 * share:.0f}% of all waiting in its "
                        f"groups), it waited {entry['waited_us'] / 1e3:.1f} ms; the transfers themselves took "
                        f"{median(entry['transfer_us']):.0f} us (median) once the last member arrived")
        evidence.append(f"slowest member of {len(entry['slowest_in'])} of the {len(entry['groups'])} groups it "
                        f"joins: {', '.join(entry['slowest_in'])}")
        return score, evidence
    return 0.0, []


def detect(merged):
    compute = compute_slowness(merged)
    groups = group_waits(merged)
    waits = rank_waits(groups)
    nvml = nvml_evidence(merged)
    suspects = []
    for hang in find_hangs(merged):
        trace = merged.ranks[hang["rank"]]
        suspects.append(Suspect(hang["rank"], trace.coords, trace.host, trace.device_index, "hang",
                                100.0 + len(hang["waiting_ranks"]), [
            f"never reached {hang['operation']} (iteration {hang['iteration']}), which ranks "
            f"{hang['entered_by']} entered", f"ranks waiting on it: {hang['waiting_ranks']}",
            f"the last operation it recorded: {hang['last_recorded'] or 'none in the traced windows'}"]))
    hung = {suspect.rank for suspect in suspects}
    for rank, trace in merged.ranks.items():
        score, evidence = _slow_rank_evidence(rank, trace, compute, waits)
        if score > 0 and rank not in hung:
            suspects.append(Suspect(rank, trace.coords, trace.host, trace.device_index, "slow_rank",
                                    score, evidence + nvml[rank]))
    suspects.sort(key=lambda suspect: -suspect.score)
    culprits = {suspect.rank for suspect in suspects}
    victims = [{"rank": rank, "coords": merged.ranks[rank].coords, "waited_us": entry["waited_us"],
                "note": f"waited {entry['waited_us'] / 1e3:.1f} ms in synchronous operations"}
               for rank, entry in sorted(waits.items())
               if culprits and rank not in culprits and rank in merged.ranks
               and entry["waited_us"] > entry["imposed_us"]]
    links = link_stats(merged)
    alignment = {rank: trace.clock.residual_us for rank, trace in merged.ranks.items() if trace.clock}
    return Report(suspects, victims, links, alignment, unjudged_ranks(merged))
