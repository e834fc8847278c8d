"""The GPU detection matrix as one markdown table (docs/benchmarks.md, "MegaScan: detection").

``python bench/detection_matrix.py DIR`` reads every case that bench/gpu_megascan_detection.sh wrote under DIR
(its RESULTS; ``MATRIX=1`` makes the matrix's cases) and prints one row per case, judged by the matrix's checks:

1. A loaded GPU's rank is named first, as a slow rank, in every window after the load began: by the verdict of
   the window judged alone offline (``tools/aggregate.py --per-window``) and by the online alert
   (``--trace-detect``). A healthy run names nobody: no alert, no suspect in any window nor over the run.
2. The delay named for it over those windows (its ``delay_us``, the "delay it caused" line) is within 25 % of
   what the job lost in them: (loaded - healthy ms per iteration) x their iterations, where "healthy" is the
   median of the same job's healthy runs in DIR, else the run's own iterations before the load began.
3. The online alert and the offline verdict agree on every window.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from detection_case import CaseError, DetectionCase, read_case

COST_TOLERANCE = 0.25
COLUMNS = ("case", "job", "load", "healthy ms/iteration", "loaded ms/iteration", "online alerts",
           "offline per-window verdicts", "whole run", "online = offline", "named vs lost", "verdict")
CAPTION = ("Online alerts and offline per-window verdicts: of a loaded case, the windows after the iteration the "
           "load began in; of a healthy one, every window that names someone. Named vs lost: the delay named for "
           "the loaded rank over those windows against (loaded - healthy ms/iteration) x their iterations.")

Named = tuple[int, str] | None  # (rank, what it is: "slow rank", "hung", "host bound") named first, or nobody


def kind_label(kind: str) -> str:
    """A suspect's kind as the online alert words it (Report.headline)."""
    return "hung" if kind == "hang" else kind.replace("_", " ")


def describe(named: Named) -> str:
    return "nobody" if named is None else f"rank {named[0]} {named[1]}"


@dataclass
class Window:
    number: int
    iterations: list[int]
    offline: Named  # the first suspect of the window judged alone
    online: Named  # the alert's
    suspects: list[dict]  # the offline suspects, with their evidence


def windows(case: DetectionCase) -> list[Window]:
    """Every window the offline report judged or an alert named, in order."""
    online = {alert.window: (alert.rank, alert.label) for alert in case.alerts}
    found = {}
    for entry in (case.report or {}).get("windows", []):
        suspects = entry["report"]["suspects"]
        first = (suspects[0]["rank"], kind_label(suspects[0]["kind"])) if suspects else None
        found[entry["window"]] = Window(entry["window"], entry["iterations"], first, online.get(entry["window"]),
                                        suspects)
    for alert in case.alerts:
        if alert.window not in found:
            found[alert.window] = Window(alert.window, list(range(alert.first, alert.last + 1)), None,
                                         online[alert.window], [])
    return [found[number] for number in sorted(found)]


def windows_text(named: Sequence[tuple[int, Named]]) -> str:
    """'2-5: rank 1 slow rank' for consecutive windows of one verdict; 'none' when no window names anyone."""
    if all(who is None for _, who in named):
        return "none"
    runs: list[list] = []  # [first window, last window, who]
    for number, who in named:
        if runs and runs[-1][2] == who and runs[-1][1] == number - 1:
            runs[-1][1] = number
        else:
            runs.append([number, number, who])
    return "; ".join(f"{first if first == last else f'{first}-{last}'}: {describe(who)}" for first, last, who in runs)


def named_delay_ms(window: Window, rank: int) -> float:
    """The delay the window's offline report names for ``rank`` as a slow rank (0 where it names none)."""
    for suspect in window.suspects:
        if suspect["rank"] == rank and suspect["kind"] == "slow_rank":
            return suspect["delay_us"] / 1e3
    return 0.0


