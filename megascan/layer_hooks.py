"""Observe a module's forward and backward without changing what it computes.

Forward: the module's ``forward`` is shadowed on the instance by a wrapper (cheaper than module
hooks, whose presence sends every call of the module down ``Module.__call__``'s slow path).
Backward: tensor hooks registered during the forward, on the module's output (its gradient
arrives: the module's backward begins) and on its input (the gradient leaves: the module's
backward ends). A module whose input or output needs no gradient (e.g. under no_grad, or the
first recomputation pass) has no backward to observe.
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
    """``forward``/``backward`` have ``begin() -> token`` and ``end(token)``.

    Returns a function that stops the observation; observations of one module stack, and are
    stopped in the reverse order of starting them.
    """
    shadowed = module.__dict__.get("forward")  # another observation's wrapper, if any
    original = module.forward

    def observed_forward(*args, **kwargs):
        token = forward.begin()
        output = original(*args, **kwargs)
        forward.end(token)
        if torch.is_grad_enabled():
            outputs, inputs = _first_tensor((output,), {}), _first_tensor(args, kwargs)
            if outputs is not None and outputs.requires_grad and inputs is not None and inputs.requires_grad:
                begun = []
                outputs.register_hook(lambda grad: begun.append(backward.begin()))
                inputs.register_hook(lambda grad: backward.end(begun.pop()) if begun else None)
        return output

    module.forward = observed_forward

    def stop():
        if shadowed is None:
            del module.forward
        else:
            module.forward = shadowed

    return stop


def layer_parts(model_chunks):
    """(part name, module, global layer number) of every transformer layer's attention and MLP."""
    for chunk in model_chunks:
        for layer in chunk.modules():
            if isinstance(layer, TransformerLayer):
                yield "attention", layer.self_attention, layer.layer_number
                yield "mlp", layer.mlp, layer.layer_number
