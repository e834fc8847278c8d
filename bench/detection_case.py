"""One case directory of bench/gpu_megascan_detection.sh (``detect_<name>/``), read: the case (case.json), what
its log says (each iteration's time, the iteration in which the competing load began, the online alerts), the
ranks' trace metadata and the detection report (report.json, each window judged alone).

``python bench/detection_case.py DIR`` prints how much slower the load made the job and the first online alert
after it began, as the bench script does after each loaded case.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

LOAD_MARKER = "== competing load began"  # appended to the log by the bench script when the load's GEMMs began
ITERATION_TIME = re.compile(r"iteration +(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+)")
# Online detection's line (megascan/online_detection.py): "... window W (iterations A-B): rank R (DP.. PP.. TP..,
# host H, GPU G): slow rank, score S; <first evidence line>"
ALERT = re.compile(r"MegaScan alert: window (\d+) \(iterations (\d+)-(\d+)\): rank (\d+) \(.*?\): (.+?), score")
WARM_UP_ITERATIONS = 2  # they build, compile and fill caches: no healthy or loaded time counts them
SPEC_FIELDS = ("name", "model", "layout", "gpu", "loaded_rank", "duty", "onset", "iterations", "exit")


class CaseError(Exception):
    """A case directory that cannot be read; the message says which file and what to do."""


@dataclass
class OnlineAlert:
    window: int
    first: int  # the window's first and last iteration
    last: int
    rank: int
    label: str  # as the alert says it: "slow rank", "hung", "host bound"


@dataclass
class DetectionCase:
    spec: dict  # case.json: SPEC_FIELDS
    times: dict[int, float]  # iteration -> ms, the log's per-iteration times
    onset: int  # the iteration the load began in (the log's marker), else the configured onset
    load_began: bool  # the log holds the marker
    alerts: list[OnlineAlert]
    metadata: dict[int, dict]  # rank -> its trace file's metadata line
    report: dict | None  # report.json; None where the case left none

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def loaded(self) -> bool:
        return self.spec["gpu"] is not None

    def times_before_onset(self) -> list[float]:
        return [ms for iteration, ms in self.times.items() if WARM_UP_ITERATIONS < iteration < self.onset]

    def times_after_onset(self) -> list[float]:
        # a margin of one iteration: the marker and the job's lines are written by two processes
        return [ms for iteration, ms in self.times.items() if iteration > self.onset + 1]

    def times_after_warm_up(self) -> list[float]:
        return [ms for iteration, ms in self.times.items() if iteration > WARM_UP_ITERATIONS]


def _json(path: Path) -> dict:
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CaseError(f"{path}: cannot read it as JSON ({error}); run the case again") from None
    if not isinstance(document, dict):
        raise CaseError(f"{path}: holds no JSON object; run the case again")
    return document


def _spec(directory: Path) -> dict:
    spec = _json(directory / "case.json")
    missing = [field for field in SPEC_FIELDS if field not in spec]
    if missing:
        raise CaseError(f"{directory / 'case.json'}: no {', '.join(missing)}; it is written by "
                        f"bench/gpu_megascan_detection.sh: run the case again")
    return spec


def load_onset(text: str, configured: int) -> tuple[int, bool]:
    """(the iteration the load began in, whether the log's marker says so): the first iteration logged after the
    marker is the one it began in; without a marker, the configured onset."""
    marker = text.find(LOAD_MARKER)
    later = ITERATION_TIME.search(text, marker) if marker >= 0 else None
    return (int(later.group(1)), True) if later else (configured, marker >= 0)


def _trace_metadata(trace: Path) -> dict[int, dict]:
    """rank -> the metadata line (the first) of its trace file; {} where the job left no trace."""
    metadata = {}
    for path in sorted(trace.glob("benchmark-data-*.json")):
        with open(path) as lines:
            try:
                first = json.loads(lines.readline())
            except ValueError:
                continue  # a file cut short by a killed job: the aggregation says so; its rank stays unknown
        if first.get("type") == "metadata":
            metadata[first["rank"]] = first
    return metadata


def read_case(directory: Path) -> DetectionCase:
    spec = _spec(directory)
    log = directory / "log"
    text = log.read_text(errors="replace") if log.exists() else ""
    onset, load_began = load_onset(text, spec["onset"])
    report = _json(directory / "report.json") if (directory / "report.json").exists() else None
    return DetectionCase(
        spec=spec,
        times={int(m.group(1)): float(m.group(2)) for m in ITERATION_TIME.finditer(text)},
        onset=onset, load_began=load_began,
        alerts=[OnlineAlert(int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4)), m.group(5))
                for m in ALERT.finditer(text)],
        metadata=_trace_metadata(directory / "trace"), report=report)


def slowdown_lines(case: DetectionCase) -> list[str]:
    """How much slower the job ran after the load began, and the first online alert after it."""
    lines = []
    before, after = case.times_before_onset(), case.times_after_onset()
    if before and after:
        b, a = statistics.median(before), statistics.median(after)
        lines.append(f"load began in iteration {case.onset}; ms/iter before {b:.1f}, after {a:.1f}: "
                     f"{100 * (a / b - 1):+.1f} %")
    alert = next((alert for alert in case.alerts if alert.last >= case.onset), None)
    if alert:
        lines.append(f"first alert after it: window {alert.window} (iterations {alert.first}-{alert.last}), "
                     f"rank {alert.rank}: {alert.last - case.onset} iteration(s) after the onset's iteration")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="detection_case.py", description=__doc__.split("\n\n")[1])
    parser.add_argument("directory", type=Path, help="a case's directory (RESULTS/detect_<name>)")
    args = parser.parse_args(argv)
    try:
        case = read_case(args.directory)
    except CaseError as error:
        print(f"detection_case.py: error: {error}", file=sys.stderr)
        return 2
    for line in slowdown_lines(case):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
