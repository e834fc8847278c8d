"""Which launched process is which instance: the split of the launch into backward and forward instances.

The first ``TP x PP x DP`` global ranks are the backward instances, laid out exactly as a normal run
of that size (megatron-core's order: tensor rank fastest, then data-parallel, then pipeline), so
that they form an ordinary Megatron world: model-parallel and data-parallel groups, distributed
optimizer and checkpoints as usual. The remaining ``TPf x PP x DP`` ranks are the forward
instances, in the same order with their own tensor-parallel size ``TPf`` (TP, or 1 with
--ignore-forward-tensor-parallel). Each (stage, replica) has one *link*: its forward instance(s)
and the backward instances they serve (one each at TPf = TP; all TP of them at TPf = 1).
"""

from dataclasses import dataclass

BACKWARD, FORWARD = "backward", "forward"


@dataclass(frozen=True)
class Coordinates:
    tensor: int
    data: int
    pipeline: int


@dataclass(frozen=True)
class Link:
    """A forward instance and the backward instances it serves; link rank i is ``members[i]``."""

    name: str
    backward_members: tuple
    forward_member: int

    @property
    def members(self):
        return (*self.backward_members, self.forward_member)

    @property
    def forward_link_rank(self):
        return len(self.backward_members)

    def link_rank(self, global_rank):
        return self.members.index(global_rank)


@dataclass(frozen=True)
class InstanceLayout:
    tensor: int
    pipeline: int
    data: int
    forward_tensor: int

    @classmethod
    def for_launch(cls, tensor, pipeline, forward_tensor, launched):
        """The layout of ``launched`` processes, or None when they do not fit (``processes_per_replica``)."""
        per_replica = cls.processes_per_replica(tensor, pipeline, forward_tensor)
        if launched % per_replica:
            return None
        return cls(tensor, pipeline, launched // per_replica, forward_tensor)

    @staticmethod
    def processes_per_replica(tensor, pipeline, forward_tensor):
        return pipeline * (tensor + forward_tensor)

    @property
    def backward_size(self):
        return self.tensor * self.pipeline * self.data

    @property
    def forward_size(self):
        return self.forward_tensor * self.pipeline * self.data

    @property
    def world_size(self):
        return self.backward_size + self.forward_size

    def kind(self, global_rank):
        return BACKWARD if global_rank < self.backward_size else FORWARD

    def kind_offset(self, kind):
        """The global rank of the kind's rank 0."""
        return 0 if kind == BACKWARD else self.backward_size

    def kind_rank(self, global_rank):
        return global_rank - self.kind_offset(self.kind(global_rank))

    def kind_size(self, kind):
        return self.backward_size if kind == BACKWARD else self.forward_size

    def _tensor_size(self, kind):
        return self.tensor if kind == BACKWARD else self.forward_tensor

    def coordinates(self, global_rank):
        kind, rank = self.kind(global_rank), self.kind_rank(global_rank)
        tp = self._tensor_size(kind)
        return Coordinates(tensor=rank % tp, data=rank // tp % self.data, pipeline=rank // (tp * self.data))

    def global_rank(self, kind, coordinates):
        tp = self._tensor_size(kind)
        rank = coordinates.tensor + tp * (coordinates.data + self.data * coordinates.pipeline)
        return rank if kind == BACKWARD else self.backward_size + rank

    def link(self, global_rank):
        """The link this process belongs to (every process belongs to exactly one)."""
        where = self.coordinates(global_rank)
        forward_tensor_rank = where.tensor if self.kind(global_rank) == FORWARD else (
            where.tensor if self.forward_tensor == self.tensor else 0)
        forward = self.global_rank(FORWARD, Coordinates(forward_tensor_rank, where.data, where.pipeline))
        served = [forward_tensor_rank] if self.forward_tensor == self.tensor else range(self.tensor)
        backward = tuple(self.global_rank(BACKWARD, Coordinates(t, where.data, where.pipeline)) for t in served)
        return Link(f"pp{where.pipeline}-dp{where.data}-tp{forward_tensor_rank}", backward, forward)
