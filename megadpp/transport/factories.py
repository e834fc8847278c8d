"""Build a transport: one factory per kind, and ``create_transport`` that picks from the launch flags."""

DEFAULT_SLOTS = 8
DEFAULT_SLOT_BYTES = 4 << 20
DEFAULT_WORKLOAD = 4 << 20  # bytes one copy thread handles; a slot of 4 MiB is copied by one thread


def shared_memory_transport(rank, peers, *, store=None, name="megadpp", slots=DEFAULT_SLOTS,
                            slot_bytes=DEFAULT_SLOT_BYTES, workload=DEFAULT_WORKLOAD, shm_limit_bytes=None,
                            observer=None, timeout=300.0):
    """Processes of one node. ``peers``: the ranks this rank exchanges with (a channel each way).
    ``store``: a torch.distributed Store for the segment names (default: the default group's);
    ``name`` keeps several transports of one run apart; ``shm_limit_bytes`` caps what may be
    taken from /dev/shm (default: what is free there)."""
    from megadpp.transport.shared_memory import SharedMemoryTransport

    return SharedMemoryTransport(rank, peers, store=store, name=name, slots=slots, slot_bytes=slot_bytes,
                                 workload=workload, shm_limit_bytes=shm_limit_bytes, observer=observer,
                                 timeout=timeout)


def cuda_ipc_transport(rank, peers, *, device=None, store=None, name="megadpp", slots=DEFAULT_SLOTS,
                       slot_bytes=DEFAULT_SLOT_BYTES, observer=None, timeout=300.0):
    """GPU tensors of processes of one node (may share one GPU)."""
    raise NotImplementedError("being built on branch dpp-transport")


def distributed_transport(rank, peers, *, group=None, observer=None):
    """torch.distributed isend/irecv (NCCL across nodes, gloo on CPU)."""
    raise NotImplementedError("being built on branch dpp-transport")


def cuda_ipc_available():
    """Whether the extension was built with CUDA (and a GPU is visible)."""
    return False


def create_transport(args, peers, observer=None):
    """The transport a run's flags ask for: ``--multi-node`` -> torch.distributed for peers on other
    nodes; CUDA tensors -> CUDA IPC; CPU -> shared memory. Reads args.device, args.multi_node,
    args.node_ips, args.workload."""
    raise NotImplementedError("being built on branch dpp-transport")
