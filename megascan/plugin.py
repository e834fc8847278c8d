"""MegaScan's plugin object: the training loop's hooks (see megatron/training/plugins.py)."""

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


class MegaScanPlugin:
    def __init__(self):
        self.session = None
        self.hang = None

    def add_arguments(self, parser):
        add_arguments(parser)

    def is_enabled(self, args):
        return args.trace or args.trace_detect or fault_injection_requested(args)

    def validate_args(self, args):
        validate_detect_args(args)
        normalised = None
        if args.trace:
            validate_trace_args(args)
            normalised = compose_with_cuda_graphs(args)
        if fault_injection_requested(args):
            validate_fault_injection_args(args)
        return normalised

    def after_setup(self, context, model, optimizer, scheduler):
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

    def wrap_schedule(self, context, schedule):
        return self.session.wrap_schedule(schedule) if self.session else schedule

    def on_iteration_begin(self, context, iteration):
        if self.hang:
            self.hang.on_iteration_begin(iteration)
        if self.session:
            self.session.iteration_begin(iteration)

    def on_iteration_end(self, context, iteration, metrics):
        if self.session:
            self.session.iteration_end(iteration)

    def on_train_end(self, context, iteration):
        if self.session:
            self.session.finish()
