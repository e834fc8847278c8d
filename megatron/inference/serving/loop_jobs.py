"""A generation job as the HTTP server's event loop sees it. The model's thread hands each streamed token and the
job's end over to the loop (``call_soon_threadsafe``), so a request waits for its generation without a thread of its
own: 256 clients waiting in executor threads would exhaust the executor, and the loop must never block on the model.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from megatron.inference.jobs import Job, TokenEvent
from megatron.inference.service import GenerationService

Value = TypeVar("Value")


def on_loop(loop: asyncio.AbstractEventLoop, callback: Callable[[Value], object]) -> Callable[[Value], None]:
    """``callback`` for another thread to call: it runs on ``loop``. Once the loop has closed (the server stopped)
    nobody waits for it, and the caller (the model's thread) must not fail for that."""
    def hand_over(value: Value) -> None:
        try:
            loop.call_soon_threadsafe(callback, value)
        except RuntimeError:  # the loop is closed
            pass
    return hand_over


class SubmittedJob:
    """``job`` submitted to ``service`` from the running loop (ProtocolError("busy") when refused): ``tokens()``
    yields its TokenEvents as they come (``streamed`` jobs only: reading them out costs every step a host copy),
    ``result()`` waits for its end."""

    def __init__(self, service: GenerationService, job: Job, streamed: bool):
        loop = asyncio.get_running_loop()
        self.job = job
        self._events: asyncio.Queue[TokenEvent | None] = asyncio.Queue()  # None: the job is done
        if streamed:
            job.stream = on_loop(loop, self._events.put_nowait)
        job.add_done_callback(on_loop(loop, lambda _: self._events.put_nowait(None)))
        service.submit(job, refuse_if_busy=False)

    async def tokens(self) -> AsyncIterator[TokenEvent]:
        while (event := await self._events.get()) is not None:
            yield event

    async def result(self) -> Any:
        """The job's result, or its error raised."""
        async for _ in self.tokens():
            pass
        if self.job.error is not None:
            raise self.job.error
        return self.job.result
