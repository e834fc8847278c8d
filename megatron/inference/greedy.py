"""Greedy generation with our GPT at any TP/PP, through megatron-core's forward-only pipeline schedule.

No KV cache: every step runs the whole sequence again (simple, and exact; a check of a converted
model's numbers, not a server). Every rank holds the same tokens; the last pipeline stage picks
the next token and sends it to the stages before it. One model chunk per pipeline rank.
"""

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region


def _forward_step(tokens, start, model_kwargs):
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device).expand_as(tokens)

    def forward_step(data_iterator, model):
        output = model(tokens, positions, None, **model_kwargs)  # a middle or last stage ignores the tokens

        def keep_logits(output_tensor, non_loss_data=True):
            return output_tensor  # collected by the schedule as "non-loss data"

        return output, keep_logits

    return forward_step


@torch.no_grad()
def logits(model, tokens, start=0, inference_context=None):
    """[batch, length, padded vocabulary] logits of ``tokens`` on the last pipeline stage, else None.

    ``start``: the position of the first token; ``inference_context``: megatron-core's KV cache (the
    model then gathers the vocabulary over TP itself, as megatron-core requires in inference)."""
    model_kwargs = {} if inference_context is None else \
        {"inference_context": inference_context, "runtime_gather_output": True}
    collected = get_forward_backward_func()(
        forward_step_func=_forward_step(tokens, start, model_kwargs), data_iterator=None, model=model, num_microbatches=1,
        seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0], forward_only=True,
        collect_non_loss_data=True)
    if not parallel_state.is_pipeline_last_stage():
        return None
    if inference_context is not None:
        return collected[0]
    return gather_from_tensor_model_parallel_region(collected[0])  # the vocabulary is split over TP


@torch.no_grad()
def greedy_generate(model, prompts, new_tokens, vocab_size):
    """``prompts`` [batch, length] (the same on every rank) followed by ``new_tokens`` greedy tokens.

    Only the first ``vocab_size`` logits compete: the rows that pad the vocabulary are never picked."""
    tokens = prompts
    last_stage = parallel_state.get_pipeline_model_parallel_last_rank()
    for _ in range(new_tokens):
        step_logits = logits(model, tokens)
        next_tokens = (torch.empty(tokens.shape[0], dtype=tokens.dtype, device=tokens.device)
                       if step_logits is None else step_logits[:, -1, :vocab_size].argmax(dim=-1))
        torch.distributed.broadcast(next_tokens, src=last_stage,
                                    group=parallel_state.get_pipeline_model_parallel_group())
        tokens = torch.cat([tokens, next_tokens[:, None]], dim=1)
    return tokens
