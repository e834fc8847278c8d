"""Delays a run injects into itself on purpose, for tests and demonstrations on CPU: the slow stage or slow host
that MegaScan (--inject-host-delay-rank) and MegaDPP (--dpp-delay-stage) each inject, one mechanism."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch


def sleep_before_each_forward(model_chunks: list[torch.nn.Module], seconds: float,
                              when: Callable[[int, int], bool] | None = None) -> None:
    """Every forward of each model chunk first sleeps ``seconds``, as a slow host or a slow stage would make it
    start late. It is a forward pre-hook on the chunk, outside every layer, so every pipeline schedule meets the
    same delays and no layer itself looks slower. ``when(chunk index, n)`` decides for the chunk's n-th forward
    (n from 0); None sleeps before every forward."""
    for index, chunk in enumerate(model_chunks):
        calls = itertools.count()

        def sleep_first(module, inputs, index=index, calls=calls):
            if when is None or when(index, next(calls)):
                time.sleep(seconds)

        chunk.register_forward_pre_hook(sleep_first)
