"""Every rank runs the model, rank 0 serves: the work between the servers (REST, WebSocket) and the ranks' model loop.

Rank 0's servers submit jobs; ``serve_forever`` on every rank runs, in the same order, what rank 0 decides next and
broadcasts (a job's data, never the job itself: it holds sockets and events). REST and OpenAI generations join the
continuous batch (megatron/inference/batcher.py): while it has work, every rank runs one planned step of it after
another. A WebSocket generation, a control message (perturbations) or a generation of a model the batch cannot serve
holds the model alone: new prompts stop joining the batch, and once it has drained every rank runs that job (a
WebSocket generation on the first data-parallel replica, whose rank 0 streams and captures). With nothing to do,
rank 0 sends an idle heartbeat now and then, so the other ranks' waiting broadcast never reaches the process group's
timeout. ``stop`` (rank 0) ends the running generations at their next step, refuses the queued ones and ends every
rank's loop.
"""

import atexit
import collections
import logging
import queue
import secrets
import threading
import time

import torch
from megatron.core import parallel_state

from megatron.inference.batch_schedule import BatchSchedule
from megatron.inference.batcher import Batcher
from megatron.inference.engine import NonFiniteLogits, NoObserver, agree
from megatron.inference.errors import ProtocolError
from megatron.inference.jobs import Job, TokenEvent
from megatron.inference.replicas import generate_share
from megatron.inference.sampling import DrawPlan, SamplingParams
from megatron.training.peer_watch import is_peer_loss

log = logging.getLogger("megatron.inference")
IDLE_HEARTBEAT_SECONDS = 30
PROGRESS_SECONDS = 30  # how often a busy batch logs its progress (and once more when the server stops)
ANSWER_AT_EXIT_SECONDS = 2.0  # how long the end of rank 0 waits for the answers of the requests it fails


class ServerLost(Exception):  # noqa: N818  what the requester is told, not a bug
    """A rank of the server died: the generation in flight cannot finish (answered 500, in one line)."""


class StopAtNextStep(NoObserver):
    """Rank 0's observer of a REST generation: cancels it at its next step once the service is stopping or
    its requester has gone or cancelled it (every rank's observer acts on the cancel); hands each new token to
    the job's ``stream``."""

    def __init__(self, service, job):
        self.service, self.job = service, job

    def poll(self):
        job = self.job
        return {"cancel": True} if self.service.stopping or job.cancelled or job.requester_gone() else None

    def step_done(self, step):
        if self.job.stream is None:
            return
        for row in step.sampled:
            best = list(zip(step.draw.best_ids[row].tolist(), step.draw.best_logprobs[row].tolist()))
            self.job.stream(TokenEvent(row, int(step.draw.tokens[row]), float(step.draw.logprobs[row]), best))


def pick_seed(seed):
    return secrets.randbelow(2**31) if seed is None else seed


