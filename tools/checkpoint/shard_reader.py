"""Hugging Face tensors read from sharded safetensors files one at a time, each into memory of its own.

A tensor is read with ``readinto`` at the offset the file's header gives, not mapped: memory-mapped
tensors (safetensors' ``get_tensor``) keep their file pages resident for as long as any view of
them lives, and a padded copy of a mapped embedding holds it twice. Read this way, a tensor freed
is its memory freed, and the embedding is read straight into its padded rows.
"""

import json
import os
import time

import torch

from megatron.training.errors import UserError

# The safetensors dtype names of the weights a Llama-family checkpoint holds.
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def _header(path):
    """{name: (dtype, shape, file offset, bytes)} from a safetensors file's header (8 bytes of its
    length, then JSON with each tensor's dtype, shape and data offsets after the header)."""
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        try:
            header = json.loads(file.read(length)) if length <= size - 8 else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            header = None
    if not isinstance(header, dict):
        raise UserError(f"{path} is not a safetensors file (its header does not parse)")
    header.pop("__metadata__", None)
    entries = {}
    for name, entry in header.items():
        if entry["dtype"] not in _DTYPES:
            raise UserError(f"{path}: {name} is {entry['dtype']}; weights of type {', '.join(_DTYPES)} are read")
        begin, end = entry["data_offsets"]
        if 8 + length + end > size:  # checked here: once the writer runs, its errors bury ours
            raise UserError(f"{path} is truncated: it ends inside {name}")
        entries[name] = (_DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + length + begin, end - begin)
    return entries


def _read_into(path, offset, buffer):
    """Fills ``buffer`` (a uint8 array) with the file's bytes from ``offset``."""
    with open(path, "rb", buffering=0) as file:
        file.seek(offset)
        done = 0
        view = memoryview(buffer)
        while done < len(view):
            count = file.readinto(view[done:])  # one read(2) returns at most about 2 GB
            if not count:
                raise UserError(f"{path} is truncated: it ends inside a tensor")
            done += count


class ShardReader:
    """Reads Hugging Face tensors by name, in ``dtype``, from the shard that holds them.

    Prints a shard's progress line once every tensor the model needs from it was read."""

    def __init__(self, files, needed, dtype):
        self.dtype, self.files = dtype, files
        self.location, self.entries = {}, {}
        for path in files:
            for name, entry in _header(path).items():
                self.location[name], self.entries[name] = path, entry
        self.shapes = {name: entry[1] for name, entry in self.entries.items()}
        missing = [name for name in needed if name not in self.location]
        if missing:
            raise UserError(f"the checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[0]}")
        self.unread = {path: set() for path in files}
        for name in needed:
            self.unread[self.location[name]].add(name)
        self.progress = {path: {"tensors": 0, "bytes": 0, "start": None} for path in files}

    def position(self, name):
        """Where ``name`` lies: reading in this order reads the shards one after the other."""
        return self.files.index(self.location[name]), name

    def read(self, name, rows=None):
        """The tensor ``name``; with ``rows``, its first dimension padded with zeros to ``rows``."""
        path = self.location[name]
        progress = self.progress[path]
        if progress["start"] is None:
            progress["start"] = time.time()
        dtype, shape, offset, nbytes = self.entries[name]
        if rows is None or rows == shape[0]:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            tensor = torch.zeros((rows, *shape[1:]), dtype=dtype)
        _read_into(path, offset, tensor.view(-1).view(torch.uint8)[:nbytes].numpy())
        tensor = tensor.to(self.dtype)
        if name in self.unread[path]:
            self.unread[path].discard(name)
            progress["tensors"] += 1
            progress["bytes"] += nbytes
            if not self.unread[path]:
                self._report(path)
        return tensor

    def _report(self, path):
        progress, number = self.progress[path], self.files.index(path) + 1
        seconds = max(time.time() - progress["start"], 1e-9)
        gigabytes = progress["bytes"] / 1e9
        print(f"shard {number}/{len(self.files)} {os.path.basename(path)}: {progress['tensors']} tensors, "
              f"{gigabytes:.3f} GB in {seconds:.1f} s ({gigabytes / seconds:.2f} GB/s)", flush=True)
