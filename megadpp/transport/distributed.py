"""Across nodes: torch.distributed isend/irecv on gloo (CPU tensors) behind the transport interface (NCCL
is refused: see ``DistributedTransport``). A message is a fixed-size header (tag, dtype, shape) followed by
its bytes; receives match by tag exactly as the shared-memory transport does.

torch.distributed's point-to-point works cannot be polled on gloo (``is_completed()`` turns true only
inside ``wait()``), so completion is tracked by threads that wait: one per peer for what arrives from
it, one for the sends. They receive only while a posted receive waits for its message, so no receive
is left pending with nothing to match it.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megadpp.transport.base import Handle, TransferEvent, TransferObserver, Transport
from megadpp.transport.native import TransportSetupError

MAX_DIMS = 16
HEADER_WORDS = 3 + MAX_DIMS  # tag, dtype index, ndim, shape
DTYPES = [getattr(torch, name) for name in (
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "uint8", "int8", "int16", "int32",
    "int64", "bool", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)]
DTYPE_INDEX = {dtype: index for index, dtype in enumerate(DTYPES)}


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor: one wire format for every dtype (gloo has no bool or fp8)."""
    return tensor.reshape(-1).view(torch.uint8)


class _Transfer:
    """One message, shared by its handle and the thread that completes it."""

    __slots__ = ("tag", "tensor", "seq", "nbytes", "start_ns", "end_ns", "error", "done")

    def __init__(self, tag):
        self.tag = tag
        self.tensor = None
        self.seq = -1
        self.nbytes = 0
        self.start_ns = time.perf_counter_ns()
        self.end_ns = 0
        self.error = None
        self.done = threading.Event()

    def complete(self, error=None):
        self.error = error
        self.end_ns = time.perf_counter_ns()
        self.done.set()


class DistributedHandle(Handle):
    """A send or receive completed by one of the transport's threads; reports itself to the observer once."""

    __slots__ = ("_transport", "_transfer", "_op", "peer", "_sent", "_reported", "label")

    def __init__(self, transport: DistributedTransport, transfer: _Transfer, op: str, peer: int,
                 sent: torch.Tensor | None = None):
        self._transport = transport
        self._transfer = transfer
        self._op = op
        self.peer = peer
        self._sent = sent
        self._reported = False
        self.label = None

    def is_completed(self) -> bool:
        if not self._transfer.done.is_set():
            return False
        self._finish()
        return True

    @property
    def end_ns(self) -> int:
        return self._transfer.end_ns

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        if not self._transfer.done.wait(timeout):
            raise TimeoutError(f"megadpp transport: {self._op} with rank {self.peer} "
                               f"(tag {self._transfer.tag}) not done after {timeout} s")
        return self._finish()

    def _finish(self):
        transfer = self._transfer
        if transfer.error is not None:
            raise RuntimeError(f"megadpp transport: {self._op} with rank {self.peer} failed: {transfer.error}")
        if not self._reported and self._transport.observer is not None:
            self._reported = True
            self._transport.observer(TransferEvent(self._op, self.peer, transfer.nbytes, transfer.seq,
                                                   transfer.tag, transfer.start_ns, transfer.end_ns, self.label))
        return self._sent if self._op == "send" else transfer.tensor


class _Inbox:
    """What arrives from one peer, matched by tag (see csrc/megadpp_transport/shm_channels.h TagMatcher)."""

    def __init__(self):
        self.posted = collections.defaultdict(collections.deque)
        self.arrived = collections.defaultdict(collections.deque)
        self.waiting = 0  # posted receives whose message has not arrived
        self.seq = 0


