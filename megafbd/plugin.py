"""MegaFBD's plugin object: the training loop's hooks (see megatron/training/plugins.py).

MegaFBD declares how the launch splits into backward and forward instances (``placement``: each kind a
world of its own, ``layout.py``), and the loop gives each process its world's configuration (the
forward instances' device and tensor-parallel size). A backward process then runs the ordinary
training loop with the backward schedule and sends the weights of every step to its forward instance
with the next command; a forward process runs ``ForwardInstance`` instead of the loop.
"""

import argparse
import os
import signal
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from megafbd.arguments import add_arguments, backward_world_size, is_requested, placement, validate_args
from megafbd.coordinator import GO, STOP, TAG_ACK, TAG_CONTROL, TAG_RNG, Coordinator, receive
from megafbd.dropout_rng import packed_state
from megafbd.process_groups import Instance, is_backward, start_instance
from megatron.training.frozen_args import FrozenArgs
from megatron.training.placement import Launch, Placement
from megatron.training.plugins import (
    AddArgumentsHook,
    AfterSetupHook,
    ForwardBackwardFuncHook,
    IsEnabledHook,
    IterationBeginHook,
    JobParts,
    PlacementHook,
    RunProcessHook,
    Schedule,
    StartProcessGroupHook,
    TrainEndHook,
    TrainingWorldSizeHook,
    ValidateArgsHook,
)
from megatron.training.run_context import RunContext
from megatron.training.training_log import print_whole_line

if TYPE_CHECKING:
    from megafbd.backward_schedule import BackwardSchedule
    from megafbd.weight_sync import WeightSync


class MegaFBDPlugin(AddArgumentsHook, IsEnabledHook, TrainingWorldSizeHook, ValidateArgsHook, PlacementHook,
                    StartProcessGroupHook, RunProcessHook, AfterSetupHook, ForwardBackwardFuncHook, IterationBeginHook,
                    TrainEndHook):
    def __init__(self) -> None:
        self.instance: Instance | None = None  # made by start_process_group, the first hook after validation
        self.coordinator: Coordinator | None = None
        self.weights: WeightSync | None = None
        self.schedule: BackwardSchedule | None = None
        self.sent_step: int | None = None  # the last step whose weights went to the forward instance

    @property
    def _instance(self) -> Instance:
        assert self.instance is not None, "start_process_group makes the instance"
        return self.instance

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_arguments(parser)

    def is_enabled(self, args: FrozenArgs) -> bool:
        return is_requested(args)

    def training_world_size(self, args: FrozenArgs, launched: int) -> int:
        return backward_world_size(args, launched) if args.forward_backward_disaggregating else launched

    def validate_args(self, args: FrozenArgs) -> Mapping[str, Any] | None:
        return validate_args(args)

    def placement(self, args: FrozenArgs, launch: Launch) -> Placement | None:
        return placement(args, launch)

    def start_process_group(self, context: RunContext) -> bool:
        self.instance = start_instance(context)
        if self.instance.global_rank == 0:
            args, layout = context.args, self.instance.layout
            print_whole_line(f"megafbd: {layout.backward_size} backward instances (TP{layout.tensor} x "
                             f"PP{layout.pipeline} x DP{layout.data}, {args.device}) + {layout.forward_size} "
                             f"forward instances (TP"
                             f"{layout.forward_tensor} x PP{layout.pipeline} x DP{layout.data}, "
                             f"{args.fbd_forward_device}); weight staleness {args.fbd_weight_staleness}, checksum "
                             f"every {args.fbd_checksum_interval} iterations")
        return True

    def run_process(self, context: RunContext, parts: JobParts) -> bool:
        if is_backward(self._instance):
            return False
        from megafbd.forward_instance import ForwardInstance

        ForwardInstance(context, self._instance, parts).run()
        return True

    # The loop's hooks below act on backward instances only: a forward instance calls the plugins'
    # hooks from its own loop for the other plugins' sake (tracing).

    def after_setup(self, context: RunContext, model: list[torch.nn.Module], optimizer: Any, scheduler: Any) -> None:
        instance = self._instance
        if not is_backward(instance):
            return
        from megafbd.weight_sync import WeightSync

        self.coordinator = Coordinator(f"{instance.kind}-{instance.global_rank}", instance.messages)
        if instance.forward_computes:
            self.weights = WeightSync.for_backward(instance, model[0], context.args.fbd_checksum_interval,
                                                   self.coordinator)

    def forward_backward_func(self, context: RunContext) -> Schedule | None:
        if not is_backward(self._instance):
            return None
        from megafbd.backward_schedule import BackwardSchedule

        self.schedule = BackwardSchedule(context.args, self._instance, self.coordinator)
        return self.schedule

    def _command(self, command: int, iteration: int) -> None:
        """Tell the forward instance what comes next; its answer says whether it was sent SIGTERM."""
        # The weights of the steps done since the last command (after --load, those training starts from,
        # as step iteration-1), sent here rather than right after the step so that the forward instance's
        # receive falls into the same iteration as the send (a trace matches them); it needs them only now.
        latest = iteration - 1 if command == GO else iteration
        instance, weights, coordinator = self._instance, self.weights, self.coordinator
        assert coordinator is not None, "after_setup makes it on backward instances"
        if weights is not None:
            for step in range(latest if self.sent_step is None else self.sent_step + 1, latest + 1):
                weights.send(step)
            self.sent_step = latest
        if instance.link_rank != 0:
            return
        last_stage = instance.coordinates.pipeline == instance.layout.pipeline - 1
        if command == GO and instance.draws_dropout and not last_stage:  # the iteration's masks: dropout_rng.py
            coordinator.send(instance.link_group, packed_state(), instance.link.forward_link_rank, TAG_RNG)
        coordinator.send(instance.link_group, torch.tensor([command, iteration]), instance.link.forward_link_rank,
                         TAG_CONTROL)
        signalled = receive(instance.link_group, (1,), torch.int64, instance.link.forward_link_rank, TAG_ACK, "cpu")
        if signalled.item():  # the backward instances' SIGTERM agreement takes it from here
            os.kill(os.getpid(), signal.SIGTERM)

    def on_iteration_begin(self, context: RunContext, iteration: int) -> None:
        if is_backward(self._instance):
            self._command(GO, iteration)

    def on_train_end(self, context: RunContext, iteration: int) -> None:
        instance = self._instance
        if not is_backward(instance):
            return
        args = context.args
        self._command(STOP, iteration)
        assert self.coordinator is not None and self.schedule is not None
        if self.weights is not None:
            self.weights.send_checksum()
        self.coordinator.close()
        instance.report_done(f"{self.schedule.batches.count} batches received from the forward instance",
                                  args.device)
