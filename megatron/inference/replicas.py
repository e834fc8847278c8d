"""Data-parallel replicas of the generation server: each generates a contiguous share of a request's
prompts (its rows draw from their own seeded streams, megatron/inference/sampling.py, so the share does not
change their tokens), and global rank 0 gathers the shares back in the request's order."""

from dataclasses import replace

import torch
from megatron.core import parallel_state

from megatron.inference.engine import Generation, NonFiniteLogits
from megatron.training.collectives import gather_objects
from megatron.training.training_log import print_whole_line


def replica_share(count):
    """[start, end) of a request's ``count`` prompts for this rank's replica: contiguous, in replica order,
    sizes differing by at most one (empty for the last replicas when there are fewer prompts than replicas)."""
    replicas = parallel_state.get_data_parallel_world_size()
    replica = parallel_state.get_data_parallel_rank()
    size, extra = divmod(count, replicas)
    start = replica * size + min(replica, extra)
    return start, start + size + (replica < extra)


def generate_share(engine, prompts, params, observer):
    """Collective over every rank: this replica generates its share, and global rank 0 gets the whole
    Generation in the prompts' order (None elsewhere). A replica whose model broke (NonFiniteLogits) still
    takes part in the gather; global rank 0 then raises it."""
    start, end = replica_share(len(prompts))
    replicas = parallel_state.get_data_parallel_world_size()
    if replicas > 1 and parallel_state.get_model_parallel_group().rank() == 0:  # progress, once per replica
        print_whole_line(f"replica {parallel_state.get_data_parallel_rank()} of {replicas}: prompts [{start}, {end}) "
                         f"of {len(prompts)}")
    try:
        share = engine.generate(prompts[start:end], replace(params, first_prompt=start), observer) \
            if end > start else None
    except NonFiniteLogits as broken:
        share = broken
    parts = gather_objects(share, parallel_state.get_data_parallel_group(), 0)
    if torch.distributed.get_rank() != 0:
        return None
    for part in parts:
        if isinstance(part, NonFiniteLogits):
            raise part
    parts = [part for part in parts if part is not None]
    return Generation(tokens=[tokens for part in parts for tokens in part.tokens],
                      prompt_lengths=[length for part in parts for length in part.prompt_lengths],
                      finish_reasons=[reason for part in parts for reason in part.finish_reasons],
                      logprobs=None if parts[0].logprobs is None else
                      [values for part in parts for values in part.logprobs],
                      top_logprobs=None if parts[0].top_logprobs is None else
                      [values for part in parts for values in part.top_logprobs])
