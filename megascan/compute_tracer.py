"""Record the compute side of a traced iteration: forward, backward and loss of every microbatch and
model chunk, and the optimizer step (the layers' halves at granularity ``full``: layer_tracer.py).

Microbatch forwards are seen through the forward step function the schedule calls; forward and
backward intervals through ``ModelParallelConfig.timers``, the hook megatron-core's schedules
already time themselves with ('forward-compute', 'backward-compute', and the pipeline transfers
such as 'forward-send'). Which microbatch a backward belongs to is learned from a gradient hook on
that microbatch's forward output, which fires as its backward begins.
"""

import torch

from megascan.layer_hooks import on_gradient_complete

_COMPUTE_TIMERS = {"forward-compute": "forward", "backward-compute": "backward"}
_IGNORED_TIMERS = {"forward-backward"}  # the whole schedule: the iteration event covers it


class _PhaseTimer:
    __slots__ = ("name", "recorder", "started")

    def __init__(self, name, recorder):
        self.name, self.recorder, self.started = name, recorder, None

    def start(self, barrier=False):
        if self.name in _COMPUTE_TIMERS:
            self.started = self.recorder.timer.mark()
        elif self.name not in _IGNORED_TIMERS:
            self.recorder.context.transfer = self.name

    def stop(self, barrier=False):
        if self.name in _COMPUTE_TIMERS:
            self.recorder.add_event(_COMPUTE_TIMERS[self.name], self.started, self.recorder.timer.mark())
        elif self.name not in _IGNORED_TIMERS:
            self.recorder.context.transfer = None


class ScheduleTimers:
    """Stands in for megatron's Timers in ``config.timers`` while a traced iteration runs."""

    def __init__(self, recorder):
        self.recorder = recorder
        self.timers = {}

    def __call__(self, name, log_level=None):
        if name not in self.timers:
            self.timers[name] = _PhaseTimer(name, self.recorder)
        return self.timers[name]


class ScheduleTracer:
    def __init__(self, recorder, model_chunks):
        self.recorder = recorder
        self.chunk_index = {id(chunk): index for index, chunk in enumerate(model_chunks)}
        self.forward_counts = [0] * len(model_chunks)
        self.active = False

    def wrap(self, schedule):
        def traced_schedule(**kwargs):
            if not self.active:
                return schedule(**kwargs)
            self.forward_counts = [0] * len(self.forward_counts)
            kwargs["forward_step_func"] = self._traced_forward_step(kwargs["forward_step_func"])
            try:
                return schedule(**kwargs)
            finally:
                self.recorder.context.set_phase("iteration")

        return traced_schedule

    def _traced_forward_step(self, forward_step_func):
        context = self.recorder.context

        def traced_forward_step(data_iterator, model, *args):
            chunk = self.chunk_index.get(id(model), 0)
            microbatch = self.forward_counts[chunk]
            self.forward_counts[chunk] += 1
            context.set_phase("forward", microbatch, chunk)
            output, loss_func = forward_step_func(data_iterator, model, *args)
            if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
                on_gradient_complete(output, lambda grad: context.set_phase("backward", microbatch, chunk))
            return output, self._traced_loss(loss_func, microbatch, chunk)

        return traced_forward_step

    def _traced_loss(self, loss_func, microbatch, chunk):
        recorder = self.recorder

        def traced_loss(*args, **kwargs):
            recorder.context.set_phase("loss", microbatch, chunk)
            start = recorder.timer.mark()
            result = loss_func(*args, **kwargs)
            recorder.add_event("loss", start, recorder.timer.mark())
            recorder.context.set_phase("forward", microbatch, chunk)
            return result

        return traced_loss


class OptimizerTracer:
    """Times ``optimizer.step()`` by shadowing the bound method on the instance while tracing."""

    def __init__(self, recorder, optimizer):
        self.recorder, self.optimizer = recorder, optimizer

    def install(self):
        recorder, step = self.recorder, self.optimizer.step

        def traced_step(*args, **kwargs):
            recorder.context.set_phase("optimizer")
            start = recorder.timer.mark()
            try:
                return step(*args, **kwargs)
            finally:
                recorder.add_event("optimizer", start, recorder.timer.mark())
                recorder.context.set_phase("iteration")

        self.optimizer.step = traced_step

    def uninstall(self):
        del self.optimizer.step
