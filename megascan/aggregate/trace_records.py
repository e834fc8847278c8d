"""What the merged trace holds of each rank's trace lines: its op records and compute events
(docs/megascan_trace_format.md), a slot per field rather than the parsed dict.

At 8192 ranks there are 3.5 million op records and 3 million events: a dict of an op record's keys (with
those merging adds) takes 464 bytes and an event's 272, their slots 192 and 112 (the peak memory of
aggregating 8192 ranks fell from 5.8 to 4.0 GiB); a slot is also read faster than a dict's key. A field
the trace lacks (traces written before ``host_us`` or ``unrecorded_before`` were added) is None; keys not
listed here are not kept, as readers ignore keys they do not know. The parser makes a new string for every
value, and a thousand ranks repeat "allreduce" a million times: the strings are shared.
"""

from __future__ import annotations

import sys


def _shared(value):
    return sys.intern(value) if type(value) is str else value


class OpRecord:
    """One rank's record of one operation: the trace's fields, its window and, once merged, its global times."""

    __slots__ = ("op", "kind", "group", "seq", "peer", "bytes", "dtype", "iteration", "microbatch", "chunk", "phase",
                 "start_us", "end_us", "host_us", "unrecorded_before",  # as in the trace: the rank's own clock
                 "window",  # the trace window it was recorded in: clocks are fitted per window
                 "start", "end", "host",  # global microseconds (merged_trace.py); None: unknown, or not merged
                 "issued_only")  # True: its window never finished, so it was only issued; start is the issue

    def __init__(self, fields: dict, window: int):
        get = fields.get  # a statement per slot, not a loop of setattr: millions of records
        self.op, self.kind, self.group = _shared(get("op")), _shared(get("kind")), _shared(get("group"))
        self.seq, self.peer, self.bytes, self.dtype = get("seq"), get("peer"), get("bytes"), _shared(get("dtype"))
        self.iteration, self.microbatch, self.chunk = get("iteration"), get("microbatch"), get("chunk")
        self.phase = _shared(get("phase"))
        self.start_us, self.end_us, self.host_us = get("start_us"), get("end_us"), get("host_us")
        self.unrecorded_before = get("unrecorded_before")
        self.window = window
        self.start = self.end = self.host = None
        self.issued_only = False


class ComputeEvent:
    """One rank's compute event (a forward, a layer's backward, ...): the trace's fields and, once merged, its
    global times."""

    __slots__ = ("name", "cat", "iteration", "microbatch", "chunk", "layer",
                 "start_us", "end_us",  # as in the trace: the rank's own clock
                 "start", "end")  # global microseconds (merged_trace.py); None until merged

    def __init__(self, fields: dict):
        get = fields.get
        self.name, self.cat = _shared(get("name")), _shared(get("cat"))
        self.iteration, self.microbatch, self.chunk, self.layer = (get("iteration"), get("microbatch"), get("chunk"),
                                                                   get("layer"))
        self.start_us, self.end_us = get("start_us"), get("end_us")
        self.start = self.end = None
