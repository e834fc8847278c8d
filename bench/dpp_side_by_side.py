"""Time megatron-core's static schedule against DPP in one launch, on the same job from the same start:
each round trains every schedule for --iterations iterations (a fresh model each time) and the table
gives each schedule's median iteration time over all rounds (the first iteration of a run left out).
Rounds alternate the schedules, so load that other processes put on the machine hits all of them.
With --predict the table adds the simulator's prediction for the same pipeline and delays
(megadpp/prediction.py): its cost solved from the measured static time, or, given the forward time a healthy run
of the same job printed (--prediction-forward-ms), the slow-down of stage S (--prediction-slow-stage S) or, with
--dpp-delay-link, how much of each link delay the static schedule hides behind the kernels its host queued.

A straggler that comes and goes: --load-gpu G --load-iterations A:B runs scripts/gpu_load.py (--load-duty) on this
node's GPU G during iterations A to B-1 of every run, so that every schedule meets it at the same iterations. The
table then gives each schedule's mean iteration (the loaded ones are not outliers here), and --predict solves the
forward time from the static schedule's unloaded iterations and GPU G's slow-down from its loaded ones.

    torchrun --nproc_per_node 4 bench/dpp_side_by_side.py --entry pretrain_gpt --rounds 3 --iterations 6 \
        <pretrain_gpt.py flags with --pipeline-model-parallel-size 4 --use-dpp [--dpp-delay-stage 2 ...]>
"""

import argparse
import importlib
import os
import statistics

import torch
import torch.distributed as dist
from competing_load import start_gpu_load
from dpp_schedules import STATIC, parse_schedule, run_schedule, setup
from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.utils import get_model_config

from megadpp.prediction import predict, predict_transient


class TransientLoad:
    """scripts/gpu_load.py on this node's GPU ``gpu`` during iterations [first, end) of every run, started by the
    rank that trains on that GPU; every rank then waits for it, so that no iteration's clock holds its start-up."""

    def __init__(self, gpu, duty, first, end):
        self.gpu, self.duty, self.first, self.end = gpu, duty, first, end
        self.mine = int(os.environ.get("LOCAL_RANK", "0")) == gpu
        self.process = None

    def loaded(self, iteration):
        return self.first <= iteration < self.end

    def before_iteration(self, iteration):
        if self.mine and iteration == self.first:
            self.process = start_gpu_load(self.gpu, self.duty)
        if iteration == self.end:
            self.stop()
        if iteration in (self.first, self.end):
            dist.barrier()

    def stop(self):
        if self.process is not None:
            self.process.terminate()
            self.process.wait()
            self.process = None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--entry", default="pretrain_gpt")
    parser.add_argument("--schedules", default="static,depth-first,breadth-first")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--predict", action="store_true", help="print the simulator's prediction beside each")
    parser.add_argument("--prediction-forward-ms", type=float, default=None)
    parser.add_argument("--prediction-slow-stage", type=int, default=None)
    parser.add_argument("--load-gpu", type=int, default=None, help="this node's GPU that a competing job slows")
    parser.add_argument("--load-duty", type=float, default=0.5)
    parser.add_argument("--load-iterations", default=None, help="A:B, the load on during iterations A to B-1")
    ours, megatron_argv = parser.parse_known_args()
    specs = ours.schedules.split(",")
    if ours.predict and STATIC not in specs:
        parser.error("--predict needs the static schedule among --schedules (the prediction is solved from it)")
    if ours.prediction_slow_stage is not None and ours.prediction_forward_ms is None:
        parser.error("--prediction-slow-stage needs --prediction-forward-ms (the forward time a healthy run printed)")
    if ours.prediction_forward_ms is not None and ours.prediction_slow_stage is None \
            and "--dpp-delay-link" not in megatron_argv:
        parser.error("--prediction-forward-ms needs --prediction-slow-stage or --dpp-delay-link: with a healthy run's "
                     "forward time the prediction solves a stage's slow-down or how much of a link delay the static "
                     "schedule hides")
    load = None
    if (ours.load_gpu is None) != (ours.load_iterations is None):
        parser.error("--load-gpu and --load-iterations go together")
    if ours.load_gpu is not None:
        if not torch.cuda.is_available():
            parser.error("--load-gpu slows a GPU with scripts/gpu_load.py: run it on GPUs")
        first, _, end = ours.load_iterations.partition(":")
        if not (first.isdigit() and end.isdigit() and 2 <= int(first) < int(end) <= ours.iterations + 1):
            parser.error(f"--load-iterations {ours.load_iterations}: want A:B with 2 <= A < B <= --iterations + 1 "
                         "(the first iteration of a run is left out of the times)")
        load = TransientLoad(ours.load_gpu, ours.load_duty, int(first), int(end))
    entry = importlib.import_module(ours.entry)
    job = setup(megatron_argv, entry)
    seconds = {spec: [] for spec in specs}  # (iteration, seconds) of every run, its first iteration left out
    peaks = dict.fromkeys(specs, 0)  # this rank's peak GPU memory under each schedule (0 on CPU)
    for _ in range(ours.rounds):
        for spec in specs:
            try:
                run = run_schedule(job, entry, spec, ours.iterations,
                                   before_iteration=load.before_iteration if load else None)
            finally:
                if load is not None:
                    load.stop()
            seconds[spec] += list(enumerate(run.seconds, start=1))[1:]
            peaks[spec] = max(peaks[spec], run.peak_memory_bytes)
    stage_peaks = per_stage_peaks(peaks, job.args.pipeline_model_parallel_size)
    slow_stage = loaded_stage(ours.load_gpu) if load else None
    if dist.get_rank() == 0:
        statistic = statistics.mean if load else statistics.median
        times = {spec: statistic([s for _, s in values]) * 1000 for spec, values in seconds.items()}
        found = None
        if ours.predict:
            found = (transient_prediction(job, seconds[STATIC], load, slow_stage) if load
                     else prediction(ours, job, times))
        print_table(times, "mean" if load else "median", stage_peaks, found)
    dist.barrier()


