"""The whole job of a forward instance: stream microbatches through its stage, keep no activations.

It holds the model's weights and nothing else of training: no gradients, no main parameters, no
optimizer state, no checkpoints. Each iteration starts when its backward partner says so (the
control message carries the iteration number, so a resumed run reads its data from the right
position); the weights of the step before (staleness 0) or of the one before that (staleness 1)
are loaded first. Per microbatch the stage's forward runs without autograd; its output goes to the
next stage's forward instance and its input to the backward instance(s) of this stage, together with
the data the stage reads (``ForwardedBatches``: the token batch at the first stage). The last stage
runs no forward (its output would be the loss, which its backward instance computes in the
recomputation): it reads the microbatch's labels and loss mask, as a normal run's last stage reads
them, and sends them on with the stage input.
"""

import signal

import torch
from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from megafbd.backward_schedule import stage_tensor_shape
from megafbd.batch_transfer import ForwardedBatches
from megafbd.coordinator import (
    GO,
    STOP,
    TAG_ACK,
    TAG_ACTIVATION,
    TAG_CONTROL,
    TAG_RNG,
    TAG_STAGE_INPUT,
    Coordinator,
    receive,
)
from megafbd.dropout_rng import load_packed_state, packed_size
from megafbd.weight_sync import WeightSync
from megatron.training.model_setup import build_model
from megatron.training.peer_watch import now_doing
from megatron.training.signal_handler import STOP_SIGNALS
from megatron.training.training import build_iterators


