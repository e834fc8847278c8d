"""MegaDPP's asynchronous point-to-point tensor transport. It knows nothing of pipelines: channels,
asynchronous handles, completion.

    transport = create_transport(args, peers)            # or one of the three factories below
    handle = transport.isend(tensor, peer, tag=0)        # -> Handle; the tensor may be non-contiguous
    handle = transport.irecv(peer, tag=0)                # -> Handle; shape and dtype travel in the header
    handle.is_completed()                                # -> bool, never blocks
    tensor = handle.wait()                               # the received tensor (a send returns what it sent)
    transport.close()                                    # also on garbage collection / process exit

Matching: ``irecv(peer, tag)`` gets the next message that ``peer`` sent to this rank with ``tag``;
messages of one (peer, tag) arrive in the order they were sent, messages of different tags on the
same channel may be received in any order (a message that arrives before its ``irecv`` is kept
until asked for). Any number of sends and receives may be outstanding on a channel.

Kinds (all behind the same interface):
- ``shared_memory_transport``: processes of one node, a /dev/shm ring of preallocated slots per
  directed pair of ranks, copies done by C++ threads of the ``megadpp_transport`` extension (csrc/).
- ``cuda_ipc_transport``: GPU tensors of processes of one node: the receiver copies each message
  straight out of the sender's memory (shared once per allocator segment through CUDA IPC), ordered by
  IPC events; a receive completes once its copy is queued, and ``wait`` orders the caller's stream after
  it, as NCCL does (built only where CUDA is; elsewhere the import says so in one line and the factory
  raises).
- ``distributed_transport``: across nodes, torch.distributed isend/irecv (NCCL on GPUs, gloo on CPU).

Observer: every factory takes ``observer``, called once per completed transfer with a
``TransferEvent`` (op, peer, nbytes, seq, tag, start_ns, end_ns), so that MegaScan can record the
transfers that bypass torch.distributed. ``seq`` counts the messages of one directed channel from 0;
times are ``time.perf_counter_ns()`` (CLOCK_MONOTONIC).
"""

from megadpp.transport.base import Handle, TransferEvent, Transport
from megadpp.transport.factories import (
    create_transport,
    cuda_ipc_available,
    cuda_ipc_transport,
    distributed_transport,
    shared_memory_transport,
)
from megadpp.transport.native import TransportSetupError  # loads csrc/'s extension; says if CUDA IPC is missing

__all__ = [
    "Handle", "Transport", "TransferEvent", "TransportSetupError", "create_transport", "cuda_ipc_available",
    "cuda_ipc_transport",
    "distributed_transport", "shared_memory_transport",
]
