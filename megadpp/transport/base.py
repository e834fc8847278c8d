"""The interface every transport implements, and the event its observer receives."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class TransferEvent:
    """One completed transfer, as MegaScan records a point-to-point op."""

    op: str          # "send" or "recv"
    peer: int        # the other rank (global rank)
    nbytes: int
    seq: int         # index of the message on its directed channel (self -> peer, or peer -> self)
    tag: int
    start_ns: int    # isend/irecv was called (time.perf_counter_ns clock)
    end_ns: int      # the transfer was seen complete
    label: object = None  # what the caller set on the handle (the transport itself gives it no meaning)


# Called once per completed transfer (MegaScan records the transfers that bypass torch.distributed).
TransferObserver = Callable[[TransferEvent], None]


class Handle(abc.ABC):
    """One outstanding send or receive with ``peer`` (global rank). ``label``: anything the caller wants its
    TransferEvent to carry (the schedule: which microbatch and chunk the message belongs to)."""

    peer: int

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """Whether the transfer is done; never blocks."""

    @property
    @abc.abstractmethod
    def end_ns(self) -> int:
        """When the transfer completed (time.perf_counter_ns clock); meaningful once it has."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Block until done and return the tensor (received, or the one sent). ``timeout`` in seconds:
        TimeoutError when it passes first."""


class Transport(abc.ABC):
    """Asynchronous tensor messages between this rank and ``peers`` (see the package docstring)."""

    rank: int

    @abc.abstractmethod
    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Handle:
        """Queue ``tensor`` (any dtype, shape, layout; it must not change until the handle completes)."""

    @abc.abstractmethod
    def irecv(self, peer: int, tag: int = 0) -> Handle:
        """Ask for the next message from ``peer`` with ``tag``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the transport's threads and release its memory; idempotent."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
