"""``WeightSync``: the weights' way from a backward instance to its forward partner, and the check that
both copies are the same.

The backward side packs its model's parameters (the model copy the optimizer writes after each step:
bf16 with --bf16, the distributed optimizer having gathered them) into one flat message. The forward
side knows, for each backward instance it serves, which slices of its own parameters that message
fills: the whole parameters at the same tensor-parallel size; at TP1 (--ignore-forward-tensor-parallel)
each backward rank's shard of a tensor-parallel parameter along its partition dimension, and the
replicated parameters from the first backward rank only. The checksum is computed on both sides over
that same packed layout from the parameters as they are held, as integers (the bit patterns), so
that it is exact on CPU and GPU alike; any difference stops the run.
"""

import torch

from megafbd.coordinator import TAG_CHECKSUM, TAG_WEIGHTS, receive
from megatron.training.errors import UserError


def named_parameters(chunk):
    """The model's parameters by their names, whatever wraps it (DDP, Float16Module)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return list(chunk.named_parameters())


def is_tensor_parallel(param):
    return bool(getattr(param, "tensor_model_parallel", False))


_INTEGER_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
_CHECKSUM_BLOCK = 1 << 20  # elements at a time: the int64 copies of a whole model would double its memory


def checksum(tensors):
    """Two wrapping 64-bit integer sums over the bit patterns (plain and position-weighted), taken over the
    tensors as if concatenated: exact on every device (integer sums do not depend on their order)."""
    plain = weighted = 0
    position = 0
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        for start in range(0, flat.numel(), _CHECKSUM_BLOCK):
            bits = flat[start:start + _CHECKSUM_BLOCK].view(_INTEGER_VIEW[flat.dtype]).to(torch.int64)
            weights = (torch.arange(bits.numel(), dtype=torch.int64, device=bits.device) + position) % 65521 + 1
            plain = plain + bits.sum()
            weighted = weighted + (bits * weights).sum()
            position += bits.numel()
    return torch.stack([torch.as_tensor(plain), torch.as_tensor(weighted)]).to(device="cpu", dtype=torch.int64)


class WeightSync:
    """One side of one link's weight transfer; build it with ``for_backward`` or ``for_forward``."""

    def __init__(self, instance, pieces_by_sender, interval, coordinator=None):
        self.instance = instance
        self.pieces_by_sender = pieces_by_sender  # link rank -> tensors (views of this side's parameters)
        self.interval = interval
        self.coordinator = coordinator
        self.loaded_iteration = None  # forward side: the step whose weights the model holds
        self.unchecked = None  # forward side: the check step the model holds, its checksum not yet compared
        self.checks = 0

    @classmethod
    def for_backward(cls, instance, chunk, interval, coordinator):
        first_of_link = instance.link_rank == 0
        pieces = [p for _, p in named_parameters(chunk) if first_of_link or is_tensor_parallel(p)]
        return cls(instance, {instance.link_rank: pieces}, interval, coordinator)

    @classmethod
    def for_forward(cls, instance, chunk, interval):
        served = len(instance.link.backward_members)
        pieces_by_sender = {}
        for sender in range(served):
            pieces = []
            for _, param in named_parameters(chunk):
                if not is_tensor_parallel(param) or served == 1:
                    if sender == 0:
                        pieces.append(param.data)
                    continue
                dim = param.partition_dim
                if getattr(param, "partition_stride", 1) != 1:
                    raise UserError(f"--ignore-forward-tensor-parallel: a parameter split with stride "
                                    f"{param.partition_stride} cannot be gathered; drop the flag")
                shard = param.shape[dim] // served
                pieces.append(param.data.narrow(dim, sender * shard, shard))
            pieces_by_sender[sender] = pieces
        return cls(instance, pieces_by_sender, interval)

    # -- backward side ---------------------------------------------------------------------------

    def _own_pieces(self):
        return self.pieces_by_sender[self.instance.link_rank]

    def send(self, step):
        """After optimizer step ``step`` (0: the weights training starts from)."""
        flat = torch.cat([p.detach().reshape(-1) for p in self._own_pieces()])  # a copy: the step may go on
        forward = self.instance.link.forward_link_rank
        self.coordinator.send(self.instance.link_group, flat, forward, TAG_WEIGHTS)
        if self._is_check_step(step):
            self.send_checksum()

    def send_checksum(self):
        self.coordinator.send(self.instance.link_group, checksum(self._own_pieces()),
                              self.instance.link.forward_link_rank, TAG_CHECKSUM)

    # -- forward side ----------------------------------------------------------------------------

    def _is_check_step(self, step):
        return step > 0 and step % self.interval == 0

    def start_receive(self, step):
        """Post the receives of the weights of ``step`` from every backward instance served; ``finish_receive``
        loads them into the model (in between, the model keeps computing with the weights it holds)."""
        posted = []
        for sender, pieces in self.pieces_by_sender.items():
            buffer = torch.empty(sum(p.numel() for p in pieces), dtype=pieces[0].dtype)
            posted.append((pieces, buffer, self.instance.link_group.recv([buffer], sender, TAG_WEIGHTS)))
        return step, posted

    def finish_receive(self, pending):
        step, posted = pending
        self.check_loaded()  # before the weights it compares are replaced (two steps load at the end, staleness 1)
        for sender, (pieces, buffer, work) in enumerate(posted):
            record = self.instance.messages.start("recv", self.instance.link_group, sender, TAG_WEIGHTS, buffer)
            work.wait()
            self.instance.messages.end(record)
            flat = buffer.to(pieces[0].device)
            offset = 0
            for piece in pieces:
                piece.copy_(flat[offset:offset + piece.numel()].view_as(piece))
                offset += piece.numel()
        self.loaded_iteration = step
        if self._is_check_step(step):
            self.unchecked = step

    def check_loaded(self):
        """Compare the weights of a check step the model holds, once: after the forward that computed with
        them, so that a change behind the transfer's back in between is caught too."""
        if self.unchecked is not None:
            step, self.unchecked = self.unchecked, None
            self.check(f"after iteration {step}")

    def check(self, when):
        """Compare this copy with each sender's checksum; a difference stops the run in one line."""
        for sender, pieces in self.pieces_by_sender.items():
            expected = receive(self.instance.link_group, (2,), torch.int64, sender, TAG_CHECKSUM, "cpu")
            held = checksum(pieces)
            if not torch.equal(expected, held):
                where = self.instance.coordinates
                raise UserError(
                    f"megafbd: the forward and backward weights of pipeline stage {where.pipeline} "
                    f"(data-parallel replica {where.data}, backward link rank {sender}) differ {when} "
                    f"(checksum {held.tolist()} vs {expected.tolist()}); the weight transfer is broken")
        self.checks += 1
