"""A rank that fails while a collective of its own is in flight and its peer never joins it (as training's
stop-signal vote is when a pipeline neighbour stalls). Launched with torchrun on 2 ranks; ``bug`` as the
argument makes the failure a plain exception instead of a UserError."""

import atexit
import sys
import time

import torch
import torch.distributed as dist

from megatron.training.errors import UserError, exit_on_user_error


@exit_on_user_error
def main():
    dist.init_process_group("gloo")
    group = dist.new_group(backend="gloo")
    if dist.get_rank() == 1:
        time.sleep(600)  # the stalled peer: torchrun ends it once rank 0 has exited
    atexit.register(print, "rank 0 ran its exit handlers", flush=True)
    dist.all_reduce(torch.ones(1), group=group, async_op=True)
    if sys.argv[1:] == ["bug"]:
        raise ValueError("a bug on rank 0")
    raise UserError("rank 0 gives up on its stalled peer")


if __name__ == "__main__":
    main()
