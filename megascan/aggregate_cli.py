"""``python tools/aggregate.py -b TRACE_DIR``: merge a run's per-rank MegaScan traces into one
clock-aligned Chrome trace, optionally an SQLite database, and with ``-d`` find the slow or hung rank.

Bad input stops the tool before any work with one line naming the flag and what to do (exit 2):
a mistyped directory should cost seconds, not a merge. Flags and outputs: docs/megascan_aggregate.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from megascan.aggregate.alignment_summary import describe_alignment
from megascan.aggregate.chrome_trace import write_chrome_trace
from megascan.aggregate.flight_recorder import FlightRecorderError, find_dumps, witness
from megascan.aggregate.loading import TRACE_FILE, TraceDirectoryError, describe
from megascan.aggregate.merged_trace import MergedTrace, load_and_merge
from megascan.aggregate.sqlite_export import write_sqlite
from megascan.aggregate.trace_subset import SubsetError, left_out, parse_numbers, trace_subset, traced_iterations
from megascan.detection.window_findings import judge_run
from megascan.detection.window_verdicts import verdicts_text
from megatron.training.atomic_file import replaced_on_success
from megatron.training.garbage_collection import cycle_collection_paused

PROG = "tools/aggregate.py"
DEFAULT_OUTPUT = "benchmark.json"


class UsageError(Exception):
    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog=PROG, description="Merge the per-rank MegaScan trace files of one run into one "
                            "clock-aligned Chrome/Perfetto trace.")
    parser.add_argument("-b", "--benchmark", "--bench-dir", "--benchmark_dir", dest="directory", required=True,
                        metavar="DIR", help="the run's --trace-dir (holds benchmark-data-*.json)")
    parser.add_argument("-o", "--output", metavar="PATH",
                        help=f"merged Chrome trace JSON (default: DIR/{DEFAULT_OUTPUT})")
    parser.add_argument("-d", "--detect", action="store_true",
                        help="find the slow GPU, slow link or hung rank and print the report")
    parser.add_argument("--report-json", metavar="PATH", help="also write the detection report as JSON (implies -d)")
    parser.add_argument("--per-window", action="store_true",
                        help="also print the verdict of each trace window judged alone, as --trace-detect judges them "
                        "during the run (-d takes their findings into the run's report anyway; implies -d)")
    parser.add_argument("--flight-recorder", metavar="PREFIX",
                        help="also read NCCL's flight-recorder dumps PREFIX<rank> (TORCH_NCCL_DEBUG_INFO_TEMP_FILE; "
                        "implies -d); MegaScan's own dumps in DIR are read with -d anyway")
    parser.add_argument("--sqlite", metavar="PATH", help="also write tables ranks, events, ops to an SQLite file")
    parser.add_argument("--ranks", metavar="LIST", help="write only these ranks to the Chrome trace, e.g. 0-63,512 "
                        "(detection and SQLite still cover every rank)")
    parser.add_argument("--iterations", metavar="LIST", help="write only these traced iterations to the Chrome "
                        "trace, e.g. 9-10")
    return parser


# A timeline this large loads slowly in Perfetto (and not at all in chrome://tracing): say how to write a part.
LARGE_TIMELINE_SLICES = 500_000


def _selection(args):
    """(ranks, iterations) asked for by --ranks/--iterations (None: all); UsageError on a bad list."""
    chosen = []
    for flag, text in (("--ranks", args.ranks), ("--iterations", args.iterations)):
        try:
            chosen.append(None if text is None else parse_numbers(text, flag))
        except SubsetError as error:
            raise UsageError(error.flag, str(error)) from None
    return chosen


def _timeline(merged, ranks, iterations):
    """(the part of the trace the Chrome trace shows, what the summary says about it)."""
    if ranks is None and iterations is None:
        slices = sum(len(t.events) for t in merged.ranks.values()) + sum(len(i.records) for i in merged.instances)
        hint = (f" ({slices:,} slices: Perfetto loads this slowly; --ranks/--iterations write a part)"
                if slices > LARGE_TIMELINE_SLICES else "")
        return merged, hint
    try:
        part = trace_subset(merged, ranks, iterations)
    except SubsetError as error:
        raise UsageError(error.flag, str(error)) from None
    shown = describe(sorted(part.ranks), "rank") + f" of {len(merged.ranks)}"
    if iterations is not None:
        shown += ", " + describe(sorted(iterations & traced_iterations(merged)), "iteration")
    for line in left_out(merged, ranks, iterations):
        print(f"warning: {line}", file=sys.stderr)
    return part, f" ({shown})"


def _check_output(flag, path):
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(flag, f"{path} is a directory; give a file name")
    if TRACE_FILE.match(os.path.basename(path)):
        raise UsageError(flag, f"{path} is named like a per-rank trace file; choose another name "
                               f"(trace files are never overwritten)")
    if not os.path.isdir(directory):
        raise UsageError(flag, f"cannot write {path}: directory {directory} does not exist; create it or "
                               f"choose another path")
    if not os.access(directory, os.W_OK):
        raise UsageError(flag, f"cannot write {path}: directory {directory} is not writable; choose another path")


def _write(flag, path, writer, *args):
    try:
        writer(*args, path)
    except OSError as error:
        raise UsageError(flag, f"cannot write {path}: {error.strerror or error}; choose a writable path") from None


def _write_report(report, second_witness, windows, path):
    document = report.to_json()
    if second_witness is not None:
        document["flight_recorder"] = second_witness.to_json()
    if windows is not None:
        document["windows"] = [verdict.to_json() for verdict in windows]
    with replaced_on_success(path) as temporary, open(temporary, "w") as out:
        json.dump(document, out, indent=1)
        out.write("\n")


def _check_flight_recorder_prefix(prefix):
    if not os.path.isdir(os.path.dirname(os.path.abspath(prefix))):
        raise UsageError("--flight-recorder", f"no directory holds {prefix}; pass the prefix the job set as "
                                              f"TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def _flight_recorder(args, merged):
    """The dumps' FlightRecorderWitness, or None where there are none (and none were asked for)."""
    paths = find_dumps(args.directory, args.flight_recorder)
    if not paths:
        if args.flight_recorder:
            raise UsageError("--flight-recorder", f"no dump named {args.flight_recorder}<rank> (nor "
                                                  f"flight-recorder-<rank>.pkl in {args.directory})")
        return None
    world_size = max(rank + 1 for rank in (*merged.ranks, *merged.unaligned))
    try:
        return witness(paths, world_size)
    except FlightRecorderError as error:
        raise UsageError("--flight-recorder", str(error)) from None


