"""Clock alignment on simulated GPU clusters (megascan/simulation/simulated_traces.py): hosts' wall clocks milliseconds
apart and drifting, CUDA-event times anchored per trace window with a few microseconds of error. Aligned
times must match the truth (the reference rank's clock) to about a microsecond, per-window anchor errors
must not be taken for drift, and the summary must say which model was fitted."""

import pytest

from megascan.aggregate import load_and_merge
from megascan.aggregate.alignment_summary import describe_alignment
from megascan.simulation.simulated_traces import Scenario, simulate

TRUTH_TOLERANCE_US = 1.5  # finishes jitter by 0.5 us per member; anchors are off by up to 5 us


def _worst_error(run, merged):
    """Largest |aligned time - the reference rank's reading of the true time| over every op record."""
    worst = 0.0
    for instance in merged.instances:
        for rank, record in instance.records.items():
            for local, aligned in ((record.start_us, record.start), (record.end_us, record.end)):
                true = run.clock.true_time(rank, record.window, local)
                worst = max(worst, abs(aligned - run.clock.reference(record.window, true)))
    return worst


@pytest.mark.parametrize("hosts", ["one host", "8 GPUs a host"])
def test_anchored_windows_align_to_the_truth(tmp_path, hosts):
    scenario = Scenario("clocks", dp=2, tp=2, pp=4, seed=4, gpus_per_host=64 if hosts == "one host" else 8)
    run = simulate(scenario, tmp_path)
    merged = load_and_merge(tmp_path)
    assert merged.problems == [] and _worst_error(run, merged) < TRUTH_TOLERANCE_US
    assert "offsets per trace window" in describe_alignment(merged)
    if hosts == "one host":  # the ranks share a wall clock: only their GPUs' own ppm may show, never tens
        assert max(abs(trace.clock.drift_ppm) for trace in merged.ranks.values()) < 5.0


def test_exact_anchors_keep_one_offset_per_rank_and_measure_drift_across_windows(tmp_path):
    run = simulate(Scenario("clocks", dp=2, tp=2, pp=4, seed=4, anchor_error_us=0.0), tmp_path)
    merged = load_and_merge(tmp_path)
    assert _worst_error(run, merged) < TRUTH_TOLERANCE_US
    summary = describe_alignment(merged)
    assert "one offset per rank" in summary and "drift measurable on" in summary
    for rank, trace in merged.ranks.items():  # across windows the hosts' drift shows, relative to rank 0's host
        true = (run.clock.drift[rank // 8] - run.clock.drift[0]) * 1e6
        assert trace.clock.drift_ppm == pytest.approx(true, abs=3.0)
