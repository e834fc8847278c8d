"""Where this process's torch.distributed world sits in the run's trace.

An ordinary run is one world and its trace is that world. A run made of several worlds (MegaFBD: its
backward and its forward instances each form a world of their own, linked by messages) is traced as
one: every process writes into the same --trace-dir under the run's launch-wide rank, with group ids
kept apart between the worlds, so that the aggregation merges all of them and matches the messages
between them. Such a run sets ``args.traced_world`` before tracing starts; ``of(args)`` gives an
ordinary run's identity placement.
"""

import datetime
import uuid
from dataclasses import dataclass

import torch.distributed as dist


def new_run_id():
    return f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class TracedWorld:
    run_id: object  # str, or None: made by this world's rank 0 and broadcast
    rank_offset: int  # launch-wide rank = rank in this world + rank_offset
    world_size: int  # the whole run's
    group_prefix: str  # prepended to this world's group ids
    tensor_offset: int  # this world's tensor-parallel index in the trace layout = its own + tensor_offset
    tensor_size: int  # the trace layout's tensor axis (every world's together)

    def global_ranks(self, ranks):
        return [rank + self.rank_offset for rank in ranks]


def of(args):
    """The run's placement of this world: ``args.traced_world``, or the world itself."""
    world = getattr(args, "traced_world", None)
    if world is not None:
        return world
    return TracedWorld(None, 0, dist.get_world_size(), "", 0, args.tensor_model_parallel_size)
