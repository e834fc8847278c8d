"""Pipeline work as data: an action is one forward or backward of one (microbatch, model chunk) on one
rank, written as ``torch.distributed.pipelining`` writes schedules (``"5F2"``: stage 5, forward,
microbatch 2), so a logged order can be read back with ``_Action.from_str`` and checked by its tools.

Stages are virtual pipeline stages: with ``stages`` pipeline ranks and ``chunks`` model chunks per rank,
chunk ``c`` of pipeline rank ``r`` is stage ``c * stages + r`` (the looped layout megatron-core's
interleaved schedule and torch's looped schedules share). A microbatch's forward visits stages
0, 1, ..., V-1; its backward visits them in reverse.
"""

from typing import NamedTuple

FORWARD = "F"
BACKWARD = "B"


class Action(NamedTuple):
    kind: str  # FORWARD or BACKWARD
    chunk: int
    microbatch: int

    def stage_index(self, pp_rank, stages):
        return self.chunk * stages + pp_rank

    def to_str(self, pp_rank, stages):
        return f"{self.stage_index(pp_rank, stages)}{self.kind}{self.microbatch}"


class StageLayout(NamedTuple):
    """Where one pipeline rank sits: which neighbours feed each of its chunks."""

    pp_rank: int
    stages: int
    chunks: int

    @property
    def virtual_stages(self):
        return self.stages * self.chunks

    def is_first(self, chunk):
        return chunk == 0 and self.pp_rank == 0

    def is_last(self, chunk):
        return chunk == self.chunks - 1 and self.pp_rank == self.stages - 1

    def downstream(self, chunk):
        """(pp rank, chunk) that takes this chunk's output; None after the last stage."""
        if self.is_last(chunk):
            return None
        if self.pp_rank == self.stages - 1:
            return 0, chunk + 1
        return self.pp_rank + 1, chunk

    def upstream(self, chunk):
        """(pp rank, chunk) whose output is this chunk's input; None before the first stage."""
        if self.is_first(chunk):
            return None
        if self.pp_rank == 0:
            return self.stages - 1, chunk - 1
        return self.pp_rank - 1, chunk


def peak_in_flight(order):
    """Most activations an order holds at once (forwards done whose backward is not)."""
    held = peak = 0
    for action in order:
        held += 1 if action.kind == FORWARD else -1
        peak = max(peak, held)
    return peak
