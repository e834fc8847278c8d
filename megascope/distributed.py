"""The tensor collectives MegaScope needs: gather tensor-parallel shards and hand the last pipeline stage's tensor
to every stage (objects go to one rank with megatron/training/collectives.py)."""

import torch
from megatron.core import parallel_state


def all_gather_along(tensor, dim, group):
    """The pieces of ``tensor`` held by the ranks of ``group``, concatenated along ``dim`` in rank order."""
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    pieces = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(pieces, tensor, group=group)
    return torch.cat(pieces, dim=dim)


def broadcast_from_last_stage(tensor, shape, dtype, device):
    """The last pipeline stage's ``tensor`` on every stage of this rank's pipeline group (the other stages pass
    None); as is without pipeline parallelism."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return tensor
    buffer = torch.empty(shape, dtype=dtype, device=device) if tensor is None else tensor.to(device, dtype).contiguous()
    torch.distributed.broadcast(buffer, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                group=parallel_state.get_pipeline_model_parallel_group())
    return buffer
