"""Observe a module's forward and backward with PyTorch hooks, without changing what it computes.

Forward: a pre-hook and a post-hook. Backward: tensor hooks registered during the forward, on the
module's output (its gradient arrives: the module's backward begins) and on its input (the
gradient leaves: the module's backward ends). A module whose input or output needs no gradient
(e.g. under no_grad, or the first recomputation pass) has no backward to observe.
"""

import torch

from megatron.core.transformer.transformer_layer import TransformerLayer


def _first_tensor(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
            return value[0]
    return None


def hook_phases(module, forward, backward):
    """``forward``/``backward`` have ``begin() -> token`` and ``end(token)``. Returns hook handles."""
    started = []

    def before(_, args, kwargs):
        started.append((forward.begin(), _first_tensor(args, kwargs)))

    def after(_, args, kwargs, output):
        token, inputs = started.pop()
        forward.end(token)
        outputs = _first_tensor((output,), {})
        if (torch.is_grad_enabled() and outputs is not None and outputs.requires_grad
                and inputs is not None and inputs.requires_grad):
            begun = []
            outputs.register_hook(lambda grad: begun.append(backward.begin()))
            inputs.register_hook(lambda grad: backward.end(begun.pop()) if begun else None)

    return [module.register_forward_pre_hook(before, with_kwargs=True),
            module.register_forward_hook(after, with_kwargs=True)]


def layer_parts(model_chunks):
    """(part name, module, global layer number) of every transformer layer's attention and MLP."""
    for chunk in model_chunks:
        for layer in chunk.modules():
            if isinstance(layer, TransformerLayer):
                yield "attention", layer.self_attention, layer.layer_number
                yield "mlp", layer.mlp, layer.layer_number
