"""Each trace window judged alone (``tools/aggregate.py --per-window``), as --trace-detect judges them during
the run.

The whole run's verdict pools every traced iteration: a GPU that turned slow in the last of five windows
is slow in a fifth of the evidence, which the run's own spread can hide (a real DP4 job on H100s, 35 %
slower from iteration 20 on: "no suspect" over the run, the loaded replica named in the window after the
onset). Judged one at a time, on the clocks aligned over the whole run, the windows say when a fault began
and name it where it shows.
"""

from __future__ import annotations

from dataclasses import dataclass

from megascan.aggregate.merged_trace import MergedTrace
from megascan.aggregate.trace_records import OpRecord
from megascan.aggregate.trace_subset import restricted
from megascan.detection import detect
from megascan.detection.clean_pace import CleanPace
from megascan.detection.report import Report


@dataclass
class WindowVerdict:
    window: int
    iterations: list  # the traced iterations of the window
    report: Report

    def line(self) -> str:
        headline = self.report.headline() or "no suspect"
        first, last = self.iterations[0], self.iterations[-1]
        iterations = f"iteration {first}" if first == last else f"iterations {first}-{last}"
        return f"window {self.window} ({iterations}): {headline}"

    def to_json(self) -> dict:
        return {"window": self.window, "iterations": self.iterations, "report": self.report.to_json()}


def window_iterations(merged: MergedTrace) -> dict[int, list[int]]:
    """window -> its traced iterations, from the op records (each carries its window and iteration)."""
    iterations: dict[int, set[int]] = {}
    for instance in merged.instances:
        for record in instance.records.values():
            if record.iteration is not None:
                iterations.setdefault(record.window, set()).add(record.iteration)
    return {window: sorted(numbers) for window, numbers in sorted(iterations.items())}


def _window(merged, window, iterations):
    """The merged trace of one window alone: its op records (those of a window that stalled included, only
    issued) and the compute events of its iterations."""
    kept = set(iterations)

    def in_window(item, rank):
        return item.window == window if isinstance(item, OpRecord) else item.iteration in kept
    return restricted(merged, in_window, renumber=True)


def judge_windows(merged: MergedTrace) -> list[WindowVerdict]:
    """Each window's detection report, the windows in order, a slow rank's cost measured against the job's pace in
    the last window before it that named nobody (clean_pace), as --trace-detect measures it."""
    pace, verdicts = CleanPace(), []
    for window, iterations in window_iterations(merged).items():
        report = detect(_window(merged, window, iterations))
        pace.account(report, window, iterations)
        verdicts.append(WindowVerdict(window, iterations, report))
    return verdicts


def verdicts_text(verdicts: list[WindowVerdict]) -> str:
    lines = ["Each window judged alone (--per-window; as --trace-detect judges them during the run):"]
    return "\n".join(lines + [f"   {verdict.line()}" for verdict in verdicts])
