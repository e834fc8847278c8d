"""Find the slow GPU, slow link or hung rank in a merged MegaScan trace (``tools/aggregate.py -d``).

The trace holds a dependency graph: program order joins each rank's operations, and each collective
instance or transfer joins its members. Detection follows it:
(a) rank_timelines: each rank's own work between synchronisation points, keyed by what the same work
    is on its peers of the same role; critical_path: each iteration's path through the graph;
(b) delay_attribution: the excess of each segment over the same work on its peers, charged to the
    rank (or link) that did it; victims only wait, so they are charged nothing; culprits: the ranks
    whose own work is slow and delayed others beyond the run's own noise (noise), with the evidence
    (compute ratio, waits caused per group, share of the critical path), and the host-bound ranks apart
    (their GPU waited for their own host's launches: not a slow GPU);
(c) links: bandwidth of every pipeline link;
(d) hung_ranks: in a window that never finished, who never reached an operation the others reached
    (hung) and who is only blocked behind it;
(e) nvml_evidence: what NVML saw. ``detect`` combines them into the report.
"""

from __future__ import annotations

from megascan.aggregate.merged_trace import MergedTrace
from megascan.detection.compute import OperationTotals, compute_slowness
from megascan.detection.coverage import unjudged_ranks
from megascan.detection.critical_path import critical_paths
from megascan.detection.culprits import find_culprits, find_victims
from megascan.detection.delay_attribution import attribute_delays
from megascan.detection.hang_report import blocked_entries, hang_suspects
from megascan.detection.hung_ranks import classify_hang
from megascan.detection.links import link_stats
from megascan.detection.nvml_evidence import nvml_evidence
from megascan.detection.rank_timelines import build_timelines
from megascan.detection.report import Report, Suspect
from megascan.detection.waits import group_waits, waited_for

__all__ = ["Report", "Suspect", "detect"]


def _tp_sampled(trace) -> bool:
    """Whether a rank's GPU trace recorded only some microbatches' tensor-parallel collectives: its delays are then
    extrapolated from them (delay_attribution). Not on a host-timed (CPU) trace, where a rank's measured microbatch
    holds the scheduler's time slices of an oversubscribed host rather than a sample of its work."""
    return (trace.timer == "cuda_event" and bool(trace.metadata.get("tp_microbatches_recorded"))
            and trace.metadata.get("layout", {}).get("tp", 1) > 1)


def detect(merged: MergedTrace, compute_totals: dict[int, OperationTotals] | None = None) -> Report:
    """The Report of a MergedTrace; ``compute_totals``: each rank's compute.operation_totals where they were
    gathered instead of the events (online detection)."""
    timelines = build_timelines(merged)
    compute = compute_slowness(merged, compute_totals)
    attribution = attribute_delays(timelines, critical_paths(timelines),
                                   {rank: entry["ratio"] for rank, entry in compute.items()},
                                   frozenset(rank for rank, trace in merged.ranks.items() if _tp_sampled(trace)))
    groups = group_waits(timelines)
    hung, blocked = classify_hang(merged)
    suspects = hang_suspects(merged, hung)
    hung_ranks = {suspect.rank for suspect in suspects}
    slow, host_bound = find_culprits(merged, attribution, compute, groups, nvml_evidence(merged))
    suspects += [suspect for suspect in slow if suspect.rank not in hung_ranks]
    alignment = {rank: trace.clock.residual_us for rank, trace in merged.ranks.items() if trace.clock}
    victims = find_victims(merged, waited_for(timelines), {suspect.rank for suspect in suspects}, attribution.path_us)
    return Report(suspects, victims, link_stats(merged, attribution), alignment, unjudged_ranks(merged),
                  blocked_entries(merged, blocked),
                  [entry for entry in host_bound if entry.rank not in hung_ranks], attribution.path_us,
                  attribution.iterations)
