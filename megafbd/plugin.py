"""MegaFBD's plugin object: the training loop's hooks (see megatron/training/plugins.py).

MegaFBD declares how the launch splits into backward and forward instances (``placement``: each kind a
world of its own, ``layout.py``), and the loop gives each process its world's configuration (the
forward instances' device and tensor-parallel size). A backward process then runs the ordinary
training loop with the backward schedule and sends the weights of every step to its forward instance
with the next command; a forward process runs ``ForwardInstance`` instead of the loop.
"""

import os
import signal

import torch

from megafbd.arguments import add_arguments, backward_world_size, is_requested, placement, validate_args
from megafbd.coordinator import GO, STOP, TAG_ACK, TAG_CONTROL, TAG_RNG, Coordinator, receive
from megafbd.dropout_rng import packed_state
from megafbd.process_groups import is_backward, start_instance


class MegaFBDPlugin:
    def __init__(self):
        self.instance = None
        self.coordinator = None
        self.weights = None
        self.schedule = None
        self.sent_step = None  # the last step whose weights went to the forward instance

    def add_arguments(self, parser):
        add_arguments(parser)

    def is_enabled(self, args):
        return is_requested(args)

    def training_world_size(self, args, launched):
        return backward_world_size(args, launched) if args.forward_backward_disaggregating else launched

    def validate_args(self, args):
        return validate_args(args)

    def placement(self, args, launch):
        return placement(args, launch)

    def start_process_group(self, context):
        self.instance = start_instance(context)
        if self.instance.global_rank == 0:
            args, layout = context.args, self.instance.layout
            print(f"megafbd: {layout.backward_size} backward instances (TP{layout.tensor} x PP{layout.pipeline} x "
                  f"DP{layout.data}, {args.device}) + {layout.forward_size} forward instances (TP"
                  f"{layout.forward_tensor} x PP{layout.pipeline} x DP{layout.data}, {args.fbd_forward_device}); "
                  f"weight staleness {args.fbd_weight_staleness}, checksum every {args.fbd_checksum_interval} "
                  f"iterations", flush=True)
        return True

    def run_process(self, context, parts):
        if is_backward(self.instance):
            return False
        from megafbd.forward_instance import ForwardInstance

        ForwardInstance(context, self.instance, parts).run()
        return True

    # The loop's hooks below act on backward instances only: a forward instance calls the plugins'
    # hooks from its own loop for the other plugins' sake (tracing).

    def after_setup(self, context, model, optimizer, scheduler):
        if not is_backward(self.instance):
            return
        from megafbd.weight_sync import WeightSync

        self.coordinator = Coordinator(f"{self.instance.kind}-{self.instance.global_rank}", self.instance.messages)
        self.weights = WeightSync.for_backward(self.instance, model[0], context.args.fbd_checksum_interval,
                                               self.coordinator)

    def forward_backward_func(self, context):
        if not is_backward(self.instance):
            return None
        from megafbd.backward_schedule import BackwardSchedule

        self.schedule = BackwardSchedule(context.args, self.instance, self.coordinator)
        return self.schedule

    def _command(self, command, iteration):
        """Tell the forward instance what comes next; its answer says whether it was sent SIGTERM."""
        # The weights of the steps done since the last command (after --load, those training starts from,
        # as step iteration-1), sent here rather than right after the step so that the forward instance's
        # receive falls into the same iteration as the send (a trace matches them); it needs them only now.
        latest = iteration - 1 if command == GO else iteration
        for step in range(latest if self.sent_step is None else self.sent_step + 1, latest + 1):
            self.weights.send(step)
        self.sent_step = latest
        if self.instance.link_rank != 0:
            return
        last_stage = self.instance.coordinates.pipeline == self.instance.layout.pipeline - 1
        if command == GO and self.instance.draws_dropout and not last_stage:  # the iteration's masks: dropout_rng.py
            self.coordinator.send(self.instance.link_group, packed_state(), self.instance.link.forward_link_rank,
                                  TAG_RNG)
        self.coordinator.send(self.instance.link_group, torch.tensor([command, iteration]),
                              self.instance.link.forward_link_rank, TAG_CONTROL)
        signalled = receive(self.instance.link_group, (1,), torch.int64, self.instance.link.forward_link_rank,
                            TAG_ACK, "cpu")
        if signalled.item():  # the backward instances' SIGTERM agreement takes it from here
            os.kill(os.getpid(), signal.SIGTERM)

    def on_iteration_begin(self, context, iteration):
        if is_backward(self.instance):
            self._command(GO, iteration)

    def on_train_end(self, context, iteration):
        if not is_backward(self.instance):
            return
        args = context.args
        self._command(STOP, iteration)
        self.weights.send_checksum()
        self.coordinator.close()
        self.instance.report_done(f"{self.schedule.batches.count} batches received from the forward instance",
                                  args.device)
