"""Detection on trace windows recorded on real GPUs (tests/data/*/README.md says how each was made)."""

import json
from pathlib import Path

import pytest
from helpers.launch import run_script
from helpers.online_windows import window_summaries

from megascan.aggregate import load_and_merge
from megascan.aggregate_cli import main
from megascan.detection import detect
from megascan.detection.window_verdicts import judge_windows
from megascan.online_detection import WindowJudge, alert_line

DATA = Path(__file__).parent / "data"
LATE_ONSET = DATA / "dp4_late_onset_h100"


def test_data_parallel_replica_loaded_late_is_named_alone_from_the_window_of_the_onset():
    """The load began in iteration 20, the second of window 3: the windows before name nobody, windows 3
    and 4 name rank 2 alone (its varying excess, outside the measured work, does not raise its own bar)."""
    merged = load_and_merge(LATE_ONSET)
    # Over the whole run the loaded replica still cost 181 ms, 2.7 % of the 10 traced iterations.
    assert [(s.rank, s.kind) for s in detect(merged).suspects] == [(2, "slow_rank")]
    verdicts = judge_windows(merged)
    assert [(v.window, v.iterations) for v in verdicts] == [(0, [4, 5]), (1, [9, 10]), (2, [14, 15]), (3, [19, 20]),
                                                           (4, [24, 25])]
    loaded_rank = [(2, "slow_rank")]
    assert [[(s.rank, s.kind) for s in v.report.suspects] for v in verdicts] == [[], [], [], loaded_rank, loaded_rank]
    loaded = verdicts[-1].report
    assert loaded.host_bound == []
    assert any("less than its peers' (its host was not late)" in line for line in loaded.suspects[0].evidence)


def test_per_window_flag_prints_each_window_and_writes_them_in_the_report_json(tmp_path, capsys):
    assert main(["-b", str(LATE_ONSET), "-o", str(tmp_path / "t.json"), "--per-window",
                 "--report-json", str(tmp_path / "report.json")]) == 0
    text = capsys.readouterr().out
    assert "MegaScan detection: 1 suspect(s)" in text
    assert "Each window judged alone (--per-window; as --trace-detect judges them during the run):" in text
    assert "   window 2 (iterations 14-15): no suspect\n" in text
    assert "   window 3 (iterations 19-20): rank 2 (DP2 PP0 TP0, host vm, GPU 2): slow rank, score" in text
    assert "   window 4 (iterations 24-25): rank 2 (DP2 PP0 TP0, host vm, GPU 2): slow rank, score" in text
    report = json.loads((tmp_path / "report.json").read_text())
    assert [s["rank"] for s in report["suspects"]] == [2]
    assert [(w["window"], [s["rank"] for s in w["report"]["suspects"]]) for w in report["windows"]] == [
        (0, []), (1, []), (2, []), (3, [2]), (4, [2])]


LOADED_H200 = DATA / "h200_loaded_gpu"
# case: (the loaded rank, its pipeline role, the window after the load began, what the load cost the job over that
# window's 2 iterations: loaded minus healthy ms per iteration, the medians of the same run's log, times 2)
LOADED_CASES = {
    "tp2_load_rank1": (1, "TP peer", 2, 2 * 411.6),
    "pp2_load_stage0": (0, "first stage", 2, 2 * 312.7),
    "pp2_load_stage1_duty03": (1, "last stage", 2, 2 * 197.8),
}


def test_a_gpu_under_a_competing_load_is_named_alone_with_the_cost_it_caused():
    """2 x H200, GPT 1.3B micro batch 8 (tests/data/h200_loaded_gpu/README.md): a TP peer, the first and the last
    pipeline stage under scripts/gpu_load.py. The window after the load began names the loaded GPU alone, as a
    slow GPU (not host-bound), with a delay within 25 % of what the job really lost; the window before names nobody."""
    for case, (rank, role, window, lost_ms) in LOADED_CASES.items():
        verdicts = {v.window: v.report for v in judge_windows(load_and_merge(LOADED_H200 / case))}
        report = verdicts.pop(window)
        assert [(s.rank, s.kind) for s in report.suspects] == [(rank, "slow_rank")], (case, role)
        assert report.host_bound == [], (case, role)
        named_ms = report.suspects[0].delay_us / 1e3
        assert abs(named_ms / lost_ms - 1) <= 0.25, (case, named_ms, lost_ms)
        assert all(r.suspects == [] for r in verdicts.values()), case


