"""Scoring read positions: the model's log-probability of the token that follows each position, and its most likely
tokens there (what echo/logprobs requests and lm-evaluation-harness ask for), computed where the logits are."""

import torch

from megatron.inference.last_stage import from_last_stage


def position_scores(logits: torch.Tensor | None, targets: torch.Tensor, best: int, vocab_size: int,
                    device: torch.device) -> torch.Tensor:
    """[k, n, 1 + 2 best] float32 on every pipeline stage from the last stage's ``logits`` [k, n, padded vocabulary]
    (None elsewhere): at each position the log-probability of ``targets`` [k, n] (0 where a target is -1), then the
    ``best`` most likely token ids and their log-probabilities."""
    packed = None
    if logits is not None:
        logprobs = logits[..., :vocab_size].float().log_softmax(dim=-1)
        targets = targets.to(device)
        columns = [logprobs.gather(-1, targets.clamp(min=0)[..., None]) * (targets >= 0)[..., None]]
        if best:
            best_logprobs, best_ids = logprobs.topk(best, dim=-1)
            columns += [best_ids.float(), best_logprobs]
        packed = torch.cat(columns, dim=-1)
    return from_last_stage(packed, (*targets.shape, 1 + 2 * best), device)
