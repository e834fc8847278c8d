"""Cost of MegaScan tracing, side by side in one run: iterations untraced, traced at ``base`` and
traced at ``full``, against iterations of the same job with tracing off.

One process group, one model. Each round runs one iteration in each of four modes, in a rotating
order, every iteration timed between a device synchronize and a barrier:
  off     the MegaScan plugin has no session: what a run without --trace does
  idle    --trace is on but this iteration is outside a trace window
  base    traced at granularity base
  full    traced at granularity full (adds every layer's attention and MLP)
The figure per mode is the median over rounds of mode / off - 1. Traced iterations really are
traced: their windows are written to --trace-dir by the background writer as in a real run.

    torchrun --nproc_per_node N bench/megascan_overhead.py <pretrain_gpt.py flags> --trace \
        --trace-dir DIR --trace-interval 2 --continuous-trace-iterations 1 \
        [--bench-rounds 20] [--bench-json out.json]

"""

import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import megascan  # noqa: E402
import pretrain_gpt  # noqa: E402
from loop_overhead import _synchronized_seconds  # noqa: E402
from megascan.compute_tracer import LayerTracer  # noqa: E402
from megatron.training.errors import exit_on_user_error  # noqa: E402
from megatron.training.initialize import shutdown  # noqa: E402
from megatron.training.training import setup_job  # noqa: E402

MODES = ("off", "idle", "base", "full")


def _bench_args(parser):
    group = parser.add_argument_group("benchmark")
    group.add_argument("--bench-rounds", type=int, default=20, help="iterations per mode")
    group.add_argument("--bench-json", default=None, help="write the figures here (rank 0)")


class ModeRunner:
    """Runs one training iteration in a given mode through the loop's own hooks."""

    def __init__(self, job):
        self.job = job
        self.plugin = megascan.PLUGIN
        self.session = self.plugin.session
        self.all_tracers = list(self.session.switchable)
        self.base_tracers = [t for t in self.all_tracers if not isinstance(t, LayerTracer)]
        self.iteration = 0

    def run(self, mode):
        # With --trace-interval 2 --continuous-trace-iterations 1, even iterations are traced.
        self.iteration += 1
        if (self.iteration % 2 == 0) != (mode in ("base", "full")):
            self.iteration += 1
        self.plugin.session = None if mode == "off" else self.session
        self.session.switchable = self.base_tracers if mode == "base" else self.all_tracers
        job, registry = self.job, self.job.trainer.registry
        registry.call("on_iteration_begin", job.args, self.iteration)
        job.trainer.train_step(job.train_iterator)
        registry.call("on_iteration_end", job.args, self.iteration, {})
        self.plugin.session = self.session


@exit_on_user_error
def main():
    job = setup_job(sys.argv[1:], prog="bench/megascan_overhead.py", model_provider=pretrain_gpt.model_provider,
                    dataset_provider=pretrain_gpt.dataset_provider, forward_step_func=pretrain_gpt.forward_step,
                    extra_args_provider=_bench_args)
    args = job.args
    if not args.trace or args.trace_interval != 2 or args.continuous_trace_iterations != 1:
        sys.exit("bench/megascan_overhead.py: error: run with --trace --trace-interval 2 "
                 "--continuous-trace-iterations 1")
    runner = ModeRunner(job)
    for mode in MODES:  # warm-up: allocator, communicators, the writer's first windows
        _synchronized_seconds(lambda: runner.run(mode), args)
    times = {mode: [] for mode in MODES}
    for round_index in range(args.bench_rounds):
        shift = round_index % len(MODES)
        for mode in MODES[shift:] + MODES[:shift]:
            times[mode].append(_synchronized_seconds(lambda: runner.run(mode), args) * 1000)
    result = {"layout": f"TP{args.tensor_model_parallel_size}xPP{args.pipeline_model_parallel_size}"
                        f"xDP{args.data_parallel_size}", "rounds": args.bench_rounds, "ms": times}
    for mode in MODES[1:]:
        ratios = [t / off - 1 for t, off in zip(times[mode], times["off"])]
        result[mode] = {"median_ms": statistics.median(times[mode]),
                        "overhead_percent": statistics.median(ratios) * 100,
                        "mean_overhead_percent": statistics.mean(ratios) * 100,
                        "std_error_percent": statistics.stdev(ratios) / len(ratios) ** 0.5 * 100}
    megascan.PLUGIN.on_train_end(args, runner.iteration)
    if torch.distributed.get_rank() == 0:
        print(f"megascan overhead {result['layout']}: off {statistics.median(times['off']):.1f} ms/iter; " +
              "; ".join(f"{mode} {result[mode]['median_ms']:.1f} ms ({result[mode]['overhead_percent']:+.2f}% "
                        f"median, {result[mode]['mean_overhead_percent']:+.2f}% mean "
                        f"+- {result[mode]['std_error_percent']:.2f})" for mode in MODES[1:]), flush=True)
        if args.bench_json:
            with open(args.bench_json, "w") as f:
                json.dump(result, f, indent=1)
    shutdown()


if __name__ == "__main__":
    main()
