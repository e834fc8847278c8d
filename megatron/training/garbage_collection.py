"""Python's garbage collector at the same iterations on every rank (Megatron-LM's --manual-gc).

Left alone, the collector runs whenever enough new container objects have piled up: at a moment that
differs from rank to rank, inside a step. A full collection of a process that holds a model, its
optimizer and a tracing session walks every object and takes milliseconds to tens of milliseconds; in a
synchronous job the other ranks wait for the one collecting, a straggler that no kernel time shows. With
--manual-gc the automatic collector is off during training; a full collection runs every
--manual-gc-interval iterations (0: never between iterations) and before each evaluation, with the
evaluation's own young objects collected after it (--no-manual-gc-eval: neither), on every rank at once.
Reference counting still frees everything that holds no cycle.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


class ManualGarbageCollection:
    """What --manual-gc, --manual-gc-interval and --no-manual-gc-eval ask for; does nothing without --manual-gc."""

    def __init__(self, args):
        self.enabled = args.manual_gc
        self.interval = args.manual_gc_interval
        self.around_evaluation = args.manual_gc_eval
        self._was_enabled = None

    def describe(self) -> str:
        every = f"every {self.interval} iterations" if self.interval else "never between iterations"
        evaluation = ", and before each evaluation" if self.around_evaluation else ""
        return f"manual garbage collection: the automatic collector is off; a full collection {every}{evaluation}"

    @property
    def started(self) -> bool:
        return self._was_enabled is not None

    def start(self) -> None:
        """Before the first iteration: the automatic collector off, what setup left behind collected."""
        if self.enabled and not self.started:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()

    def after_iteration(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextmanager
    def evaluation(self) -> Iterator[None]:
        if self.enabled and self.around_evaluation:
            gc.collect()
        yield
        if self.enabled and self.around_evaluation:
            gc.collect(generation=0)  # what the evaluation made and dropped in cycles: its objects are the young ones

    def stop(self) -> None:
        """After training: the collector as it was before start()."""
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