def _causality_line(check):
    if not check.backwards:
        return f"causality: none of {check.checked} transfers and collective finishes runs backwards"
    shifted = ", ".join(f"{rank} ({shift:+.1f} us)" for rank, shift in sorted(check.shifts_us.items()))
    line = (f"causality: {check.backwards} of {check.checked} transfers and collective finishes ran backwards "
            f"after the fit; {f'shifted ranks {shifted}' if shifted else 'no shift satisfies them all'}; ")
    if not check.remaining:
        return line + "none remains"
    return line + (f"{check.remaining} remain(s) (the traces contradict themselves there; their flows are left "
                   f"out of the Chrome trace)")


def summary(merged: MergedTrace, outputs: list[tuple[str, str]], seconds: float) -> str:
    layout = merged.layout
    windows = sorted({w for t in merged.ranks.values() for w in t.windows})
    iterations = sorted({i for t in merged.ranks.values() for i in t.iterations})
    collectives = sum(1 for i in merged.instances if i.kind == "collective")
    incomplete = sum(1 for i in merged.instances if i.missing)
    unaligned = f"not merged: {describe(sorted(merged.unaligned), 'rank')}" if merged.unaligned else "all aligned"
    lines = [f"MegaScan aggregate: run {merged.run_id}, DP{layout['dp']} x PP{layout['pp']} x TP{layout['tp']}",
             f"  ranks: {len(merged.ranks)} merged of {len(merged.ranks) + len(merged.unaligned)} loaded ({unaligned})",
             f"  {describe(windows, 'window')}; traced {describe(iterations, 'iteration')}",
             f"  instances matched: {len(merged.instances)} ({collectives} collective, "
             f"{len(merged.instances) - collectives} p2p); {incomplete} with members that never issued them",
             f"  {describe_alignment(merged)}",
             f"  {_causality_line(merged.causality)}",
             f"  problems: {len(merged.problems)}{' (warnings above)' if merged.problems else ''}"]
    lines += [f"  {label}: {path}" for label, path in outputs]
    lines.append(f"  done in {seconds:.1f} s")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if not os.path.isdir(args.directory):
        raise UsageError("-b/--benchmark", f"{args.directory} is not a directory; pass the run's --trace-dir")
    output = args.output or os.path.join(args.directory, DEFAULT_OUTPUT)
    for flag, path in (("-o/--output", output), ("--report-json", args.report_json), ("--sqlite", args.sqlite)):
        if path:
            _check_output(flag, path)
    if args.flight_recorder:  # before any work, as the outputs
        _check_flight_recorder_prefix(args.flight_recorder)
    ranks, iterations = _selection(args)
    try:
        merged = load_and_merge(args.directory)
    except TraceDirectoryError as error:
        raise UsageError("-b/--benchmark", str(error)) from None
    for problem in merged.problems:
        print(f"warning: {problem}", file=sys.stderr)
    timeline, shown = _timeline(merged, ranks, iterations)
    _write("-o/--output", output, write_chrome_trace, timeline)
    outputs = [(f"Chrome trace{shown} (open in ui.perfetto.dev or chrome://tracing)", output)]
    if args.sqlite:
        _write("--sqlite", args.sqlite, write_sqlite, merged)
        outputs.append(("SQLite", args.sqlite))
    detecting = args.detect or args.report_json or args.flight_recorder or args.per_window
    report, windows = judge_run(merged) if detecting else (None, None)
    second_witness = _flight_recorder(args, merged) if detecting else None
    if args.report_json:
        _write("--report-json", args.report_json, _write_report, report, second_witness, windows)
        outputs.append(("detection report JSON", args.report_json))
    print(summary(merged, outputs, time.perf_counter() - started))
    if report is not None:
        print(report.to_text())
    if windows is not None and args.per_window:
        print(verdicts_text(windows))
    if second_witness is not None and report is not None:  # both come with detecting
        print(second_witness.to_text([suspect.rank for suspect in report.suspects if suspect.kind == "hang"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with cycle_collection_paused():
            return run(args)
    except UsageError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 2