def healthy_reference(case: DetectionCase, cases: list[DetectionCase]) -> tuple[float | None, str]:
    """(healthy ms per iteration, where it comes from): the median over the same job's healthy runs that
    finished, else the run's own iterations before the onset."""
    runs = [other for other in cases if not other.loaded and other.spec["exit"] == 0
            and (other.spec["model"], other.spec["layout"]) == (case.spec["model"], case.spec["layout"])]
    pooled = [ms for run in runs for ms in run.times_after_warm_up()]
    if pooled:
        return statistics.median(pooled), f"{len(runs)} healthy run{'s' if len(runs) > 1 else ''}"
    before = case.times_before_onset()
    return (statistics.median(before), "before the onset") if before else (None, "no healthy run")


def job_label(case: DetectionCase) -> str:
    """'1.3b_mb8 TP2 x DP2 + SP', from the ranks' trace metadata (else the case's layout name)."""
    layout = next(iter(case.metadata.values()), {}).get("layout")
    if layout is None:
        return f"{case.spec['model']} {case.spec['layout']}"
    parts = [f"{axis.upper()}{layout[axis]}" for axis in ("tp", "pp", "dp") if layout[axis] > 1]
    return f"{case.spec['model']} {' x '.join(parts) or 'one rank'}{' + SP' if layout.get('sequence_parallel') else ''}"


def loaded_rank(case: DetectionCase) -> int:
    """The rank on the loaded GPU: by the traces' device indices where one rank has it, else case.json's."""
    on_gpu = [rank for rank, metadata in case.metadata.items() if metadata.get("device_index") == case.spec["gpu"]]
    return on_gpu[0] if len(on_gpu) == 1 else case.spec["loaded_rank"]


def role(case: DetectionCase, rank: int) -> str:
    metadata = case.metadata.get(rank)
    if metadata is None:
        return "no trace of it"
    layout, stage = metadata["layout"], metadata["coords"]["pp"]
    roles = ["TP peer"] if layout["tp"] > 1 else []
    if layout["pp"] > 1:
        roles.append("first stage, data loader" if stage == 0 else
                     "last stage, loss" if stage == layout["pp"] - 1 else f"stage {stage}")
    return ", ".join(roles) or ("DP replica" if layout["dp"] > 1 else "the only rank")


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


@dataclass
class Judged:
    """The cells in which a loaded case and a healthy one differ, and the checks it failed."""

    load: str
    loaded_ms: str
    online: str
    offline: str
    named_vs_lost: str
    failures: list[str]


def _judge_healthy(case: DetectionCase, every: list[Window]) -> Judged:
    alerts = [(window.number, window.online) for window in every if window.online]
    suspects = [(window.number, window.offline) for window in every if window.offline]
    failures = ["an online alert"] if alerts else []
    failures += ["a window names a suspect"] if suspects else []
    failures += ["the whole run names a suspect"] if case.report and case.report["suspects"] else []
    return Judged("healthy", "", windows_text(alerts), windows_text(suspects), "", failures)


def _named_vs_lost(loaded: list[Window], rank: int, healthy_ms: float | None,
                   loaded_ms: float | None) -> tuple[str, list[str]]:
    """(the cell, the failures of check 2)."""
    if not loaded or healthy_ms is None or loaded_ms is None:
        return "n/a", ["no iteration times to compare"] if loaded else []
    named = sum(named_delay_ms(window, rank) for window in loaded)
    lost = sum(len(window.iterations) for window in loaded) * (loaded_ms - healthy_ms)
    if lost <= 0:
        return f"{named:.0f} ms named; nothing lost", ["the job was not slower than healthy"]
    deviation = named / lost - 1
    failures = [f"named delay {100 * deviation:+.0f} % off the loss"] if abs(deviation) > COST_TOLERANCE else []
    return f"{named:.0f} vs {lost:.0f} ms ({100 * deviation:+.0f} %)", failures


