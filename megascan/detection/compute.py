"""Stage (a): ranks whose kernels are slow, from identical compute operations on different ranks.

Two ranks run identical operations when they hold the same part of the model: every transformer
layer's attention (or MLP) forward (or backward) is the same computation on every rank of a
uniform layout, and a microbatch's forward/backward is the same on ranks of the same pipeline
stage and chunk. Time spent waiting in tensor-parallel collectives inside an event is taken out
(a victim waits there for its slow peer), leaving the rank's own compute. A GPU shared with
another job is not slower at every kernel: it loses whole time slices now and then, so the
comparison is of total time, not of the typical sample. A rank's ratio is its own compute over
what the other ranks typically take for the same operations (the median of their means). Where only
some microbatches' TP collectives were recorded (``--trace-tp-microbatches``: their forward passes), only
those microbatches' (forward) events are compared: the others' waits are unknown.

How far that excess stands out of the noise of the samples behind it is its size in standard errors: the spread
of the rank's own samples (a slow GPU is slower at every kernel, or loses time slices in many of them; a healthy
one that lost two time slices has its whole excess in those two) and of its peers' (what it is measured against
is their mean). Each cell's sum of squares travels with its total, so the online judge has it too.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from megascan.aggregate.merged_trace import MergedTrace
from megascan.aggregate.trace_records import ComputeEvent
from megascan.detection.robust import medians_of_others

LAYER_EVENTS = ("attention-forward", "attention-backward", "mlp-forward", "mlp-backward")
MICROBATCH_EVENTS = ("forward", "backward")
BACKWARD_EVENTS = ("backward", "attention-backward", "mlp-backward")


def _tp_waits(intervals):
    """(starts, ends, cumulative durations) of one rank's finished TP collectives, by start; None if none."""
    if not intervals:
        return None
    starts, ends = np.array(sorted(intervals), dtype=np.float64).T
    return starts, ends, np.concatenate(([0.0], np.cumsum(ends - starts)))


def _tp_waits_by_rank(merged):
    """rank -> (starts, ends, cumulative durations) of its finished TP collectives, by start."""
    waits = defaultdict(list)
    for instance in merged.instances:
        if instance.kind == "collective" and instance.role == "tp":
            for rank, record in instance.records.items():
                if record.end is not None:
                    waits[rank].append((record.start, record.end))
    return {rank: _tp_waits(intervals) for rank, intervals in waits.items()}


def _own_compute(starts, ends, waits):
    """Each event's duration less the TP waits inside it (one rank's waits follow each other)."""
    durations = ends - starts
    if waits is None:
        return durations
    wait_starts, wait_ends, cumulative = waits
    first = np.searchsorted(wait_ends, starts, side="right")  # the first wait ending after the event starts
    stop = np.searchsorted(wait_starts, ends, side="left")  # the waits starting before the event ends
    inside = np.where(stop > first, cumulative[stop] - cumulative[first], 0.0)
    last = np.maximum(stop - 1, 0)
    clipped_front = np.maximum(starts - wait_starts[np.minimum(first, len(wait_starts) - 1)], 0.0)
    clipped_back = np.maximum(wait_ends[last] - ends, 0.0)
    inside -= np.where(stop > first, clipped_front + clipped_back, 0.0)
    return np.maximum(durations - inside, 0.0)


def _operation_key(event, kind, stage):
    """What an event is compared with: the same operation on ranks of the same instance kind (MegaFBD's
    forward instances run other work, maybe on other hardware, than its backward instances)."""
    if event.name in LAYER_EVENTS:
        return kind, event.name
    if event.name in MICROBATCH_EVENTS:
        return kind, event.name, stage, event.chunk
    return None


# {operation key: [own compute in total (us), samples, sum of the samples' squares (us^2)]} of one rank
# (operation_totals)
OperationTotals = dict[tuple, list]


@dataclass(frozen=True)
class KnownTpWaits:
    """Where a rank recorded its TP collectives: in these microbatches, in their backward passes too or not."""

    microbatches: range
    backward: bool

    def cover(self, event: ComputeEvent) -> bool:
        """Whether every TP wait inside the event is known (events outside microbatches: always)."""
        return event.microbatch is None or (event.microbatch in self.microbatches
                                            and (self.backward or event.name not in BACKWARD_EVENTS))


def tp_waits_known(metadata: dict) -> KnownTpWaits | None:
    """Where a rank recorded its TP collectives (session metadata: ``tp_microbatches_recorded`` 0 where its world
    has no tensor parallelism or all were recorded; the last ones, or the first in traces written before
    ``tp_microbatches_recorded_are`` was added; their backward passes too in traces written before
    ``tp_backward_recorded`` was added), or None: all known."""
    count = metadata.get("tp_microbatches_recorded")
    if not count:
        return None
    backward = metadata.get("tp_backward_recorded", True)
    if metadata.get("tp_microbatches_recorded_are") == "last":
        total = metadata["layout"]["num_microbatches"]
        return KnownTpWaits(range(max(total - count, 0), total), backward)
    return KnownTpWaits(range(count), backward)


