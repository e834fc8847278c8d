"""Whether a request's client is still there, asked by the model's thread between the steps of its generation
(``Job.requester_gone``). The model's thread looks at the connection's socket itself: a client that leaves ends its
generation at the next step, however long the event loop takes to notice (aiohttp cancels the handler too, but only
once the loop has had its turns, which a busy model thread and a loaded machine delay past a short generation)."""

from __future__ import annotations

import logging
import socket

from aiohttp import web

from megatron.inference.jobs import Job

log = logging.getLogger("megatron.inference.rest")


class ConnectionWatch:
    """A socket of its own onto ``request``'s connection (a duplicate: the loop may close its own meanwhile, and the
    number be reused), let go once the job is done (``job_done``), which logs a generation its client left."""

    def __init__(self, request: web.Request):
        transport = request.transport
        connection = transport.get_extra_info("socket") if transport is not None else None
        self._socket: socket.socket | None = connection.dup() if connection is not None else None
        self._remote = request.remote

    def gone(self) -> bool:
        """Whether the client has closed its connection (or reset it): it reads as end of file. Its body has been
        read whole, so nothing else is due; bytes it sent after (a pipelined request) mean it is still there."""
        if self._socket is None:
            return True
        try:
            return not self._socket.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:  # nothing to read
            return False
        except OSError:  # reset
            return True

    def job_done(self, job: Job) -> None:
        """On the model's thread, once the job is done: say so if its client left; close the socket."""
        if self.gone() and job.error is None:
            generation, wanted = job.result, job.payload["params"]["tokens_to_generate"]
            assert generation is not None, "a generation that ended without an error has its result"
            generated = max(len(tokens) - prompt for tokens, prompt in zip(generation.tokens,
                                                                           generation.prompt_lengths))
            log.info("%s went away: its generation stopped after %d of %d tokens", self._remote, generated, wanted)
        self.close()

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
