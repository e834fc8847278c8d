"""The training schedule of a backward instance.

Per microbatch, in order: take the stage input from the forward partner (the hidden states, except at
the first stage, and whatever the stage's forward step reads from its data iterator: the token batch
at the first stage, labels and loss mask at the last; ``ReceivedBatches`` stands in for the data
iterator, so the backward instances read no data in training), recompute the stage's forward with
gradients (megatron-core's ``forward_step``: loss scaling and averaging as in every megatron-core
schedule), take the output gradient from the next stage's
backward instance (the last stage computes the loss itself), run the backward
(megatron-core's ``backward_step``) and hand the input gradient to the coordinator for the previous
stage's backward instance. Only one microbatch's activations are alive at a time. Gradients are
reduced over the backward instances' data-parallel group only (megatron-core's
``finalize_model_grads``, as after every schedule). Evaluation (``forward_only``) is the backward
instances' own business: megatron-core's schedule over their world.
"""

import contextlib

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.schedules import backward_step, deallocate_output_tensor, forward_step
from megatron.core.utils import get_model_config, get_model_type

from megafbd.batch_transfer import ReceivedBatches
from megafbd.coordinator import TAG_INPUT_GRAD, TAG_STAGE_INPUT, receive


def stage_tensor_shape(args):
    """Shape of the hidden states between stages on this instance (sequence-split with sequence parallelism)."""
    split = args.tensor_model_parallel_size if args.sequence_parallel else 1
    return (args.seq_length // split, args.micro_batch_size, args.hidden_size)


class BackwardSchedule:
    def __init__(self, args, instance, coordinator):
        self.args = args
        self.instance = instance
        self.coordinator = coordinator
        self.evaluation_schedule = get_forward_backward_func()
        self.batches = ReceivedBatches(instance, pin_memory=args.device == "cuda")

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches, forward_only=False,
                 **schedule_kwargs):
        if forward_only:
            return self.evaluation_schedule(forward_step_func=forward_step_func, data_iterator=data_iterator,
                                            model=model, num_microbatches=num_microbatches, forward_only=True,
                                            **schedule_kwargs)
        chunk = model[0] if isinstance(model, list) else model
        config = get_model_config(chunk)
        first = parallel_state.is_pipeline_first_stage()
        last = parallel_state.is_pipeline_last_stage()
        device = torch.device(torch.cuda.current_device()) if self.args.device == "cuda" else torch.device("cpu")
        no_sync = config.no_sync_func or contextlib.nullcontext
        reported, total_tokens = [], torch.zeros([], dtype=torch.int, device=device)
        for microbatch in range(num_microbatches):
            # The last microbatch's backward starts the gradient reduction (as in megatron-core's schedules).
            with no_sync() if microbatch < num_microbatches - 1 else contextlib.nullcontext():
                stage_input = None if first else self._receive_stage_input(device, microbatch)
                output, tokens = forward_step(
                    forward_step_func, self.batches, chunk, num_microbatches, stage_input, reported, config,
                    parallel_state.get_context_parallel_world_size(), is_first_microbatch=microbatch == 0,
                    current_microbatch=microbatch, is_last_stage=last)
                total_tokens += tokens
                output_grad = None
                if not last:  # nobody reads this output: the forward instance sent the next stage its own
                    deallocate_output_tensor(output, config.deallocate_pipeline_outputs)
                    output_grad = self._receive_output_grad(device, microbatch)
                input_grad = backward_step(stage_input, output, output_grad, get_model_type(chunk), config)
                if not first:
                    self.coordinator.send(self.instance.chain_group, input_grad,
                                          parallel_state.get_pipeline_model_parallel_prev_rank(), TAG_INPUT_GRAD,
                                          microbatch)
        if config.finalize_model_grads_func is not None:
            config.finalize_model_grads_func([chunk], total_tokens if config.calculate_per_token_loss else None)
        return reported

    def _receive_stage_input(self, device, microbatch):
        stage_input = receive(self.instance.link_group, stage_tensor_shape(self.args), self.args.params_dtype,
                              self.instance.link.forward_link_rank, TAG_STAGE_INPUT, device, self.instance.messages,
                              microbatch)
        return stage_input.requires_grad_()

    def _receive_output_grad(self, device, microbatch):
        return receive(self.instance.chain_group, stage_tensor_shape(self.args), self.args.params_dtype,
                       parallel_state.get_pipeline_model_parallel_next_rank(), TAG_INPUT_GRAD, device,
                       self.instance.messages, microbatch)
