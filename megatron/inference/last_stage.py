"""What the last pipeline stage computed (logits, draws, scores), on every stage of the pipeline."""

import torch
from megatron.core import parallel_state


def from_last_stage(tensor: torch.Tensor | None, shape: tuple, device: torch.device,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``tensor`` of the last pipeline stage (None on the others) on every stage; as it is without pipeline
    parallelism."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return tensor
    buffer = tensor if tensor is not None else torch.empty(shape, dtype=dtype, device=device)
    torch.distributed.broadcast(buffer, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                group=parallel_state.get_pipeline_model_parallel_group())
    return buffer