def operation_totals(events: list[ComputeEvent], tp_waits: list[tuple[float, float]], kind: str, stage: int,
                     layers_traced: bool, known: KnownTpWaits | None = None) -> OperationTotals:
    """{operation key: [own compute in total (us), samples, sum of squares (us^2)]} of one rank, from its events
    (their start and end set) and its TP collectives' (start, end) intervals, all on one clock.
    With ``layers_traced``, only the layers: the finer, uniform comparison. ``known``: only the events it covers
    (tp_waits_known). A window's totals are what online detection gathers from each rank instead of its events."""
    chosen = [(key, e) for e in events if (key := _operation_key(e, kind, stage)) is not None
              and not (layers_traced and e.name in MICROBATCH_EVENTS)
              and (known is None or known.cover(e))]
    if not chosen:
        return {}
    own = _own_compute(np.array([e.start for _, e in chosen], dtype=np.float64),
                       np.array([e.end for _, e in chosen], dtype=np.float64), _tp_waits(tp_waits))
    totals: OperationTotals = {}
    for (key, _), us in zip(chosen, own.tolist()):
        total = totals.setdefault(key, [0.0, 0, 0.0])
        total[0] += us
        total[1] += 1
        total[2] += us * us
    return totals


def totals_by_rank(merged: MergedTrace) -> dict[int, OperationTotals]:
    """rank -> operation_totals of every merged rank."""
    waits = _tp_waits_by_rank(merged)
    layers_traced = any(e.name in LAYER_EVENTS for r in merged.ranks.values() for e in r.events)
    intervals = {rank: list(zip(w[0].tolist(), w[1].tolist())) for rank, w in waits.items() if w is not None}
    return {rank: operation_totals(trace.events, intervals.get(rank, []),
                                   trace.metadata.get("instance_kind", "training"), trace.coords["pp"], layers_traced,
                                   tp_waits_known(trace.metadata))
            for rank, trace in merged.ranks.items()}


def _excess_variance(key_ids, counts, means, squares):
    """Per (operation, rank) cell: the variance of its excess, count x (its mean - the others' typical time): its
    own samples' spread, plus its count squared times the variance of the others' mean (their pooled spread over
    their samples)."""
    deviations = np.maximum(squares - counts * means * means, 0.0)  # the cell's sum of squared deviations
    others_deviations = np.bincount(key_ids, weights=deviations)[key_ids] - deviations
    others_counts = np.bincount(key_ids, weights=counts)[key_ids] - counts
    typical_variance = np.divide(others_deviations, others_counts * others_counts,
                                 out=np.zeros_like(counts), where=others_counts > 0)
    return deviations + counts * counts * typical_variance


def _in_standard_errors(excess, variance):
    """``excess`` over its standard error; infinite for an excess without spread (every sample alike)."""
    if variance > 0:
        return float(excess / np.sqrt(variance))
    return float("inf") if excess > 0 else 0.0


def compute_slowness(merged: MergedTrace, totals: dict[int, OperationTotals] | None = None) -> dict[int, dict]:
    """rank -> {"ratio", "others_ratio", "samples", "excess_sigmas"} for ranks with operations to compare
    (excess_sigmas: its excess over the others' time in standard errors, module docstring); ``totals``: the ranks'
    operation_totals where they were gathered already (online detection), else made from ``merged``."""
    totals = totals_by_rank(merged) if totals is None else totals
    cells = [(key, rank, *total) for rank, per_key in totals.items() for key, total in per_key.items()]
    if not cells:
        return {}
    numbers: dict[tuple, int] = {}  # operation key -> its number
    key_ids = np.array([numbers.setdefault(key, len(numbers)) for key, *_ in cells], dtype=np.int64)
    cell_rank = np.array([rank for _, rank, *_ in cells], dtype=np.int64)
    counts = np.array([count for _, _, _, count, _ in cells], dtype=np.float64)
    means = np.array([total for _, _, total, _, _ in cells], dtype=np.float64) / counts
    squares = np.array([square for *_, square in cells], dtype=np.float64)
    # Per (operation, rank): the mean of its samples; the typical time is the median of the other ranks' means.
    typical = medians_of_others(means, key_ids)
    comparable = ~np.isnan(typical)
    actual = np.bincount(cell_rank[comparable], weights=(means * counts)[comparable])
    expected = np.bincount(cell_rank[comparable], weights=(typical * counts)[comparable])
    samples = np.bincount(cell_rank[comparable], weights=counts[comparable])
    variance = np.bincount(cell_rank[comparable], weights=_excess_variance(key_ids, counts, means, squares)[comparable])
    ratios = {rank: actual[rank] / expected[rank] for rank in np.unique(cell_rank[comparable]).tolist()
              if expected[rank] > 0}
    others = medians_of_others(list(ratios.values()), np.zeros(len(ratios)))
    return {rank: {"ratio": ratio, "others_ratio": float(other), "samples": int(samples[rank]),
                   "excess_sigmas": _in_standard_errors(actual[rank] - expected[rank], variance[rank])}
            for (rank, ratio), other in zip(ratios.items(), others)}
