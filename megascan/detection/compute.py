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

from megascan.detection.robust import median, overlap

LAYER_EVENTS = ("attention-forward", "attention-backward", "mlp-forward", "mlp-backward")
MICROBATCH_EVENTS = ("forward", "backward")


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
    """rank -> {"ratio", "others_ratio", "samples"} for ranks with operations to compare."""
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
    actual, expected, counts = defaultdict(float), defaultdict(float), defaultdict(int)
    for per_rank in samples.values():
        if len(per_rank) < 2:
            continue
        means = {rank: np.mean(durations) for rank, durations in per_rank.items()}
        for rank, durations in per_rank.items():
            typical = median([mean for other, mean in means.items() if other != rank])
            actual[rank] += sum(durations)
            expected[rank] += typical * len(durations)
            counts[rank] += len(durations)
    ratios = {rank: actual[rank] / expected[rank] for rank in actual if expected[rank] > 0}
    return {rank: {"ratio": ratio, "others_ratio": median([r for other, r in ratios.items() if other != rank]),
                   "samples": counts[rank]}
            for rank, ratio in ratios.items()}
