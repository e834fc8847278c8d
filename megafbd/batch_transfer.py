"""The data a stage reads (tokens, labels, loss mask, position ids, ...): read by the forward instance,
received by its backward partner(s).

A forward instance reads its microbatches from the data iterator as a normal run's stage does and
hands each one, as read, to the backward instances it serves (``ForwardedBatches``, an iterator over
its own). The backward instances' forward step reads from ``ReceivedBatches`` instead of a data
iterator: the same dictionaries, in the same order, with no loader of their own in the loop. Each
batch travels as two messages: its size, then a description (JSON: key, dtype, shape per tensor)
followed by the tensors' bytes, because a batch's keys are the model's business (GPT, BERT).
"""

import json

import torch
from megatron.core.num_microbatches_calculator import get_num_microbatches

from megafbd.coordinator import TAG_BATCH, TAG_BATCH_SIZE, receive

_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def pack(batch):
    """One uint8 tensor: the JSON description's length (8 bytes), the description, the tensors' bytes."""
    tensors = {key: value.detach().to("cpu").contiguous() for key, value in batch.items()}
    description = json.dumps([[key, str(t.dtype).removeprefix("torch."), list(t.shape)]
                              for key, t in tensors.items()]).encode()
    header = torch.tensor([len(description)], dtype=torch.int64).view(torch.uint8)
    parts = [header, torch.frombuffer(bytearray(description), dtype=torch.uint8)]
    parts += [t.reshape(-1).view(torch.uint8) for t in tensors.values()]
    return torch.cat(parts)


def unpack(packed, pin_memory=False):
    """The batch ``pack`` made, each tensor in its own memory: page-locked with ``pin_memory``, as a GPU run's data
    loader gives its batches, so that their copies to the GPU do not wait for the GPU's queued work."""
    length = int(packed[:8].clone().view(torch.int64))
    description = json.loads(bytes(packed[8:8 + length].tolist()))
    batch, offset = {}, 8 + length
    for key, dtype_name, shape in description:
        tensor = torch.empty(shape, dtype=_DTYPES[dtype_name], pin_memory=pin_memory)
        nbytes = tensor.numel() * tensor.itemsize
        tensor.view(-1).view(torch.uint8).copy_(packed[offset:offset + nbytes])
        batch[key] = tensor
        offset += nbytes
    return batch


class ForwardedBatches:
    """The forward instance's data iterator: every batch read from it also goes to the backward
    instances served (all of them get the whole batch: each tensor-parallel rank reads the same data
    in a normal run)."""

    def __init__(self, data_iterator, coordinator, instance):
        self.data_iterator = data_iterator
        self.coordinator = coordinator
        self.instance = instance
        self.count = 0  # batches so far; their index in the iteration labels them in a trace

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.data_iterator)
        microbatch = self.count % get_num_microbatches()
        self.count += 1
        packed = pack(batch)
        group = self.instance.link_group
        for link_rank in range(len(self.instance.link.backward_members)):
            self.coordinator.send(group, torch.tensor([packed.numel()]), link_rank, TAG_BATCH_SIZE)
            self.coordinator.send(group, packed, link_rank, TAG_BATCH, microbatch)
        return batch


class ReceivedBatches:
    """The backward instance's data iterator in training: the batches its forward partner read."""

    def __init__(self, instance, pin_memory):
        self.instance = instance
        self.pin_memory = pin_memory  # the backward instance trains on a GPU
        self.count = 0

    def __iter__(self):
        return self

    def __next__(self):
        microbatch = self.count % get_num_microbatches()
        self.count += 1
        group, forward = self.instance.link_group, self.instance.link.forward_link_rank
        size = receive(group, (1,), torch.int64, forward, TAG_BATCH_SIZE, "cpu").item()
        return unpack(receive(group, (size,), torch.uint8, forward, TAG_BATCH, "cpu", self.instance.messages,
                              microbatch), self.pin_memory)
