"""MegaScan's recorder of the transfers that bypass torch.distributed: the loop's transfer-trace sink
(megatron/training/transfer_trace.py) hands it what MegaDPP's transport and MegaFBD's coordinator report,
and it records each one as the same send / recv op the process-group tracer (comm_tracer.py) records,
through the same Recorder calls, so that the aggregation matches both ends and draws the flow.

It records the transfers whose start is reported inside a traced iteration (a transport that reports a
transfer once complete reports its start and end together). Their times are host clock readings
(the sink's one clock rule): on CPU they are MegaScan's marks; on GPUs, where marks are CUDA events, the
window's clock places host readings on the same wall clock as the events (timing.CudaWindowClock). A
GPU transfer's times are then when the host handed it over and when the host saw it complete: later
than the GPU's own by the completion's wake-up (tens of µs). The reporter numbers the messages of each
channel itself: that number is the op's sequence, equal on both ends.
"""

from megatron.training.transfer_trace import TransferChannel, TransferLabel


class TransferRecorder:
    """Installed into the run's sink by the TraceSession; switched on for each traced iteration."""

    def __init__(self, recorder):
        self.recorder = recorder
        self.on = False  # inside a traced iteration

    def install(self):
        self.on = True

    def uninstall(self):
        self.on = False

    def start(self, op: str, channel: TransferChannel, peer: int, nbytes: int, dtype: str | None, seq: int,
              start_ns: int, label: TransferLabel | None):
        """The op record of a transfer that starts in a traced iteration, else None."""
        if not self.on:
            return None
        self.recorder.window.groups.setdefault(channel.name, {"ranks": list(channel.ranks), "role": channel.role})
        record = self.recorder.add_op(op, op, channel.name, None, peer, nbytes, dtype, seq=seq, start=start_ns)
        if label is not None:  # what the reporter knows better than the context (its schedule's microbatch)
            phase, microbatch, chunk = label
            record.phase = record.phase if phase is None else phase
            record.microbatch = record.microbatch if microbatch is None else microbatch
            record.chunk = record.chunk if chunk is None else chunk
        return record

    def end(self, record, end_ns: int) -> None:
        self.recorder.end_ops([record], end=end_ns)
