"""Delays a pipeline can be given on purpose, for demonstrations and tests (CPU runs).

- A slow stage (--dpp-delay-stage): every forward of that pipeline stage's model chunks sleeps
  --dpp-delay-ms (for a random --dpp-delay-probability share of microbatches). It is a forward pre-hook,
  so the static schedules and DPP meet the same delays and can be compared.
- A slow link (--dpp-delay-link) and jitter on every transfer (--dpp-jitter-ms): the receiving rank
  holds a message back before its schedule may use it, as if it had travelled that much longer. Held on
  the receiving side, the delay needs nothing from the sender, so it cannot change who waits for whom.

Draws come from ``random.Random`` seeded with (--seed, what is delayed, a running count), so a run is
repeatable and the delays do not depend on the schedule.
"""

import random
import time

from megatron.core import parallel_state

_STAGE, _LINK, _JITTER = 0, 1, 2


class _Draws:
    def __init__(self, seed):
        self.seed = seed

    def __call__(self, *key):
        return random.Random(hash((self.seed, *key))).random()


def install_stage_delay(model_chunks, args):
    """On the delayed stage, make each chunk's forward sleep; the n-th forward of a chunk draws key n."""
    if parallel_state.get_pipeline_model_parallel_rank() != args.dpp_delay_stage:
        return
    draws = _Draws(args.seed)
    delay_s = args.dpp_delay_ms / 1000.0
    for index, chunk in enumerate(model_chunks):
        calls = [0]

        def sleep_before_forward(module, inputs, index=index, calls=calls):
            if draws(_STAGE, index, calls[0]) < args.dpp_delay_probability:
                time.sleep(delay_s)
            calls[0] += 1

        chunk.register_forward_pre_hook(sleep_before_forward)


def arrival_delay(args):
    """(kind, chunk, microbatch, sending pp rank) -> seconds a received message stays unseen, or None."""
    if args.dpp_delay_link is None and not args.dpp_jitter_ms:
        return None
    draws = _Draws((args.seed, parallel_state.get_pipeline_model_parallel_rank()))
    count = [0]

    def delay(kind, chunk, microbatch, sender):
        count[0] += 1
        seconds = args.dpp_jitter_ms / 1000.0 * draws(_JITTER, count[0])
        if sender == args.dpp_delay_link and draws(_LINK, kind, chunk, microbatch) < args.dpp_delay_probability:
            seconds += args.dpp_delay_ms / 1000.0
        return seconds

    return delay
