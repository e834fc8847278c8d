"""Where this process's torch.distributed world sits in the run's trace.

An ordinary run is one world and its trace is that world. A run made of several worlds (a placement
declared through the plugin contract: MegaFBD's backward and forward instances each form a world of
their own, linked by messages) is traced as one: every process writes into the same --trace-dir under
its launch-wide rank, the worlds after the first prefix their group ids with their kind, and the trace
layout's tensor axis holds every world's tensor-parallel ranks, one world after the other.
"""

import datetime
import uuid
from dataclasses import dataclass

from megatron.training.placement import Placement

RUN_ID_KEY = "megascan/run-id"


def new_run_id():
    return f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


def shared_run_id(store, placement: Placement) -> str:
    """One run id for every process of the launch: launch rank 0 makes it, the others read it from the
    launch's store (waiting for it)."""
    if placement.launch_rank == 0:
        store.set(RUN_ID_KEY, new_run_id())
    return store.get(RUN_ID_KEY).decode()


@dataclass(frozen=True)
class TracedWorld:
    rank_offset: int  # launch-wide rank = rank in this world + rank_offset
    world_size: int  # the whole run's
    group_prefix: str  # prepended to this world's group ids
    tensor_offset: int  # this world's tensor-parallel index in the trace layout = its own + tensor_offset
    tensor_size: int  # the trace layout's tensor axis (every world's together)

    def global_ranks(self, ranks):
        return [rank + self.rank_offset for rank in ranks]


def of(placement: Placement) -> TracedWorld:
    """This process's world's place in the trace."""
    index = placement.worlds.index(placement.world)
    return TracedWorld(placement.world.first_rank, placement.launch_size,
                       f"{placement.world.kind}/" if index else "",
                       sum(world.tensor_model_parallel_size for world in placement.worlds[:index]),
                       sum(world.tensor_model_parallel_size for world in placement.worlds))
