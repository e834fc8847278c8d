"""Stage (a): ranks whose kernels are slow, from identical compute operations on different ranks.

Two ranks run identical operations when they hold the same part of the model: every transformer
layer's attention (or MLP) forward (or backward) is the same computation on every rank of a
uniform layout, and a microbatch's forward/backward is the same on ranks of the same pipeline
stage and chunk. Time spent waiting in tensor-parallel collectives inside an event is taken out
(a victim waits there for its slow peer), leaving the rank's own compute. Each sample is divided
by the median of its operation over all ranks; a rank's slowness is the median of its ratios,
and its z-score is that excess over the spread of the other ranks' ratios, with the standard
error shrinking with the number of samples.
"""

import math
from collections import defaultdict

import numpy as np

from megascan.detection.robust import MAD_TO_SIGMA, mad, median, overlap

LAYER_EVENTS = ("attention-forward", "attention-backward", "mlp-forward", "mlp-backward")
MICROBATCH_EVENTS = ("forward", "backward")
MIN_RATIO_SPREAD = 0.02  # ratios of healthy ranks never agree better than this: floor the spread


def _tp_waits_by_rank(merged):
    waits = defaultdict(list)
    for instance in merged.instances:
        if instance.kind == "collective" and instance.role == "tp":
            for rank, record in instance.records.items():
                if record.get("end") is not None:
                    waits[rank].append((record["start"], record["end"]))
    for intervals in waits.values():
        intervals.sort()
    return waits


def _own_compute(event, waits):
    start, end = event["start"], event["end"]
    inside = sum(overlap(start, end, s, e) for s, e in waits if s < end and e > start)
    return max(end - start - inside, 0.0)


def _operation_key(event, coords):
    if event["name"] in LAYER_EVENTS:
        return event["name"]
    if event["name"] in MICROBATCH_EVENTS:
        return event["name"], coords["pp"], event.get("chunk")
    return None


def compute_slowness(merged):
    """rank -> {"ratio", "z", "samples", "operations"} for ranks with comparable operations."""
    waits = _tp_waits_by_rank(merged)
    samples = defaultdict(lambda: defaultdict(list))  # key -> rank -> own compute durations
    has_layers = any(e["name"] in LAYER_EVENTS for r in merged.ranks.values() for e in r.events)
    for rank, trace in merged.ranks.items():
        rank_waits = waits.get(rank, [])
        for event in trace.events:
            key = _operation_key(event, trace.coords)
            if key is None or (has_layers and event["name"] in MICROBATCH_EVENTS):
                continue  # with layer events, those are the finer, uniform comparison
            samples[key][rank].append(_own_compute(event, rank_waits))
    ratios = defaultdict(list)
    for per_rank in samples.values():
        if len(per_rank) < 2:
            continue
        reference = median(np.concatenate([np.asarray(v) for v in per_rank.values()]))
        if reference <= 0:
            continue
        for rank, durations in per_rank.items():
            ratios[rank].extend(d / reference for d in durations)
    result = {}
    for rank, own in ratios.items():
        others = np.concatenate([np.asarray(v) for r, v in ratios.items() if r != rank] or [np.ones(1)])
        spread = max(MAD_TO_SIGMA * mad(others), MIN_RATIO_SPREAD)
        ratio = median(own)
        z = (ratio - median(others)) / (1.2533 * spread / math.sqrt(len(own)))  # std. error of a median
        result[rank] = {"ratio": ratio, "others_ratio": median(others), "z": z, "samples": len(own)}
    return result
