"""What the training thread records during a trace window: compute events, communication ops
and the context (iteration, phase, microbatch, chunk) they happened in.

Records hold raw marks (CUDA events or host clock readings); the writer thread turns them into
times after the window. Appending to a list is atomic in CPython, so the writer may read a
window's ops while the training thread still adds to it (for ``issued`` lines of a stalled window).
"""

import time


class TraceContext:
    """Where the training thread is; ops and events are labelled with it."""

    __slots__ = ("iteration", "phase", "microbatch", "chunk", "transfer", "first_recorded", "backward_counted",
                 "counting", "on_counting")

    def __init__(self):
        self.iteration = None
        # Microbatches before ``first_recorded``, and every microbatch's backward where ``backward_counted``, only
        # count their TP collectives (counted_collectives.py): while the thread is in one of those, ``counting`` is
        # True, and ``on_counting`` hears each change before the context moves.
        self.first_recorded, self.backward_counted, self.counting, self.on_counting = 0, False, False, None
        self.set_phase("iteration")
        self.transfer = None  # the pipeline transfer in progress, e.g. "forward-send"

    def set_phase(self, phase, microbatch=None, chunk=None):
        counting = microbatch is not None and (microbatch < self.first_recorded
                                               or (self.backward_counted and phase == "backward"))
        if counting != self.counting:
            self.counting = counting
            if self.on_counting is not None:
                self.on_counting(counting)
        self.phase, self.microbatch, self.chunk = phase, microbatch, chunk


class OpRecord:
    __slots__ = ("op", "kind", "group", "seq", "peer", "bytes", "dtype", "iteration", "microbatch",
                 "chunk", "phase", "start", "end", "host_us", "window", "unrecorded_before")

    def issued_fields(self):
        return {"op": self.op, "kind": self.kind, "group": self.group, "seq": self.seq, "peer": self.peer,
                "bytes": self.bytes, "dtype": self.dtype, "iteration": self.iteration,
                "microbatch": self.microbatch, "chunk": self.chunk, "phase": self.phase}


class TraceWindow:
    def __init__(self, index, iterations, base_mark):
        self.index = index
        self.iterations = iterations  # the iterations this window covers
        self.traced = []  # those that ran
        self.base_mark = base_mark
        self.events = []  # (name, iteration, microbatch, chunk, layer, start mark, end mark)
        self.ops = []  # OpRecord
        self.groups = {}  # group id -> {"ranks": [...], "role": ...}
        self.open = True
        self.opened_at = time.monotonic()


class Recorder:
    """The open window, the context, and the per-group sequence counters (which run across windows)."""

    def __init__(self, timer):
        self.timer = timer
        self.context = TraceContext()
        self.window = None
        self.counters = {}
        # Ops passed unrecorded (skip_collectives) since this iteration's latest finish, where the own work before
        # the next arrival is measured from: that work then holds waits nobody measured.
        self.unrecorded = 0
        self.counted = None  # the open window's CountedCollectives, which knows the latest passed one

    def begin_iteration(self, iteration):
        self.context.iteration = iteration
        self.context.set_phase("iteration")
        self.unrecorded = 0

    def open_window(self, index, iterations):
        self.window = TraceWindow(index, iterations, self.timer.mark())
        self.counted = None

    def close_window(self):
        window, self.window = self.window, None
        window.open = False
        return window

    def add_event(self, name, start, end, layer=None):
        ctx = self.context
        self.window.events.append((name, ctx.iteration, ctx.microbatch, ctx.chunk, layer, start, end))

    def add_op(self, op, kind, group, counter_key, peer, nbytes, dtype, seq=None, start=None):
        """Start an op record (the caller marks its end); ``counter_key`` picks its sequence counter.
        A transport that numbers its own messages gives ``seq`` instead, and one that reports a transfer
        after the fact its ``start`` mark."""
        window, ctx = self.window, self.context
        record = OpRecord()
        if seq is None:
            seq = self.counters.get(counter_key, 0)
            self.counters[counter_key] = seq + 1
        record.seq = seq
        record.op, record.kind, record.group, record.peer = op, kind, group, peer
        record.bytes, record.dtype = nbytes, dtype
        record.iteration, record.microbatch, record.chunk = ctx.iteration, ctx.microbatch, ctx.chunk
        record.phase = ctx.transfer or ctx.phase
        record.host_us = time.time_ns() / 1000.0
        record.end = None
        record.window = window
        record.unrecorded_before = self.unrecorded
        window.ops.append(record)
        record.start = self.timer.mark() if start is None else start
        return record

    def skip_collectives(self, group, count):
        """Count collectives of ``group`` that were not recorded: their sequence numbers go by, so that the next
        recorded one matches its peers' (they skip the same ones). The records issued before the next finish
        say that some were skipped since the last one."""
        self.counters[group] = self.counters.get(group, 0) + count
        self.unrecorded += count

    def last_unrecorded_fields(self):
        """The open window's latest skipped collective as an ``issued`` line's op, or None."""
        return None if self.counted is None else self.counted.latest_fields()

    def end_ops(self, records, end=None):
        """Mark the end of records whose work the rank waited for (only while their window is open);
        ``end``: a mark taken earlier (default: now)."""
        for record in records:
            if record.end is None and record.window.open:
                if end is None:
                    end = self.timer.mark()
                record.end = end
                self.unrecorded = 0
