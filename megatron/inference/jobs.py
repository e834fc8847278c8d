"""A generation request as the serving side hands it to the model's loop (megatron/inference/service.py), and the
tokens it streams back."""

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine's torch and megatron-core stay out of the serving side's imports
    from megatron.inference.engine import Generation


@dataclass(frozen=True)
class TokenEvent:
    """One new token of a streamed request: its prompt's ``row`` in the request, the token, the unmodified model's
    log-probability of it and its ``best`` [(token id, log-probability)] (params.top_logprobs of them)."""
    row: int
    token: int
    logprob: float
    best: list


@dataclass
class Job:
    """``payload`` goes to every rank: {"kind": "generate", "prompts", "params": SamplingParams fields,
    "session": session data} or {"kind": "control", ...} or {"kind": "stop"}. The serving side (rank 0) gives
    ``stream`` to see each token as it comes, waits for ``done`` (or ``add_done_callback``) and reads ``result``
    or ``error``. ``observer``: a MegaScope generation's (it holds the model for itself)."""
    payload: dict
    observer: object = None
    source: str = "rest"
    # Rank 0, the model's thread: called with each TokenEvent of the generation, in order (REST streaming).
    stream: Callable[[TokenEvent], None] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    answered: threading.Event = field(default_factory=threading.Event)  # its requester has its answer (REST)
    cancelled: bool = False   # set by ``cancel``: it ends at its next step and holds the model no longer
    # Rank 0, between steps: whether its requester left (a REST client that closed its connection); it ends then.
    requester_gone: Callable[[], bool] = lambda: False
    result: "Generation | None" = None  # a generate job's, when it ends without error
    error: BaseException | None = None
    _callbacks: list = field(default_factory=list)
    _callbacks_lock: threading.Lock = field(default_factory=threading.Lock)

    def cancel(self) -> None:
        """The requester wants no more tokens (it left, or has what it needs): the generation ends at its next step,
        with what it has."""
        self.cancelled = True

    def add_done_callback(self, callback: Callable[["Job"], None]) -> None:
        """``callback(job)`` once the job is done, on the thread that finishes it (at once if it is done already):
        an event loop hands it over with ``call_soon_threadsafe``."""
        with self._callbacks_lock:
            if not self.done.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def finish(self, result=None, error=None) -> None:
        """Record the outcome, set ``done`` and run the callbacks (once)."""
        with self._callbacks_lock:
            if self.done.is_set():
                return
            self.result, self.error = result, error
            self.done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)
