"""SIGTERM (a scheduler's preemption, torchrun's shutdown) and SIGINT (Ctrl-C: torchrun passes it on to
every rank) end training with a checkpoint.

Ranks may receive the signal in different iterations, so they agree on it: every iteration
each rank starts a maximum of the signal number it received (0 for none) over a gloo group of all
ranks (host memory, no device sync) and reads the maximum started one iteration earlier, which has
long arrived. All ranks thus stop at the same iteration, one iteration after the first of them saw
the signal, and no iteration waits on the vote.
"""

import signal

import torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignalAgreement:
    def __init__(self):
        self.received = 0  # the signal number, 0 for none
        self._group = torch.distributed.new_group(backend="gloo")
        self._vote = None  # (signal tensor, work handle) of the vote in flight
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame):
        self.received = max(self.received, signum)

    def any_rank_received(self) -> str | None:
        """The name of the stop signal any rank had received by the previous call ("SIGINT", "SIGTERM"; the
        higher number when ranks differ), else None (collective: every rank calls)."""
        previous = self._vote
        flag = torch.tensor([self.received], dtype=torch.int32)
        self._vote = (flag, torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX,
                                                          group=self._group, async_op=True))
        if previous is None:
            return None
        previous[1].wait()
        received = int(previous[0].item())
        return signal.Signals(received).name if received else None
