"""Asynchronous point-to-point transfers over torch.distributed (gloo on CPU, NCCL on GPU), behind the
transport interface the schedule uses: ``isend(tensor, peer, channel)`` and
``irecv(shape, dtype, peer, channel)`` return a handle with ``is_completed()``, ``wait()`` and ``tensor``.

A channel is one kind of stream between pipeline ranks: the activations, or the gradients, of one model
chunk. Each channel has a process group of its own (spanning the pipeline group), because NCCL matches the
sends and receives between two ranks in the order they are posted: within one channel the schedule posts
them in microbatch order on both sides, across channels it does not.
"""

import threading

import torch
import torch.distributed as dist


class TorchHandle:
    """A transfer in flight. NCCL's Work answers ``is_completed()``; gloo's point-to-point Work only ever
    says so after ``wait()``, so on gloo a helper thread waits (it releases the GIL while it does)."""

    __slots__ = ("work", "tensor", "done", "error")

    def __init__(self, work, tensor, poll_natively):
        self.work, self.tensor, self.error = work, tensor, None
        self.done = None if poll_natively else threading.Event()
        if self.done is not None:
            threading.Thread(target=self._wait_in_background, daemon=True).start()

    def _wait_in_background(self):
        try:
            self.work.wait()  # also marks the end of the op for a tracer that wrapped the work
        except Exception as error:  # handed to the training thread by is_completed()/wait()
            self.error = error
        self.done.set()

    def is_completed(self):
        if self.done is None:
            return self.work.is_completed()
        if self.done.is_set() and self.error is not None:
            raise self.error
        return self.done.is_set()

    def wait(self):
        if self.done is None:
            self.work.wait()
        else:
            self.done.wait()
            if self.error is not None:
                raise self.error
        return self.tensor


def channel_groups(pp_group, channels):
    """One process group per channel over the ranks of ``pp_group``. Collective over the whole job: every
    rank calls it with the same ``channels`` (each pipeline group gets its own groups)."""
    members = [None] * dist.get_world_size()
    dist.all_gather_object(members, dist.get_process_group_ranks(pp_group))
    pipelines = sorted({tuple(ranks) for ranks in members})
    return [dist.new_subgroups_by_enumeration([list(ranks) for ranks in pipelines])[0] for _ in range(channels)]


class TorchDistributedTransport:
    name = "torch.distributed"

    def __init__(self, groups, device):
        self.groups, self.device = groups, device
        self.poll_natively = dist.get_backend(groups[0]) != "gloo"

    def isend(self, tensor, peer, channel):
        return TorchHandle(dist.isend(tensor, dst=peer, group=self.groups[channel]), tensor, self.poll_natively)

    def irecv(self, shape, dtype, peer, channel):
        tensor = torch.empty(shape, dtype=dtype, device=self.device, requires_grad=False)
        return TorchHandle(dist.irecv(tensor, src=peer, group=self.groups[channel]), tensor, self.poll_natively)
