"""Small numeric helpers shared by the detection stages."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def median(values: Sequence[float] | np.ndarray) -> float:
    """The median of ``values``; 0.0 when there are none."""
    return float(np.median(values)) if len(values) else 0.0


def overlap(start: float, end: float, other_start: float, other_end: float) -> float:
    """How long the intervals [start, end] and [other_start, other_end] overlap (0.0 when they do not)."""
    return max(0.0, min(end, other_end) - max(start, other_start))


def medians_of_others(values: Sequence[float] | np.ndarray, groups: Sequence[int] | np.ndarray) -> np.ndarray:
    """For each value, the median of the other values of its group (nan when it is alone).

    Leaving the value itself out matters for small groups: with two TP peers, a slow one would
    otherwise be measured against a median half made of itself. Vectorised: sorted within groups, the
    others' median sits at a fixed place, one step further where the value itself sits before it.
    """
    values, groups = np.asarray(values, dtype=np.float64), np.asarray(groups)
    order = np.lexsort((values, groups))
    ordered = values[order]
    _, first, counts = np.unique(groups[order], return_index=True, return_counts=True)
    start = np.repeat(first, counts)
    size = np.repeat(counts, counts)  # group size of each sorted element
    own = np.arange(len(values)) - start  # its place in its group
    others = size - 1

    def other(k):  # the k-th smallest of the others
        return ordered[np.minimum(start + k + (k >= own), len(values) - 1)]

    low, high = (others - 1) // 2, others // 2
    median = np.where(others > 0, (other(np.maximum(low, 0)) + other(np.maximum(high, 0))) / 2.0, np.nan)
    result = np.empty(len(values))
    result[order] = median
    return result
