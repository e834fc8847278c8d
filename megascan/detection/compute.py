"""Stage (a): ranks whose kernels are slow, from identical compute operations on different ranks.

Two ranks run identical operations when they hold the same part of the model: every transformer
layer's attention (or MLP) forward (or backward) is the same computation on every rank of a
uniform layout, and a microbatch's forward/backward is the same on ranks of the same pipeline
stage and chunk. Time spent waiting in tensor-parallel collectives inside an event is taken out
(a victim waits there for its slow peer), leaving the rank's own compute. A GPU shared with
another job is not slower at every kernel: it loses whole time slices now and then, so the
comparison is of total time, not of the typical sample. A rank's ratio is its own compute over
what the other ranks typically take for the same operations (the median of their means).
"""

from collections import defaultdict

import numpy as np

from megascan.detection.robust import medians_of_others

LAYER_EVENTS = ("attention-forward", "attention-backward", "mlp-forward", "mlp-backward")
MICROBATCH_EVENTS = ("forward", "backward")


def _tp_waits_by_rank(merged):
    """rank -> (starts, ends, cumulative durations) of its finished TP collectives, by start."""
    waits = defaultdict(list)
    for instance in merged.instances:
        if instance.kind == "collective" and instance.role == "tp":
            for rank, record in instance.records.items():
                if record.get("end") is not None:
                    waits[rank].append((record["start"], record["end"]))
    result = {}
    for rank, intervals in waits.items():
        starts, ends = np.array(sorted(intervals), dtype=np.float64).T
        result[rank] = (starts, ends, np.concatenate(([0.0], np.cumsum(ends - starts))))
    return result


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


def _operation_key(event, trace):
    """What an event is compared with: the same operation on ranks of the same instance kind (MegaFBD's
    forward instances run other work, maybe on other hardware, than its backward instances)."""
    kind = trace.metadata.get("instance_kind", "training")
    if event["name"] in LAYER_EVENTS:
        return kind, event["name"]
    if event["name"] in MICROBATCH_EVENTS:
        return kind, event["name"], trace.coords["pp"], event.get("chunk")
    return None


def _samples(merged):
    """(operation key, rank, own compute) of every comparable event."""
    waits = _tp_waits_by_rank(merged)
    has_layers = any(e["name"] in LAYER_EVENTS for r in merged.ranks.values() for e in r.events)
    keys, ranks, own = [], [], []
    for rank, trace in merged.ranks.items():
        events = [(key, e) for e in trace.events if (key := _operation_key(e, trace)) is not None
                  and not (has_layers and e["name"] in MICROBATCH_EVENTS)]  # layers: the finer, uniform comparison
        if not events:
            continue
        starts = np.array([e["start"] for _, e in events], dtype=np.float64)
        ends = np.array([e["end"] for _, e in events], dtype=np.float64)
        own.append(_own_compute(starts, ends, waits.get(rank)))
        keys += [key for key, _ in events]
        ranks += [rank] * len(events)
    return keys, np.array(ranks, dtype=np.int64), np.concatenate(own) if own else np.zeros(0)


def compute_slowness(merged):
    """rank -> {"ratio", "others_ratio", "samples"} for ranks with operations to compare."""
    keys, ranks, own = _samples(merged)
    if not keys:
        return {}
    numbers = {}
    key_ids = np.array([numbers.setdefault(key, len(numbers)) for key in keys], dtype=np.int64)
    # Per (operation, rank): the mean of its samples; the typical time is the median of the other ranks' means.
    cells, cell_of = np.unique(key_ids * (ranks.max() + 1) + ranks, return_inverse=True)
    counts = np.bincount(cell_of)
    means = np.bincount(cell_of, weights=own) / counts
    cell_rank = cells % (ranks.max() + 1)
    typical = medians_of_others(means, cells // (ranks.max() + 1))
    comparable = ~np.isnan(typical)
    actual = np.bincount(cell_rank[comparable], weights=(means * counts)[comparable])
    expected = np.bincount(cell_rank[comparable], weights=(typical * counts)[comparable])
    samples = np.bincount(cell_rank[comparable], weights=counts[comparable])
    ratios = {rank: actual[rank] / expected[rank] for rank in np.unique(cell_rank[comparable]).tolist()
              if expected[rank] > 0}
    others = medians_of_others(list(ratios.values()), np.zeros(len(ratios)))
    return {rank: {"ratio": ratio, "others_ratio": float(other), "samples": int(samples[rank])}
            for (rank, ratio), other in zip(ratios.items(), others)}