class ForwardInstance:
    def __init__(self, context, instance, parts):
        args = context.args  # this process's: the forward instances' device and tensor-parallel size
        self.context = context
        self.args = args
        self.instance = instance
        self.parts = parts
        self.sigterm_received = False
        # Preemption (SIGTERM) and Ctrl-C (SIGINT) signal the whole job: the backward instances agree on
        # where to stop, save, and then tell this instance to stop; this one only reports that it was signalled.
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_sigterm)
        self.model = build_model(args, parts.model_provider, with_gradients=False)[0]
        for param in self.model.parameters():
            param.requires_grad_(False)
        # Dropout only where this instance can draw its backward partner's masks (dropout_rng.py).
        self.model.train(instance.draws_dropout)
        # None at the last stage, which runs no forward (Instance.forward_computes).
        self.weights = (WeightSync.for_forward(instance, self.model, args.fbd_checksum_interval)
                        if instance.forward_computes else None)
        self.coordinator = Coordinator(f"{instance.kind}-{instance.global_rank}", instance.messages)
        self.data_iterator = None
        self.start_step = None  # the step whose weights training starts from (iteration - 1 after --load)
        self.next_step = None  # the first step whose weights are not yet asked for
        self.first = parallel_state.is_pipeline_first_stage()
        self.last = parallel_state.is_pipeline_last_stage()
        self.device = torch.device(torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
        # The other plugins see this loop as a training loop without an optimizer (MegaScan traces it).
        self.plugins = parts.registry
        self.plugins.after_setup(context, [self.model], None, None)
        self.forward_pass = self.plugins.wrap_schedule(context, self._forward_microbatches)

    def _on_sigterm(self, signum, frame):
        self.sigterm_received = True

    def _control(self):
        command, iteration = receive(self.instance.link_group, (2,), torch.int64, 0, TAG_CONTROL, "cpu").tolist()
        return command, iteration

    def run(self):
        pending = []  # weight receives posted, oldest first
        iterations = 0
        while True:
            now_doing("waiting for the backward instances' next command")
            command, iteration = self._control()
            now_doing(f"iteration {iteration} (forward instance)")  # named if a peer dies meanwhile
            self.instance.link_group.send([torch.tensor([int(self.sigterm_received)])], 0, TAG_ACK).wait()
            if self.next_step is None:  # the weights training starts from come first, as step iteration-1
                self.start_step = self.next_step = iteration if command == STOP else iteration - 1
                if command == GO:  # every forward instance gets here at once: the datasets are built collectively
                    self.data_iterator = self._build_data(iteration)
            if command == STOP:
                if self.weights is not None:
                    self._finish_weights(pending, up_to=iteration)
                    self.weights.check_loaded()
                    self.weights.check(f"at the end (iteration {iteration})")
                break
            # The iteration (and its trace) begins with the weights' arrival: the backward instances send
            # them with the command. Those of step iteration-1 are on their way; the model must hold step
            # iteration-1-staleness.
            self.plugins.on_iteration_begin(self.context, iteration)
            if self.weights is not None:
                self._post_weights(pending, up_to=iteration - 1)
                self._finish_weights(pending,
                                     up_to=max(self.start_step, iteration - 1 - self.args.fbd_weight_staleness))
            if self.instance.draws_dropout and not self.last:
                load_packed_state(receive(self.instance.link_group, (packed_size(),), torch.uint8, 0, TAG_RNG, "cpu"))
            self.forward_pass(forward_step_func=self.parts.forward_step_func, data_iterator=self.data_iterator,
                              model=[self.model])
            self.plugins.on_iteration_end(self.context, iteration, {"losses": {}, "grad_norm": None,
                                                                           "skipped": False})
            if self.weights is not None:
                self.weights.check_loaded()
            iterations += 1
        self.plugins.on_train_end(self.context, iteration)
        self.coordinator.close()
        self._report(iterations)

    def _post_weights(self, pending, up_to):
        for step in range(self.next_step, up_to + 1):
            pending.append(self.weights.start_receive(step))
        self.next_step = max(self.next_step, up_to + 1)

    def _finish_weights(self, pending, up_to):
        self._post_weights(pending, up_to)
        while pending and pending[0][0] <= up_to:
            self.weights.finish_receive(pending.pop(0))

    def _build_data(self, iteration):
        consumed = (iteration - 1) * self.args.global_batch_size
        data = build_iterators(self.args, self.parts.dataset_provider, self.parts.tokenizer, 1, consumed)[0]
        return ForwardedBatches(data, self.coordinator, self.instance)

    @torch.no_grad()
    def _forward_microbatches(self, forward_step_func, data_iterator, model):
        """One iteration's forwards, called as a schedule is (so that a tracer can wrap it)."""
        set_input_tensor = get_attr_wrapped_model(self.model, "set_input_tensor")
        config = get_model_config(self.model)
        for microbatch in range(get_num_microbatches()):
            stage_input = None
            if not self.first:
                stage_input = receive(self.instance.chain_group, stage_tensor_shape(self.args), self.args.params_dtype,
                                      parallel_state.get_pipeline_model_parallel_prev_rank(), TAG_ACTIVATION,
                                      self.device, self.instance.messages, microbatch)
            if not self.last:
                set_input_tensor([stage_input])
                if config.timers is not None:  # megatron-core's schedules time their forwards so
                    config.timers("forward-compute").start()
                output, _ = forward_step_func(data_iterator, self.model)
                if config.timers is not None:
                    config.timers("forward-compute").stop()
                self.coordinator.send(self.instance.chain_group, output,
                                      parallel_state.get_pipeline_model_parallel_next_rank(), TAG_ACTIVATION,
                                      microbatch)
            else:  # every forward step reads one batch at the last stage (its labels): read it for the backward
                next(data_iterator)
            if not self.first:
                self._send_stage_input(stage_input, microbatch)

    def _send_stage_input(self, stage_input, microbatch):
        """To each backward instance served: the whole input, or its sequence part when the backward
        instances split the sequence (sequence parallelism) and this one does not."""
        receivers = len(self.instance.link.backward_members)
        parts = [stage_input] * receivers
        if receivers > 1 and self.instance.backward_sequence_parallel:
            parts = stage_input.chunk(receivers, dim=0)
        for link_rank, part in enumerate(parts):
            self.coordinator.send(self.instance.link_group, part, link_rank, TAG_STAGE_INPUT, microbatch)

    def _report(self, iterations):
        weights = (f"weights checked {self.weights.checks} times" if self.weights is not None
                   else "no weights (the last stage runs no forward)")
        self.instance.report_done(f"{iterations} iterations, {weights}, "
                                  f"{self.data_iterator.count if self.data_iterator else 0} batches read and sent",
                                  self.args.device)
