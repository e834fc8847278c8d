"""Delays a pipeline can be given on purpose, for demonstrations and tests (CPU runs).

- A slow stage (--dpp-delay-stage): every forward of that pipeline stage's model chunks sleeps
  --dpp-delay-ms (for a random --dpp-delay-probability share of microbatches). It is a forward pre-hook
  (megatron/training/fault_injection.py, as MegaScan's host delay), so the static schedules and DPP meet the
  same delays and can be compared.
- A slow link (--dpp-delay-link S): each message that pipeline stage S sends takes --dpp-delay-ms longer
  to get through (for a --dpp-delay-probability share of them), as the simulator's straggler link does
  (megadpp/simulator.py). Under DPP the receiving rank holds such a message back that long after it
  arrived before its schedule may use it; the sender does not wait (its transport is asynchronous).
  Under megatron-core's static schedules the sending rank sleeps that long before it hands the message
  to torch.distributed: their exchanges are blocking, so the sender waits for a slow transfer too.
  Either way the message is the sender's action's output, and its draw is keyed by that action
  (kind, chunk, microbatch), so both schedules meet the same delays.
- Jitter on every DPP transfer (--dpp-jitter-ms): held back on the receiving side as above.

Draws come from ``random.Random`` seeded with (--seed, what is delayed, a key), so a run is repeatable.
"""

import random
import time

import torch.distributed as dist
from megatron.core import parallel_state
from torch.distributed import ProcessGroup

from megadpp.actions import FORWARD, StageLayout
from megadpp.static_orders import static_order
from megatron.training.fault_injection import sleep_before_each_forward

_STAGE, _LINK, _JITTER = 0, 1, 2


class _Draws:
    def __init__(self, seed):
        self.seed = seed

    def __call__(self, *key):
        # Seeded by the key's text: str hashes differ between processes, and ranks must agree on a draw.
        return random.Random(repr((self.seed, *key))).random()


def install_stage_delay(model_chunks, args):
    """On the delayed stage, make each chunk's forward sleep; the n-th forward of a chunk draws key n."""
    if parallel_state.get_pipeline_model_parallel_rank() != args.dpp_delay_stage:
        return
    draws = _Draws(args.seed)
    sleep_before_each_forward(model_chunks, args.dpp_delay_ms / 1000.0,
                              lambda chunk, n: draws(_STAGE, chunk, n) < args.dpp_delay_probability)


def arrival_delay(args):
    """(kind, sender's chunk, microbatch, sending pp rank) -> seconds a received DPP message stays unseen,
    or None."""
    if args.dpp_delay_link is None and not args.dpp_jitter_ms:
        return None
    jitter_draws = _Draws((args.seed, parallel_state.get_pipeline_model_parallel_rank()))
    link_draws = _Draws(args.seed)  # keyed by the sender's action alone, as StaticLinkDelay's
    count = [0]

    def delay(kind, chunk, microbatch, sender):
        count[0] += 1
        seconds = args.dpp_jitter_ms / 1000.0 * jitter_draws(_JITTER, count[0])
        if sender == args.dpp_delay_link and link_draws(_LINK, kind, chunk, microbatch) < args.dpp_delay_probability:
            seconds += args.dpp_delay_ms / 1000.0
        return seconds

    return delay


class StaticLinkDelay:
    """--dpp-delay-link for megatron-core's static schedules, on the delayed stage: its sends to the
    pipeline neighbours (``ProcessGroup.send``, where torch.distributed's point-to-point ends) sleep
    first. The n-th send to a peer carries the output of the n-th action of this rank's static order that
    feeds that peer; that action keys the draw. Training iterations only (forward-only runs send fewer)."""

    def __init__(self, args, chunks, microbatches, group_size=None):
        self.args, self.draws = args, _Draws(args.seed)
        stages = parallel_state.get_pipeline_model_parallel_world_size()
        stage = parallel_state.get_pipeline_model_parallel_rank()
        ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
        layout = StageLayout(stage, stages, chunks)
        self.outputs = {}  # peer global rank -> the actions whose outputs go there, in the order they run
        for action in static_order(stage, stages, chunks, microbatches, group_size):
            target = layout.downstream(action.chunk) if action.kind == FORWARD else layout.upstream(action.chunk)
            if target is not None:
                self.outputs.setdefault(ranks[target[0]], []).append(action)
        self.sent = dict.fromkeys(self.outputs, 0)
        self.original = None

    def install(self):
        if parallel_state.get_pipeline_model_parallel_rank() != self.args.dpp_delay_link:
            return
        self.original = original = ProcessGroup.__dict__["send"]

        def send(group, tensors, dst, *rest, **kwargs):
            peer = dist.get_global_rank(group, dst)
            if peer in self.outputs:
                actions = self.outputs[peer]
                action = actions[self.sent[peer] % len(actions)]
                self.sent[peer] += 1
                if self.draws(_LINK, action.kind, action.chunk, action.microbatch) < self.args.dpp_delay_probability:
                    time.sleep(self.args.dpp_delay_ms / 1000.0)
            return original(group, tensors, dst, *rest, **kwargs)

        ProcessGroup.send = send

    def uninstall(self):
        if self.original is not None:
            ProcessGroup.send, self.original = self.original, None
