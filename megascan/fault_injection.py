"""Faults one rank can inject into its own run, for tests and demonstrations on CPU.

--inject-slowdown-rank R (--inject-slowdown-factor F): after each attention and MLP forward and
backward, rank R sleeps (F - 1) times what that pass took, so it looks like a slow device: its
layers take longer than the same layers elsewhere, and it reaches every collective late.

--inject-host-delay-rank R --inject-host-delay-ms X: rank R's host sleeps X ms before each
microbatch's forward (megatron/training/fault_injection.py: a pre-hook on each model chunk, outside
every layer), as slow data loading or a busy CPU would: its layers are not slower, it only reaches its
first collective of each microbatch late. On a GPU its GPU idles meanwhile (a host-bound rank); on
CPU host and device are one.

--inject-hang-rank R --inject-hang-iteration I: rank R stops itself (SIGSTOP) at its first
attention forward of iteration I, like a process frozen by a driver fault; its peers block in
the next operation they share with it.
"""

import os
import signal
import time

from megascan.layer_hooks import hook_phases, layer_parts
from megatron.training.fault_injection import sleep_before_each_forward


class _Stretch:
    def __init__(self, factor):
        self.extra = factor - 1.0

    @staticmethod
    def begin():
        return time.perf_counter()

    def end(self, started):
        time.sleep(self.extra * (time.perf_counter() - started))


def slow_down(model_chunks, factor):
    stretch = _Stretch(factor)
    for _, module, _ in layer_parts(model_chunks):
        hook_phases(module, stretch, stretch)


def delay_host(model_chunks, milliseconds):
    sleep_before_each_forward(model_chunks, milliseconds / 1000.0)


class HangAtIteration:
    """Arms at the chosen iteration; the next attention forward then stops the process."""

    def __init__(self, model_chunks, iteration):
        self.iteration = iteration
        self.armed = False
        for part, module, _ in layer_parts(model_chunks):
            if part == "attention":
                module.register_forward_pre_hook(self._maybe_stop)

    def on_iteration_begin(self, iteration):
        self.armed = iteration == self.iteration

    def _maybe_stop(self, module, args):
        if self.armed:
            os.kill(os.getpid(), signal.SIGSTOP)
