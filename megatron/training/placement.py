"""Where each launched process sits: which torch.distributed world it belongs to, whether that world
trains or serves the training, and at which device and tensor-parallel size.

An ordinary run is one world of every launched process. A plugin that splits the launch (MegaFBD:
backward instances that train, forward instances that serve them) declares the split through the
plugin contract (``Plugin.placement``) instead of editing the configuration; the loop then gives each
process the configuration of its own world (``configuration_at``): its device, tensor-parallel size,
sequence parallelism and world size, which the loop and megatron-core read from there.
"""

import argparse
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from megatron.training.frozen_args import FrozenArgs

TRAINING = "training"  # the kind of an ordinary run's one world


@dataclass(frozen=True)
class Launch:
    """What the launcher started: ``size`` processes, this one being ``rank`` (torchrun's RANK, WORLD_SIZE)."""

    rank: int
    size: int

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> "Launch":
        return cls(int(environ.get("RANK", "0")), int(environ.get("WORLD_SIZE", "1")))


@dataclass(frozen=True)
class World:
    """One torch.distributed world of a launch: the launch ranks ``first_rank`` .. ``first_rank + size - 1``."""

    kind: str  # "training" for an ordinary run; MegaFBD's "backward", "forward"
    first_rank: int
    size: int
    tensor_model_parallel_size: int
    sequence_parallel: bool
    device: str  # "cuda" or "cpu"
    trains: bool = True  # runs the training loop (optimizer, checkpoints, log); False: it serves those that do

    @property
    def launch_ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.size)


@dataclass(frozen=True)
class Placement:
    """The worlds of a launch (in launch-rank order, covering it) and this process's place in them."""

    launch_rank: int
    worlds: tuple[World, ...]

    def __post_init__(self) -> None:
        expected = 0
        for world in self.worlds:
            if world.first_rank != expected or world.size < 1:
                raise ValueError(f"placement: the worlds must cover the launch ranks in order, got {self.worlds}")
            expected += world.size
        if not 0 <= self.launch_rank < expected:
            raise ValueError(f"placement: launch rank {self.launch_rank} is outside its worlds ({expected} ranks)")

    @classmethod
    def single_world(cls, launch: Launch, args: argparse.Namespace) -> "Placement":
        """An ordinary run: every launched process trains, in one world, as the flags say."""
        return cls(launch.rank, (World(TRAINING, 0, launch.size, args.tensor_model_parallel_size,
                                       args.sequence_parallel, args.device),))

    @property
    def launch_size(self) -> int:
        return sum(world.size for world in self.worlds)

    @property
    def world(self) -> World:
        """This process's world."""
        return next(world for world in self.worlds if self.launch_rank in world.launch_ranks)

    @property
    def world_rank(self) -> int:
        """This process's rank in its world (its torch.distributed rank)."""
        return self.launch_rank - self.world.first_rank

    @property
    def training_ranks(self) -> list[int]:
        """The launch ranks that run the training loop."""
        return [rank for world in self.worlds if world.trains for rank in world.launch_ranks]

    def launch_ranks_of(self, world_ranks: Iterable[int]) -> list[int]:
        """The launch ranks of ranks of this process's world."""
        first = self.world.first_rank
        return [first + rank for rank in world_ranks]


def configuration_at(args: argparse.Namespace, placement: Placement) -> FrozenArgs:
    """The validated configuration as this process runs it: its world's device, tensor-parallel size,
    sequence parallelism and world size (the rest as validated: the vocabulary padding, the data-parallel
    size and the batch sizes are the training world's, which every world shares)."""
    if len(placement.training_ranks) != args.world_size:  # the plugin's training_world_size and placement disagree
        raise ValueError(f"placement: its training worlds hold {len(placement.training_ranks)} processes, but the "
                         f"flags were validated for a training world of {args.world_size}")
    world = placement.world
    backend = args.distributed_backend
    if world.device != args.device:  # a world on another device than the flags (MegaFBD's CPU forward instances)
        backend = "gloo" if world.device == "cpu" else backend
    return FrozenArgs(args).replaced(device=world.device, distributed_backend=backend, world_size=world.size,
                                     tensor_model_parallel_size=world.tensor_model_parallel_size,
                                     sequence_parallel=world.sequence_parallel)
