"""The cost of a slow rank measured against the job's pace in the last window that named nobody
(megascan/detection/clean_pace.py): which windows set the pace, how several slow ranks share a window's loss, and
where the critical path's estimate stands."""

import pytest

from megascan.detection.clean_pace import CleanPace
from megascan.detection.report import DELAY_PREFIX, Report, Suspect


def _report(traced_ms, iterations=2, slow=(), host_bound=(), slow_link=False):
    """A window's report: ``slow`` holds (rank, critical-path estimate in ms) per slow rank."""
    suspects = [Suspect(rank, {"dp": 0, "pp": 0, "tp": rank}, "node", rank, "slow_rank", 0.1,
                        [f"{DELAY_PREFIX}it made the {iterations} traced iterations {ms} ms longer"], ms * 1e3)
                for rank, ms in slow]
    bound = [Suspect(rank, {"dp": 0, "pp": 0, "tp": rank}, "node", rank, "host_bound", 0.1) for rank in host_bound]
    return Report(suspects, [], [{"slow": slow_link}], {}, [], [], bound, traced_ms * 1e3, iterations)


def test_a_window_after_a_clean_one_names_its_loss_against_it_and_keeps_the_estimate_beside_it():
    pace = CleanPace()
    pace.account(_report(3000.0), 1, [9, 10])
    loaded = _report(3800.0, slow=[(1, 1100.0)])
    pace.account(loaded, 2, [14, 15])
    (suspect,) = loaded.suspects
    assert suspect.delay_us == pytest.approx(800e3)
    assert suspect.evidence == [
        "delay it caused: its window's 2 traced iterations took 800.0 ms longer than the 2 of window 1 "
        "(iterations 9-10), the last that named nobody: the job ran 1.27x slower",
        "against its peers' speed: it made the 2 traced iterations 1100.0 ms longer"]


def test_two_slow_ranks_share_the_loss_by_their_excess_on_the_critical_path():
    pace = CleanPace()
    pace.account(_report(3000.0), 0, [4, 5])
    loaded = _report(4000.0, slow=[(1, 900.0), (3, 300.0)])
    pace.account(loaded, 1, [9, 10])
    assert [round(s.delay_us / 1e3, 1) for s in loaded.suspects] == [750.0, 250.0]
    assert loaded.suspects[1].evidence[0].endswith("; its share, by its excess on the critical path: 25 % (250.0 ms)")


def test_a_host_bound_window_sets_the_pace_and_a_named_window_does_not():
    pace = CleanPace()
    pace.account(_report(3100.0, host_bound=[0]), 0, [4, 5])  # the job's host sets its pace in every window
    pace.account(_report(3900.0, slow=[(1, 700.0)]), 1, [9, 10])  # named: not a pace
    later = _report(3900.0, slow=[(1, 700.0)])
    pace.account(later, 2, [14, 15])
    assert later.suspects[0].delay_us == pytest.approx(800e3)
    assert "than the 2 of window 0 (iterations 4-5)" in later.suspects[0].evidence[0]


@pytest.mark.parametrize("before", [[], [(3000.0, dict(slow_link=True))], [(4000.0, {})]],
                         ids=["no window before", "only a slow link before", "not slower than the pace"])
def test_the_critical_path_estimate_stands_without_a_clean_window_or_a_loss(before):
    pace = CleanPace()
    for number, (traced_ms, faults) in enumerate(before):
        pace.account(_report(traced_ms, **faults), number, [number])
    loaded = _report(3800.0, slow=[(1, 500.0)])
    pace.account(loaded, len(before), [len(before)])
    assert loaded.suspects[0].delay_us == 500e3
    assert loaded.suspects[0].evidence == [f"{DELAY_PREFIX}it made the 2 traced iterations 500.0 ms longer"]


def test_a_slow_rank_that_cost_the_job_under_the_bar_is_not_named_and_its_window_sets_the_pace():
    """Estimated at 4 % of its window (no clean window before it to measure against): under the 5 % bar, so the
    window names nobody, nor the victims that waited for that rank alone, and it is the pace of the next."""
    pace = CleanPace()
    cheap = _report(3000.0, slow=[(1, 120.0)])
    cheap.victims = [{"rank": 0, "waited_for": [1]}, {"rank": 2, "waited_for": [1, 3]}]
    pace.account(cheap, 0, [4, 5])
    assert cheap.suspects == [] and cheap.victims == [{"rank": 2, "waited_for": [1, 3]}]
    loaded = _report(3800.0, slow=[(1, 1100.0)])
    pace.account(loaded, 1, [9, 10])
    assert "than the 2 of window 0 (iterations 4-5)" in loaded.suspects[0].evidence[0]


def test_where_a_window_measures_the_loss_the_bar_holds_the_measured_cost_not_the_estimate():
    pace = CleanPace()
    pace.account(_report(3000.0), 0, [4, 5])
    slight = _report(3100.0, slow=[(1, 400.0)])  # estimated at 13 %, but the job lost 100 ms: 3 %
    pace.account(slight, 1, [9, 10])
    assert slight.suspects == []
    late = _report(3600.0, slow=[(1, 100.0)])  # estimated at 3 %, the job lost 500 ms against window 1: 14 %
    pace.account(late, 2, [14, 15])
    assert [s.rank for s in late.suspects] == [1] and late.suspects[0].delay_us == pytest.approx(500e3)
    assert "than the 2 of window 1 (iterations 9-10)" in late.suspects[0].evidence[0]

