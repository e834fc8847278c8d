"""Dropout masks drawn alike by a forward instance and its backward partner, as a normal run draws them.

In a normal run with full recomputation a stage's forward draws the dropout masks of each
microbatch in turn from the stage's random stream, and the recomputation replays them (megatron-core's
checkpointing restores the stream around it), so the stream only advances with the forwards. Under
MegaFBD both kinds run that forward: the forward instance's output (with its masks) is the next stage's
input, and the backward instance's forward (with its masks) gives the loss and the gradients. They are
the normal run's when both draw the same masks, so at the start of every iteration the backward
instance, which holds the normal run's stream (same seeds, same setup, restored from checkpoints),
sends its random state to its forward partner; both then draw one microbatch after the other.

Possible where both kinds draw from the same kind of generator with the same tensor-parallel split:
the same device, and no --ignore-forward-tensor-parallel (a TP1 forward cannot draw the masks of TP
shards). Elsewhere the forward instances run without dropout and runs with dropout are not
loss-equivalent (docs/megafbd.md).
"""

import torch
from megatron.core import tensor_parallel

from megatron.training.frozen_args import FrozenArgs
from megatron.training.placement import World


def draws_dropout_alike(args: FrozenArgs, backward: World, forward: World) -> bool:
    """Whether a forward instance can draw the masks of its backward partner (see the module docstring);
    ``backward``, ``forward``: the two worlds of the placement."""
    dropout = args.hidden_dropout > 0 or args.attention_dropout > 0
    return dropout and forward.device == backward.device and not args.ignore_forward_tensor_parallel


def _states():
    """The device generator's state (on CPU: the CPU generator's) and the tracker's, in a fixed order."""
    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    return [torch.cuda.get_rng_state(), *(tracker[name] for name in sorted(tracker))]


def packed_state():
    return torch.cat([state.view(torch.uint8).reshape(-1) for state in _states()])


def packed_size():
    return sum(state.numel() * state.element_size() for state in _states())


def load_packed_state(packed):
    states, offset = [], 0
    for own in _states():
        nbytes = own.numel() * own.element_size()
        states.append(packed[offset:offset + nbytes].clone().view(own.dtype).reshape(own.shape))
        offset += nbytes
    torch.cuda.set_rng_state(states[0])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.set_states(dict(zip(sorted(tracker.get_states()), states[1:])))
