"""torchrun entry for tests/test_megadpp_equivalence.py: train one tiny job from the same start under
megatron-core's static schedule and under DPP schedules, and check on every rank that the losses of
every iteration and the weights at the end agree. Prints one ``DPP-EQUIVALENCE`` line per rank and DPP
schedule; exits 1 on a mismatch.

    torchrun ... tests/helpers/dpp_equivalence_entry.py --entry pretrain_gpt --schedules depth-first,breadth-first:1
        --iterations 10 --schedule-log-prefix DIR/log <pretrain flags, with --use-dpp>
"""

import argparse
import importlib
import sys

import torch.distributed as dist

from bench.dpp_schedules import STATIC, run_schedule, setup
from megadpp.schedule_log import ScheduleLog

LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-4  # of the largest weight: gradients summed over microbatches in another order


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--entry", required=True)
    parser.add_argument("--schedules", required=True)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--schedule-log-prefix", required=True)
    ours, megatron_argv = parser.parse_known_args()
    entry = importlib.import_module(ours.entry)
    job = setup(megatron_argv, entry)
    reference = run_schedule(job, entry, STATIC, ours.iterations)
    failed = False
    for index, spec in enumerate(ours.schedules.split(",")):
        log = ScheduleLog(f"{ours.schedule_log_prefix}-{index}.json")
        run = run_schedule(job, entry, spec, ours.iterations, log)
        log.write()
        loss_diff = max((abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for a, b in zip(run.losses, reference.losses)
                         for k in b), default=0.0)
        same_keys = [sorted(a) for a in run.losses] == [sorted(b) for b in reference.losses]
        weight_diff = float((run.weights - reference.weights).abs().max() / reference.weights.abs().max())
        ok = same_keys and loss_diff <= LOSS_RTOL and weight_diff <= WEIGHT_RTOL
        failed |= not ok
        line = (f"DPP-EQUIVALENCE rank={dist.get_rank()} schedule={spec} iterations={ours.iterations} "
                f"losses={sum(len(x) for x in run.losses)} max_loss_rel_diff={loss_diff:.3e} "
                f"max_weight_rel_diff={weight_diff:.3e} {'OK' if ok else 'MISMATCH'}\n")
        sys.stdout.write(line)  # one write: the ranks share the pipe, print() writes the newline apart
        sys.stdout.flush()
    dist.barrier()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
