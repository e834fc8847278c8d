"""Train the same job from the same start under several pipeline schedules, one after another in one
launch: megatron-core's static schedule and DPP's policies. The equivalence tests
(tests/helpers/dpp_equivalence_entry.py) compare what they compute; bench/dpp_side_by_side.py and
bench/dpp_stress.py compare how long they take and how repeatable they are. A harness, not part of
MegaDPP: it sets the job up through the training loop (``setup_job``) and gives each ``Trainer`` the
schedule to run.

Each schedule gets a freshly built model, optimizer and data iterators (layout-invariant initialization
with --use-cpu-initialization makes them equal), and the delays of --dpp-delay-stage and --dpp-delay-link
(megadpp/fault_injection.py: the same draws for every schedule). Needs --use-dpp
(its transport is shared by the DPP schedules) and no --trace (one trace session per job).
"""

import functools
import gc
import time
from dataclasses import dataclass, field

import torch
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

import megadpp
from megadpp.fault_injection import StaticLinkDelay, install_stage_delay
from megadpp.runtime import DynamicPipelineSchedule
from megatron.training.errors import ArgumentError
from megatron.training.model_setup import setup_model_and_optimizer
from megatron.training.plugins import PluginRegistry
from megatron.training.tokenizer import build_tokenizer
from megatron.training.training import Trainer, build_iterators, setup_job

STATIC = "static"


@dataclass
class ScheduleRun:
    name: str
    losses: list = field(default_factory=list)  # per iteration: {name: float} (last pipeline stage only)
    seconds: list = field(default_factory=list)  # per iteration, this rank's wall time of the train step
    grad_norms: list = field(default_factory=list)  # per iteration (every rank: the norm is global)
    peak_memory_bytes: int = 0  # this rank's peak GPU memory over the run (0 on CPU)
    weights: torch.Tensor = None  # this rank's parameters after the last iteration, flattened


def parse_schedule(spec):
    """``static``, ``<policy>`` or ``<policy>:<activation cap>``."""
    policy, _, cap = spec.partition(":")
    return policy, int(cap) if cap else None


def setup(argv, entry):
    """Set the job up once (process groups, DPP transport) through the real entry point's providers."""
    job = setup_job(argv, prog=entry.__name__, model_provider=entry.model_provider,
                    dataset_provider=entry.dataset_provider, forward_step_func=entry.forward_step)
    if not job.args.use_dpp or job.args.trace:
        raise ArgumentError("side-by-side runs need --use-dpp (for its transport) and no --trace")
    return job


def run_schedule(job, entry, spec, iterations, schedule_log=None, before_iteration=None):
    """``before_iteration(n)``: called before iteration n's clock starts (a competing load switched on or off)."""
    args = job.args
    gc.collect()  # the previous schedule's model and optimizer sit in reference cycles: not in this one's peak
    model, optimizer, scheduler = setup_model_and_optimizer(args, functools.partial(entry.model_provider, args))
    if args.dpp_delay_stage is not None:
        install_stage_delay(model, args)
    iterators = build_iterators(args, entry.dataset_provider, build_tokenizer(args), len(model), 0)
    if spec != STATIC:
        policy, cap = parse_schedule(spec)
        shared = megadpp.PLUGIN.schedule  # the job's DPP schedule: its transport serves every DPP run here
        schedule = DynamicPipelineSchedule(policy, shared.transport, cap or args.dpp_max_inflight, schedule_log,
                                           shared.arrival_delay, shared.stall_timeout)
        link_delay = None  # DPP's receivers hold the slow link's messages back (the plugin's arrival_delay)
    else:
        schedule = get_forward_backward_func()
        link_delay = StaticLinkDelay(args, len(model), get_num_microbatches(),
                                     get_model_config(model[0]).microbatch_group_size_per_vp_stage)
    trainer = Trainer(job.context, PluginRegistry([]), model, optimizer, scheduler,
                      functools.partial(entry.forward_step, args), schedule=schedule)
    run = ScheduleRun(spec)
    on_gpu = torch.cuda.is_available() and args.device == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    if link_delay is not None:
        link_delay.install()
    try:
        for iteration in range(1, iterations + 1):
            if schedule_log is not None:
                schedule_log.iteration = iteration
            if before_iteration is not None:
                before_iteration(iteration)
            start = time.perf_counter()
            losses, grad_norm, _ = trainer.train_step(iterators[0])
            run.losses.append({name: float(value) for name, value in losses.items()})  # float(): waits for the GPU
            run.grad_norms.append(float(grad_norm))
            run.seconds.append(time.perf_counter() - start)
    finally:
        if link_delay is not None:
            link_delay.uninstall()
    run.weights = torch.cat([p.detach().float().flatten() for chunk in model for p in chunk.parameters()])
    if on_gpu:
        run.peak_memory_bytes = torch.cuda.max_memory_allocated()
    return run
