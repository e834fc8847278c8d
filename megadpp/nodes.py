"""Which ranks share a node: shared memory and CUDA IPC reach only the processes of one host."""

import os


def ranks_on_this_node(node_ips: str | None, rank: int, world_size: int) -> range:
    """The ranks that share ``rank``'s node. ``node_ips`` (--node-ips, one address per node) splits the ranks
    evenly; otherwise torchrun's environment: it numbers the LOCAL_WORLD_SIZE ranks of one node consecutively
    from RANK - LOCAL_RANK. A process that torchrun did not start is one node with its whole world."""
    if node_ips:
        per_node = max(1, world_size // len(node_ips.split(",")))
        first = rank // per_node * per_node
        return range(first, first + per_node)
    if "LOCAL_WORLD_SIZE" not in os.environ:
        return range(world_size)
    first = rank - int(os.environ["LOCAL_RANK"])
    return range(first, first + int(os.environ["LOCAL_WORLD_SIZE"]))


def launch_spans_nodes(node_ips: str | None) -> bool:
    """Whether the launch's processes are on more than one node (read before any process group exists)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return len(ranks_on_this_node(node_ips, int(os.environ.get("RANK", "0")), world_size)) < world_size
