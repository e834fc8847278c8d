"""Detection on simulated 3D-parallel runs (megascan/simulation/simulated_traces.py) with known faults: every slow GPU
is named (two at once too) and nothing else, in every role; a slow link is found and no rank blamed for
it; a hung rank is the only hung one, with the ranks behind it listed as blocked. The same case matrix
runs at 256-1024 ranks in bench/detection_scale.py."""

import json

import pytest

from megascan.aggregate import load_and_merge
from megascan.detection import detect
from megascan.detection.window_verdicts import judge_windows
from megascan.online_detection import judge, summarize
from megascan.simulation.detection_cases import check, scenarios
from megascan.simulation.simulated_traces import Scenario, simulate
from megascan.simulation.synthetic_traces import write_lines

# (DP, TP, PP, seed): 8 to 64 ranks, pipelines of 2 to 8 stages (one without a peer in its stage: measured by
# its compute ratio against the same layers on other stages); the seed also picks the culprits' places.
LAYOUTS = [(2, 2, 2, 0), (1, 1, 8, 1), (1, 2, 4, 1), (2, 1, 4, 2), (2, 2, 4, 0), (1, 2, 8, 1), (2, 4, 2, 2),
           (4, 2, 4, 0), (2, 2, 8, 1), (2, 4, 8, 2)]


@pytest.mark.parametrize("dp, tp, pp, seed", LAYOUTS, ids=[f"DP{d}xTP{t}xPP{p}-seed{s}" for d, t, p, s in LAYOUTS])
def test_every_fault_is_named_and_nothing_else(tmp_path, dp, tp, pp, seed):
    misses = []
    for number, (scenario, expected) in enumerate(scenarios(dp, tp, pp, seed)):
        run = simulate(scenario, tmp_path / str(number))
        report = detect(load_and_merge(run.directory))
        misses += [f"{scenario.name}: {problem}" for problem in check(report, run, expected)]
    assert misses == []


def test_culprit_evidence_names_its_ratio_waits_and_critical_path(tmp_path):
    scenario = Scenario("middle stage", dp=2, tp=2, pp=4, seed=3, culprits={9: 1.3})
    report = detect(load_and_merge(simulate(scenario, tmp_path).directory))
    assert [(s.rank, s.kind) for s in report.suspects] == [(9, "slow_rank")]
    evidence = "\n".join(report.suspects[0].evidence)
    for expected in ("delay it caused:", "critical path:", "own work between synchronisations: 1.2",
                     "waits it caused: p2p 9->5"):
        assert expected in evidence
    ratio = float(evidence.split("compute: its own compute took ")[1].split("x")[0])
    assert 1.2 < ratio < 1.4
    # Its TP peer and pipeline neighbours only waited: victims, not suspects.
    assert {8, 5, 13} <= {victim["rank"] for victim in report.victims}


def test_blocked_ranks_behind_a_hang_are_not_hung(tmp_path):
    """Every blocked host ran ahead, so ranks wait in pipeline exchanges both sides issued while the sender
    is stuck behind a TP all-reduce with the hung rank: they are blocked, and only rank 5 is hung."""
    scenario = Scenario("hang", dp=2, tp=2, pp=4, seed=1, hang=(5, 9, "tp", 2), lookahead=1.0)
    run = simulate(scenario, tmp_path)
    report = detect(load_and_merge(run.directory))
    assert [(s.rank, s.kind) for s in report.suspects] == [(5, "hang")]
    assert "allreduce on tp group [4, 5]" in report.suspects[0].evidence[0]
    blocked = {entry["rank"]: entry for entry in report.blocked}
    assert set(blocked) == run.blocked == set(range(16)) - {5}
    assert blocked[4]["waits_for"] == [5] and all(entry["behind"] == [5] for entry in blocked.values())
    both_issued = [entry for entry in blocked.values() if entry["operation"].startswith("transfer")
                   and entry["waits_for"] != [5]]
    assert both_issued  # waiting in an exchange whose other side is itself blocked: the case that was misnamed
    assert "Blocked (not hung" in report.to_text()


def test_host_bound_rank_is_listed_apart_with_its_launch_waits(tmp_path):
    """A host five times slower (its GPU idles between launches, its layers look 1.5x longer) is host-bound,
    not a slow GPU: no suspect, and its evidence says how long its GPU waited for launches against its peers."""
    scenario = Scenario("slow host", dp=2, tp=2, pp=2, seed=0, host_slow={1: 5.0})
    report = detect(load_and_merge(simulate(scenario, tmp_path).directory))
    assert report.suspects == [] and [entry.rank for entry in report.host_bound] == [1], report.to_text()
    evidence = report.host_bound[0].evidence[0]
    waited, peers = (float(evidence.split(part)[1].split("%")[0]) for part in ("launches ", "(its peers: "))
    assert waited > 30 > peers, evidence
    text = report.to_text()
    assert text.startswith("MegaScan detection: no suspect") and "Host-bound (not a slow GPU" in text


@pytest.mark.parametrize("faults", [{"culprits": {6: 1.3}}, {"host_slow": {2: 5.0}}], ids=["slow GPU", "slow host"])
def test_online_judgment_of_a_window_is_the_offline_detection_of_it(tmp_path, faults):
    """--trace-detect judges each window from the ranks' summaries (ops, iteration events, compute totals; no
    layer events) with the offline code: the same verdict as tools/aggregate.py -d on that window alone."""
    run = simulate(Scenario("online", dp=2, tp=2, pp=2, seed=1, **faults), tmp_path / "trace")
    lines = {path.name: [json.loads(text) for text in path.read_text().splitlines()]
             for path in (tmp_path / "trace").glob("benchmark-data-*.json")}
    summaries = [summarize(rank_lines[0], rank_lines[1]) for rank_lines in lines.values()]
    (tmp_path / "window0").mkdir()
    for name, rank_lines in lines.items():  # the same window as trace files
        write_lines(tmp_path / "window0" / name, rank_lines[:2])
    online, offline = judge(summaries), detect(load_and_merge(tmp_path / "window0"))
    verdict = [(s.rank, s.kind, round(s.score, 6)) for s in offline.suspects + offline.host_bound]
    assert verdict and [(s.rank, s.kind, round(s.score, 6)) for s in online.suspects + online.host_bound] == verdict
    assert set(run.scenario.culprits or run.scenario.host_slow) == {verdict[0][0]}



def test_per_window_judgment_names_the_hung_rank_in_the_window_that_stalled_and_nobody_before(tmp_path):
    """tools/aggregate.py --per-window on a run whose last window stalled: that window holds only issued
    records (no iterations completed), and is judged like the others."""
    run = simulate(Scenario("hang", dp=2, tp=2, pp=2, seed=1, hang=(5, 9, "tp", 2)), tmp_path)
    verdicts = judge_windows(load_and_merge(run.directory))
    assert [(v.window, v.iterations) for v in verdicts] == [(0, [4, 5]), (1, [9])]  # it stopped in 9
    assert verdicts[0].report.suspects == []
    assert [(s.rank, s.kind) for s in verdicts[1].report.suspects] == [(5, "hang")]
    assert verdicts[1].line().startswith("window 1 (iteration 9): rank 5 (DP0 PP1 TP1")
