"""MegaFBD's messages as transfers of the run's transfer-trace sink (megatron/training/transfer_trace.py):
which channel each one travels on, its peer's launch-wide rank, and its number on that channel.

The data of training travels in FBD's own messages: batches and stage inputs (forward to backward
instance), activations (forward instance to the next stage's), input gradients (backward instance to
the previous stage's) and weights (backward to forward instance). Each is reported, on both ends, on a
channel of its own per link or chain and message kind, numbered by both ends alike: each counts every
message of the channel, whether anyone records it or not (a tracer such as MegaScan's --trace records
them as point-to-point ops). Control messages, acknowledgements, batch sizes and checksums are not
reported.
"""

import collections

import torch

from megafbd.coordinator import TAG_ACTIVATION, TAG_BATCH, TAG_INPUT_GRAD, TAG_STAGE_INPUT, TAG_WEIGHTS
from megatron.training.transfer_trace import TransferChannel, TransferLabel, TransferTrace

TRACED = {TAG_WEIGHTS: "weights", TAG_STAGE_INPUT: "stage-input", TAG_BATCH: "batch",
          TAG_ACTIVATION: "activation", TAG_INPUT_GRAD: "input-grad"}
ROLE = "message"  # the role of the channels in a trace


class MessageTrace:
    def __init__(self, instance, sink: TransferTrace):
        self.instance = instance
        self.sink = sink  # the run's TransferTrace
        # (channel name, op, peer) -> how many of its messages were numbered: the next one's seq
        self.counts: collections.Counter[tuple[str, str, int]] = collections.Counter()
        self.channels: dict[tuple[bool, str], TransferChannel] = {}  # (on the link?, message kind) -> channel

    def _channel(self, group, name):
        instance = self.instance
        key = (group is instance.link_group, name)
        channel = self.channels.get(key)
        if channel is None:
            if group is instance.link_group:
                channel = TransferChannel(f"megafbd/{instance.link.name}/{name}", instance.link.members, ROLE)
            else:
                offset = instance.layout.kind_offset(instance.kind)
                ranks = tuple(range(offset, offset + instance.layout.kind_size(instance.kind)))
                channel = TransferChannel(f"megafbd/{instance.kind}-chain/{name}", ranks, ROLE)
            self.channels[key] = channel
        return channel

    def _peer(self, group, peer):
        """The launch-wide rank of ``peer`` of ``group``."""
        if group is self.instance.link_group:
            return self.instance.link.members[peer]
        return self.instance.layout.kind_offset(self.instance.kind) + peer

    def start(self, op: str, group, peer: int, tag: int, tensor: torch.Tensor,
              microbatch: int | None = None) -> object | None:
        """Number a ``send`` or ``recv`` of a traced message kind and report its start; the token for ``end``."""
        name = TRACED.get(tag)
        if name is None:
            return None
        channel, peer = self._channel(group, name), self._peer(group, peer)
        key = (channel.name, op, peer)
        seq = self.counts[key]
        self.counts[key] = seq + 1
        label = None if microbatch is None else TransferLabel(microbatch=microbatch)
        return self.sink.start(op, channel, peer, tensor.numel() * tensor.element_size(),
                               str(tensor.dtype).removeprefix("torch."), seq, label=label)

    def end(self, token: object | None) -> None:
        self.sink.end(token)