class DistributedTransport(Transport):
    """torch.distributed point-to-point between this rank and ``peers`` (global ranks), on gloo."""

    def __init__(self, rank: int, peers: Iterable[int], *, group: dist.ProcessGroup | None = None,
                 device: torch.device | str | None = None, observer: TransferObserver | None = None):
        if dist.get_backend(group) == "nccl":
            # NCCL runs a pair's sends and receives in order on one stream: a receive posted ahead holds back
            # this rank's later sends to that peer. Its GPU check hung (docs/megadpp.md): refused, not risked.
            raise TransportSetupError("megadpp transport: the torch.distributed transport runs on gloo (CPU "
                                      "tensors) only; between GPUs of one node MegaDPP uses CUDA IPC")
        self.rank = rank
        self.peers = sorted(set(peers) - {rank})
        self.group = group
        self.observer = observer
        self.device = torch.device("cpu" if device is None else device)
        self._send_seq = dict.fromkeys(self.peers, 0)
        self._inboxes = {peer: _Inbox() for peer in self.peers}
        self._lock = threading.Condition()
        self._closing = False
        # (a send, its works), then None when closing
        self._sends: queue.Queue[tuple[_Transfer, list[dist.Work]] | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._complete_sends, daemon=True, name="megadpp-sends")]
        self._threads += [threading.Thread(target=self._receive_from, args=(peer,), daemon=True,
                                           name=f"megadpp-recv-{peer}") for peer in self.peers]
        for thread in self._threads:
            thread.start()

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Handle:
        if tensor.dim() > MAX_DIMS or tensor.dtype not in DTYPE_INDEX:
            raise ValueError(f"megadpp transport: cannot send a {tensor.dim()}-d {tensor.dtype} tensor")
        header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
        header[:3] = torch.tensor([tag, DTYPE_INDEX[tensor.dtype], tensor.dim()])
        header[3:3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        payload = tensor.contiguous()
        transfer = _Transfer(tag)
        transfer.tensor, transfer.nbytes, transfer.seq = payload, payload.nbytes, self._send_seq[peer]
        self._send_seq[peer] += 1
        works = [dist.isend(header.to(self.device), peer, group=self.group)]
        if payload.numel():
            works.append(dist.isend(as_bytes(payload), peer, group=self.group))
        self._sends.put((transfer, works))
        return DistributedHandle(self, transfer, "send", peer, sent=tensor)

    def irecv(self, peer: int, tag: int = 0) -> Handle:
        inbox = self._inboxes[peer]
        with self._lock:
            if inbox.arrived[tag]:
                transfer = inbox.arrived[tag].popleft()
            else:
                transfer = _Transfer(tag)
                inbox.posted[tag].append(transfer)
                inbox.waiting += 1
                self._lock.notify_all()
        return DistributedHandle(self, transfer, "recv", peer)

    def close(self) -> None:
        """Stop the threads that are idle; one blocked on a message that never comes is a daemon.
        torch.distributed owns the communicators."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._sends.put(None)

    def _complete_sends(self):
        while (item := self._sends.get()) is not None:
            transfer, works = item
            try:
                for work in works:
                    work.wait()
                transfer.complete()
            except RuntimeError as error:
                transfer.complete(str(error).splitlines()[0])

    def _receive_from(self, peer):
        inbox = self._inboxes[peer]
        while True:
            with self._lock:
                self._lock.wait_for(lambda: inbox.waiting or self._closing)
                if self._closing:
                    return
            try:
                header = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.device)
                dist.irecv(header, peer, group=self.group).wait()
                tag, dtype_index, ndim, *shape = header.tolist()
                tensor = torch.empty(shape[:ndim], dtype=DTYPES[dtype_index], device=self.device)
                if tensor.numel():
                    dist.irecv(as_bytes(tensor), peer, group=self.group).wait()
            except RuntimeError as error:
                self._fail_posted(inbox, str(error).splitlines()[0])
                return
            with self._lock:
                if inbox.posted[tag]:
                    transfer = inbox.posted[tag].popleft()
                    inbox.waiting -= 1
                else:
                    transfer = _Transfer(tag)
                    inbox.arrived[tag].append(transfer)
                transfer.tensor, transfer.nbytes, transfer.seq = tensor, tensor.nbytes, inbox.seq
                inbox.seq += 1
            transfer.complete()

    def _fail_posted(self, inbox, why):
        with self._lock:
            for transfers in inbox.posted.values():
                for transfer in transfers:
                    transfer.complete(why)
            inbox.posted.clear()
            inbox.waiting = 0
