"""Start torch.distributed for one instance: its kind's own world, its link, and its stage chain.

Each kind is a default process group of its own (a prefix of the launcher's store), so the backward
instances are an ordinary Megatron world for megatron-core's parallel_state, and so are the forward
instances at their own tensor-parallel size. Messages between the kinds go over the link: a gloo
group of the forward instance and the backward instances it serves, made only by its members (no
collective over the whole launch). Messages between the stages of one kind (forward activations,
backward input gradients) go over a gloo group of that kind's world kept for them alone, so that
they never interleave with the collectives of the compute.
"""

import datetime
from dataclasses import dataclass

import torch

from megafbd.dropout_rng import draws_dropout_alike
from megafbd.layout import BACKWARD, InstanceLayout, Link
from megafbd.message_trace import MessageTrace
from megatron.training.placement import Placement
from megatron.training.run_context import RunContext
from megatron.training.training_log import peak_memory, print_whole_line


@dataclass
class Instance:
    """This process's place in an FBD launch and its groups (gloo: messages travel in host memory)."""

    layout: InstanceLayout
    global_rank: int
    kind: str
    link: Link
    link_group: object  # ProcessGroupGloo over link.members
    chain_group: object  # ProcessGroupGloo over this kind's world, ranks as in that world
    draws_dropout: bool  # the forward instances draw their backward partners' dropout masks (dropout_rng.py)
    backward_sequence_parallel: bool  # the backward instances split the sequence (what the forward ones send)
    messages: object = None  # message_trace.MessageTrace of this instance's messages

    @property
    def link_rank(self):
        return self.link.link_rank(self.global_rank)

    @property
    def coordinates(self):
        return self.layout.coordinates(self.global_rank)

    @property
    def forward_computes(self):
        """Whether this stage's forward instance runs a forward. The last stage's does not (its output would
        be the loss, which the backward instance computes in its recomputation), so it needs no weights:
        none are sent there, and its backward instance never waits for a weight transfer."""
        return self.coordinates.pipeline < self.layout.pipeline - 1

    def describe(self):
        where = self.coordinates
        return f"{self.kind} instance (stage {where.pipeline}, replica {where.data}, tensor rank {where.tensor})"

    def report_done(self, details, device):
        """The instance's last line: what it did, and its peak memory (GPU, or host RSS on CPU)."""
        _, _, peak = peak_memory(device)
        print_whole_line(f"megafbd: {self.describe()} (global rank {self.global_rank}) done: {details}, peak "
                         f"{'GPU memory' if device == 'cuda' else 'host RSS'} {peak / 2**20:.0f} MB")


def layout_of(placement: Placement, pipeline: int) -> InstanceLayout:
    """The instance layout of a placement MegaFBD declared (arguments.placement), at ``pipeline`` stages."""
    backward, forward = placement.worlds
    tensor = backward.tensor_model_parallel_size
    return InstanceLayout(tensor, pipeline, backward.size // (tensor * pipeline), forward.tensor_model_parallel_size)


def start_instance(context: RunContext) -> Instance:
    """Start this process's kind world (the default group), link and chain over the launch's store; returns
    the Instance. The configuration is this process's already (its world's device and tensor-parallel size)."""
    args, placement, store = context.args, context.placement, context.launch_store
    layout = layout_of(placement, args.pipeline_model_parallel_size)
    global_rank, kind = placement.launch_rank, placement.world.kind
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    kind_rank = placement.world_rank
    torch.distributed.init_process_group(
        backend=args.distributed_backend, store=torch.distributed.PrefixStore(f"megafbd/{kind}/", store),
        rank=kind_rank, world_size=placement.world.size, timeout=timeout)
    link = layout.link(global_rank)
    link_group = torch.distributed.ProcessGroupGloo(
        torch.distributed.PrefixStore(f"megafbd/link/{link.name}/", store), link.link_rank(global_rank),
        len(link.members), timeout)
    chain_group = torch.distributed.ProcessGroupGloo(
        torch.distributed.PrefixStore(f"megafbd/chain/{kind}/", store), kind_rank, layout.kind_size(kind), timeout)
    backward, forward = placement.worlds
    instance = Instance(layout, global_rank, kind, link, link_group, chain_group,
                        draws_dropout_alike(args, backward, forward), backward.sequence_parallel)
    instance.messages = MessageTrace(instance, context.transfer_trace)
    return instance


def is_backward(instance):
    return instance is not None and instance.kind == BACKWARD
