"""Repeat DPP against megatron-core's static schedule on one job, many times, and compare every iteration:
the check that a dynamic schedule over an asynchronous transport computes the same numbers every time
(a race between copies and compute shows only now and then: docs/megadpp.md, "CUDA IPC").

One launch trains the job once under the static schedule (the reference), then --repetitions times under
each DPP policy, each time from the same start (a fresh model: layout-invariant initialization), with
random delays on every transfer (--dpp-jitter-ms: new draws each repetition), and --static-repetitions
more times under the static schedule: how far the static schedule is from itself on this machine (GPU
kernels are not all deterministic) is the floor the DPP differences are read against. Every rank
compares each iteration's grad norm, and the last pipeline stage each loss, with the reference's. Prints
one line per run (rank 0) and a summary line ``DPP-STRESS ... largest_rel_diff=... static_floor=...
OK|MISMATCH``; exits 1 on a DPP difference beyond --rtol.

    torchrun --nproc_per_node 4 bench/dpp_stress.py --repetitions 20 --iterations 10 \
        <pretrain_gpt.py flags with --pipeline-model-parallel-size N --use-dpp --dpp-jitter-ms 2>

bench/gpu_megadpp.sh runs it on GPUs at PP2 x DP2, PP4 and PP4 with a virtual pipeline.
"""

import argparse
import importlib
import sys
import time

import torch
import torch.distributed as dist
from dpp_schedules import STATIC, run_schedule, setup

from megadpp.policy import POLICIES


def relative_differences(run, reference):
    """Per iteration, the largest relative difference of the grad norm and of each reported loss."""
    diffs = []
    for losses, norm, ref_losses, ref_norm in zip(run.losses, run.grad_norms, reference.losses, reference.grad_norms):
        if sorted(losses) != sorted(ref_losses):
            return [float("inf")]
        pairs = [(norm, ref_norm)] + [(losses[k], ref_losses[k]) for k in ref_losses]
        diffs.append(max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs))
    return diffs


def largest_over_ranks(value):
    tensor = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entry", default="pretrain_gpt")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--repetitions", type=int, default=20, help="DPP runs per policy")
    parser.add_argument("--static-repetitions", type=int, default=2, help="static runs compared with the first")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--rtol", type=float, default=1e-3)
    ours, megatron_argv = parser.parse_known_args()
    entry = importlib.import_module(ours.entry)
    job = setup(megatron_argv, entry)
    reference = run_schedule(job, entry, STATIC, ours.iterations)
    largest = {STATIC: 0.0, "dpp": 0.0}
    runs = 0
    plan = [(r, STATIC) for r in range(ours.static_repetitions)]
    plan += [(r, policy) for r in range(ours.repetitions) for policy in ours.policies.split(",")]
    for repetition, schedule in plan:
        started = time.perf_counter()
        worst = largest_over_ranks(max(relative_differences(run_schedule(job, entry, schedule, ours.iterations),
                                                            reference)))
        kind = STATIC if schedule == STATIC else "dpp"
        largest[kind] = max(largest[kind], worst)
        runs += kind == "dpp"
        if dist.get_rank() == 0:
            print(f"repetition {repetition + 1} {schedule}: largest relative difference {worst:.3e} over "
                  f"{ours.iterations} iterations ({time.perf_counter() - started:.1f} s)", flush=True)
    ok = largest["dpp"] <= ours.rtol
    if dist.get_rank() == 0:
        print(f"DPP-STRESS runs={runs} iterations={ours.iterations} largest_rel_diff={largest['dpp']:.3e} "
              f"static_floor={largest[STATIC]:.3e} rtol={ours.rtol:g} {'OK' if ok else 'MISMATCH'}", flush=True)
    dist.barrier()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
