"""Point-to-point messages that travel outside the process groups CommTracer sees (MegaFBD's links
between its instances are bare gloo backends): their sender and receiver record them here, as the
p2p ops of the trace that they are, so that the aggregation matches each send with its receive and
draws the flow between them.

The sender and the receiver number their messages themselves (both count every message of a
channel, traced or not), so a send and its receive carry the same ``seq`` even where they fall into
different trace windows. A send may be recorded on one thread and end on another (a coordinator
thread that waits for its completion): ``end`` takes the record that ``start`` returned.
"""

from megascan.comm_tracer import size_and_dtype

_active = None  # the process's MessageTracer while a trace session runs


def active():
    """The MessageTracer of this process's trace session, or None when the run is not traced."""
    return _active


class MessageTracer:
    ROLE = "message"  # the role of the message channels' groups in the trace

    def __init__(self, recorder):
        global _active
        self.recorder = recorder
        self.on = False  # inside a traced iteration
        _active = self

    def install(self):
        self.on = True

    def uninstall(self):
        self.on = False

    def start(self, op, channel, ranks, peer, tensor, seq, microbatch=None):
        """Record the start of a ``send`` or ``recv`` of ``tensor`` with launch-wide rank ``peer`` on ``channel``
        (a group id of its own, whose launch-wide ``ranks`` are given) as its ``seq``-th message between the
        two; None outside traced iterations. ``microbatch`` overrides the context's."""
        if not self.on:
            return None
        window = self.recorder.window
        if channel not in window.groups:
            window.groups[channel] = {"ranks": list(ranks), "role": self.ROLE}
        nbytes, dtype = size_and_dtype(op, ([tensor],))
        record = self.recorder.add_op(op, op, channel, None, peer, nbytes, dtype, seq=seq)
        if microbatch is not None:
            record.microbatch = microbatch
        return record

    def end(self, record):
        if record is not None:
            self.recorder.end_ops([record])
