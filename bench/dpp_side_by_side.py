"""Time megatron-core's static schedule against DPP in one launch, on the same job from the same start:
each round trains every schedule for --iterations iterations (a fresh model each time) and the table
gives each schedule's median iteration time over all rounds (the first iteration of a run left out).
Rounds alternate the schedules, so load that other processes put on the machine hits all of them.
With --predict the table adds the simulator's prediction for the same pipeline and delays
(megadpp/prediction.py): its cost solved from the measured static time, or, with --prediction-slow-stage S
and the forward time a healthy run printed (--prediction-forward-ms), the slow-down of stage S.

    torchrun --nproc_per_node 4 bench/dpp_side_by_side.py --entry pretrain_gpt --rounds 3 --iterations 6 \
        <pretrain_gpt.py flags with --pipeline-model-parallel-size 4 --use-dpp [--dpp-delay-stage 2 ...]>
"""

import argparse
import importlib
import statistics

import torch.distributed as dist
from dpp_schedules import STATIC, parse_schedule, run_schedule, setup
from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.utils import get_model_config

from megadpp.prediction import predict


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--entry", default="pretrain_gpt")
    parser.add_argument("--schedules", default="static,depth-first,breadth-first")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--predict", action="store_true", help="print the simulator's prediction beside each")
    parser.add_argument("--prediction-forward-ms", type=float, default=None)
    parser.add_argument("--prediction-slow-stage", type=int, default=None)
    ours, megatron_argv = parser.parse_known_args()
    specs = ours.schedules.split(",")
    if ours.predict and STATIC not in specs:
        parser.error("--predict needs the static schedule among --schedules (the prediction is solved from it)")
    if (ours.prediction_slow_stage is None) != (ours.prediction_forward_ms is None):
        parser.error("--prediction-slow-stage and --prediction-forward-ms go together (the healthy run's forward)")
    entry = importlib.import_module(ours.entry)
    job = setup(megatron_argv, entry)
    seconds = {spec: [] for spec in specs}
    peaks = dict.fromkeys(specs, 0)  # this rank's peak GPU memory under each schedule (0 on CPU)
    for _ in range(ours.rounds):
        for spec in specs:
            run = run_schedule(job, entry, spec, ours.iterations)
            seconds[spec] += run.seconds[1:]
            peaks[spec] = max(peaks[spec], run.peak_memory_bytes)
    stage_peaks = per_stage_peaks(peaks, job.args.pipeline_model_parallel_size)
    if dist.get_rank() == 0:
        medians = {spec: statistics.median(values) * 1000 for spec, values in seconds.items()}
        print_table(medians, stage_peaks, prediction(ours, job, medians) if ours.predict else None)
    dist.barrier()


def prediction(ours, job, medians):
    args, config = job.args, get_model_config(job.trainer.model[0])
    stage_layers = [get_num_layers_to_build(config, pp_rank=r) for r in range(args.pipeline_model_parallel_size)]
    link_delay = None if args.dpp_delay_link is None else (args.dpp_delay_link, args.dpp_delay_ms,
                                                            args.dpp_delay_probability)
    found = predict(stage_layers, args.virtual_pipeline_model_parallel_size or 1, get_num_microbatches(),
                    medians[STATIC], link_delay, ours.prediction_forward_ms, ours.prediction_slow_stage)
    print(f"simulator: forward_ms={found.forward_ms:.3f} stage scale "
          + " / ".join(f"{s:.2f}" for s in found.stage_scale)
          + f"; no schedule beats {found.bound_ms:.1f} ms (the busiest stage's own compute)")
    return found


def print_table(medians, stage_peaks, found):
    reference = medians.get(STATIC)
    predicted = "| simulator (ms), vs static " if found else ""
    print(f"| schedule | median iteration (ms) | vs static | peak memory per pipeline stage (GiB) {predicted}|")
    print("|---|---|---|---|" + ("---|" if found else ""))
    for spec, median in medians.items():
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
