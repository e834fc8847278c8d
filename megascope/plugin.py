"""MegaScope's training mode as a plugin of the training loop (megatron/training/plugins.py):
``--training-ws-port PORT [--training-ws-host 127.0.0.1] [--training-ws-wait]``. Without the port
flag nothing is installed."""

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from megatron.training.compiled_layers import refuse_compiled_layers
from megatron.training.cuda_graphs import graphs_give_way
from megatron.training.errors import ArgumentError
from megatron.training.frozen_args import FrozenArgs
from megatron.training.plugins import (
    AddArgumentsHook,
    AfterSetupHook,
    IsEnabledHook,
    IterationEndHook,
    Schedule,
    TrainEndHook,
    ValidateArgsHook,
    WrapScheduleHook,
)
from megatron.training.run_context import RunContext

if TYPE_CHECKING:
    from megascope.training_session import TrainingSession


class MegaScopePlugin(AddArgumentsHook, IsEnabledHook, ValidateArgsHook, AfterSetupHook, WrapScheduleHook,
                      IterationEndHook, TrainEndHook):
    def __init__(self) -> None:
        self.session: TrainingSession | None = None

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("MegaScope training mode")
        group.add_argument("--training-ws-port", type=int, default=None,
                           help="stream losses, per-layer norms and captured internals of every iteration to "
                                "MegaScope clients on this WebSocket port (global rank 0 serves), and take "
                                "pause / resume / step / stop, capture and perturbation requests")
        group.add_argument("--training-ws-host", default="127.0.0.1",
                           help="interface of the training WebSocket server; any other than localhost needs "
                                "the token it prints")
        group.add_argument("--training-ws-wait", action="store_true",
                           help="start paused: the first iteration runs when a client sends resume or step")

    def is_enabled(self, args: FrozenArgs) -> bool:
        return args.training_ws_port is not None

    def validate_args(self, args: FrozenArgs) -> Mapping[str, Any] | None:
        if not 1 <= args.training_ws_port <= 65535:
            raise ArgumentError(f"--training-ws-port {args.training_ws_port}: a TCP port is 1 .. 65535")
        # Captures, patches and perturbations are hooks inside the layers, which a replayed graph never calls.
        refuse_compiled_layers(args, "--training-ws-port reads and edits activations inside the layers from hooks")
        return graphs_give_way(args, "off with --training-ws-port: MegaScope reads and edits inside the layers",
                               f"--training-ws-port reads and edits activations inside the layers, which "
                               f"--cuda-graph-impl {args.cuda_graph_impl} replays without calling them; drop it")

    def after_setup(self, context: RunContext, model: list[torch.nn.Module], optimizer: Any, scheduler: Any) -> None:
        from megascope.training_session import TrainingSession  # only a run with the flag loads the server

        self.session = TrainingSession(context.args, model, optimizer, scheduler, context.request_stop)
        self.session.control_point(0, finished_iteration=False)  # --training-ws-wait waits here

    def wrap_schedule(self, context: RunContext, schedule: Schedule) -> Schedule:
        assert self.session is not None, "after_setup makes the session"
        return self.session.wrap_schedule(schedule)

    def on_iteration_end(self, context: RunContext, iteration: int, metrics: Mapping[str, Any]) -> None:
        assert self.session is not None, "after_setup makes the session"
        self.session.iteration_end(iteration, metrics)

    def on_train_end(self, context: RunContext, iteration: int) -> None:
        if self.session is not None:
            self.session.close()
