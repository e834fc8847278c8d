"""The background thread that turns closed windows into lines of the rank's trace file.

Resolving a window waits for its CUDA events on this thread only, never on the training thread.
Each line is flushed and fsync'ed whole, so a run that dies keeps every window already written.
When the open window makes no progress for ``STALL_SECONDS``, or twice the longest window so far
where that is longer (a rank hung in a collective; a slow healthy window is no stall), the thread
appends what the training thread has issued since, as ``issued`` lines: the evidence a hang leaves
behind even if the run is killed; and, where PyTorch's flight recorder is on, writes its buffer
beside the trace (megascan/flight_recorder_dump.py). Format: docs/megascan_trace_format.md.
"""

import atexit
import json
import os
import queue
import threading
import time

import torch

from megascan.flight_recorder_dump import dump_flight_recorder

STALL_SECONDS = 5.0
ROWS_PER_TURN = 64

# Rows are filled into templates: about 1.5 us a row where json.dumps of a dict takes 5 (on a CPU
# host). The writer shares the GIL with the training thread, so its time per row is tracing's cost.
_EVENT_ROW = ('{"name":%s,"cat":"compute","iteration":%s,"microbatch":%s,"chunk":%s,"layer":%s,'
              '"start_us":%.1f,"end_us":%.1f}')
_OP_ROW = ('{"op":%s,"kind":%s,"group":%s,"seq":%s,"peer":%s,"bytes":%s,"dtype":%s,"iteration":%s,'
           '"microbatch":%s,"chunk":%s,"phase":%s,"start_us":%.1f,"end_us":%s,"host_us":%.1f,"unrecorded_before":%d}')
_STRINGS = {None: "null"}  # JSON of the few names, groups, dtypes and phases a trace holds


def _text(value):
    encoded = _STRINGS.get(value)
    if encoded is None:
        encoded = _STRINGS[value] = json.dumps(value)
    return encoded


def _integer(value):
    return "null" if value is None else str(value)


def _joined(rows):
    """Comma-separated rows, giving the GIL back every ROWS_PER_TURN rows.

    Encoding a whole window at once would hold the GIL for milliseconds at a stretch, and the
    training thread, which launches the GPU's work, would wait that long each time it needs it.
    """
    pieces = []
    for count, row in enumerate(rows, 1):
        pieces.append(row)
        if count % ROWS_PER_TURN == 0:
            time.sleep(0)
    return ",".join(pieces)


class TraceWriter:
    def __init__(self, path, metadata, recorder, nvml_probe=None, device_index=None, on_window=None):
        # exclusive: never write into a file this run did not create; open for the whole run, closed by close()
        self.file = open(path, "x")  # noqa: SIM115
        self.recorder = recorder
        self.nvml_probe = nvml_probe
        self.device_index = device_index
        self.on_window = on_window  # called with (window, its time conversion) after each complete window
        self.queue = queue.Queue()
        self.last_line_at = time.monotonic()
        self.issued_reported = (None, 0)  # (window index, ops of it already written as issued)
        self.unrecorded_reported = None  # the last skipped collective written as issued
        self.longest_window = 0.0  # seconds from a window's opening to its submission
        self._write_line(metadata)
        self.thread = threading.Thread(target=self._run, name="megascan-writer", daemon=True)
        self.thread.start()
        atexit.register(self.close)  # a run that stops with an error still writes its closed windows

    def submit(self, window, complete):
        self.longest_window = max(self.longest_window, time.monotonic() - window.opened_at)
        self.queue.put((window, complete))

    def drain(self):
        """Wait until every submitted window is written (benchmarks charge that time to tracing)."""
        self.queue.join()

    def close(self):
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()
        if not self.file.closed:
            self.file.close()

    def _run(self):
        if self.device_index is not None:
            torch.cuda.set_device(self.device_index)
        while True:
            try:
                item = self.queue.get(timeout=STALL_SECONDS)
            except queue.Empty:
                self._report_stalled_window()
                continue
            try:
                if item is None:
                    return
                self._write_window(*item)
            finally:
                self.queue.task_done()

    def _write_line(self, record):
        self._write_text(json.dumps(record, separators=(",", ":")) + "\n")

    def _write_text(self, text):
        self.file.write(text)
        self.file.flush()
        os.fsync(self.file.fileno())
        self.last_line_at = time.monotonic()

    def _write_window(self, window, complete):
        clock = self.recorder.timer.window_clock(window.base_mark)
        to_us = clock.to_wall_us
        events = _joined(
            _EVENT_ROW % (_text(name), _integer(iteration), _integer(microbatch), _integer(chunk), _integer(layer),
                          to_us(start), to_us(end))
            for name, iteration, microbatch, chunk, layer, start, end in window.events)
        ops = _joined(
            _OP_ROW % (_text(r.op), _text(r.kind), _text(r.group), r.seq, _integer(r.peer), r.bytes, _text(r.dtype),
                       _integer(r.iteration), _integer(r.microbatch), _integer(r.chunk), _text(r.phase),
                       start, "null" if r.end is None else f"{to_us(r.end):.1f}", min(r.host_us, start),
                       r.unrecorded_before)
            for r in window.ops for start in (to_us(r.start),))
        head = json.dumps({
            "type": "window", "window": window.index, "iterations": window.traced, "complete": complete,
            "clock": {"source": self.recorder.timer.source, "anchor_uncertainty_us": round(clock.uncertainty_us, 2)},
            "groups": window.groups, "nvml": self.nvml_probe.read() if self.nvml_probe else None},
            separators=(",", ":"))
        self._write_text(f'{head[:-1]},"events":[{events}],"ops":[{ops}]}}\n')
        if complete and self.on_window is not None:
            self.on_window(window, to_us)
        clock.release()

    def _report_stalled_window(self):
        window = self.recorder.window
        if window is None:
            return
        quiet = time.monotonic() - max(window.opened_at, self.last_line_at)
        if quiet < max(STALL_SECONDS, 2 * self.longest_window):
            return
        index, reported = self.issued_reported
        if index != window.index:
            reported = 0
        new_ops = window.ops[reported:]
        self.issued_reported = (window.index, reported + len(new_ops))
        ops = [{**record.issued_fields(), "host_us": round(record.host_us, 1)} for record in new_ops]
        # A rank blocked in a collective it only counted (--trace-tp-microbatches) says which one.
        unrecorded = self.recorder.last_unrecorded_fields()
        if unrecorded is not None and unrecorded != self.unrecorded_reported:
            ops.append(unrecorded)
            self.unrecorded_reported = unrecorded
        self._write_line({
            "type": "issued", "window": window.index, "iteration": self.recorder.context.iteration,
            "groups": dict(window.groups), "ops": ops})
        dump_flight_recorder(os.path.dirname(self.file.name))
