"""ClockAligner recovers injected clock offsets and drift from collective finish times."""

import numpy as np
import pytest

from megascan.clock_alignment import ClockAligner

RANKS = 8
TP_GROUPS = [[0, 1], [2, 3], [4, 5], [6, 7]]
DP_GROUPS = [[0, 4], [1, 5], [2, 6], [3, 7]]


def _synthetic_trace(rng, ranks=range(RANKS), groups=TP_GROUPS + DP_GROUPS + [list(range(RANKS))]):
    """Local finish times of 600 collectives over 60 s, with 5 us jitter and 5 % late returns."""
    rate = {r: 1.0 + rng.uniform(-50e-6, 50e-6) for r in ranks}
    offset = {r: rng.uniform(-5e6, 5e6) for r in ranks}  # up to 5 s apart
    rate[0], offset[0] = 1.0, 0.0  # the reference clock defines global time
    instances = {}
    for k, finish in enumerate(np.sort(rng.uniform(0, 60e6, 600))):
        group = groups[k % len(groups)]
        late = rng.random(len(group)) < 0.05
        instances[k] = {r: rate[r] * finish + offset[r] + rng.normal(0, 5) + (1000.0 if is_late else 0.0)
                        for r, is_late in zip(group, late)}
    anchors = {r: offset[r] + rng.normal(0, 2000) for r in ranks}  # wall clock: good to ~ms
    return instances, anchors, rate, offset


def test_recovers_offsets_and_drift_within_tolerance():
    rng = np.random.default_rng(7)
    instances, anchors, rate, offset = _synthetic_trace(rng)
    alignment = ClockAligner().align(instances, anchors)
    assert alignment.unaligned == {}
    for r in range(RANKS):
        clock = alignment.clocks[r]
        assert clock.drift_ppm == pytest.approx((rate[r] - 1) * 1e6, abs=0.5)
        # Where it matters, across the run: global times agree within 10 us.
        for global_us in (0.0, 30e6, 60e6):
            local = rate[r] * global_us + offset[r]
            assert abs(float(clock.to_global(local)) - global_us) < 10.0, (r, global_us)
        assert clock.residual_us < 10.0


def test_rank_without_shared_collectives_is_reported_not_merged():
    rng = np.random.default_rng(3)
    instances, anchors, _, _ = _synthetic_trace(rng, ranks=range(4), groups=[[0, 1], [1, 2]])
    anchors[3] = 123.0  # rank 3 has a trace file but joined no collective the others did
    alignment = ClockAligner().align(instances, anchors)
    assert sorted(alignment.clocks) == [0, 1, 2]
    assert list(alignment.unaligned) == [3] and "shares no collective with rank 0" in alignment.unaligned[3]


def test_reference_without_collectives_leaves_everyone_else_unaligned():
    alignment = ClockAligner(reference_rank=0).align({1: {1: 10.0, 2: 11.0}}, {0: 0.0})
    assert sorted(alignment.clocks) == [0] and sorted(alignment.unaligned) == [1, 2]
