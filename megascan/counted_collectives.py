"""The tensor-parallel collectives of a traced iteration that are only counted, not recorded
(``--trace-tp-microbatches``: comm_tracer.py says which and why).

Counting them one by one in the process group's wrapper cost the host about 10 us a call in a real job
(docs/benchmarks.md), with a few hundred per microbatch, in the microbatches where the host is least ahead of
its GPU. So while the training thread is in such a microbatch they pass the wrapper on a fast path that only
notes the latest (a stall report names it), and how many passed is read from the process group's own
sequence number. That number is folded into the recorder's counter for the group as the thread leaves those
microbatches, and before any op it records among them (a pipeline transfer, a data-parallel collective), so
the next recorded collective's number equals its peers': they pass the same ones. A coalesced batch counts
once there, on every peer alike.
"""


class CountedCollectives:
    __slots__ = ("recorder", "group", "name", "mark", "latest", "latest_seq")

    def __init__(self, recorder, group, name):
        self.recorder, self.group, self.name = recorder, group, name
        self.mark = group._get_sequence_number_for_group()  # the group's own number when the count was last folded
        self.latest = None  # the latest passed: (op, iteration, microbatch, chunk, phase, host ns), from the wrapper
        self.latest_seq = None  # its sequence number, once folded

    @classmethod
    def of(cls, recorder, group, name):
        """Counting for ``group``, or None where its backend keeps no sequence numbers (then all are recorded)."""
        try:
            return cls(recorder, group, name)
        except RuntimeError:  # "Backend ... does not yet support sequence numbers"
            return None

    def restart(self):
        """From here on its collectives pass uncounted until the next fold; those before were recorded (each
        numbered as it was) or issued outside the traced iterations (numbered by nobody, on every peer alike)."""
        self.mark = self.group._get_sequence_number_for_group()

    def fold(self):
        now = self.group._get_sequence_number_for_group()
        if now != self.mark:
            self.recorder.skip_collectives(self.name, now - self.mark)
            self.latest_seq = self.recorder.counters[self.name] - 1
            self.mark = now

    def moved(self, counting):
        """TraceContext.on_counting: the thread enters (True) or leaves (False) the counted microbatches."""
        if counting:
            self.restart()
        else:
            self.fold()

    def latest_fields(self):
        """The latest passed collective as an ``issued`` line's op (it was entered: a rank blocked in it says so),
        or None. Read from the writer thread while the training thread is stalled."""
        if self.latest is None:
            return None
        op, iteration, microbatch, chunk, phase, host_ns = self.latest
        # Passed since the last fold: only while counting, since recorded ones move the group's number too.
        pending = self.group._get_sequence_number_for_group() - self.mark if self.recorder.context.counting else 0
        seq = self.recorder.counters.get(self.name, 0) + pending - 1 if pending else self.latest_seq
        return {"op": op, "kind": "collective", "group": self.name, "seq": seq, "peer": None, "bytes": None,
                "dtype": None, "iteration": iteration, "microbatch": microbatch, "chunk": chunk, "phase": phase,
                "host_us": round(host_ns / 1000.0, 1), "unrecorded": True}