class GenerationService:
    """Rank 0's side: submit jobs; ``serve_forever`` runs them on every rank. REST requests join one continuous batch
    where the engine's slot cache serves the model; ``prefill_tokens``: the prompt tokens a batch step reads at most
    beside its decoding rows."""

    def __init__(self, engine, device, observer_factory=None, on_control=None, prefill_tokens=512):
        self.engine = engine
        self.device = device
        # Builds the observer of a generation on ranks other than 0 from the job's payload.
        self.observer_factory = observer_factory or (lambda payload: NoObserver())
        # Applies a control message between generations, on every rank (perturbations).
        self.on_control = on_control or (lambda payload: None)
        self._jobs = queue.Queue()
        self._lock = threading.Lock()
        self._unfinished = []   # submitted generations, in order, until they have run
        self.stopping = False   # set by stop: the running generation is cancelled at its next step
        cache = engine.cache
        self.batcher = self.schedule = None
        if cache is not None:
            if torch.distributed.get_rank() == 0:
                self.schedule = BatchSchedule(parallel_state.get_data_parallel_world_size(), cache.slots,
                                              cache.length, prefill_tokens, engine.vocab_size, engine.eod,
                                              cache.key_length)
            self.batcher = Batcher(cache, self.schedule)
        self._alone = collections.deque()  # rank 0: jobs that hold the model alone, waiting for the batch to drain
        self._started = self._logged = time.monotonic()
        # However rank 0 ends (a peer's death ends it from the peer watch's thread, which runs the exit handlers),
        # the requests in flight get their answer first.
        atexit.register(self.fail_unfinished)

    def fail_unfinished(self) -> None:
        """Answer every generation not yet run with ServerLost, and wait (a bounded time) for the answers to go."""
        with self._lock:
            unfinished, self._unfinished = self._unfinished, []
        for job in unfinished:
            job.finish(error=ServerLost("a rank of the server died during this generation; the server stops"))
        for job in unfinished:
            if job.source == "rest":
                job.answered.wait(ANSWER_AT_EXIT_SECONDS)

    def submit(self, job, refuse_if_busy):
        """Queue ``job``; ProtocolError("busy") when ``refuse_if_busy`` and a generation is queued or
        running, or whenever a WebSocket generation holds the model (cancelled ones do not count)."""
        with self._lock:
            if self.stopping:
                raise ProtocolError("busy", "the server is stopping")
            holding = [other for other in self._unfinished if not other.cancelled]
            if any(other.source == "websocket" for other in holding) or (refuse_if_busy and holding):
                raise ProtocolError("busy", "a generation is running; wait for its generation_done")
            self._unfinished.append(job)
            self._jobs.put(job)

    def run(self, job):
        """Submit a REST job and wait for its result."""
        self.submit(job, refuse_if_busy=False)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def control(self, payload):
        """Queue a control message for every rank while no generation runs (perturbations)."""
        self._jobs.put(Job(payload={"kind": "control", **payload}, source="control"))

    def stop(self):
        """Rank 0, any thread but the model loop's: every rank's ``serve_forever`` returns soon (after the
        step in progress); generations still queued are refused."""
        with self._lock:
            self.stopping = True
        self._jobs.put(Job(payload={"kind": "stop"}, source="control"))

    # -- rank 0: what every rank does next --------------------------------------------------------------------
    def _next_job(self):
        """The next job every rank runs: a step of the batch while it has work, else the next job that holds the
        model alone (control, a WebSocket generation, a generation the batch cannot serve), else the next queued."""
        self._answer_batched()
        batch_busy = self.schedule is not None and (self.schedule.busy or self.batcher.in_flight)
        self._take_queued(wait=not batch_busy and not self._alone)
        if self.schedule is not None:
            if self.schedule.busy:
                # While a job waits to hold the model alone, no new prompt takes a slot: the batch drains.
                return Job(payload=self.schedule.plan_step(admitting=not self._alone), source="control")
            if self.batcher.in_flight:
                return Job(payload={"kind": "flush"}, source="control")
        if self.stopping:
            self._refuse_queued()
            self._log_progress()
            return Job(payload={"kind": "stop"}, source="control")
        if self._alone:
            return self._alone.popleft()
        return Job(payload={"kind": "idle"}, source="control")

    def _take_queued(self, wait):
        """Move the queued jobs in: batched generations into the schedule, the others in line to hold the model
        alone. ``wait``: for one job, or the idle heartbeat's time."""
        try:
            job = self._jobs.get(timeout=IDLE_HEARTBEAT_SECONDS) if wait else self._jobs.get_nowait()
        except queue.Empty:
            return
        while True:
            payload = job.payload
            if (self.schedule is not None and not self.stopping and payload["kind"] == "generate"
                    and "scope" not in payload and not self._alone):
                params = SamplingParams(**payload["params"])
                self.schedule.add(job, params, DrawPlan.of(params, self.engine.vocab_size))
            else:
                self._alone.append(job)
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return

    def _answer_batched(self):
        """Cancel the batched requests whose requester left or cancelled (or all, once stopping); answer the
        ended ones."""
        if self.schedule is None:
            return
        if time.monotonic() - self._logged > PROGRESS_SECONDS and self.schedule.busy:
            self._log_progress()
        for request in list(self.schedule.requests):
            job = request.job
            if self.stopping or job.cancelled or job.requester_gone():
                self.schedule.cancel(request)
        for request in self.schedule.finished_requests():
            with self._lock:
                self._unfinished.remove(request.job)
            request.job.finish(None if request.error else request.generation(), request.error)

    def _log_progress(self):
        if self.schedule is None or not self.schedule.served.steps:
            return
        self._logged = time.monotonic()
        log.info(self.schedule.served.line(self._logged - self._started, len(self.schedule.holding),
                                           len(self.schedule.waiting)))

    def _refuse_queued(self):
        """Before the stop: every generation still in line is answered with an error (control jobs are dropped)."""
        while self._alone:
            job = self._alone.popleft()
            if job.source != "control":
                with self._lock:
                    self._unfinished.remove(job)
                job.finish(error=ProtocolError("busy", "the server stopped before this generation ran"))

    def _generate(self, job, payload):
        """Every rank: a REST request's prompts are shared among the data-parallel replicas; a streamed generation
        (a WebSocket one, captured by rank 0, or an OpenAI ``stream``) runs on the first replica, whose first rank
        sees every token as it comes; the others wait."""
        params = SamplingParams(**payload["params"])
        if "scope" not in payload and not payload.get("streamed"):
            observer = (job.observer or StopAtNextStep(self, job)) if job else None
            return generate_share(self.engine, payload["prompts"], params, observer)
        if parallel_state.get_data_parallel_rank() != 0:
            return None
        observer = (job.observer or StopAtNextStep(self, job)) if job else self.observer_factory(payload)
        return self.engine.generate(payload["prompts"], params, observer)

    def serve_forever(self, rank):
        """The loop of every rank; returns after a stop job."""
        while True:
            job = self._next_job() if rank == 0 else None
            payload = agree(job.payload if job else None, self.device)
            if payload["kind"] == "stop":
                return
            if payload["kind"] == "batch":
                self.batcher.step(payload)
                continue
            if payload["kind"] == "flush":
                self.batcher.flush()
                continue
            result = error = None
            try:
                if payload["kind"] == "control":
                    self.on_control(payload)
                    if self.batcher is not None:
                        self.batcher.cache.hooks_changed()
                elif payload["kind"] == "generate":
                    result = self._generate(job, payload)
            except NonFiniteLogits as broken:  # every rank of the replica raised it: the generation ends, all go on
                error = broken
            except Exception as failure:  # noqa: BLE001  reported to the requester on rank 0, re-raised elsewhere
                if not job or is_peer_loss(failure):
                    raise  # the rank ends with the death's line; fail_unfinished answers the requester
                error = failure
            if job and job.source != "control":
                with self._lock:
                    self._unfinished.remove(job)
                job.finish(result, error)