def loaded_stage(gpu):
    """The pipeline stage of the rank that trains on GPU ``gpu`` (DPP on GPUs runs within one node)."""
    mine = (int(os.environ.get("LOCAL_RANK", "0")), parallel_state.get_pipeline_model_parallel_rank())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return next(stage for local, stage in everyone if local == gpu)


def transient_prediction(job, static_seconds, load, slow_stage):
    args, config = job.args, get_model_config(job.trainer.model[0])
    stage_layers = [get_num_layers_to_build(config, pp_rank=r) for r in range(args.pipeline_model_parallel_size)]
    loaded = [s for iteration, s in static_seconds if load.loaded(iteration)]
    healthy = [s for iteration, s in static_seconds if not load.loaded(iteration)]
    found = predict_transient(stage_layers, args.virtual_pipeline_model_parallel_size or 1, get_num_microbatches(),
                              statistics.median(healthy) * 1000, statistics.median(loaded) * 1000,
                              len(loaded) / len(static_seconds), slow_stage)
    print(f"simulator: forward_ms={found.forward_ms:.3f}; stage {slow_stage} loaded: "
          f"x{found.stage_scale[slow_stage]:.2f} during {len(loaded)} of {len(static_seconds)} iterations")
    return found


def prediction(ours, job, medians):
    args, config = job.args, get_model_config(job.trainer.model[0])
    stage_layers = [get_num_layers_to_build(config, pp_rank=r) for r in range(args.pipeline_model_parallel_size)]
    link_delay = None if args.dpp_delay_link is None else (args.dpp_delay_link, args.dpp_delay_ms,
                                                            args.dpp_delay_probability)
    found = predict(stage_layers, args.virtual_pipeline_model_parallel_size or 1, get_num_microbatches(),
                    medians[STATIC], link_delay, ours.prediction_forward_ms, ours.prediction_slow_stage)
    hidden = (f"; the static schedule hides {found.host_overlap:.2f} of a sending action's compute behind each link "
              f"delay" if found.host_overlap is not None else "")
    print(f"simulator: forward_ms={found.forward_ms:.3f} stage scale "
          + " / ".join(f"{s:.2f}" for s in found.stage_scale)
          + f"; no schedule beats {found.bound_ms:.1f} ms (the busiest stage's own compute){hidden}")
    return found


def print_table(times, statistic, stage_peaks, found):
    reference = times.get(STATIC)
    predicted = "| simulator (ms), vs static " if found else ""
    print(f"| schedule | {statistic} iteration (ms) | vs static | peak memory per pipeline stage (GiB) {predicted}|")
    print("|---|---|---|---|" + ("---|" if found else ""))
    for spec, median in times.items():
        ratio = f"{median / reference:.2f}x" if reference else "n/a"
        memory = " / ".join(f"{b / 2**30:.1f}" for b in stage_peaks[spec])
        cell = ""
        if found:
            simulated = found.static_ms if spec == STATIC else found.dpp_ms[parse_schedule(spec)[0]]
            cell = f"| {simulated:.1f}, {simulated / found.static_ms:.2f}x "
        print(f"| {spec} | {median:.1f} | {ratio} | {memory} {cell}|", flush=True)


def per_stage_peaks(peaks, stages):
    """schedule -> the largest peak of each pipeline stage's ranks (gathered from every rank)."""
    mine = (parallel_state.get_pipeline_model_parallel_rank(), peaks)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {spec: [max(p[spec] for stage, p in everyone if stage == s) for s in range(stages)] for spec in peaks}


if __name__ == "__main__":
    main()
