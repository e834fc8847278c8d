"""Time megatron-core's static schedule against DPP in one launch, on the same job from the same start:
each round trains every schedule for --iterations iterations (a fresh model each time) and the table
gives each schedule's median iteration time over all rounds (the first iteration of a run left out).
Rounds alternate the schedules, so load that other processes put on the machine hits all of them.

    torchrun --nproc_per_node 4 bench/dpp_side_by_side.py --entry pretrain_gpt --rounds 3 --iterations 6 \
        <pretrain_gpt.py flags with --pipeline-model-parallel-size 4 --use-dpp [--dpp-delay-stage 2 ...]>
"""

import argparse
import importlib
import statistics
import sys
from pathlib import Path

import torch.distributed as dist
from megatron.core import parallel_state

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megadpp.side_by_side import STATIC, run_schedule, setup  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--entry", default="pretrain_gpt")
    parser.add_argument("--schedules", default="static,depth-first,breadth-first")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=6)
    ours, megatron_argv = parser.parse_known_args()
    entry = importlib.import_module(ours.entry)
    job = setup(megatron_argv, entry)
    specs = ours.schedules.split(",")
    seconds = {spec: [] for spec in specs}
    peaks = dict.fromkeys(specs, 0)  # this rank's peak GPU memory under each schedule (0 on CPU)
    for _ in range(ours.rounds):
        for spec in specs:
            run = run_schedule(job, entry, spec, ours.iterations)
            seconds[spec] += run.seconds[1:]
            peaks[spec] = max(peaks[spec], run.peak_memory_bytes)
    stage_peaks = per_stage_peaks(peaks, job.args.pipeline_model_parallel_size)
    if dist.get_rank() == 0:
        reference = statistics.median(seconds[STATIC]) if STATIC in seconds else None
        print("| schedule | median iteration (ms) | vs static | peak memory per pipeline stage (GiB) |")
        print("|---|---|---|---|")
        for spec, values in seconds.items():
            median = statistics.median(values)
            ratio = f"{median / reference:.2f}x" if reference else "n/a"
            memory = " / ".join(f"{b / 2**30:.1f}" for b in stage_peaks[spec])
            print(f"| {spec} | {median * 1000:.1f} | {ratio} | {memory} |", flush=True)
    dist.barrier()


def per_stage_peaks(peaks, stages):
    """schedule -> the largest peak of each pipeline stage's ranks (gathered from every rank)."""
    mine = (parallel_state.get_pipeline_model_parallel_rank(), peaks)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {spec: [max(p[spec] for stage, p in everyone if stage == s) for s in range(stages)] for spec in peaks}


if __name__ == "__main__":
    main()
