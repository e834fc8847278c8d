"""The training loop: set up, iterate, evaluate, checkpoint, and call the plugins' hooks.

An entry point (``pretrain_gpt.py``) supplies what is model-specific: how to build a model
chunk, the datasets, and the forward step. Everything a plugin may change goes through the
hooks of ``plugins.PluginRegistry``, which receive the ``RunContext`` the loop owns; this file
knows no plugin.
"""

import functools
import time
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.full_cuda_graph import FullCudaGraphWrapper
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron.training.arguments import parse_args
from megatron.training.checkpointing import load_checkpoint, save_checkpoint, use_checkpoint_vocab_padding
from megatron.training.core_configs import whole_iteration_graph
from megatron.training.cuda_graphs import layers_run_eagerly
from megatron.training.data import build_data_iterators
from megatron.training.flops import training_flops_per_iteration
from megatron.training.fp8_flags import fp8_summary
from megatron.training.garbage_collection import ManualGarbageCollection
from megatron.training.initialize import initialize_megatron, open_launch_store, shutdown
from megatron.training.local_layer_specs import attention_summary
from megatron.training.model_setup import setup_model_and_optimizer, use_fused_adam
from megatron.training.peer_watch import now_doing
from megatron.training.placement import Launch, configuration_at
from megatron.training.plugins import JobParts, PluginRegistry, Schedule
from megatron.training.profiling import build_profiler
from megatron.training.run_context import RunContext
from megatron.training.save_dir.checks import claim_save_dir
from megatron.training.signal_handler import StopSignalAgreement
from megatron.training.tensorboard_log import TensorBoardLog
from megatron.training.tokenizer import build_tokenizer
from megatron.training.training_log import TrainingLog, log_evaluation, print_rank_0
from megatron.training.transfer_trace import TransferTrace
from megatron.training.validate_args import validate_args


@dataclass
class TrainingState:
    """What the loop carries from one iteration to the next (and what a checkpoint restores)."""

    iteration: int = 0
    last_saved_iteration: int = -1


def core_schedule(args):
    """megatron-core's forward-backward schedule for this layout, captured and replayed whole under
    --cuda-graph-scope full_iteration (its data copied into static buffers each iteration first)."""
    schedule = get_forward_backward_func()
    if whole_iteration_graph(args):
        schedule = FullCudaGraphWrapper(schedule, cuda_graph_warmup_steps=args.cuda_graph_warmup_steps)
    return schedule


def reduce_reported_losses(per_microbatch):
    """Average each reported loss over microbatches and data-parallel replicas.

    A forward step reports ``{name: tensor([sum, count])}`` per microbatch; only the last
    pipeline stage has them. One all-reduce per iteration, no host sync.
    """
    if not per_microbatch:
        return {}
    reduced = {}
    for name in per_microbatch[0]:
        total = torch.stack([m[name].float().view(-1) for m in per_microbatch]).sum(dim=0)
        torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
        reduced[name] = total[0] / total[1].clamp(min=1)
    return reduced


