"""MegaDPP's plugin object: the training loop's hooks (see megatron/training/plugins.py)."""

import argparse
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.utils import get_model_config

from megadpp.arguments import add_arguments, any_flag_given, stall_timeout, validate_args
from megadpp.fault_injection import StaticLinkDelay, arrival_delay, install_stage_delay
from megadpp.nodes import launch_spans_nodes
from megadpp.runtime import DynamicPipelineSchedule
from megadpp.schedule_log import ScheduleLog
from megatron.training.frozen_args import FrozenArgs
from megatron.training.plugins import (
    AddArgumentsHook,
    AfterSetupHook,
    ForwardBackwardFuncHook,
    IsEnabledHook,
    IterationBeginHook,
    Schedule,
    TrainEndHook,
    ValidateArgsHook,
)
from megatron.training.run_context import RunContext
from megatron.training.training_log import print_rank_0
from megatron.training.transfer_trace import TransferChannel, TransferLabel, TransferTrace

if TYPE_CHECKING:  # importing the transport loads its compiled part: only where --use-dpp asks for it
    from megadpp.transport import TransferEvent


class MegaDPPPlugin(AddArgumentsHook, IsEnabledHook, ValidateArgsHook, AfterSetupHook, ForwardBackwardFuncHook,
                    IterationBeginHook, TrainEndHook):
    def __init__(self) -> None:
        self.schedule: DynamicPipelineSchedule | None = None
        self.log: ScheduleLog | None = None

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_arguments(parser)

    def is_enabled(self, args: FrozenArgs) -> bool:
        return any_flag_given(args)

    def validate_args(self, args: FrozenArgs) -> Mapping[str, Any] | None:
        return validate_args(args)

    def after_setup(self, context: RunContext, model: list[torch.nn.Module], optimizer: Any, scheduler: Any) -> None:
        args = context.args
        if args.dpp_delay_stage is not None:
            install_stage_delay(model, args)
        if not args.use_dpp:
            if args.dpp_delay_link is not None:  # the static schedule's sends (fault_injection.py)
                StaticLinkDelay(args, len(model), get_num_microbatches(),
                                get_model_config(model[0]).microbatch_group_size_per_vp_stage).install()
            return
        transport, kind = self._transport(context)
        self.log = ScheduleLog(args.dpp_log_schedule) if args.dpp_log_schedule else None
        self.schedule = DynamicPipelineSchedule(args.dpp_policy, transport, args.dpp_max_inflight, self.log,
                                                arrival_delay(args), stall_timeout(args))
        cap = args.dpp_max_inflight or "what 1F1B holds"
        print_rank_0(f"MegaDPP: {args.dpp_policy} dynamic pipeline schedule over {kind}, "
                     f"activation cap per stage: {cap}")

    @staticmethod
    def _transport(context: RunContext) -> tuple[Any, str]:
        """megadpp.transport's choice for the pipeline neighbours (shared memory or CUDA IPC within a node,
        torch.distributed between CPUs of different nodes). The transport reports every transfer into the
        run's transfer-trace sink (host clock times; a tracer, if any, records them)."""
        # Imported here: loading the compiled transport prints what it lacks, which a run without
        # --use-dpp (or one refused at its flags) must not show.
        from megadpp.transport import create_transport

        args = context.args
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        pipeline = dist.get_process_group_ranks(pp_group)
        stage = parallel_state.get_pipeline_model_parallel_rank()
        peers = sorted({pipeline[(stage + step) % len(pipeline)] for step in (-1, 1)} - {dist.get_rank()})
        channel = TransferChannel(f"megadpp-{pp_group.group_name}", tuple(context.placement.launch_ranks_of(pipeline)),
                                  "pp")
        observer = transfer_reporter(context.transfer_trace, channel, context.placement.world.first_rank)
        local = ("CUDA IPC" if args.device == "cuda" else "shared memory") + " within a node"
        if launch_spans_nodes(args.node_ips):
            local += ", torch.distributed across nodes"
        # A tracer installs its recorder before this hook runs (plugins run in registration order).
        traced = "; --trace records its transfers" if context.transfer_trace.recording else ""
        return create_transport(args, peers, observer=observer), local + traced

    def forward_backward_func(self, context: RunContext) -> Schedule | None:
        return self.schedule

    def on_iteration_begin(self, context: RunContext, iteration: int) -> None:
        if self.log is not None:
            self.log.iteration = iteration

    def on_train_end(self, context: RunContext, iteration: int) -> None:
        if self.schedule is not None:
            self.schedule.transport.close()
        if self.log is not None:
            self.log.write()
            print_rank_0(f"MegaDPP: wrote the schedule each rank ran to {context.args.dpp_log_schedule}")


def transfer_reporter(sink: TransferTrace, channel: TransferChannel,
                      rank_offset: int) -> Callable[["TransferEvent"], None]:
    """The transport's observer: each completed transfer (a TransferEvent) into the run's sink, its peer as a
    launch rank (``rank_offset``: the launch rank of this world's rank 0)."""

    def report(event: "TransferEvent") -> None:
        label = event.label if isinstance(event.label, TransferLabel) else None  # the schedule's (runtime.py)
        sink.report(event.op, channel, event.peer + rank_offset, event.nbytes, None, event.seq, event.start_ns,
                    event.end_ns, label)

    return report
