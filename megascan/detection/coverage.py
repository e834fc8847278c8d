"""Which ranks detection could not judge, and why: a verdict of "no suspect" says nothing about a rank
whose trace is missing, unusable, on an unknown clock or cut short, so the report names those beside it.
"""

from __future__ import annotations

from megascan.aggregate.loading import coords_name, describe
from megascan.aggregate.merged_trace import MergedTrace


def _cut_short(merged):
    """rank -> the traced iterations the others have and its file lacks (it was cut off, not stalled)."""
    iterations = {rank: set(trace.iterations) for rank, trace in merged.ranks.items()}
    everyone = set().union(*iterations.values()) if iterations else set()
    return {rank: sorted(everyone - have) for rank, have in iterations.items()
            if everyone - have and not merged.ranks[rank].issued_only}


def unjudged_ranks(merged: MergedTrace) -> list[dict[str, str]]:
    """[{"who", "why"}]: layout positions and ranks not judged (or judged on part of the run only)."""
    entries = [{"who": position, "why": f"no usable trace ({why})"} for position, why in merged.absent.items()]
    entries += [{"who": f"rank {rank}", "why": f"not aligned, so not merged: {why}"}
                for rank, why in sorted(merged.unaligned.items())]
    for rank, lacking in sorted(_cut_short(merged).items()):
        entries.append({"who": f"rank {rank} ({coords_name(merged.ranks[rank].coords)})",
                        "why": f"its trace ends early (cut off): no verdict on it for "
                               f"{describe(lacking, 'iteration')}"})
    return entries
