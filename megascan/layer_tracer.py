"""Granularity ``full``: the attention and MLP halves of every transformer layer, forward and backward.

A layer is cut into two contiguous halves at the input of its pre-MLP norm: ``attention`` (input
norm, attention, residual add) and ``mlp`` (pre-MLP norm, MLP, residual add). The halves share
their boundaries, and one layer's output is the next layer's input, so a layer costs two marks
and two gradient hooks per pass where timing each half on its own took four and four: on a job
whose host sets the pace (GPT 345M on an H200), every mark and hook lands in the step time.

Forward: the layer's ``forward`` and its pre-MLP norm's ``forward`` are shadowed on the instances
(cheaper than module hooks, whose presence sends every call down ``Module.__call__``'s slow path)
and take a mark at each boundary. Backward: a hook on each boundary tensor takes a mark once the
gradient reaching it is complete, i.e. when the half after it has finished its backward.
"""

import functools
import weakref

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megascan.layer_hooks import first_tensor, on_gradient_complete, shadow_forward


class _Boundary:
    """A tensor between two halves: its forward mark, the mark taken when its gradient was
    complete, and the backward half that ends there, ``(event name, layer, its start boundary)``."""

    __slots__ = ("recorder", "forward_mark", "backward_mark", "ends")

    def __init__(self, recorder, forward_mark):
        self.recorder, self.forward_mark, self.backward_mark, self.ends = recorder, forward_mark, None, None

    def watch(self, tensor):
        """Take the backward mark when ``tensor``'s gradient is complete, if it will get one."""
        if tensor.requires_grad and torch.is_grad_enabled():
            on_gradient_complete(tensor, self.on_gradient)

    def on_gradient(self, _gradient):
        recorder = self.recorder
        self.backward_mark = recorder.timer.mark()
        if self.ends is not None:
            name, layer, start = self.ends
            if start.backward_mark is not None:
                recorder.add_event(name, start.backward_mark, self.backward_mark, layer)


class LayerTracer:
    """Installed on every transformer layer of the model chunks while a traced iteration runs."""

    def __init__(self, recorder, model_chunks):
        self.recorder = recorder
        self.layers = [layer for chunk in model_chunks for layer in chunk.modules()
                       if isinstance(layer, TransformerLayer)]
        self.middle = None  # the boundary the running layer's pre-MLP norm took
        # (weak reference to the tensor, boundary) of the last layer to finish its forward: weak, so
        # that tracing does not keep an output (and the graph that made it) alive
        self.last_output = None
        self.restores = []

    def install(self):
        for layer in self.layers:
            self.restores.append(shadow_forward(
                layer, functools.partial(self._observed_layer, layer_number=layer.layer_number)))
            self.restores.append(shadow_forward(layer.pre_mlp_layernorm, self._observed_middle))

    def uninstall(self):
        for restore in reversed(self.restores):
            restore()
        self.restores = []
        self.middle = self.last_output = None

    def _observed_middle(self, norm_forward):
        def observed_norm(hidden_states, *args, **kwargs):
            self.middle = _Boundary(self.recorder, self.recorder.timer.mark())
            self.middle.watch(hidden_states)
            return norm_forward(hidden_states, *args, **kwargs)

        return observed_norm

    def _observed_layer(self, layer_forward, layer_number):
        recorder = self.recorder

        def observed_layer(*args, **kwargs):
            hidden_states = first_tensor(args, kwargs)
            last = self.last_output
            if last is not None and last[0]() is hidden_states:
                start = last[1]  # the previous layer's output: its boundary and mark serve twice
            else:
                start = _Boundary(recorder, recorder.timer.mark())
                start.watch(hidden_states)
            self.middle = None
            output = layer_forward(*args, **kwargs)
            end_mark = recorder.timer.mark()
            middle, self.middle = self.middle, None
            if middle is None:  # the layer has no MLP half (it never called its pre-MLP norm)
                self.last_output = None
                return output
            recorder.add_event("attention-forward", start.forward_mark, middle.forward_mark, layer_number)
            recorder.add_event("mlp-forward", middle.forward_mark, end_mark, layer_number)
            end = _Boundary(recorder, end_mark)
            hidden_output = first_tensor((output,), {})
            end.watch(hidden_output)
            start.ends = ("attention-backward", layer_number, middle)
            middle.ends = ("mlp-backward", layer_number, end)
            self.last_output = (weakref.ref(hidden_output), end)
            return output

        return observed_layer
