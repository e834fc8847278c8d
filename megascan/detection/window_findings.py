"""The whole run's report with what its windows found, each judged alone (``tools/aggregate.py -d``).

Pooled over every traced iteration, a GPU that turned slow part-way through a run is slow in part of the evidence
only, and the windows before the fault dilute it: on two H200s, a TP2 job whose GPU 1 was loaded from iteration 12
had windows 2-5 each name rank 1 while the whole run named nobody (its sampled compute came to 1.17x its peer's over
all six windows, under the bar for a sample). The windows are what --trace-detect judges during the run, so the
run's report takes in every rank that a window named as a slow rank: with the windows that named it and the delay
it caused in them (each window's, summed). A rank the whole run listed as host-bound is the slow GPU where a
window, judged alone, found its GPU slow.
"""

from __future__ import annotations

from megascan.aggregate.merged_trace import MergedTrace
from megascan.detection import detect
from megascan.detection.report import DELAY_PREFIX, Report, Suspect
from megascan.detection.window_verdicts import WindowVerdict, judge_windows

WHOLE_RUN_PREFIX = "over the whole run: "


def _windows_text(named):
    windows = [str(verdict.window) for verdict, _ in named]
    iterations = sorted(number for verdict, _ in named for number in verdict.iterations)
    which = f"window {windows[0]}" if len(windows) == 1 else f"windows {', '.join(windows[:-1])} and {windows[-1]}"
    return f"{which}: iterations {iterations[0]}-{iterations[-1]}"


def _window_line(named):
    lost = sum(suspect.delay_us for _, suspect in named)
    traced = sum(verdict.report.traced_us for verdict, _ in named)
    iterations = sum(verdict.report.iterations for verdict, _ in named)
    return (f"{DELAY_PREFIX}it made the {iterations} traced iterations of the windows that named it, judged alone as "
            f"during the run ({_windows_text(named)}), {lost / 1e3:.1f} ms longer: the job ran "
            f"{traced / (traced - lost):.2f}x slower in them"), lost


def with_window_findings(run: Report, verdicts: list) -> Report:
    """``run`` (the whole run's Report) with every slow rank that one of ``verdicts`` (window_verdicts.WindowVerdict,
    in order) named: module docstring."""
    found: dict[int, list[tuple[WindowVerdict, Suspect]]] = {}  # rank -> the windows that named it
    for verdict in verdicts:
        for suspect in verdict.report.suspects:
            if suspect.kind == "slow_rank":
                found.setdefault(suspect.rank, []).append((verdict, suspect))
    named = {suspect.rank: suspect for suspect in run.suspects}
    for rank, in_windows in found.items():
        line, lost = _window_line(in_windows)
        suspect = named.get(rank)
        if suspect is not None and suspect.kind == "slow_rank":
            whole_run = suspect.evidence[0].removeprefix(DELAY_PREFIX)
            suspect.evidence[0:1] = [line, WHOLE_RUN_PREFIX + whole_run]
            suspect.delay_us = lost
        elif suspect is None:
            verdict, latest = in_windows[-1]
            others = len(verdicts) - len(in_windows)
            diluted = (f"{WHOLE_RUN_PREFIX}it is not named there: the {others} window{'s' * (others != 1)} that did "
                       f"not name it dilute its excess")
            run.suspects.append(Suspect(rank, latest.coords, latest.host, latest.device_index, "slow_rank",
                                        lost / run.traced_us if run.traced_us else 0.0,
                                        [line, diluted] + [f"in window {verdict.window}: {evidence}"
                                                           for evidence in latest.evidence[1:]], lost))
    run.host_bound = [entry for entry in run.host_bound if entry.rank not in found]
    # Hung ranks first, in their order; then the slow ranks, the most delay first
    run.suspects.sort(key=lambda suspect: (0, 0.0) if suspect.kind == "hang" else (1, -suspect.score))
    return run


def judge_run(merged: MergedTrace) -> tuple[Report, list | None]:
    """What ``tools/aggregate.py -d`` judges: the whole run and, where the trace has several windows, each window
    alone, with their findings taken into the run's report. (the report, the window verdicts or None)."""
    report = detect(merged)
    if len({window for trace in merged.ranks.values() for window in trace.windows}) < 2:
        return report, None
    windows = judge_windows(merged)
    return with_window_findings(report, windows), windows
