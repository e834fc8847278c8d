"""SIGTERM (a scheduler's preemption, torchrun's shutdown) ends training with a checkpoint.

Ranks may receive the signal in different iterations, so they agree on it: after every
iteration one integer is summed over a gloo group of all ranks (host memory, no device sync).
"""

import signal

import torch


class SigtermAgreement:
    def __init__(self):
        self.received = False
        self._group = torch.distributed.new_group(backend="gloo")
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        self.received = True

    def any_rank_received(self):
        flag = torch.tensor([int(self.received)], dtype=torch.int32)
        torch.distributed.all_reduce(flag, group=self._group)
        return bool(flag.item())
