"""What a slow rank must have cost the job before a trace window judged alone names it (--trace-detect during the
run, tools/aggregate.py's windows after it).

A window's alert is what a user acts on, by draining a node, and a window is a small sample: a couple of
iterations, whose pace moves by itself. So a window names a slow rank only where it cost the job at least
MIN_COST_SHARE of the window's traced iterations: its delay as the window states it, measured against the last
window that named nobody where there is one (clean_pace.py), else estimated from its excess on the critical path.
In a DP2 x PP2 x TP2 job of an independent simulator, a window named a healthy rank that had lost two time slices
beside the real culprit, the job 1.03x slower by it. Hung ranks and slow links are not held to it: a hang is no
matter of degree, and a link is measured against the other links. A slow GPU that costs less than this in every
window (a first stage hidden in a deep pipeline's bubbles) is still named by the whole run's verdict, where every
traced iteration is evidence.
"""

from __future__ import annotations

from megascan.detection.report import Report

# A loss under 5 % of a window is within how far a healthy job's own pace moves from window to window (a healthy
# TP2 job on two H200s: 1402-1623 ms per iteration over its windows), so a user could not see it in the job's
# iteration times, let alone drain a node for it; every GPU under a competing load traced on real GPUs here cost
# the job 15-28 % (docs/benchmarks.md).
MIN_COST_SHARE = 0.05


def hold_to_cost_bar(report: Report) -> None:
    """Takes out of a window's ``report`` (its slow ranks' costs stated) every slow rank that cost the job less than
    MIN_COST_SHARE of the window's traced iterations, and the victims that waited for none but them."""
    report.drop_suspects({suspect.rank for suspect in report.suspects
                          if suspect.kind == "slow_rank" and suspect.delay_us < MIN_COST_SHARE * report.traced_us})
