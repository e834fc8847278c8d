"""Granularity ``full``: the attention and MLP halves of every transformer layer, forward and backward.

A layer is cut into two contiguous halves at the input of its pre-MLP norm: ``attention`` (input
norm, attention, residual add) and ``mlp`` (pre-MLP norm, MLP, residual add). One half ends where
the next begins, and one layer's output is the next layer's input, so each boundary takes one mark
a pass: two per layer, where timing each half on its own took four. On a job whose host sets the
pace (GPT 345M on an H200), every mark and hook lands in the step time.

Forward: the layer's ``forward`` and its pre-MLP norm's ``forward`` are shadowed on the instances
(cheaper than module hooks, whose presence sends every call down ``Module.__call__``'s slow path)
and take a mark at each boundary.

Backward: a half's backward ends with its norm's backward (its first operation in the forward), and
the norm's weight gets its gradient right then: a post-accumulate-grad hook on that weight marks it,
registered once per traced iteration, not once per microbatch as a gradient hook on the half's input
would be (the fallback for a norm without a trainable weight, e.g. one fused into the next linear
layer by transformer-engine). A chunk's backward runs its layers in reverse, without another chunk
in between, so each such mark ends one half and starts the next; the first half of a chunk's backward
starts at a gradient hook on the chunk's last layer output. With activation recomputation, a half's
backward may include the recomputation that runs just before it.
"""

import functools
import weakref

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megascan.layer_hooks import first_tensor, on_gradient_complete, shadow_forward


def _trainable_weight(norm):
    return next((p for p in norm.parameters() if p.requires_grad), None)


def _on_input_gradient(tensor, hook):
    if hook is not None and tensor.requires_grad and torch.is_grad_enabled():
        on_gradient_complete(tensor, hook)


class LayerTracer:
    """Installed on every transformer layer of the model chunks while a traced iteration runs."""

    def __init__(self, recorder, model_chunks):
        self.recorder = recorder
        chunks = [[layer for layer in chunk.modules() if isinstance(layer, TransformerLayer)] for chunk in model_chunks]
        chunks = [layers for layers in chunks if layers]
        self.layers = [layer for layers in chunks for layer in layers]
        self.chunk_ends = {layers[-1].layer_number for layers in chunks}  # their output's gradient starts a backward
        self.chunk_starts = {layers[0].layer_number for layers in chunks}  # their attention ends one
        self.middle_mark = None  # taken by the running layer's pre-MLP norm
        # (weak reference to the tensor, its mark) of the last layer to finish its forward: weak, so
        # that tracing does not keep an output (and the graph that made it) alive
        self.last_output = None
        self.backward_mark = None  # where the next half's backward starts
        self.restores = []

    def install(self):
        for layer in self.layers:
            attention_ends, mlp_ends = (self._half_end_hook(norm, name, layer.layer_number) for norm, name in (
                (layer.input_layernorm, "attention-backward"), (layer.pre_mlp_layernorm, "mlp-backward")))
            self.restores.append(shadow_forward(layer, functools.partial(
                self._observed_layer, layer_number=layer.layer_number, chunk_end=layer.layer_number in self.chunk_ends,
                input_hook=attention_ends)))
            self.restores.append(shadow_forward(layer.pre_mlp_layernorm, functools.partial(
                self._observed_middle, input_hook=mlp_ends)))

    def _half_end_hook(self, norm, name, layer_number):
        """Hooks the norm's weight and returns None, or returns the hook for the half's input."""
        hook = functools.partial(self._backward_half_ends, name, layer_number)
        weight = _trainable_weight(norm)
        if weight is None:
            return hook
        self.restores.append(weight.register_post_accumulate_grad_hook(hook).remove)
        return None

    def uninstall(self):
        for restore in reversed(self.restores):
            restore()
        self.restores = []
        self.middle_mark = self.last_output = self.backward_mark = None

    def _observed_middle(self, norm_forward, input_hook):
        def observed_norm(hidden_states, *args, **kwargs):
            self.middle_mark = self.recorder.timer.mark()
            _on_input_gradient(hidden_states, input_hook)
            return norm_forward(hidden_states, *args, **kwargs)

        return observed_norm

    def _observed_layer(self, layer_forward, layer_number, chunk_end, input_hook):
        recorder = self.recorder

        def observed_layer(*args, **kwargs):
            hidden_states, last = first_tensor(args, kwargs), self.last_output
            if last is not None and last[0]() is hidden_states:
                start_mark = last[1]  # the previous layer's output: its mark serves twice
            else:
                start_mark = recorder.timer.mark()
            _on_input_gradient(hidden_states, input_hook)
            self.middle_mark = None
            output = layer_forward(*args, **kwargs)
            end_mark = recorder.timer.mark()
            middle_mark, self.middle_mark = self.middle_mark, None
            if middle_mark is not None:  # None: the layer never called its pre-MLP norm
                recorder.add_event("attention-forward", start_mark, middle_mark, layer_number)
                recorder.add_event("mlp-forward", middle_mark, end_mark, layer_number)
            hidden_output = first_tensor((output,), {})
            self.last_output = (weakref.ref(hidden_output), end_mark)
            if chunk_end and hidden_output.requires_grad and torch.is_grad_enabled():
                on_gradient_complete(hidden_output, self._backward_begins)
            return output

        return observed_layer

    def _backward_begins(self, _gradient):
        self.backward_mark = self.recorder.timer.mark()

    def _backward_half_ends(self, name, layer_number, _weight_or_gradient):
        recorder = self.recorder
        mark = recorder.timer.mark()
        if self.backward_mark is not None:
            recorder.add_event(name, self.backward_mark, mark, layer_number)
        # the chunk's backward is over after its first layer's attention
        self.backward_mark = None if name == "attention-backward" and layer_number in self.chunk_starts else mark
