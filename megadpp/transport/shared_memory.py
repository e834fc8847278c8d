"""Processes of one node: a /dev/shm ring per directed pair of ranks (see csrc/megadpp_transport)."""

import weakref

from megadpp.transport.base import Transport
from megadpp.transport.native import NativeHandle, TransportSetupError, shm_module
from megadpp.transport.rendezvous import channel_key, check_shm_room, default_store, segment_name

MAX_COPY_THREADS = 8


def copy_threads_for(slot_bytes, workload):
    """Threads besides the channel's own that copy one slot: one per ``workload`` bytes."""
    if workload <= 0:
        raise TransportSetupError(f"megadpp transport: --workload must be a positive number of bytes (got {workload})")
    return max(0, min(MAX_COPY_THREADS, -(-slot_bytes // workload)) - 1)


class SharedMemoryTransport(Transport):
    def __init__(self, rank, peers, *, store, name, slots, slot_bytes, workload, shm_limit_bytes, observer, timeout):
        shm = shm_module()
        self.rank = rank
        self.peers = sorted(set(peers) - {rank})
        self.observer = observer
        check_shm_room(len(self.peers) * shm.segment_bytes(slots, slot_bytes), len(self.peers), shm_limit_bytes)
        store = store if store is not None else default_store()
        self._native = shm.ShmTransport(workload, copy_threads_for(slot_bytes, workload))
        self._closer = weakref.finalize(self, self._native.close)
        try:
            # Every rank creates all its outgoing channels before it opens any incoming one, so the
            # waits below (for a name, for the receiver to attach) cannot form a cycle.
            for peer in self.peers:
                segment = segment_name(rank, peer)
                self._native.create_send_channel(peer, segment, slots, slot_bytes)
                store.set(channel_key(name, rank, peer), segment)
            for peer in self.peers:
                self._native.open_recv_channel(peer, store.get(channel_key(name, peer, rank)).decode())
            self._native.await_receivers(timeout)
        except RuntimeError as error:
            self.close()
            raise TransportSetupError(str(error)) from None
        self._native.start()

    def isend(self, tensor, peer, tag=0):
        return NativeHandle(self._native.isend(tensor, peer, tag), "send", peer, self.observer, tensor)

    def irecv(self, peer, tag=0):
        return NativeHandle(self._native.irecv(peer, tag), "recv", peer, self.observer)

    def close(self):
        self._closer()
