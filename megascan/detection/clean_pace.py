"""What a slow GPU cost the job, measured against the job's own pace in the last window that named nobody.

The delay attribution estimates a culprit's cost from its excess over its peers' speed on the critical path.
Where the trace measured only a sample of a rank's work (--trace-tp-microbatches: one microbatch of a TP rank's
iteration), that estimate is the sample's excess scaled up to the whole iteration, and one microbatch is a small
sample: on two H200s it put a GPU under a competing load at 1.30-1.42x its peer while the job ran a steady 1.27x
slower, so the cost named ranged from 7 % to 47 % above the real loss. The scaled-up span also holds the
collectives, which a slow GPU does not slow.

Windows judged in order have a direct measure: a window's traced iterations against those of the latest window
that named nobody, the job's own pace before the fault. That loss is the cost, split among the window's slow ranks
in proportion to their critical-path estimates. The online judge (--trace-detect, window by window) and the offline
one (tools/aggregate.py, windows in order) apply the same rule, so they name the same cost. Without a clean window
before it (a fault from the first window on) the critical-path estimate stands. The cost stated, a slow rank that
cost the job too little to act on is not named (window_cost_bar.py), and a window left naming nobody sets the pace.
"""

from __future__ import annotations

from dataclasses import dataclass

from megascan.detection.report import DELAY_PREFIX, Report
from megascan.detection.window_cost_bar import hold_to_cost_bar

# The critical-path estimate stays in the evidence, under this name, where the clean window's measure replaces it
PEERS_ESTIMATE_PREFIX = "against its peers' speed: "


def _iterations_text(iterations):
    first, last = iterations[0], iterations[-1]
    return f"iteration {first}" if first == last else f"iterations {first}-{last}"


def is_clean(report: Report) -> bool:
    """Whether the window names nobody: no slow or hung rank and no slow link. A host-bound rank does not count:
    a job whose host sets its pace does so in every window, and that is the pace a fault is measured against."""
    return not report.suspects and not any(link["slow"] for link in report.links)


@dataclass
class CleanPace:
    window: int | None = None  # the latest window that named nobody
    iterations: tuple = ()  # its traced iterations
    iteration_us: float = 0.0  # its mean traced iteration

    def account(self, report: Report, window: int, iterations: list[int]) -> None:
        """Take ``report`` (of ``window``, judged after every earlier one) into the pace: in a window that names a
        slow rank, each slow rank's cost is restated as its share of the loss against the pace; then the slow ranks
        that cost the job too little to act on are taken out (window_cost_bar.py); a window left naming nobody becomes
        the pace."""
        if not is_clean(report):
            self._restate_costs(report)
            hold_to_cost_bar(report)
        if is_clean(report) and report.iterations:
            self.window, self.iterations = window, tuple(iterations)
            self.iteration_us = report.traced_us / report.iterations

    def _restate_costs(self, report):
        slow = [suspect for suspect in report.suspects if suspect.kind == "slow_rank" and suspect.delay_us > 0]
        lost = report.traced_us - self.iteration_us * report.iterations
        if self.window is None or not slow or lost <= 0:
            return
        estimated = sum(suspect.delay_us for suspect in slow)
        measured = (f"{DELAY_PREFIX}its window's {report.iterations} traced iterations took {lost / 1e3:.1f} ms longer "
                    f"than the {len(self.iterations)} of window {self.window} ({_iterations_text(self.iterations)}), "
                    f"the last that named nobody: the job ran {report.traced_us / (report.traced_us - lost):.2f}x "
                    f"slower")
        for suspect in slow:
            share = suspect.delay_us / estimated
            suspect.delay_us = share * lost
            split = (f"; its share, by its excess on the critical path: {100 * share:.0f} % "
                     f"({suspect.delay_us / 1e3:.1f} ms)" if len(slow) > 1 else "")
            peers = suspect.evidence[0].removeprefix(DELAY_PREFIX)
            suspect.evidence[0:1] = [measured + split, PEERS_ESTIMATE_PREFIX + peers]