class Trainer:
    """Iterates one model and optimizer. ``schedule``: the forward-backward schedule to run (a benchmark
    harness compares several on one job); by default the one a plugin supplies or megatron-core's,
    wrapped by the plugins."""

    def __init__(self, context: RunContext, registry: PluginRegistry, model: list, optimizer, scheduler,
                 forward_step_func, schedule: Schedule | None = None):
        args = context.args
        self.context = context
        self.args = args
        self.registry = registry
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.forward_step_func = forward_step_func
        if schedule is None:
            schedule = registry.wrap_schedule(
                context, registry.forward_backward_func(context, core_schedule(args)))
        self.forward_backward = schedule
        self.flops_per_iteration = training_flops_per_iteration(args, args.padded_vocab_size)
        self.stop_signal = StopSignalAgreement()
        self.profiler = build_profiler(args)  # None unless this rank profiles
        self.tensorboard = TensorBoardLog.for_this_rank(args)  # None unless this rank writes
        self.garbage_collection = ManualGarbageCollection(args)

    def _run_schedule(self, data_iterator, forward_only):
        return self.forward_backward(
            forward_step_func=self.forward_step_func,
            data_iterator=data_iterator,
            model=self.model,
            num_microbatches=get_num_microbatches(),
            seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size,
            decoder_seq_length=self.args.seq_length,
            forward_only=forward_only,
        )

    def train_step(self, data_iterator):
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        per_microbatch = self._run_schedule(data_iterator, forward_only=False)
        succeeded, grad_norm, _ = self.optimizer.step()
        if succeeded:
            self.scheduler.step(increment=1)
        return reduce_reported_losses(per_microbatch), grad_norm, not succeeded

    @torch.no_grad()
    def evaluate(self, data_iterator, iterations):
        for chunk in self.model:
            chunk.eval()
        sums = {}
        with self.garbage_collection.evaluation(), layers_run_eagerly(self.model):
            for _ in range(iterations):
                for name, value in reduce_reported_losses(self._run_schedule(data_iterator, forward_only=True)).items():
                    sums[name] = sums.get(name, 0.0) + value
        for chunk in self.model:
            chunk.train()
        return {name: float(total) / iterations for name, total in sums.items()}

    def save(self, state):
        save_checkpoint(self.args, state.iteration, self.model, self.optimizer, self.scheduler,
                        state.iteration * self.args.global_batch_size)
        state.last_saved_iteration = state.iteration

    def train(self, state: TrainingState, train_iterator, valid_iterator, until: int | None = None) -> bool:
        """Iterate until iteration ``until`` (default --train-iters) or a plugin's ``request_stop``, SIGTERM or
        SIGINT, or --exit-interval; save at the end when --save. Whether training ended as planned: at
        ``until`` or where a plugin asked, not cut short by a signal or --exit-interval."""
        args, context = self.args, self.context
        until = args.train_iters if until is None else until
        log = TrainingLog(args, self.flops_per_iteration, self.tensorboard)
        cut_short = False
        if self.garbage_collection.start():
            print_rank_0(self.garbage_collection.describe())
        while state.iteration < until and context.stop_reason is None:
            now_doing(f"iteration {state.iteration + 1}")  # named if a peer dies meanwhile
            if self.profiler is not None:
                self.profiler.iteration_begin(state.iteration + 1)
            self.registry.on_iteration_begin(context, state.iteration + 1)
            losses, grad_norm, skipped = self.train_step(train_iterator)
            state.iteration += 1
            self.registry.on_iteration_end(context, state.iteration,
                               {"losses": losses, "grad_norm": grad_norm, "skipped": skipped})
            log.record(state.iteration, losses, grad_norm, skipped, self.scheduler.get_lr(
                self.optimizer.param_groups[0]))
            if self.profiler is not None:
                self.profiler.iteration_end(state.iteration)
            self.garbage_collection.after_iteration(state.iteration)
            if valid_iterator is not None and args.eval_iters > 0 and state.iteration % args.eval_interval == 0:
                log_evaluation("validation", state.iteration, self.evaluate(valid_iterator, args.eval_iters),
                               self.tensorboard)
            if args.save and args.save_interval and state.iteration % args.save_interval == 0:
                self.save(state)
            if signal_name := self.stop_signal.any_rank_received():
                print_rank_0(f"{signal_name} received: stopping at iteration {state.iteration}")
                cut_short = True
                break
            if args.exit_interval and state.iteration % args.exit_interval == 0:
                print_rank_0(f"exiting at iteration {state.iteration} (--exit-interval {args.exit_interval})")
                cut_short = True
                break
        now_doing(f"the end of training (after iteration {state.iteration})")
        if args.save and state.last_saved_iteration != state.iteration:
            self.save(state)
        return not cut_short and (state.iteration == until or context.stop_reason is not None)

    def close(self, iteration):
        """Write what the profiler and TensorBoard still hold (a run stopped early included); the garbage collector
        back as it was."""
        self.garbage_collection.stop()
        if self.profiler is not None:
            self.profiler.close(iteration)
        if self.tensorboard is not None:
            self.tensorboard.close()


def build_iterators(args, dataset_provider, tokenizer, num_chunks, consumed_samples):
    """Per model chunk: each chunk that reads data consumes its own stream of microbatches."""
    datasets = dataset_provider(args, tokenizer)
    per_chunk = [build_data_iterators(args, datasets, consumed_samples) for _ in range(num_chunks)]
    train, valid, test = ([chunk[i] for chunk in per_chunk] for i in range(3))
    unwrap = (lambda its: its[0]) if num_chunks == 1 else (lambda its: its)
    return tuple(None if its[0] is None else unwrap(its) for its in (train, valid, test))


