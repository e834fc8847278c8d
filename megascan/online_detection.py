"""Detection during the run (``--trace-detect``): each closed trace window is judged while training goes on.

Each rank reduces its window to a summary: its op records (what the attribution follows from rank to rank)
and its compute totals per operation (detection/compute.py), not its events. At the window's last iteration
every rank hands its summary to rank 0 over a gloo group (host objects: no GPU stream is synchronised for
it); rank 0 merges them (the clock alignment of tools/aggregate.py) and runs the same detection, then
prints one line, ``MegaScan alert: ...``, when it names a suspect, and calls the user's hook
(``--trace-detect-hook module:function``) with it. With ``--trace-detect-exit`` rank 0's verdict goes back
to every rank and all stop after that iteration, as a MegaScope client's stop does.

The summaries are made on the writer thread, where the window's times are resolved; the training thread
waits for its own at the window's last iteration (on a GPU the step's grad-norm read has synchronised the
stream by then, so the events are complete).
"""

import importlib
import queue
import sys
import time
from dataclasses import dataclass

import torch.distributed as dist

from megascan.aggregate.loading import RankFile, TraceDirectory, compacted
from megascan.aggregate.merged_trace import merge
from megascan.aggregate.trace_records import ComputeEvent
from megascan.detection import detect
from megascan.detection.clean_pace import CleanPace
from megascan.detection.compute import LAYER_EVENTS, operation_totals, tp_waits_known
from megatron.training.training_log import print_whole_line

ALERT_PREFIX = "MegaScan alert:"
SUMMARY_WAIT_SECONDS = 300  # resolving a window's events waits for the GPU to finish that window's work


@dataclass
class DetectionAlert:
    """What the hook receives on rank 0 (once per window that names a suspect)."""

    window: int
    iterations: list
    line: str  # the printed alert
    report: object  # detection.Report of the window


def load_hook(path):
    """The callable at ``module:function``; raises ValueError with the reason."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError("expected module:function")
    try:
        hook = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(str(error)) from None
    if callable(hook):
        return hook
    raise ValueError(f"{attribute} is not callable")


def _op_fields(record, to_us):
    start = to_us(record.start)
    return {**record.issued_fields(), "start_us": start, "end_us": None if record.end is None else to_us(record.end),
            "host_us": min(record.host_us, start), "unrecorded_before": record.unrecorded_before}


def window_line(window, to_us):
    """A closed recorder window as its trace line holds it (docs/megascan_trace_format.md), on this rank's clock."""
    return {"type": "window", "window": window.index, "iterations": list(window.traced), "complete": True,
            "groups": dict(window.groups), "nvml": None,
            "events": [{"name": name, "iteration": iteration, "microbatch": microbatch, "chunk": chunk,
                        "layer": layer, "start_us": to_us(start), "end_us": to_us(end)}
                       for name, iteration, microbatch, chunk, layer, start, end in window.events],
            "ops": [_op_fields(record, to_us) for record in window.ops]}


def summarize(metadata, line):
    """The summary of one window line (module docstring): its ops, its iteration events, its compute totals."""
    tp_groups = {name for name, group in line["groups"].items() if group["role"] == "tp"}
    events = [ComputeEvent(event) for event in line["events"]]
    for event in events:  # compared on the rank's own clock: no other rank's times are involved
        event.start, event.end = event.start_us, event.end_us
    tp_waits = [(op["start_us"], op["end_us"]) for op in line["ops"]
                if op["group"] in tp_groups and op["end_us"] is not None]
    compute = operation_totals(events, tp_waits, metadata.get("instance_kind", "training"), metadata["coords"]["pp"],
                               any(event.name in LAYER_EVENTS for event in events), tp_waits_known(metadata))
    iterations = [event for event in line["events"] if event["name"] == "iteration"]
    return {"metadata": metadata, "compute": compute,
            "line": {**line, "complete": True, "nvml": None, "events": iterations}}


def judge(summaries):
    """detection.Report of one window from every rank's summary: the offline merge and detection."""
    files = {s["metadata"]["rank"]: RankFile(f"rank {s['metadata']['rank']}", s["metadata"],
                                             {s["line"]["window"]: compacted(s["line"])}) for s in summaries}
    first = summaries[0]["metadata"]
    loaded = TraceDirectory(first["run_id"], first["layout"], first["world_size"], files, [])
    return detect(merge(loaded), {s["metadata"]["rank"]: s["compute"] for s in summaries})


