"""Rank 0's streaming of graphed steps: the model thread lands each step's packed readout with one asynchronous
device-to-host copy into pinned memory as soon as the step is queued; once the step's tokens are known it hands the
step to a host thread, which waits for the copy, builds the step's frames and messages and queues them on the
client, while the model runs the next steps.

The pinned buffers form a ring of ``DEPTH``: when the thread falls behind by that many steps the model waits for
it, so the thread never falls further behind and nothing is dropped on the way. Frames go out through a
``PatientSender``, which waits for a client whose send queue is full (``Client.wait_for_room``): a client that reads
keeps every frame. One that reads nothing for ``PATIENCE_SECONDS`` is slow: it loses frames as before (the oldest,
with a ``dropped`` report), so it never holds the model for long.
"""

import logging
import queue
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger("megascope.inference")
DEPTH = 4
PATIENCE_SECONDS = 2.0


class PatientSender:
    """Rank 0: a client's data frames, each queued once the client has room for it, until the client turns out slow
    (no room for PATIENCE_SECONDS once); from then on frames are queued at once and the oldest dropped."""

    def __init__(self, client):
        self.client = client
        self.slow = False

    def send_data(self, frame):
        if not self.slow and not self.client.wait_for_room(PATIENCE_SECONDS):
            self.slow = True
            log.warning("MegaScope client %s read nothing for %.0f s: its oldest frames are dropped from now on",
                        self.client.number, PATIENCE_SECONDS)
        self.client.send_data(frame)


@dataclass
class Landed:
    """A step's values on their way into one of the stream's pinned buffers (``host``, complete once ``done``)."""
    buffer: torch.Tensor
    host: torch.Tensor
    done: torch.cuda.Event | None


class StepStream:
    """``land(values)`` right after a step is queued (before the next step can overwrite them), ``submit(landed,
    work)`` once its tokens are known: ``work(host_values)`` runs on the stream's thread with the step's values in host
    memory (valid during the call only); ``flush`` waits until every submitted step is done."""

    def __init__(self, device):
        self.device = device
        self._free = queue.Queue()
        self._pending = queue.Queue()
        self._buffers = 0
        self._thread = threading.Thread(target=self._run, name="megascope-step-stream", daemon=True)
        self._thread.start()

    def land(self, values):
        """Model thread: start copying ``values`` (a flat device tensor) into a free host buffer; waits for the thread
        when all DEPTH are in use."""
        buffer = self._buffer(values.numel())
        host = buffer[:values.numel()]
        host.copy_(values, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return Landed(buffer, host, done)

    def submit(self, landed, work):
        """Model thread: queue ``work`` after ``landed`` (or with nothing to read: None)."""
        self._pending.put((landed, work))

    def flush(self):
        self._pending.join()

    def close(self):
        self.flush()
        self._pending.put(None)
        self._thread.join()

    def _buffer(self, numel):
        """A free host buffer of at least ``numel`` floats; waits for the thread when all DEPTH are in use."""
        if self._free.empty() and self._buffers < DEPTH:
            self._buffers += 1
            return self._new(numel)
        buffer = self._free.get()
        return buffer if buffer.numel() >= numel else self._new(numel)

    def _new(self, numel):
        return torch.empty(numel, dtype=torch.float32, pin_memory=self.device.type == "cuda")

    def _run(self):
        while (item := self._pending.get()) is not None:
            landed, work = item
            try:
                if landed is not None and landed.done is not None:
                    landed.done.synchronize()
                work(None if landed is None else landed.host)
            except Exception:  # noqa: BLE001  a failed frame must not end the generation or the thread
                log.exception("MegaScope could not stream a step")
            finally:
                if landed is not None:
                    self._free.put(landed.buffer)
                self._pending.task_done()