@dataclass
class Job:
    """Everything a training run is made of, once set up."""

    context: RunContext
    trainer: Trainer
    state: TrainingState
    train_iterator: object
    valid_iterator: object
    test_iterator: object

    @property
    def args(self):
        """The run's read-only configuration (``context.args``)."""
        return self.context.args


def setup_job(argv, *, prog, model_provider, dataset_provider, forward_step_func, extra_args_provider=None,
              extra_args_check=None):
    """Parse and check flags, start the process groups, build model, optimizer and data, load --load.
    ``extra_args_check(args)`` checks the flags ``extra_args_provider`` added, with the others, before anything
    is built.

    None when a plugin ran this process's whole job instead (MegaFBD's forward instances)."""
    registry = PluginRegistry.discover()
    args = parse_args(argv, prog, registry.add_arguments, extra_args_provider)
    registry.select_enabled(args)
    launch = Launch.from_environment()
    validate_args(args, registry.training_world_size(args, launch.size))
    registry.validate_args(args)
    if extra_args_check is not None:
        extra_args_check(args)
    use_checkpoint_vocab_padding(args)
    tokenizer = build_tokenizer(args)  # before the process group: a bad vocabulary fails at once
    claim_save_dir(args)  # a second job on the same --save is refused before it starts
    placement = registry.placement(args, launch)
    args = configuration_at(args, placement)  # read-only from here on
    start = time.time()
    context = RunContext(args, placement, TransferTrace(), open_launch_store(args))
    initialize_megatron(args, functools.partial(registry.start_process_group, context),
                        context.launch_store)
    parts = JobParts(tokenizer, functools.partial(model_provider, args), dataset_provider,
                     functools.partial(forward_step_func, args), registry)
    if registry.run_process(context, parts):
        shutdown()
        return None
    model, optimizer, scheduler = setup_model_and_optimizer(args, functools.partial(model_provider, args))
    state = TrainingState()
    state.iteration, consumed_samples = load_checkpoint(args, model, optimizer, scheduler)
    if args.device == "cuda":
        use_fused_adam(optimizer)
    print_rank_0(f"setup done in {time.time() - start:.1f} s: {args.world_size} ranks = "
                 f"TP{args.tensor_model_parallel_size} x PP{args.pipeline_model_parallel_size} x "
                 f"DP{args.data_parallel_size} on {args.device}, "
                 f"{sum(p.numel() for chunk in model for p in chunk.parameters()) / 1e6:.2f} M "
                 f"parameters on rank 0, "
                 f"starting at iteration {state.iteration}; attention: {attention_summary(args)}; "
                 f"CUDA graphs: {args.cuda_graph_impl} ({args.cuda_graph_note})"
                 f"{'; layers under torch.compile' if args.compile_transformer_layers else ''}{fp8_summary(args)}")
    registry.after_setup(context, model, optimizer, scheduler)
    iterators = build_iterators(args, dataset_provider, tokenizer, len(model), consumed_samples)
    trainer = Trainer(context, registry, model, optimizer, scheduler, functools.partial(forward_step_func, args))
    return Job(context, trainer, state, *iterators)


def pretrain(argv, **entry_point):
    """Run a whole training job from command-line flags.

    ``entry_point``: prog, model_provider, dataset_provider, forward_step_func (see setup_job)."""
    # No try/finally: tearing the process groups down while a peer still waits in a collective
    # hangs; on an error the process exits and the launcher ends the others.
    job = setup_job(argv, **entry_point)
    if job is None:
        return
    args, trainer, state = job.args, job.trainer, job.state
    finished = trainer.train(state, job.train_iterator, job.valid_iterator)
    if finished and job.test_iterator is not None and args.eval_iters > 0:
        log_evaluation("test", state.iteration, trainer.evaluate(job.test_iterator, args.eval_iters),
                       trainer.tensorboard)
    trainer.close(state.iteration)
    trainer.registry.on_train_end(job.context, state.iteration)
    shutdown(trainer.model)
