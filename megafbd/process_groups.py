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
import os
from dataclasses import dataclass

import torch

from megafbd.layout import BACKWARD, FORWARD, InstanceLayout, Link
from megafbd.message_trace import MessageTrace


@dataclass
class Instance:
    """This process's place in an FBD launch and its groups (gloo: messages travel in host memory)."""

    layout: InstanceLayout
    global_rank: int
    kind: str
    link: Link
    link_group: object  # ProcessGroupGloo over link.members
    chain_group: object  # ProcessGroupGloo over this kind's world, ranks as in that world
    messages: object = None  # message_trace.MessageTrace of this instance's messages

    @property
    def link_rank(self):
        return self.link.link_rank(self.global_rank)

    @property
    def coordinates(self):
        return self.layout.coordinates(self.global_rank)

    def describe(self):
        where = self.coordinates
        return f"{self.kind} instance (stage {where.pipeline}, replica {where.data}, tensor rank {where.tensor})"


def configure_forward_process(args, layout):
    """A forward instance runs the same model at its own tensor-parallel size and device."""
    args.tensor_model_parallel_size = layout.forward_tensor
    if layout.forward_tensor == 1:
        args.sequence_parallel = False
    if args.fbd_forward_device != args.device:
        args.device = args.fbd_forward_device
        args.distributed_backend = "gloo" if args.device == "cpu" else args.distributed_backend
    args.world_size = layout.forward_size


def traced_world(layout, kind, global_rank, store):
    """Where this kind's world sits in the run's trace (--trace): both kinds write one trace under their
    launch-wide ranks; the forward instances' group ids are kept apart from the backward instances', and
    in the trace layout their tensor ranks follow the backward instances' (TP .. TP + TPf - 1)."""
    from megascan.traced_world import TracedWorld, new_run_id

    if global_rank == 0:
        store.set("megafbd/trace-run-id", new_run_id())
    run_id = store.get("megafbd/trace-run-id").decode()
    forward = kind == FORWARD
    return TracedWorld(run_id, layout.kind_offset(kind), layout.world_size, f"{FORWARD}/" if forward else "",
                       layout.tensor if forward else 0, layout.tensor + layout.forward_tensor)


def start_instance(args, layout):
    """Start this process's kind world (the default group), link and chain; returns the Instance."""
    global_rank = int(os.environ["RANK"])
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    store, _, _ = next(torch.distributed.rendezvous("env://", global_rank, layout.world_size, timeout=timeout))
    kind = layout.kind(global_rank)
    args.instance_kind = kind
    if kind == FORWARD:
        configure_forward_process(args, layout)
    if getattr(args, "trace", False):
        args.traced_world = traced_world(layout, kind, global_rank, store)
    kind_rank = layout.kind_rank(global_rank)
    torch.distributed.init_process_group(
        backend=args.distributed_backend, store=torch.distributed.PrefixStore(f"megafbd/{kind}/", store),
        rank=kind_rank, world_size=layout.kind_size(kind), timeout=timeout)
    link = layout.link(global_rank)
    link_group = torch.distributed.ProcessGroupGloo(
        torch.distributed.PrefixStore(f"megafbd/link/{link.name}/", store), link.link_rank(global_rank),
        len(link.members), timeout)
    chain_group = torch.distributed.ProcessGroupGloo(
        torch.distributed.PrefixStore(f"megafbd/chain/{kind}/", store), kind_rank, layout.kind_size(kind), timeout)
    instance = Instance(layout, global_rank, kind, link, link_group, chain_group)
    instance.messages = MessageTrace(instance)
    return instance


def is_backward(instance):
    return instance is not None and instance.kind == BACKWARD
