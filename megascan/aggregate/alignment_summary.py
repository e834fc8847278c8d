"""The summary's account of the clock alignment: which model was fitted, where drift was found, and the
residuals of every collective finish, stated as they are (ClockAligner, megascan/clock_alignment.py)."""

from __future__ import annotations

import statistics

from megascan.aggregate.loading import describe
from megascan.aggregate.merged_trace import MergedTrace


def _window_spread(clock):
    offsets = list(clock.window_offsets_us.values())
    return max(offsets) - min(offsets) if offsets else 0.0


def describe_alignment(merged: MergedTrace) -> str:
    """One line (no leading spaces) for the aggregation summary."""
    clocks = {rank: trace.clock for rank, trace in merged.ranks.items()}
    fitted = {rank: clock for rank, clock in clocks.items() if clock.collectives}
    if not fitted and len(clocks) > 1:
        return "alignment: no collective to align on, wall clocks used as they are"
    if not fitted:
        return f"alignment: only rank {merged.reference_rank} merged, so its clock is the reference (nothing to align)"
    residuals = {rank: clock.residual_us for rank, clock in fitted.items()}
    worst = max(residuals, key=residuals.__getitem__)
    spread = {rank: _window_spread(clock) for rank, clock in clocks.items()}
    widest = max(spread, key=spread.__getitem__)
    model = (f"offsets per trace window (a rank's windows differ by up to {spread[widest]:.1f} us, rank {widest})"
             if spread[widest] > 0 else "one offset per rank")
    drifting = {rank: clock.drift_ppm for rank, clock in clocks.items() if clock.drift_ppm}
    if drifting:
        fastest = max(drifting, key=lambda rank: abs(drifting[rank]))
        drift = (f"drift measurable on {len(drifting)} of {len(clocks)} ranks (largest {drifting[fastest]:.1f} ppm, "
                 f"rank {fastest}), none on the others")
    else:
        drift = "no measurable drift"
    return (f"alignment residual per rank: max {residuals[worst]:.2f} us (rank {worst}), median "
            f"{statistics.median(residuals.values()):.2f} us, over {sum(c.collectives for c in fitted.values()):,} "
            f"collective finishes; {model}; {drift}; reference clock: rank {merged.reference_rank}"
            + (f"; not fitted: {describe(sorted(set(clocks) - set(fitted)), 'rank')}" if len(fitted) < len(clocks)
               else ""))
