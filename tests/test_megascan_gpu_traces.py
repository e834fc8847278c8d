"""Detection on trace windows recorded on real GPUs (tests/data/*/README.md says how each was made)."""

import json
from pathlib import Path

from megascan.aggregate import load_and_merge
from megascan.aggregate_cli import main
from megascan.detection import detect
from megascan.detection.window_verdicts import judge_windows

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
    assert "less than its peers' (its host was not late)" in loaded.suspects[0].evidence[1]


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
