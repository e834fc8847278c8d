"""Build a transport: one factory per kind, and ``create_transport`` that picks from the launch flags."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megadpp.nodes import ranks_on_this_node
from megadpp.transport import node
from megadpp.transport.base import TransferObserver, Transport
from megadpp.transport.native import TransportSetupError
from megadpp.transport.routed import RoutedTransport

DEFAULT_SLOTS = 8
DEFAULT_SLOT_BYTES = 4 << 20
DEFAULT_WORKLOAD = 4 << 20  # bytes one copy thread handles; a slot of 4 MiB is copied by one thread


def shared_memory_transport(rank: int, peers: Iterable[int], *, store: dist.Store | None = None,
                            name: str = "megadpp", slots: int = DEFAULT_SLOTS, slot_bytes: int = DEFAULT_SLOT_BYTES,
                            workload: int = DEFAULT_WORKLOAD, shm_limit_bytes: int | None = None,
                            observer: TransferObserver | None = None, timeout: float = 300.0) -> Transport:
    """Processes of one node. ``peers``: the ranks this rank exchanges with (a channel each way).
    ``store``: a torch.distributed Store for the segment names (default: the default group's);
    ``name`` keeps several transports of one run apart; ``shm_limit_bytes`` caps what may be
    taken from /dev/shm (default: what is free there). Collective over ``rank`` and ``peers``."""
    return node.shared_memory(rank, peers, store=store, name=name, slots=slots, slot_bytes=slot_bytes,
                              workload=workload, shm_limit_bytes=shm_limit_bytes, observer=observer, timeout=timeout)


def cuda_ipc_transport(rank: int, peers: Iterable[int], *, device: int | None = None, store: dist.Store | None = None,
                       name: str = "megadpp", slots: int = DEFAULT_SLOTS, shm_limit_bytes: int | None = None,
                       observer: TransferObserver | None = None, timeout: float = 300.0) -> Transport:
    """GPU tensors of processes of one node (they may share one GPU); ``device``: this rank's GPU
    (default: the current one); ``slots``: messages a channel holds unconsumed (the receiver copies each
    straight out of the sender's memory). Other options as for ``shared_memory_transport``."""
    return node.cuda_ipc(rank, peers, device=device, store=store, name=name, slots=slots,
                         shm_limit_bytes=shm_limit_bytes, observer=observer, timeout=timeout)


def distributed_transport(rank: int, peers: Iterable[int], *, group: dist.ProcessGroup | None = None,
                          device: torch.device | str | None = None,
                          observer: TransferObserver | None = None) -> Transport:
    """torch.distributed isend/irecv on gloo (CPU tensors; NCCL is refused in one line); ``device`` holds
    received tensors (default: CPU). ``rank`` and ``peers`` are global ranks."""
    from megadpp.transport.distributed import DistributedTransport

    return DistributedTransport(rank, peers, group=group, device=device, observer=observer)


def cuda_ipc_available() -> bool:
    """Whether this install has the CUDA IPC part (built where CUDA was) and a GPU is visible."""
    from megadpp.transport import native

    return native._cuda_ipc is not None and torch.cuda.is_available()


def create_transport(args: argparse.Namespace, peers: Iterable[int],
                     observer: TransferObserver | None = None) -> Transport:
    """The transport a run's flags ask for: peers on this node over shared memory (CPU) or CUDA IPC
    (GPU: without the CUDA IPC part built, a one-line TransportSetupError says how to build it); CPU peers on
    other nodes over torch.distributed (GPU peers there are refused: see docs/megadpp.md). Reads args.device,
    args.node_ips, args.workload; collective over all ranks of ``peers``."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    this_node = ranks_on_this_node(getattr(args, "node_ips", None), rank, world_size)
    local = [p for p in peers if p in this_node and p != rank]
    remote = [p for p in peers if p not in this_node]
    routes = {}
    if getattr(args, "device", "cpu") == "cuda" and remote:
        raise TransportSetupError(
            f"megadpp transport: ranks {remote} are pipeline neighbours on other nodes, and DPP between GPUs of "
            "different nodes would go over torch.distributed with NCCL, which hung in its GPU check "
            "(docs/megadpp.md); keep each pipeline within a node, or drop --use-dpp")
    if local:
        if getattr(args, "device", "cpu") == "cuda":
            routes.update(dict.fromkeys(local, cuda_ipc_transport(rank, local, observer=observer)))
        else:
            workload = getattr(args, "workload", None) or DEFAULT_WORKLOAD
            routes.update(dict.fromkeys(local, shared_memory_transport(rank, local, workload=workload,
                                                                       observer=observer)))
    if remote:
        routes.update(dict.fromkeys(remote, distributed_transport(rank, remote, observer=observer)))
    return RoutedTransport(rank, routes)
