"""A plugin implementing every hook of the training loop's contract, recording each call.

Enabled by --record-hooks-to DIR; each rank writes DIR/rank<N>.json at the end of training.
"""

import json
import os

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron.training.errors import ArgumentError


class RecordingPlugin:
    def __init__(self):
        self.calls = []

    def add_arguments(self, parser):
        parser.add_argument("--record-hooks-to", default=None)

    def is_enabled(self, args):
        return args.record_hooks_to is not None

    def validate_args(self, args):
        if not os.path.isdir(args.record_hooks_to):
            raise ArgumentError(f"--record-hooks-to: {args.record_hooks_to} is not a directory")
        self.calls.append(["validate_args"])

    def placement(self, args, launch):
        self.calls.append(["placement", launch.size])  # declares none: the loop's one training world

    def after_setup(self, context, model, optimizer, scheduler):
        self.calls.append(["after_setup", len(model), type(optimizer).__name__, type(scheduler).__name__])

    def forward_backward_func(self, context):
        schedule = get_forward_backward_func()

        def recorded_schedule(**kwargs):
            self.calls.append(["schedule", kwargs["forward_only"]])
            return schedule(**kwargs)

        return recorded_schedule

    def wrap_schedule(self, context, schedule):
        def wrapped_schedule(**kwargs):
            self.calls.append(["wrapped", kwargs["forward_only"]])
            return schedule(**kwargs)

        return wrapped_schedule

    def on_iteration_begin(self, context, iteration):
        self.calls.append(["iteration_begin", iteration])

    def on_iteration_end(self, context, iteration, metrics):
        self.calls.append(["iteration_end", iteration, sorted(metrics["losses"])])

    def on_train_end(self, context, iteration):
        self.calls.append(["train_end", iteration])
        path = os.path.join(context.args.record_hooks_to, f"rank{torch.distributed.get_rank()}.json")
        with open(path, "w") as f:
            json.dump(self.calls, f)


PLUGIN = RecordingPlugin()
