"""SIGTERM (a scheduler's preemption, torchrun's shutdown) ends training with a checkpoint.

Ranks may receive the signal in different iterations, so they agree on it: every iteration
each rank starts a sum of its flag over a gloo group of all ranks (host memory, no device
sync) and reads the sum started one iteration earlier, which has long arrived. All ranks thus
stop at the same iteration, one iteration after the first of them saw the signal, and no
iteration waits on the vote.
"""

import signal

import torch


class SigtermAgreement:
    def __init__(self):
        self.received = False
        self._group = torch.distributed.new_group(backend="gloo")
        self._vote = None  # (flag tensor, work handle) of the vote in flight
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        self.received = True

    def any_rank_received(self):
        """Whether any rank had received SIGTERM by the previous call (collective: every rank calls)."""
        previous = self._vote
        flag = torch.tensor([int(self.received)], dtype=torch.int32)
        self._vote = (flag, torch.distributed.all_reduce(flag, group=self._group, async_op=True))
        if previous is None:
            return False
        previous[1].wait()
        return bool(previous[0].item())
