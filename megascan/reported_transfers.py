"""Point-to-point transfers that bypass torch.distributed (MegaDPP's shared-memory and CUDA IPC transports).
The transport reports each transfer once it is complete (its observer, megadpp/transport/base.py:
TransferEvent), and it is recorded as the same send / recv op the process-group tracer (comm_tracer.py)
records, through the same Recorder calls, so aggregation matches both ends and draws the flow. The
transport numbers the messages of each directed channel itself: that number is the op's sequence, equal on
both ends.

Its times are host clock readings (perf_counter_ns): on CPU they are MegaScan's marks; on GPUs, where marks
are CUDA events, the window's clock places host readings on the same wall clock as the events
(timing.CudaWindowClock). A GPU transfer's times are then when the host asked for it and when the host saw
its copies complete on the GPU: later than the GPU's own by the completion's wake-up (tens of µs).
"""


class TransferReporter:
    """The observer to give a transport: records its transfers while a trace window is open."""

    def __init__(self, recorder, group, ranks, role):
        self.recorder, self.group, self.ranks, self.role = recorder, group, list(ranks), role

    def __call__(self, event):
        recorder = self.recorder
        window = recorder.window
        if window is None:  # an iteration that is not traced
            return
        window.groups.setdefault(self.group, {"ranks": self.ranks, "role": self.role})
        record = recorder.add_op(event.op, event.op, self.group, None, event.peer, event.nbytes, None,
                                 seq=event.seq, start=event.start_ns)
        if event.label is not None:  # (phase, microbatch, chunk) of the message, from its sender's schedule
            record.phase, record.microbatch, record.chunk = event.label
        recorder.end_ops([record], end=event.end_ns)
