"""Cost of MegatronApp's training loop against a bare loop over megatron-core's schedule.

Both loops drive the same model, optimizer and data iterator in one process group. After a
warm-up, they take turns in pairs (bare then ours, then ours then bare, ...), each turn
--bench-iters iterations timed between a device synchronize and a barrier, so that clock,
thermal and data drift land on both alike. The figure is the median over pairs of
ours / bare - 1, with the interquartile range of those per-pair ratios as its noise.
The bare loop is what any megatron-core user writes: zero the grad buffers, call the
forward-backward function, step the optimizer and scheduler. Ours is ``Trainer.train``: the same
plus plugin hooks, loss reduction across replicas, logging and the SIGTERM agreement.

    torchrun --nproc_per_node N bench/loop_overhead.py <pretrain_gpt.py flags> \
        [--bench-pairs 40] [--bench-iters 1] [--bench-json out.json]

--train-iters must cover the warm-up and all turns: (2 x pairs + 5) x iters.
"""

import json
import statistics
import sys
import time

import torch
from megatron.core.num_microbatches_calculator import get_num_microbatches

import pretrain_gpt
from megatron.training.errors import exit_on_user_error
from megatron.training.initialize import shutdown
from megatron.training.training import setup_job


def _bench_args(parser):
    group = parser.add_argument_group("benchmark")
    group.add_argument("--bench-pairs", type=int, default=40, help="turns of each loop")
    group.add_argument("--bench-iters", type=int, default=1, help="iterations per turn")
    group.add_argument("--bench-json", default=None, help="write the figures here (rank 0)")


def _synchronized_seconds(run, args):
    if args.device == "cuda":
        torch.cuda.synchronize()
    torch.distributed.barrier()
    start = time.perf_counter()
    run()
    if args.device == "cuda":
        torch.cuda.synchronize()
    torch.distributed.barrier()
    return time.perf_counter() - start


def setup_gpt_bench_job(prog, bench_args, check_bench_args=None):
    """The job pretrain_gpt.py would run, with the benchmark's own flags added (and checked by
    ``check_bench_args(args)`` before anything is built)."""
    return setup_job(sys.argv[1:], prog=prog, model_provider=pretrain_gpt.model_provider,
                     dataset_provider=pretrain_gpt.dataset_provider, forward_step_func=pretrain_gpt.forward_step,
                     extra_args_provider=bench_args, extra_args_check=check_bench_args)


def report(args, result, line):
    """Rank 0 prints the benchmark's line and writes its figures to --bench-json."""
    if torch.distributed.get_rank() == 0:
        print(line, flush=True)
        if args.bench_json:
            with open(args.bench_json, "w") as f:
                json.dump(result, f, indent=1)


def bare_loop(job, iterations):
    trainer, args = job.trainer, job.args
    for _ in range(iterations):
        for chunk in trainer.model:
            chunk.zero_grad_buffer()
        trainer.optimizer.zero_grad()
        trainer.forward_backward(
            forward_step_func=trainer.forward_step_func, data_iterator=job.train_iterator,
            model=trainer.model, num_microbatches=get_num_microbatches(), seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length, forward_only=False)
        succeeded, _, _ = trainer.optimizer.step()
        if succeeded:
            trainer.scheduler.step(increment=1)
    job.state.iteration += iterations


def our_loop(job, iterations):
    job.trainer.train(job.state, job.train_iterator, None, until=job.state.iteration + iterations)


@exit_on_user_error
def main():
    job = setup_gpt_bench_job("bench/loop_overhead.py", _bench_args)
    args = job.args
    warmup_turns = 5
    needed = (2 * args.bench_pairs + warmup_turns) * args.bench_iters
    if args.train_iters < needed:
        sys.exit(f"bench/loop_overhead.py: error: --train-iters must be >= {needed} "
                 f"((2 x --bench-pairs + {warmup_turns}) x --bench-iters)")
    loops = {"bare": bare_loop, "ours": our_loop}
    for _ in range(warmup_turns):
        _synchronized_seconds(lambda: bare_loop(job, args.bench_iters), args)
    times = {"bare": [], "ours": []}
    for pair in range(args.bench_pairs):
        for name in (("bare", "ours") if pair % 2 == 0 else ("ours", "bare")):
            seconds = _synchronized_seconds(lambda loop=loops[name]: loop(job, args.bench_iters), args)
            times[name].append(seconds / args.bench_iters * 1000)
    ratios = sorted(ours / bare - 1 for bare, ours in zip(times["bare"], times["ours"]))
    quartiles = statistics.quantiles(ratios, n=4)
    result = {
        "overhead_percent": statistics.median(ratios) * 100,
        "overhead_iqr_percent": [quartiles[0] * 100, quartiles[2] * 100],
        "bare_ms_per_iter": statistics.median(times["bare"]),
        "ours_ms_per_iter": statistics.median(times["ours"]),
        "turn_ms_per_iter": times, "world_size": args.world_size,
        "layout": f"TP{args.tensor_model_parallel_size}xPP{args.pipeline_model_parallel_size}"
                  f"xDP{args.data_parallel_size}",
    }
    report(args, result, f"loop overhead {result['layout']}: bare {result['bare_ms_per_iter']:.1f} ms/iter, "
                         f"ours {result['ours_ms_per_iter']:.1f} ms/iter, overhead {result['overhead_percent']:+.2f}% "
                         f"(interquartile {quartiles[0] * 100:+.2f}% .. {quartiles[2] * 100:+.2f}%, "
                         f"{args.bench_pairs} pairs)")
    shutdown(job.trainer.model)


if __name__ == "__main__":
    main()
