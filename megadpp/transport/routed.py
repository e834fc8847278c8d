"""One transport per peer: shared memory / CUDA IPC to the ranks of this node, torch.distributed to
the others (``--multi-node``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megadpp.transport.base import Handle, Transport


class RoutedTransport(Transport):
    """``routes``: peer -> the transport that reaches it (one transport may serve many peers)."""

    def __init__(self, rank: int, routes: Mapping[int, Transport]):
        self.rank = rank
        self.routes = dict(routes)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Handle:
        return self.routes[peer].isend(tensor, peer, tag)

    def irecv(self, peer: int, tag: int = 0) -> Handle:
        return self.routes[peer].irecv(peer, tag)

    def close(self) -> None:
        for transport in {id(t): t for t in self.routes.values()}.values():
            transport.close()