def _judge_loaded(case: DetectionCase, every: list[Window], healthy_ms: float | None) -> Judged:
    rank = loaded_rank(case)
    culprit = (rank, "slow rank")
    after = [window for window in every if window.iterations[0] > case.onset]
    failures = [] if case.load_began else ["the load never began (no marker in the log)"]
    failures += [] if after else ["no window after the onset"]
    for source in ("offline", "online"):
        missed = [str(window.number) for window in after if getattr(window, source) != culprit]
        failures += [f"{source}: window(s) {', '.join(missed)} do not name rank {rank} first"] if missed else []
    times = case.times_after_onset()
    loaded_ms = statistics.median(times) if times else None
    slower = f" ({100 * (loaded_ms / healthy_ms - 1):+.1f} %)" if loaded_ms and healthy_ms else ""
    named_vs_lost, cost_failures = _named_vs_lost(after, rank, healthy_ms, loaded_ms)
    load = (f"GPU {case.spec['gpu']}: rank {rank} ({role(case, rank)}), duty {case.spec['duty']:g}, from iteration "
            f"{case.onset}{'' if case.load_began else ' (configured)'}")
    return Judged(load, _ms(loaded_ms) + slower, windows_text([(window.number, window.online) for window in after]),
                  windows_text([(window.number, window.offline) for window in after]), named_vs_lost,
                  failures + cost_failures)


def _run_failures(case: DetectionCase) -> list[str]:
    status = case.spec["exit"]
    failures = [] if status == 0 else ["the job did not finish" if status is None else f"the job exited {status}"]
    if case.report is None:
        failures.append("no report.json")
    elif "windows" not in case.report:
        failures.append("report.json has no window verdicts (tools/aggregate.py --per-window)")
    return failures


def judge(case: DetectionCase, cases: list[DetectionCase]) -> tuple[list[str], bool]:
    """(the case's row, whether it passes)."""
    every = windows(case)
    healthy_ms, source = healthy_reference(case, cases)
    judged = _judge_loaded(case, every, healthy_ms) if case.loaded else _judge_healthy(case, every)
    differ = [window for window in every if window.online != window.offline]
    agreement = "yes" if not differ else "no: " + "; ".join(
        f"window {w.number} online {describe(w.online)}, offline {describe(w.offline)}" for w in differ)
    failures = _run_failures(case) + judged.failures
    failures += [f"online and offline differ in window(s) {', '.join(str(w.number) for w in differ)}"] if differ else []
    whole = case.report["suspects"] if case.report else []
    whole_run = ("n/a" if case.report is None else "no suspect" if not whole else
                 describe((whole[0]["rank"], kind_label(whole[0]["kind"]))) +
                 (f" (+{len(whole) - 1} more)" if len(whole) > 1 else ""))
    verdict = "PASS" if not failures else "FAIL: " + "; ".join(failures)
    return [case.name, job_label(case), judged.load, f"{_ms(healthy_ms)} ({source})", judged.loaded_ms,
            judged.online, judged.offline, whole_run, agreement, judged.named_vs_lost, verdict], not failures


def table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def _order(case: DetectionCase) -> tuple:
    """Each job's rows together, its healthy runs first."""
    spec = case.spec
    return spec["model"], spec["layout"], case.loaded, spec["gpu"] or 0, spec["duty"] or 0, spec["name"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="detection_matrix.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, metavar="DIR", help="the RESULTS of bench/gpu_megascan_detection.sh")
    args = parser.parse_args(argv)
    try:
        if not args.results.is_dir():
            raise CaseError(f"{args.results} is not a directory; pass the RESULTS that "
                            f"bench/gpu_megascan_detection.sh wrote into")
        directories = sorted(path.parent for path in args.results.glob("*/case.json"))
        if not directories:
            raise CaseError(f"no case under {args.results} (a folder with case.json); run MATRIX=1 "
                            f"RESULTS={args.results} bash bench/gpu_megascan_detection.sh first")
        cases = sorted((read_case(directory) for directory in directories), key=_order)
    except CaseError as error:
        print(f"detection_matrix.py: error: {error}", file=sys.stderr)
        return 2
    judged = [judge(case, cases) for case in cases]
    print(table([cells for cells, _ in judged]))
    print(f"\n{CAPTION}\n\n{sum(passed for _, passed in judged)} of {len(judged)} case(s) pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
