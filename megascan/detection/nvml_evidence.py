"""Stage (e): what NVML saw on each GPU during the trace windows (clocks, throttling)."""

from __future__ import annotations

from megascan.aggregate.merged_trace import MergedTrace
from megascan.detection.robust import median

LOW_CLOCK_FRACTION = 0.9  # an SM clock under 90% of the other GPUs' median is worth reporting


def nvml_evidence(merged: MergedTrace) -> dict[int, list[str]]:
    """rank -> list of evidence strings (empty where nothing unusual was recorded)."""
    clocks = {rank: median([reading["sm_clock_mhz"] for _, reading in trace.nvml])
              for rank, trace in merged.ranks.items() if trace.nvml}
    evidence = {}
    for rank, trace in merged.ranks.items():
        lines = []
        if rank in clocks and len(clocks) > 1:
            others = median([clock for other, clock in clocks.items() if other != rank])
            if clocks[rank] < LOW_CLOCK_FRACTION * others:
                lines.append(f"NVML: SM clock {clocks[rank]:.0f} MHz while the other GPUs ran at {others:.0f} MHz")
        reasons = sorted({reason for _, reading in trace.nvml for reason in reading.get("throttle_reasons", [])
                          if reason != "gpu_idle"})
        if reasons:
            lines.append(f"NVML: clocks limited by {', '.join(reasons)}")
        evidence[rank] = lines
    return evidence
