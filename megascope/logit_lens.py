"""Logit lens: each layer's residual stream read out through the final norm and the output layer.

Where: on the last pipeline stage, which holds the final norm and the (vocabulary-parallel) output
layer. Every stage sends its layers' residuals (a few tokens x hidden, small) there; each
tensor-parallel rank multiplies by its vocabulary shard and the shards are gathered before the
softmax. The result travels to the first rank with the other records.
"""

import torch
import torch.nn.functional as F
from megatron.core import parallel_state

from megascope.distributed import all_gather_along
from megatron.training.collectives import gather_objects

LOGIT_LENS_DIMS = ("topk", "id_prob")  # per token: k rows of (token id, probability)


def output_weight(model):
    """This rank's vocabulary shard of the output layer (the word embedding when they are tied)."""
    weight = model.output_layer.weight
    return weight if weight is not None else model.shared_embedding_or_output_weight()


@torch.no_grad()
def logit_lens(model, residual, k):
    """residual [s, b, hidden] (whole, not sequence-split) on the last stage -> [s, b, k, 2] of
    (token id, probability), the top k of softmax(output_layer(final_norm(residual)))."""
    norm = getattr(model.decoder, "final_layernorm", None)
    hidden = norm(residual) if norm is not None else residual
    weight = output_weight(model)
    logits = all_gather_along(F.linear(hidden.to(weight.dtype), weight), -1,
                              parallel_state.get_tensor_model_parallel_group())
    top = logits.float().softmax(dim=-1).topk(k, dim=-1)
    return torch.stack([top.indices.float(), top.values], dim=-1)


def logit_lens_on_last_stage(models, residuals, k):
    """Collective over the pipeline group. ``residuals`` {layer: (positions, [s, b, hidden])} of this
    stage -> on the last stage {layer: (positions, [s, b, k, 2])}, elsewhere {}."""
    to_send = {layer: (positions, tensor.cpu()) for layer, (positions, tensor) in residuals.items()}
    received = gather_objects(to_send, parallel_state.get_pipeline_model_parallel_group(), -1)
    if received is None:
        return {}
    last = next(model for model in models if model.post_process)
    device = output_weight(last).device
    everyone = {layer: pair for part in received for layer, pair in part.items()}
    return {layer: (positions, logit_lens(last, tensor.to(device), k))
            for layer, (positions, tensor) in sorted(everyone.items())}
