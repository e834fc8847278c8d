"""One transport per peer: shared memory / CUDA IPC to the ranks of this node, torch.distributed to
the others (``--multi-node``)."""

from megadpp.transport.base import Transport


class RoutedTransport(Transport):
    def __init__(self, rank, routes):
        self.rank = rank
        self.routes = dict(routes)

    def isend(self, tensor, peer, tag=0):
        return self.routes[peer].isend(tensor, peer, tag)

    def irecv(self, peer, tag=0):
        return self.routes[peer].irecv(peer, tag)

    def close(self):
        for transport in {id(t): t for t in self.routes.values()}.values():
            transport.close()
