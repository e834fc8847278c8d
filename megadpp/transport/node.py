"""Transports between processes of one node, whose channels live in the C++ extension (csrc/): the
shared-memory one (CPU tensors) and the CUDA IPC one (GPU tensors). Both agree on segment names
through a torch.distributed Store and unlink every segment once its receiver has it open; the segments of a job
killed before that are removed by the next transport started on the node."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from megadpp.transport.base import Handle, TransferObserver, Transport
from megadpp.transport.native import NativeHandle, TransportSetupError, cuda_ipc_module, shm_module
from megadpp.transport.rendezvous import (
    channel_key,
    check_shm_room,
    default_store,
    remove_abandoned_segments,
    segment_name,
)

MAX_COPY_THREADS = 8


def copy_threads_for(slot_bytes: int, workload: int) -> int:
    """Threads besides the channel's own that copy one slot: one per ``workload`` bytes."""
    if workload <= 0:
        raise TransportSetupError(f"megadpp transport: --workload must be a positive number of bytes (got {workload})")
    return max(0, min(MAX_COPY_THREADS, -(-slot_bytes // workload)) - 1)


class NodeTransport(Transport):
    """``native``: a ShmTransport or CudaIpcTransport of the extension; ``segment_bytes``: what one
    channel takes of /dev/shm; ``channel_shape``: what the native transport's channels are made with after
    (peer, segment name): (slots, slot bytes) for shared memory, (slots,) for CUDA IPC."""

    def __init__(self, native: Any, segment_bytes: int, rank: int, peers: Iterable[int], *, store: dist.Store | None,
                 name: str, channel_shape: tuple[int, ...], shm_limit_bytes: int | None,
                 observer: TransferObserver | None, timeout: float):
        self.rank = rank
        self.peers = sorted(set(peers) - {rank})
        self.observer = observer
        remove_abandoned_segments()  # first: what a killed job left counts as room again
        check_shm_room(len(self.peers) * segment_bytes, len(self.peers), shm_limit_bytes)
        store = store if store is not None else default_store()
        self._native = native
        self._closer = weakref.finalize(self, native.close)
        try:
            # Every rank creates all its outgoing channels before it opens any incoming one, so the
            # waits below (for a name, for the receiver to attach) cannot form a cycle.
            for peer in self.peers:
                segment = segment_name(rank, peer)
                native.create_send_channel(peer, segment, *channel_shape)
                store.set(channel_key(name, rank, peer), segment)
            for peer in self.peers:
                native.open_recv_channel(peer, store.get(channel_key(name, peer, rank)).decode())
            native.await_receivers(timeout)
        except RuntimeError as error:
            self.close()
            raise TransportSetupError(str(error)) from None
        native.start()

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Handle:
        return NativeHandle(self._native.isend(tensor, peer, tag), "send", peer, self.observer, tensor)

    def irecv(self, peer: int, tag: int = 0) -> Handle:
        return NativeHandle(self._native.irecv(peer, tag), "recv", peer, self.observer)

    def close(self) -> None:
        self._closer()


def shared_memory(rank: int, peers: Iterable[int], *, slots: int, slot_bytes: int, workload: int,
                  **options: Any) -> NodeTransport:
    """The shared-memory transport (CPU tensors); ``options``: NodeTransport's keyword arguments."""
    shm = shm_module()
    native = shm.ShmTransport(workload, copy_threads_for(slot_bytes, workload))
    return NodeTransport(native, shm.segment_bytes(slots, slot_bytes), rank, peers,
                         channel_shape=(slots, slot_bytes), **options)


def cuda_ipc(rank: int, peers: Iterable[int], *, device: int | None, slots: int, **options: Any) -> NodeTransport:
    """The CUDA IPC transport (GPU tensors); ``options``: NodeTransport's keyword arguments."""
    cuda = cuda_ipc_module()  # first: on a build without CUDA this is the one line to show
    device = torch.cuda.current_device() if device is None else torch.device("cuda", device).index
    return NodeTransport(cuda.CudaIpcTransport(device), cuda.segment_bytes(slots), rank, peers,
                         channel_shape=(slots,), **options)