def test_a_healthy_tp_pair_whose_sampled_compute_differed_by_1_16x_raises_no_alarm():
    """A healthy TP2 window whose one recorded microbatch (--trace-tp-microbatches 1: 4 % of the work) measured rank 0's
    compute at 1.16x its peer's: extrapolated from so small a sample, that is within a healthy pair's spread."""
    (verdict,) = judge_windows(load_and_merge(LOADED_H200 / "tp2_healthy"))
    assert verdict.report.suspects == [] and verdict.report.host_bound == []


def test_the_cost_of_a_slow_gpu_is_measured_against_the_last_window_that_named_nobody():
    """The TP peer's window 2 against window 1, the window before the load began: its two traced iterations took
    819 ms longer, where the log's medians say the job lost 823 ms. Its one recorded microbatch alone put the cost
    at 879 ms, and in other windows of the same run at up to 47 % above the loss; that estimate stays beside it."""
    verdicts = {v.window: v.report for v in judge_windows(load_and_merge(LOADED_H200 / "tp2_load_rank1"))}
    (suspect,) = verdicts[2].suspects
    assert suspect.evidence[0].startswith("delay it caused: its window's 2 traced iterations took ")
    assert "than the 2 of window 1 (iterations 9-10), the last that named nobody: the job ran 1.27x slower" \
        in suspect.evidence[0]
    assert suspect.evidence[1].startswith("against its peers' speed: it made the 2 traced iterations ")
    assert suspect.delay_us / 1e3 == pytest.approx(LOADED_CASES["tp2_load_rank1"][3], rel=0.05)


def test_online_alerts_name_the_culprit_kind_and_cost_that_the_offline_windows_name(capsys):
    """--trace-detect's judge, fed the ranks' summaries window after window, measures the cost against the same
    clean window as tools/aggregate.py does: each alert is the offline verdict of that window, word for word."""
    for case in LOADED_CASES:
        judge = WindowJudge()
        alerts = [judge.window(summaries) for summaries in window_summaries(LOADED_H200 / case)]
        offline = judge_windows(load_and_merge(LOADED_H200 / case))
        assert len(alerts) == len(offline)
        assert alerts == [alert_line(v.report, v.window, v.iterations) for v in offline], case
        if case == "tp2_load_rank1":  # the case with a clean window before the loaded one
            assert "than the 2 of window 1" in alerts[-1]
    capsys.readouterr()


def test_the_run_report_takes_in_a_slow_gpu_that_only_the_windows_after_its_onset_name(tmp_path, capsys):
    """Over both windows the loaded TP peer's sampled excess is diluted below the bar, so the whole run alone names
    nobody; -d judges the windows too (as --trace-detect did) and names it, with the cost the window measured."""
    assert detect(load_and_merge(LOADED_H200 / "tp2_load_rank1")).suspects == []
    assert main(["-b", str(LOADED_H200 / "tp2_load_rank1"), "-o", str(tmp_path / "t.json"), "-d",
                 "--report-json", str(tmp_path / "report.json")]) == 0
    text = capsys.readouterr().out
    assert "MegaScan detection: 1 suspect(s), most likely first\n1. rank 1 (DP0 PP0 TP1, host vm, GPU 1): slow rank" \
        in text
    assert ("delay it caused: it made the 2 traced iterations of the windows that named it, judged alone as during "
            "the run (window 2: iterations 14-15), 819.1 ms longer: the job ran 1.27x slower in them") in text
    assert "over the whole run: it is not named there: the 1 window that did not name it dilute its excess" in text
    assert "Each window judged alone" not in text  # printed with --per-window
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(s["rank"], s["kind"]) for s in report["suspects"]] == [(1, "slow_rank")] and report["host_bound"] == []
    assert [(w["window"], [s["rank"] for s in w["report"]["suspects"]]) for w in report["windows"]] == [
        (1, []), (2, [1])]


def test_the_tp_collective_share_bench_reads_a_real_tp_trace_and_refuses_one_without_tp_in_one_line():
    """bench/tp_collective_share.py on the healthy TP2 window: both ranks' recorded TP collectives took about a
    quarter of the recorded stretch; a PP2 trace has no tensor-parallel collective to measure."""
    result = run_script("bench/tp_collective_share.py", [LOADED_H200 / "tp2_healthy"])
    assert result.returncode == 0, result.stderr[-2000:]
    shares = [float(line.rsplit("|", 2)[1].strip(" %")) for line in result.stdout.splitlines()[2:]]
    assert len(shares) == 2 and all(20 < share < 32 for share in shares), result.stdout
    refused = run_script("bench/tp_collective_share.py", [LOADED_H200 / "pp2_load_stage0"])
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].endswith(
        "no tensor-parallel collective recorded; trace a TP job at --trace-granularity full"), refused.stderr
