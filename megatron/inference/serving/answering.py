"""A generation request's answer, around the routes that generate (``generation_route``). The answer is written
before the route's call returns, so that its generation is told once it has gone (``job.answered``: the end of a
server that lost a rank waits for that, service.fail_unfinished). A client that leaves ends its generation at the
next step: the model's thread finds its connection closed (connection_watch.py); on the loop, aiohttp cancels the
handler of a closed connection (``handler_cancellation``), or a write finds it closed, and the generation is cancelled
too (one still queued then ends at its first step).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from megatron.inference.jobs import Job
from megatron.inference.serving.connection_watch import ConnectionWatch
from megatron.inference.serving.context import ROUTE_CONTEXT
from megatron.inference.serving.loop_jobs import SubmittedJob

log = logging.getLogger("megatron.inference.rest")
JOB = "job"  # the request's key of the generation it submitted (aiohttp 3.9 has no typed request keys)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def submit(request: web.Request, job: Job, streamed: bool = False) -> SubmittedJob:
    """Submit ``job`` as ``request``'s generation (ProtocolError("busy") when refused); see SubmittedJob."""
    watch = ConnectionWatch(request)
    job.requester_gone = watch.gone
    job.add_done_callback(watch.job_done)
    try:
        submitted = SubmittedJob(request.app[ROUTE_CONTEXT].service, job, streamed)
    except BaseException:
        watch.close()  # never queued: never done
        raise
    request[JOB] = job
    return submitted


def generation_route(route: Handler) -> Handler:
    """``route``, a route that may submit a generation (``submit``), with its answer written before the call returns,
    then its generation told (``job.answered``); a client that leaves cancels it."""
    @functools.wraps(route)
    async def answer(request: web.Request) -> web.StreamResponse:
        response = None
        try:
            response = await route(request)
            await response.prepare(request)
            await response.write_eof()
            return response
        except asyncio.CancelledError:  # its client left
            _cancel_the_job(request)
            raise
        except ConnectionResetError:
            log.info("%s went away before its answer", request.remote)
            _cancel_the_job(request)
            return response or web.Response()  # aiohttp finds the connection closed and drops the answer quietly
        finally:
            if (job := request.get(JOB)) is not None:
                job.answered.set()
    return answer


def _cancel_the_job(request: web.Request) -> None:
    if (job := request.get(JOB)) is not None:
        job.cancel()
