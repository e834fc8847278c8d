"""Observe modules' forward and backward without changing what they compute.

Forward: the module's ``forward`` is shadowed on the instance by a wrapper (cheaper than module
hooks, whose presence sends every call of the module down ``Module.__call__``'s slow path).
Backward: gradient hooks registered during the forward, on the module's output (its gradient
arrives: the module's backward begins) and on its input (the gradient leaves: the module's
backward ends). A module whose input or output needs no gradient (e.g. under no_grad, or the
first recomputation pass) has no backward to observe.
"""

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer


def first_tensor(args, kwargs):
    """The first tensor among a call's arguments, or the first item of a tuple or list of them."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
            return value[0]
    return None


def on_gradient_complete(tensor, hook):
    """Call ``hook`` once the gradient of ``tensor`` is complete.

    On a tensor made by an operation, a pre-hook of the graph node that made it (the node runs once
    the gradients of its outputs are complete; the modules observed here output one tensor from a
    node of one output): less host time than ``Tensor.register_hook``, which keeps Python
    bookkeeping per tensor (to register: 1.7 against 2.7 us on a 2-core CPU host). A leaf (e.g. a
    pipeline stage's received input) has no node: a tensor hook.
    """
    node = tensor.grad_fn
    if node is None:
        tensor.register_hook(hook)
    else:
        node.register_prehook(hook)


def shadow_forward(module, wrap):
    """Shadow ``module.forward`` on the instance by ``wrap(the forward seen now)``.

    Returns a function that puts back what was there before; shadowings of one module stack (e.g.
    fault injection and tracing) and are undone in the reverse order of making them.
    """
    shadowed = module.__dict__.get("forward")  # another shadowing's wrapper, if any
    module.forward = wrap(module.forward)

    def restore():
        if shadowed is None:
            del module.forward
        else:
            module.forward = shadowed

    return restore


def hook_phases(module, forward, backward):
    """``forward``/``backward`` have ``begin() -> token`` and ``end(token)``; returns the function
    that stops the observation."""

    def wrap(original):
        def observed_forward(*args, **kwargs):
            token = forward.begin()
            output = original(*args, **kwargs)
            forward.end(token)
            if torch.is_grad_enabled():
                outputs, inputs = first_tensor((output,), {}), first_tensor(args, kwargs)
                if outputs is not None and outputs.requires_grad and inputs is not None and inputs.requires_grad:
                    begun = []
                    on_gradient_complete(outputs, lambda grad: begun.append(backward.begin()))
                    on_gradient_complete(inputs, lambda grad: backward.end(begun.pop()) if begun else None)
            return output

        return observed_forward

    return shadow_forward(module, wrap)


def layer_parts(model_chunks):
    """(part name, module, global layer number) of every transformer layer's attention and MLP."""
    for chunk in model_chunks:
        for layer in chunk.modules():
            if isinstance(layer, TransformerLayer):
                yield "attention", layer.self_attention, layer.layer_number
                yield "mlp", layer.mlp, layer.layer_number
