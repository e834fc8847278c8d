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

import torch

# Tags of the message kinds (gloo matches a receive to a send by peer and tag).
(TAG_CONTROL, TAG_WEIGHTS, TAG_CHECKSUM, TAG_STAGE_INPUT, TAG_ACK, TAG_ACTIVATION, TAG_INPUT_GRAD, TAG_BATCH_SIZE,
 TAG_BATCH, TAG_RNG) = range(1, 11)
# Commands of a control message (backward to forward): [command, iteration].
STOP, GO = 0, 1


class Coordinator:
    def __init__(self, name, messages, max_queued=64, max_in_flight=256):
        self.messages = messages  # message_trace.MessageTrace: numbers the messages, reports them to the sink
        self._queue = queue.Queue(maxsize=max_queued)
        # Sends started and not yet known to be received, oldest first. gloo marks a send done only
        # when waited on, so a second thread waits on them in order: the sending thread never blocks on
        # a receiver, and a tensor is released as soon as its peer has it.
        self._in_flight = queue.Queue()
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._error = None
        self._threads = [threading.Thread(target=target, name=f"megafbd-{role}-{name}", daemon=True)
                         for role, target in (("coordinator", self._send_loop), ("completion", self._wait_loop))]
        for thread in self._threads:
            thread.start()

    def send(self, group, tensor, peer, tag, microbatch=None):
        """Hand ``tensor`` over for sending to ``peer`` of ``group``; returns at once unless the queue is full.
        The caller must not change ``tensor`` afterwards (pass a copy if it will)."""
        self._raise_if_failed()
        record = self.messages.start("send", group, peer, tag, tensor, microbatch)
        self._queue.put((group, tensor, peer, tag, record))

    def flush(self):
        """Wait until everything handed over so far has been received by its peer."""
        done = threading.Event()
        self._queue.put(done)
        done.wait()
        self._raise_if_failed()

    def close(self):
        self.flush()
        self._queue.put(None)
        for thread in self._threads:
            thread.join()

    def _raise_if_failed(self):
        if self._error is not None:
            raise RuntimeError(f"megafbd coordinator thread failed: {self._error}") from self._error

    def _send_loop(self):
        while True:
            item = self._queue.get()
            if item is None or isinstance(item, threading.Event):
                self._in_flight.put(item)  # in order: the completion thread reaches it after the sends before it
                if item is None:
                    return
                continue
            try:
                group, tensor, peer, tag, record = item
                host = tensor.detach().to("cpu").contiguous()
                self._slots.acquire()
                self._in_flight.put((group.send([host], peer, tag), host, record))
            except Exception as error:  # noqa: BLE001  handed to the compute thread at its next call
                self._error = error

    def _wait_loop(self):
        # It marks the end of sends for the transfer-trace sink: host clock readings, no device work here.
        while True:
            item = self._in_flight.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            work, _, record = item
            try:
                work.wait()
                self.messages.end(record)
            except Exception as error:  # noqa: BLE001
                self._error = error
            finally:
                self._slots.release()


def receive(group, shape, dtype, peer, tag, device, messages=None, microbatch=None):
    """Receive one message of known shape and dtype from ``peer`` (blocking, on the calling thread);
    ``messages`` (a MessageTrace) records it for --trace. For a GPU the message lands in page-locked memory, so
    that its copy to the GPU is queued behind the GPU's work instead of waiting for it on the host."""
    buffer = torch.empty(shape, dtype=dtype, pin_memory=torch.device(device).type == "cuda")
    record = messages.start("recv", group, peer, tag, buffer, microbatch) if messages is not None else None
    group.recv([buffer], peer, tag).wait()
    if record is not None:
        messages.end(record)
    return buffer.to(device, non_blocking=True)
