"""What the loop hands every plugin hook once the configuration is validated (see plugins.py): the loop
owns it, plugins read it and act through its methods."""

import torch

from megatron.training.frozen_args import FrozenArgs
from megatron.training.placement import Placement
from megatron.training.training_log import print_rank_0
from megatron.training.transfer_trace import TransferTrace


class RunContext:
    """The run as the plugins see it.

    - ``args``: the validated configuration, read-only, with argparse's names (``args.train_iters``), as
      this process runs it (its world's device and tensor-parallel size: ``Placement``);
    - ``placement``: which processes train and which serve, in which worlds, at which devices;
    - ``transfer_trace``: the sink for transfers that bypass torch.distributed (transfer_trace.py);
    - ``launch_store``: a key-value store every process of the launch shares (the launcher's rendezvous
      store), for what spans worlds (MegaFBD's links, one trace id for all of them);
    - ``request_stop(reason)``: end training after the current iteration.
    """

    __slots__ = ("_args", "_placement", "_transfer_trace", "_launch_store", "_stop_reason")

    def __init__(self, args: FrozenArgs, placement: Placement, transfer_trace: TransferTrace,
                 launch_store: torch.distributed.Store | None = None):
        self._args, self._placement, self._transfer_trace = args, placement, transfer_trace
        self._launch_store = launch_store
        self._stop_reason: str | None = None

    @property
    def args(self) -> FrozenArgs:
        return self._args

    @property
    def placement(self) -> Placement:
        return self._placement

    @property
    def transfer_trace(self) -> TransferTrace:
        return self._transfer_trace

    @property
    def launch_store(self) -> torch.distributed.Store | None:
        return self._launch_store

    @property
    def stop_reason(self) -> str | None:
        """Why training was asked to stop (the first request's reason), or None."""
        return self._stop_reason

    def request_stop(self, reason: str) -> None:
        """End training at the end of the current iteration (before the first one when called during
        setup), saving a checkpoint when --save is set, as the end of --train-iters would. ``reason`` is the
        line the loop prints, once (global rank 0), however many requests follow.

        Every rank of the training world must ask at the same iteration: the decision is the caller's
        (MegaScope and MegaScan broadcast theirs), the loop does not vote on it."""
        if self._stop_reason is None:
            self._stop_reason = reason
            print_rank_0(reason)
