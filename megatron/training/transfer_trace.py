"""One sink for the point-to-point transfers that bypass torch.distributed's process groups (MegaDPP's
shared-memory and CUDA IPC transport, MegaFBD's links between its instances), which a tracer at the
process groups cannot see.

The loop gives every plugin the run's sink (``RunContext.transfer_trace``). A module that moves data
outside the process groups reports every transfer into it, always, without knowing whether anyone traces;
a tracer (MegaScan with --trace) installs its recorder into it. With no recorder installed a report
costs two calls that return at once and keeps nothing.

One clock rule: every time is a host clock reading, ``time.perf_counter_ns()`` (CLOCK_MONOTONIC), taken
when the host handed the transfer over (start) and when it saw it complete (end); a recorder places
these readings on its own timeline. Ranks are launch-wide (``Placement``), and each side numbers the
messages of a channel itself (``seq``, counting every message of the channel, recorded or not), so that
a send and its receive carry the same number.
"""

import time
from dataclasses import dataclass
from typing import NamedTuple, Protocol


@dataclass(frozen=True)
class TransferChannel:
    """A channel of messages outside the process groups: its id in a trace, its launch-wide ranks, its role
    (``pp``: pipeline neighbours; ``message``: a module's own messages)."""

    name: str
    ranks: tuple[int, ...]
    role: str


class TransferLabel(NamedTuple):
    """What a transfer belongs to, where the reporter knows better than the recorder's context (None: the
    recorder's own)."""

    phase: str | None = None  # e.g. "forward-send"
    microbatch: int | None = None
    chunk: int | None = None


class TransferSink(Protocol):
    """What a reporter calls, and what a recorder implements."""

    def start(self, op: str, channel: TransferChannel, peer: int, nbytes: int, dtype: str | None, seq: int,
              start_ns: int, label: TransferLabel | None) -> object | None:
        """A ``send`` or ``recv`` of ``nbytes`` (elements of ``dtype``, None when unknown) with launch rank
        ``peer`` started at ``start_ns``; returns a token for ``end``, or None when it is not recorded."""

    def end(self, token: object, end_ns: int) -> None:
        """The transfer of ``token`` (not None) completed at ``end_ns``."""


class NoTransferRecording:
    """The default: nothing is recorded."""

    def start(self, op: str, channel: TransferChannel, peer: int, nbytes: int, dtype: str | None, seq: int,
              start_ns: int, label: TransferLabel | None) -> None:
        return None

    def end(self, token: object, end_ns: int) -> None:
        pass


class TransferTrace:
    """The run's sink: reporters call it, it hands their transfers to the installed recorder, if any.

    ``start`` may be called on one thread and ``end`` on another (a thread that waits for a send's
    completion): ``end`` takes what ``start`` returned."""

    def __init__(self) -> None:
        self._recorder: TransferSink = NoTransferRecording()

    def install(self, recorder: TransferSink) -> None:
        """Hand every later transfer to ``recorder`` (one per run: the run's tracer)."""
        if not isinstance(self._recorder, NoTransferRecording):
            raise RuntimeError("transfer trace: a recorder is installed already (one tracer per run)")
        self._recorder = recorder

    @property
    def recording(self) -> bool:
        """Whether a recorder is installed (for a reporter's start-up line, never for its reports)."""
        return not isinstance(self._recorder, NoTransferRecording)

    def start(self, op: str, channel: TransferChannel, peer: int, nbytes: int, dtype: str | None, seq: int, *,
              label: TransferLabel | None = None, start_ns: int | None = None) -> object | None:
        """A transfer starts (now, or at ``start_ns``); the token to give ``end``."""
        return self._recorder.start(op, channel, peer, nbytes, dtype, seq,
                                    time.perf_counter_ns() if start_ns is None else start_ns, label)

    def end(self, token: object | None, end_ns: int | None = None) -> None:
        """The transfer that ``start`` returned ``token`` for completed (now, or at ``end_ns``)."""
        if token is not None:
            self._recorder.end(token, time.perf_counter_ns() if end_ns is None else end_ns)

    def report(self, op: str, channel: TransferChannel, peer: int, nbytes: int, dtype: str | None, seq: int,
               start_ns: int, end_ns: int, label: TransferLabel | None = None) -> None:
        """A transfer reported once complete, with both of its times."""
        self.end(self._recorder.start(op, channel, peer, nbytes, dtype, seq, start_ns, label), end_ns)
