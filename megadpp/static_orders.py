"""megatron-core's static schedules as data: the order of actions one pipeline rank runs under 1F1B
(``forward_backward_pipelining_without_interleaving``) and interleaved 1F1B
(``forward_backward_pipelining_with_interleaving``), built from megatron-core's own warm-up rule and
schedule table. The simulator replays them; the default activation cap of DPP is their peak."""

from megatron.core.pipeline_parallel.schedules import get_schedule_table

from megadpp.actions import BACKWARD, FORWARD, Action


def warmup_count(pp_rank, stages, chunks, microbatches, group_size):
    """Forwards before the first backward (megatron-core's get_pp_rank_microbatches, without its
    process-group look-ups)."""
    total = microbatches * chunks
    if chunks == 1:
        warmup = stages - pp_rank - 1
    else:
        warmup = (stages - pp_rank - 1) * 2 + (chunks - 1) * group_size
    return min(warmup, total)


def static_order(pp_rank, stages, chunks, microbatches, group_size=None):
    """The actions pipeline rank ``pp_rank`` runs, in order, under megatron-core's static schedule."""
    group_size = stages if group_size is None else group_size
    table = get_schedule_table(microbatches, chunks, group_size)  # virtual microbatch -> (microbatch, chunk)
    forwards = [Action(FORWARD, chunk, m) for m, chunk in table]
    backwards = [Action(BACKWARD, chunks - chunk - 1, m) for m, chunk in table]
    warmup = warmup_count(pp_rank, stages, chunks, microbatches, group_size)
    order = forwards[:warmup]
    for index in range(len(table) - warmup):
        order += [forwards[warmup + index], backwards[index]]
    return order + backwards[len(table) - warmup:]
