"""The coordinator thread of an instance: it carries the outgoing messages so that compute never waits
on a send.

Compute hands a message over through a bounded queue (a full queue holds compute back: memory stays
bounded) and goes on. The thread copies device tensors to host memory (every link is gloo) and
starts the sends in the order they were handed over, keeping the unfinished ones alive until done.
Receives stay on the compute thread, in program order. Why no ordering of the instances can
deadlock: a send never waits for its receiver before the next one is started, and every receive
waits only for messages of the same or an earlier microbatch and iteration, which their senders
produce without waiting on this receiver (see docs/megafbd.md).
"""

import queue
import threading
from collections import deque

import torch

# Tags of the message kinds (gloo matches a receive to a send by peer and tag).
TAG_CONTROL, TAG_WEIGHTS, TAG_CHECKSUM, TAG_STAGE_INPUT, TAG_ACK, TAG_ACTIVATION, TAG_INPUT_GRAD = range(1, 8)
# Commands of a control message (backward to forward): [command, iteration].
STOP, GO = 0, 1


class Coordinator:
    def __init__(self, name, max_queued=64, max_in_flight=256):
        self._queue = queue.Queue(maxsize=max_queued)
        self._max_in_flight = max_in_flight
        self._in_flight = deque()
        self._error = None
        self._thread = threading.Thread(target=self._run, name=f"megafbd-coordinator-{name}", daemon=True)
        self._thread.start()

    def send(self, group, tensor, peer, tag):
        """Hand ``tensor`` over for sending to ``peer`` of ``group``; returns at once unless the queue is full.
        The caller must not change ``tensor`` afterwards (pass a copy if it will)."""
        self._raise_if_failed()
        self._queue.put((group, tensor, peer, tag))

    def flush(self):
        """Wait until everything handed over so far has been received by its peer."""
        done = threading.Event()
        self._queue.put(done)
        done.wait()
        self._raise_if_failed()

    def close(self):
        self.flush()
        self._queue.put(None)
        self._thread.join()

    def _raise_if_failed(self):
        if self._error is not None:
            raise RuntimeError(f"megafbd coordinator thread failed: {self._error}") from self._error

    def _run(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                if isinstance(item, threading.Event):
                    while self._in_flight:
                        self._in_flight.popleft()[0].wait()
                    item.set()
                    continue
                self._start(*item)
            except Exception as error:  # noqa: BLE001  handed to the compute thread at its next call
                self._error = error
                if isinstance(item, threading.Event):
                    item.set()

    def _start(self, group, tensor, peer, tag):
        host = tensor.detach().to("cpu").contiguous()
        self._in_flight.append((group.send([host], peer, tag), host))
        while self._in_flight and (len(self._in_flight) > self._max_in_flight or self._in_flight[0][0].is_completed()):
            self._in_flight.popleft()[0].wait()


def receive(group, shape, dtype, peer, tag, device):
    """Receive one message of known shape and dtype from ``peer`` (blocking, on the calling thread)."""
    buffer = torch.empty(shape, dtype=dtype)
    group.recv([buffer], peer, tag).wait()
    return buffer.to(device)
