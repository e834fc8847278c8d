"""Each trace window judged alone (``tools/aggregate.py --per-window``), as --trace-detect judges them during
the run.

The whole run's verdict pools every traced iteration: a GPU that turned slow in the last of five windows
is slow in a fifth of the evidence, which the run's own spread can hide (a real DP4 job on H100s, 35 %
slower from iteration 20 on: "no suspect" over the run, the loaded replica named in the window after the
onset). Judged one at a time, on the clocks aligned over the whole run, the windows say when a fault began
and name it where it shows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megascan.aggregate.merged_trace import MergedTrace
from megascan.aggregate.trace_subset import trace_subset
from megascan.detection import detect
from megascan.detection.report import Report


@dataclass
class WindowVerdict:
    window: int
    iterations: list  # the traced iterations of the window
    report: Report

    def line(self) -> str:
        headline = self.report.headline() or "no suspect"
        return f"window {self.window} (iterations {self.iterations[0]}-{self.iterations[-1]}): {headline}"

    def to_json(self) -> dict:
        return {"window": self.window, "iterations": self.iterations, "report": self.report.to_json()}


def window_iterations(merged: MergedTrace) -> dict[int, list[int]]:
    """window -> its traced iterations, from the op records (each carries its window and iteration)."""
    iterations = {}
    for instance in merged.instances:
        for record in instance.records.values():
            if record.get("iteration") is not None:
                iterations.setdefault(record["window"], set()).add(record["iteration"])
    return {window: sorted(numbers) for window, numbers in sorted(iterations.items())}


def _window(merged, iterations):
    """The merged trace of those iterations alone, its instances numbered 0..n-1 as detection indexes them (a
    subset for the timeline keeps the whole trace's instance ids instead)."""
    part = trace_subset(merged, iterations=set(iterations))
    return dataclasses.replace(part, instances=[dataclasses.replace(instance, id=number)
                                                for number, instance in enumerate(part.instances)])


def judge_windows(merged: MergedTrace) -> list[WindowVerdict]:
    """Each window's detection report, the windows in order."""
    return [WindowVerdict(window, iterations, detect(_window(merged, iterations)))
            for window, iterations in window_iterations(merged).items()]


def verdicts_text(verdicts: list[WindowVerdict]) -> str:
    lines = ["Each window judged alone (--per-window; as --trace-detect judges them during the run):"]
    return "\n".join(lines + [f"   {verdict.line()}" for verdict in verdicts])
