"""Python's garbage collector at the same iterations on every rank (Megatron-LM's --manual-gc).

Left alone, the collector runs whenever enough new container objects have piled up: at a moment that
differs from rank to rank, inside a step. A full collection of a process that holds a model, its
optimizer and a tracing session walks every object and takes milliseconds to tens of milliseconds; in a
synchronous job the other ranks wait for the one collecting, a straggler that no kernel time shows. With
--manual-gc the automatic collector is off during training; a full collection runs every
--manual-gc-interval iterations (0: never between iterations) and before each evaluation, with the
evaluation's own young objects collected after it (--no-manual-gc-eval: neither), on every rank at once.
Reference counting still frees everything that holds no cycle.

``tools/aggregate.py`` pauses the collector for another reason: merging a run builds a dict per op
record and compute event (millions at thousands of ranks) and keeps nearly all of them to the end. Each
time enough new ones pile up, the collector walks the older ones too, finding no cycle; pausing it took
a fifth off aggregating 1024 ranks (bench/aggregate_scale.py).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager


@contextmanager
def cycle_collection_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector inside the block; restore its earlier state after it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class ManualGarbageCollection:
    """What --manual-gc, --manual-gc-interval and --no-manual-gc-eval ask for; does nothing without --manual-gc."""

    def __init__(self, args):
        self.enabled = args.manual_gc
        self.interval = args.manual_gc_interval
        self.around_evaluation = args.manual_gc_eval
        self._paused = None  # while training runs: the pause to close at stop()

    def describe(self) -> str:
        every = f"every {self.interval} iterations" if self.interval else "never between iterations"
        evaluation = ", and before each evaluation" if self.around_evaluation else ""
        return f"manual garbage collection: the automatic collector is off; a full collection {every}{evaluation}"

    def start(self) -> bool:
        """Before the first iteration: the automatic collector off, what setup left behind collected. Whether
        this call did it (not without --manual-gc, nor a second time)."""
        if not self.enabled or self._paused is not None:
            return False
        self._paused = ExitStack()
        self._paused.enter_context(cycle_collection_paused())
        gc.collect()
        return True

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
        if self._paused is not None:
            self._paused.close()
            self._paused = None
