"""MegaFBD's messages in a MegaScan trace (--trace): which channel each one travels on, its peer's
launch-wide rank, and its number on that channel.

The data of training travels in FBD's own messages: batches and stage inputs (forward to backward
instance), activations (forward instance to the next stage's), input gradients (backward instance to
the previous stage's) and weights (backward to forward instance). Each is recorded, on both ends, as
a p2p op of MegaScan's trace (``megascan.message_tracer``) on a channel of its own per link or chain
and message kind, numbered by both ends alike: each counts every message of the channel, traced or
not. Control messages, acknowledgements, batch sizes and checksums are not recorded.
"""

import collections

from megafbd.coordinator import TAG_ACTIVATION, TAG_BATCH, TAG_INPUT_GRAD, TAG_STAGE_INPUT, TAG_WEIGHTS
from megascan import message_tracer

TRACED = {TAG_WEIGHTS: "weights", TAG_STAGE_INPUT: "stage-input", TAG_BATCH: "batch",
          TAG_ACTIVATION: "activation", TAG_INPUT_GRAD: "input-grad"}


class MessageTrace:
    def __init__(self, instance):
        self.instance = instance
        self.counts = collections.Counter()

    def _channel(self, group, peer, name):
        """(channel id, its launch-wide ranks, the peer's launch-wide rank)."""
        instance = self.instance
        if group is instance.link_group:
            link = instance.link
            return f"megafbd/{link.name}/{name}", link.members, link.members[peer]
        offset = instance.layout.kind_offset(instance.kind)
        ranks = range(offset, offset + instance.layout.kind_size(instance.kind))
        return f"megafbd/{instance.kind}-chain/{name}", ranks, offset + peer

    def start(self, op, group, peer, tag, tensor, microbatch=None):
        """Number a ``send`` or ``recv`` of a traced message kind and record its start; the record, or None."""
        name = TRACED.get(tag)
        if name is None:
            return None
        channel, ranks, peer = self._channel(group, peer, name)
        key = (channel, op, peer)
        seq = self.counts[key]
        self.counts[key] = seq + 1
        tracer = message_tracer.active()
        return tracer.start(op, channel, ranks, peer, tensor, seq, microbatch) if tracer is not None else None

    @staticmethod
    def end(record):
        if record is not None:
            message_tracer.active().end(record)
