"""A megatron-core ``torch_dist`` checkpoint written with each tensor produced only when its bytes are written.

megatron-core's own torch_dist strategy stages every tensor of the state dict in host memory
before it writes (its asynchronous writer copies them all first), so converting a model that way
needs the whole model in memory. Here the state dict holds ShardedTensors on the meta device (their
place in the checkpoint: key, shape, offset, dtype), translated to PyTorch's distributed-checkpoint
form with megatron-core's own ``mcore_to_pyt_state_dict``; the DCP planner's ``resolve_data`` (the
hook PyTorch's writer calls for each item, one at a time, right before writing it) asks a producer
for the real tensor. PyTorch's ``FileSystemWriter`` then writes that tensor and drops it. The items
are written in the order the producer asks for (the order of its sources, so that they are read
sequentially), one after the other (no copy-ahead).

The result is the same format megatron-core writes (``metadata.json`` says torch_dist, the common
state in ``common.pt`` saved by ``dist_checkpointing.save``, the tensors in ``.distcp`` files with
DCP's ``.metadata``), so ``dist_checkpointing.load`` reads it at any TP/PP.
"""

import dataclasses
import os
from collections.abc import Callable

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner, mcore_to_pyt_state_dict
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.planner import WriteItemType

# (ShardedTensor key, global offset) -> the tensor of that place, in the ShardedTensor's dtype and local shape
Producer = Callable[[str, tuple], torch.Tensor]
# (ShardedTensor key, global offset) -> a sort key: places are produced in its order
Order = Callable[[str, tuple], tuple]


def placeholder(template, dtype):
    """``template``'s place in the checkpoint with no data yet (a meta tensor of its shape and dtype)."""
    data = torch.empty(template.local_shape, dtype=dtype, device="meta")
    return ShardedTensor(template.key, data, dtype, template.local_shape, template.global_shape,
                         template.global_offset, template.axis_fragmentations, template.replica_id,
                         template.prepend_axis_num)


class _ProducingPlanner(MCoreSavePlanner):
    """megatron-core's planner, with tensors produced when the writer resolves them."""

    def __init__(self, produce: Producer, order: Order):
        super().__init__(flatten_state_dict=False)
        self.produce, self.order = produce, order

    def create_local_plan(self):
        plan = super().create_local_plan()

        def position(item):  # the serialized objects first, as the writer puts them
            if item.type == WriteItemType.BYTE_IO:
                return (0,)
            return (1, *self.order(item.index.fqn, tuple(item.index.offset)))

        self.plan = dataclasses.replace(plan, items=sorted(plan.items, key=position))
        return self.plan

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:  # extra-state objects, already serialized
            return super().resolve_data(write_item)
        index = write_item.index
        tensor = self.produce(index.fqn, tuple(index.offset))
        return tensor.reshape(write_item.tensor_data.chunk.sizes)  # with the prepended layer axis


class StreamingTorchDistSaveStrategy(SaveShardedStrategy):
    """Pass to ``dist_checkpointing.save(..., sharded_strategy=...)`` with a state dict of ``placeholder``s.

    One process only (a conversion), a file per item, written serially: at most two tensors in memory
    (the one being written and, until the next is made, the one before)."""

    def __init__(self, produce: Producer, order: Order):
        super().__init__("torch_dist", 1)  # what the loader dispatches on: megatron-core's torch_dist reader
        self.produce, self.order = produce, order

    @property
    def can_handle_sharded_objects(self):
        return True

    def save(self, sharded_state_dict, checkpoint_dir):
        grouped = {}  # as megatron-core's strategy groups them: by checkpoint key, main replicas only
        for item in nested_values(sharded_state_dict):
            if is_main_replica(item.replica_id):
                key = item.unique_key if isinstance(item, ShardedObject) else item.key
                grouped.setdefault(key, []).append(item)
        # One file per item: PyTorch's writer keeps each tensor it wrote to a file (the last one of
        # each key, in the dict its safetensors format needs) until it closes the file, so with a
        # single file the embedding and the output layer stayed in memory to the end.
        # No copy-ahead: with it (the default where CUDA is present) the writer resolves items
        # ahead, smallest first, instead of one at a time in the plan's order.
        # Synced once at the end, not each file as it closes: the kernel writes the files back while the
        # next tensors are read, and the checkpoint is as durable when ``save`` returns.
        writer = FileSystemWriter(checkpoint_dir, single_file_per_rank=False, thread_count=1, per_thread_copy_ahead=0,
                                  sync_files=False)
        dcp_save(mcore_to_pyt_state_dict(grouped, is_loading=False), storage_writer=writer,
                 planner=_ProducingPlanner(self.produce, self.order))
        _sync_folder(checkpoint_dir)


def _sync_folder(folder):
    """fsync every file directly in ``folder`` (what the writer wrote there) and the folder itself."""
    for entry in os.scandir(folder):
        if entry.is_file():
            with open(entry.path, "rb") as f:
                os.fsync(f.fileno())
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