def alert_line(report, window, iterations):
    """One line naming the first suspect and why, or None when the window names nobody."""
    headline = report.headline()
    if headline is None:
        return None
    return f"{ALERT_PREFIX} window {window} (iterations {iterations[0]}-{iterations[-1]}): {headline}"


class OnlineDetection:
    def __init__(self, args, metadata):
        self.metadata = metadata
        self.stop_on_alert = args.trace_detect_exit
        self.rank = dist.get_rank()
        self.group = dist.new_group(backend="gloo")  # every rank calls this, in TraceSession's construction
        self.judge = WindowJudge(load_hook(args.trace_detect_hook) if args.trace_detect_hook else None) \
            if self.rank == 0 else None
        self.summaries = queue.Queue()

    def summarize(self, window, to_us):
        """On the writer thread, for each complete window; never raises (every rank must reach the gather)."""
        try:
            summary = summarize(self.metadata, window_line(window, to_us))
        except Exception as error:  # noqa: BLE001 - every rank must still reach the gather: say it there
            summary = {"error": f"rank {self.rank} could not summarise window {window.index}: "
                                f"{type(error).__name__}: {error}"}
        self.summaries.put(summary)

    def _summary_of(self, window):
        """This rank's summary of ``window`` (older ones, late after a timeout, are dropped), or an error summary
        when its writer has not made one in SUMMARY_WAIT_SECONDS: every rank must still reach the gather."""
        deadline = time.monotonic() + SUMMARY_WAIT_SECONDS
        while True:
            try:
                summary = self.summaries.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                return {"error": f"rank {self.rank} has no summary of window {window} after {SUMMARY_WAIT_SECONDS} s "
                                 f"(its trace writer is stuck or stopped)"}
            if "error" in summary or summary["line"]["window"] >= window:
                return summary

    def evaluate(self, window):
        """Collective, at ``window``'s last iteration: the alert line when the job is to stop, else None."""
        summary = self._summary_of(window)
        gathered = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(summary, gathered, dst=0, group=self.group)
        verdict = [None]
        if self.rank == 0:
            line = self.judge.window(gathered)
            verdict = [line if self.stop_on_alert else None]
        if self.stop_on_alert:
            dist.broadcast_object_list(verdict, src=0, group=self.group)
        return verdict[0]


class WindowJudge:
    """Rank 0's side: each window judged as it closes, in order, a slow rank's cost measured against the job's pace
    in the last window that named nobody (detection/clean_pace.py), as tools/aggregate.py measures it."""

    def __init__(self, hook=None):
        self.hook = hook
        self.pace = CleanPace()

    def window(self, gathered):
        """Judge the window of every rank's summary, print and hand on the alert; the alert line or None. Never
        raises: a window that cannot be judged is said in one line and training goes on."""
        failed = [summary["error"] for summary in gathered if "error" in summary]
        if failed:
            print_whole_line(f"MegaScan: --trace-detect skipped a window: {failed[0]}", sys.stderr)
            return None
        window, iterations = gathered[0]["line"]["window"], gathered[0]["line"]["iterations"]
        started = time.perf_counter()
        try:
            report = judge(gathered)
            self.pace.account(report, window, iterations)
        except Exception as error:  # noqa: BLE001 - a window that cannot be judged must not stop training
            print_whole_line(f"MegaScan: --trace-detect could not judge window {window}: {type(error).__name__}: "
                             f"{error}", sys.stderr)
            return None
        line = alert_line(report, window, iterations)
        if line:
            print_whole_line(f"{line} (judged in {time.perf_counter() - started:.2f} s)")
            self._call_hook(DetectionAlert(window, iterations, line, report))
        return line

    def _call_hook(self, alert):
        if self.hook is None:
            return
        try:
            self.hook(alert)
        except Exception as error:  # noqa: BLE001 - a user's hook must not stop training: say so, go on
            print_whole_line(f"MegaScan: --trace-detect-hook raised {type(error).__name__}: {error}", sys.stderr)
