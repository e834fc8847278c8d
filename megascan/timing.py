"""Timestamps that cost no synchronization while tracing, resolved to wall-clock microseconds later.

``mark()`` runs on the training thread: on GPU it records a CUDA event (taken from a reusable pool)
on the current stream, on CPU it reads the host's monotonic clock (a GPU window also takes such host
readings, from transports that report their transfers). ``WindowClock`` turns the marks
of one trace window into microseconds on this host's wall clock; it runs on the writer thread,
after the window, where waiting for an event blocks nobody but the writer: ``Event.synchronize()`` gives
up the GIL while it waits. (Polling ``query()`` instead took the GIL back every few hundred microseconds
for as long as the GPU was still running the window's last iteration, and each time the training thread
that held it was made to hand it over.)
"""

import collections
import time

import torch


class HostTimer:
    source = "host_clock"

    @staticmethod
    def mark():
        return time.perf_counter_ns()

    def window_clock(self, base_mark):
        return HostWindowClock()


class HostWindowClock:
    """perf_counter -> wall clock, anchored when the window's clock is made."""

    def __init__(self):
        self.wall_minus_perf_ns = time.time_ns() - time.perf_counter_ns()
        self.uncertainty_us = 0.0

    def to_wall_us(self, mark):
        return (mark + self.wall_minus_perf_ns) / 1000.0

    def release(self):
        pass


class CudaEventTimer:
    """CUDA events from a pool: a window's events go back to the pool once the writer has read them."""

    source = "cuda_event"

    def __init__(self, device_index):
        self.device_index = device_index
        self.pool = collections.deque()  # deque: the training thread pops while the writer appends
        # ``Event.record()`` asks ``torch.cuda.current_stream()`` for the stream, which builds a new
        # Stream object each time: 8 of the 13 us a mark took on an H100 host. The raw handle of the
        # current stream costs 0.2 us and keys a cache of Stream objects, and recording through the
        # event's base class skips a Python wrapper: 4 us a mark. (Both exist in CUDA builds only.)
        self.streams = {}  # raw stream handle -> torch.cuda.Stream
        self.current_raw_stream = torch._C._cuda_getCurrentRawStream
        self.record = torch._C._CudaEventBase.record

    def mark(self):
        """Record an event on the current stream (the stream the work being timed runs on)."""
        try:
            event = self.pool.pop()
        except IndexError:
            event = torch.cuda.Event(enable_timing=True)
        raw = self.current_raw_stream(self.device_index)
        stream = self.streams.get(raw)
        if stream is None:
            stream = self.streams[raw] = torch.cuda.current_stream(self.device_index)
        self.record(event, stream)
        return event

    def window_clock(self, base_mark):
        return CudaWindowClock(self, base_mark)


class CudaWindowClock:
    """Event times relative to the window's first event, placed on the wall clock by an anchor.

    The anchor is an event recorded on an idle side stream: it completes as soon as the GPU sees
    it, so its GPU time lies between the host times just before recording and just after it is
    seen complete. The best of a few tries bounds the anchor's error (``uncertainty_us``).
    """

    ANCHOR_TRIES = 5

    def __init__(self, timer, base_mark):
        self.timer = timer
        self.base = base_mark
        self.used = {id(base_mark): base_mark}
        base_mark.synchronize()
        stream = torch.cuda.Stream(device=timer.device_index)
        best = None
        for _ in range(self.ANCHOR_TRIES):
            anchor = torch.cuda.Event(enable_timing=True)
            before = time.time_ns()
            anchor.record(stream)
            anchor.synchronize()
            after = time.time_ns()
            if best is None or after - before < best[1] - best[0]:
                best = (before, after, anchor)
        before, after, anchor = best
        self.anchor_wall_us = (before + after) / 2000.0
        self.host = HostWindowClock()  # for host clock readings in the window
        self.anchor_gpu_us = self.base.elapsed_time(anchor) * 1000.0
        self.uncertainty_us = (after - before) / 2000.0

    def to_wall_us(self, mark):
        if isinstance(mark, int):  # a host clock reading (a transfer from the sink: transfer_recorder.py)
            return self.host.to_wall_us(mark)
        self.used[id(mark)] = mark
        mark.synchronize()
        return self.anchor_wall_us + self.base.elapsed_time(mark) * 1000.0 - self.anchor_gpu_us

    def release(self):
        """Give this window's events back to the pool (each once, however many records shared it)."""
        self.timer.pool.extend(self.used.values())
        self.used = {}


def make_timer(args):
    if args.device == "cuda":
        return CudaEventTimer(torch.cuda.current_device())
    return HostTimer()
