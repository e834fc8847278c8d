"""MegaScan's plugin object: the training loop's hooks (see megatron/training/plugins.py)."""

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megascan.arguments import (
    add_arguments,
    compose_with_cuda_graphs,
    fault_injection_requested,
    validate_detect_args,
    validate_fault_injection_args,
    validate_trace_args,
)
from megascan.fault_injection import HangAtIteration, delay_host, slow_down
from megatron.training.frozen_args import FrozenArgs
from megatron.training.plugins import (
    AddArgumentsHook,
    AfterSetupHook,
    IsEnabledHook,
    IterationBeginHook,
    IterationEndHook,
    Schedule,
    TrainEndHook,
    ValidateArgsHook,
    WrapScheduleHook,
)
from megatron.training.run_context import RunContext

if TYPE_CHECKING:
    from megascan.session import TraceSession


class MegaScanPlugin(AddArgumentsHook, IsEnabledHook, ValidateArgsHook, AfterSetupHook, WrapScheduleHook,
                     IterationBeginHook, IterationEndHook, TrainEndHook):
    def __init__(self) -> None:
        self.session: TraceSession | None = None
        self.hang: HangAtIteration | None = None

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_arguments(parser)

    def is_enabled(self, args: FrozenArgs) -> bool:
        return args.trace or args.trace_detect or fault_injection_requested(args)

    def validate_args(self, args: FrozenArgs) -> Mapping[str, Any] | None:
        validate_detect_args(args)
        normalised = None
        if args.trace:
            validate_trace_args(args)
            normalised = compose_with_cuda_graphs(args)
        if fault_injection_requested(args):
            validate_fault_injection_args(args)
        return normalised

    def after_setup(self, context: RunContext, model: list[torch.nn.Module], optimizer: Any, scheduler: Any) -> None:
        args = context.args
        if args.inject_slowdown_rank == dist.get_rank():
            slow_down(model, args.inject_slowdown_factor)
        if args.inject_host_delay_rank == dist.get_rank():
            delay_host(model, args.inject_host_delay_ms)
        if args.inject_hang_rank == dist.get_rank():
            self.hang = HangAtIteration(model, args.inject_hang_iteration)
        if args.trace:
            # only a traced run loads the tracers
            from megascan.session import TraceSession

            self.session = TraceSession(context, model, optimizer)

    def wrap_schedule(self, context: RunContext, schedule: Schedule) -> Schedule:
        return self.session.wrap_schedule(schedule) if self.session else schedule

    def on_iteration_begin(self, context: RunContext, iteration: int) -> None:
        if self.hang:
            self.hang.on_iteration_begin(iteration)
        if self.session:
            self.session.iteration_begin(iteration)

    def on_iteration_end(self, context: RunContext, iteration: int, metrics: Mapping[str, Any]) -> None:
        if self.session:
            self.session.iteration_end(iteration)

    def on_train_end(self, context: RunContext, iteration: int) -> None:
        if self.session:
            self.session.finish()
