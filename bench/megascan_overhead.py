"""Cost of MegaScan tracing, side by side in one run: whole trace intervals with tracing off, at
granularity ``base`` and at ``full``.

One process group, one model. Each round runs one interval of --trace-interval iterations per
mode, in a rotating order; in a traced interval the last --continuous-trace-iterations iterations
are traced exactly as in a real run. Every iteration is timed between a device synchronize and a
barrier, and after a traced interval the time until the background writer has written its window
is added to it (an upper bound: in a real run that work overlaps the next, untraced iterations).
The figures per mode: the median over rounds of interval / off interval - 1 (the cost of tracing
averaged over the interval), and the same for the traced iterations alone and for the untraced
iterations of traced intervals (which must cost nothing); the medians of single iterations pooled
over rounds; the host time to issue the schedule (well below the iteration's time: the GPUs set
the pace; close to it: the host does, or a full launch queue held it back); and the
training thread's CPU time per iteration, which a host-bound job's step time follows but which
waits behind the other rank or a descheduled thread do not blur (waits for the GPU may: the CUDA
driver can spin while it blocks a launch or a synchronize), also put per event and op that a traced
iteration records (each takes two marks: the figure to set against the cost of a mark); and each rank's
time in Python's garbage collector per interval (--manual-gc, applied as the training loop applies it,
takes it out).

    torchrun --nproc_per_node N bench/megascan_overhead.py <pretrain_gpt.py flags> --trace \
        --trace-dir DIR [--trace-interval 5 --continuous-trace-iterations 2] \
        [--bench-rounds 10] [--bench-json out.json] [--bench-modes off,base]

A job traced at ``base`` alone (``--bench-modes off,base --trace-granularity base``) keeps the CUDA graphs that a
real ``base``-traced job keeps (on by default at TP1 and PP1 on a GPU); with ``full`` among the modes the job runs as
a ``full``-traced one would, without them, in every mode.

Several runs of one job pool with ``python bench/megascan_overhead_pool.py out1.json out2.json ...``.
"""

import argparse
import gc
import statistics
import time

import torch
from loop_overhead import _synchronized_seconds, report, setup_gpt_bench_job
from overhead_rounds import off_iteration_ms, ratios, round_ratios, single_iterations_ms, summary

import megascan
from megascan.layer_tracer import LayerTracer
from megascan.session import is_traced
from megatron.training.errors import ArgumentError, exit_on_user_error
from megatron.training.initialize import shutdown
from megatron.training.training import Trainer

MODES = ("off", "base", "full")


def _modes(text):
    """--bench-modes as a tuple in MODES' order; anything but 'off' and one or both of the others is refused while
    the flags are parsed (one line, before any model is built)."""
    chosen = set(text.split(","))
    if "off" not in chosen or len(chosen) < 2 or not chosen <= set(MODES):
        raise argparse.ArgumentTypeError(f"{text!r}: give 'off' and one or both of 'base' and 'full'")
    return tuple(mode for mode in MODES if mode in chosen)


def _bench_args(parser):
    group = parser.add_argument_group("benchmark")
    group.add_argument("--bench-rounds", type=int, default=10, help="intervals per mode")
    group.add_argument("--bench-json", default=None, help="write the figures here (rank 0)")
    group.add_argument("--bench-modes", type=_modes, default=MODES,
                       help="the modes to rotate, comma-separated: 'off' and one or both of 'base' and 'full' "
                            "(fewer modes: more rounds of each in the same time)")


class CollectorPauses:
    """Time this process spent in Python's garbage collector, and its full collections (gc.callbacks). A full
    collection walks every object of a process holding a model: milliseconds to tens of them, at a moment of
    its own on each rank, unless --manual-gc sets it."""

    def __init__(self):
        self.seconds, self.full, self._began = 0.0, 0, None
        gc.callbacks.append(self._phase)

    def _phase(self, phase, info):
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self.full += info["generation"] == 2
            self._began = None


def _host_timed(schedule, seconds):
    def timed_schedule(**kwargs):
        started = time.perf_counter()
        try:
            return schedule(**kwargs)
        finally:
            seconds[0] += time.perf_counter() - started

    return timed_schedule


class IntervalRunner:
    """Runs one trace interval in a given mode through the training loop's own hooks."""

    def __init__(self, job):
        self.job = job
        self.plugin = megascan.PLUGIN
        self.session = self.plugin.session
        self.all_tracers = list(self.session.switchable)
        self.base_tracers = [t for t in self.all_tracers if not isinstance(t, LayerTracer)]
        self.iteration = 0
        # Host time to issue the schedule (the wrapper adds to the list's one number). Only a time well
        # below the iteration's says the GPUs set the pace: a launch queue full of about a thousand
        # kernels blocks the host too, so a GPU-bound job may also issue in nearly its iteration time.
        self.schedule_host_seconds = [0.0]
        trainer = job.trainer
        self.trainer = Trainer(job.context, trainer.registry, trainer.model, trainer.optimizer, trainer.scheduler,
                               trainer.forward_step_func,
                               schedule=_host_timed(trainer.forward_backward, self.schedule_host_seconds))
        # Events and ops of the windows handed to the writer: what a traced iteration records, so that
        # its added CPU time can be put per record (two marks each, plus the Python around them).
        self.records = [0]
        submit = self.session.writer.submit

        def counted_submit(window, complete):
            self.records[0] += len(window.events) + len(window.ops)
            submit(window, complete)

        self.session.writer.submit = counted_submit
        self.collector = CollectorPauses()
        self.trainer.garbage_collection.start()  # --manual-gc, as Trainer.train would

    def _iteration(self, cpu_seconds):
        job, registry = self.job, self.trainer.registry
        self.iteration += 1
        started = time.thread_time()
        registry.on_iteration_begin(job.context, self.iteration)
        self.trainer.train_step(job.train_iterator)
        registry.on_iteration_end(job.context, self.iteration, {})
        self.trainer.garbage_collection.after_iteration(self.iteration)
        cpu_seconds.append(time.thread_time() - started)

    def run(self, mode):
        """{"traced": [ms...], "untraced": [ms...], "traced_cpu": [ms...], "untraced_cpu": [ms...],
        "drain": ms, "schedule_host": ms, "records": per traced iteration} of one interval."""
        args = self.job.args
        self.plugin.session = None if mode == "off" else self.session
        self.session.switchable = self.base_tracers if mode == "base" else self.all_tracers
        times = {"traced": [], "untraced": [], "traced_cpu": [], "untraced_cpu": []}
        self.schedule_host_seconds[0] = self.records[0] = 0
        gc_seconds, full_collections = self.collector.seconds, self.collector.full
        for _ in range(args.trace_interval):
            kind = "traced" if is_traced(self.iteration + 1, args.trace_interval,
                                         args.continuous_trace_iterations) else "untraced"
            cpu_seconds = []
            seconds = _synchronized_seconds(lambda cpu_seconds=cpu_seconds: self._iteration(cpu_seconds), args)
            times[kind].append(seconds * 1000)
            times[f"{kind}_cpu"].append(cpu_seconds[0] * 1000)
        started = time.perf_counter()
        self.session.writer.drain()
        times["drain"] = (time.perf_counter() - started) * 1000
        times["schedule_host"] = self.schedule_host_seconds[0] * 1000 / args.trace_interval
        times["records"] = self.records[0] / args.continuous_trace_iterations
        times["gc_ms"] = (self.collector.seconds - gc_seconds) * 1000
        times["full_collections"] = self.collector.full - full_collections
        self.plugin.session = self.session
        return times


def _percent(figure):
    if figure is None:
        return "n/a"
    error = figure["std_error_percent"]
    return f"{figure['median_percent']:+.2f}%" + ("" if error is None else f" (SE {error:.2f})")


def _mode_summary(mode, figures):
    return (f"{mode}: interval {_percent(figures['interval'])}, traced iterations "
            f"{_percent(figures['traced_iterations'])}, untraced {_percent(figures['untraced_iterations'])}, "
            f"training-thread CPU traced {_percent(figures['traced_cpu'])}, untraced "
            f"{_percent(figures['untraced_cpu'])} ({figures['records_per_traced_iteration']:.0f} events and ops a "
            f"traced iteration, {figures['added_cpu_us_per_record']:.1f} us CPU each), writer drain "
            f"{figures['writer_drain_ms']:.1f} ms; single "
            "iterations: " + ", ".join(f"{statistic} {kind} {value:+.2f}%"
                                       for statistic, values in figures["pooled_iteration_percent"].items()
                                       for kind, value in values.items()))


def _lower_decile(values):
    return statistics.quantiles(values, n=10)[0] if len(values) > 1 else values[0]


# Single iterations pooled over rounds: a host-bound job's iterations spread by 10-30 %, in slow
# stretches of a few seconds that hit every mode (outliers up to +40 % move means and interval
# sums). The median iteration moves less, and the lower decile measures the fast stretches alone.
_POOLED = {"median": statistics.median, "lower decile": _lower_decile}


def _collector_by_rank(runs):
    """{mode: {"gc_ms", "full_collections"}: per interval, each rank's mean over rounds, ranks in order}: the
    rank that collects sets everyone's step in a synchronous job."""
    own = {mode: [statistics.mean(r[key] for r in rounds) for key in ("gc_ms", "full_collections")]
           for mode, rounds in runs.items()}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, own)
    return {mode: {"gc_ms": [rank[mode][0] for rank in gathered],
                   "full_collections": [rank[mode][1] for rank in gathered]} for mode in runs}


def _collector_summary(collector):
    return "garbage collector per interval, most of any rank: " + ", ".join(
        f"{mode} {max(figures['gc_ms']):.1f} ms ({max(figures['full_collections']):.1f} full)"
        for mode, figures in collector.items())


def _check_bench_args(args):
    """The flags the benchmark cannot time, refused before the job is built."""
    if not args.trace:
        raise ArgumentError("run with --trace (the modes switch it off and on)")
    modes = args.bench_modes
    if "full" in modes and args.trace_granularity != "full":
        # At base the layers are not traced at all: a 'full' interval would time base tracing again.
        raise ArgumentError(f"--bench-modes {','.join(modes)} times 'full', which needs --trace-granularity full "
                            f"(its default); or give --bench-modes off,base")
    needed = (args.bench_rounds + 1) * len(modes) * args.trace_interval  # with one warm-up interval per mode
    if needed > args.train_iters:  # the data loader holds --train-iters iterations' batches, no more
        raise ArgumentError(f"--bench-rounds {args.bench_rounds} runs {needed} iterations ({len(modes)} modes, "
                            f"--trace-interval {args.trace_interval}, a warm-up interval each), more than the "
                            f"--train-iters {args.train_iters} the data is drawn for; raise --train-iters to {needed}")


@exit_on_user_error
def main():
    job = setup_gpt_bench_job("bench/megascan_overhead.py", _bench_args, _check_bench_args)
    args = job.args
    modes = args.bench_modes
    runner = IntervalRunner(job)
    for mode in modes:  # warm-up: allocator, communicators, the writer's first window
        runner.run(mode)
    runs = {mode: [] for mode in modes}
    for round_index in range(args.bench_rounds):
        shift = round_index % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            runs[mode].append(runner.run(mode))
    off_iteration = off_iteration_ms(runs["off"])
    off_cpu = [statistics.mean(r["traced_cpu"] + r["untraced_cpu"]) for r in runs["off"]]
    kinds = ("traced", "untraced") if runs["off"][0]["untraced"] else ("traced",)
    off_pooled = single_iterations_ms(runs["off"])
    result = {"layout": f"TP{args.tensor_model_parallel_size}xPP{args.pipeline_model_parallel_size}"
                        f"xDP{args.data_parallel_size}",
              "model": f"{args.num_layers} layers, hidden {args.hidden_size}, sequence {args.seq_length}, micro batch "
                       f"{args.micro_batch_size}, global batch {args.global_batch_size}",
              "cuda_graphs": args.cuda_graph_impl,
              "rounds": args.bench_rounds,
              "interval": args.trace_interval, "continuous": args.continuous_trace_iterations, "runs": runs,
              "off_ms_per_iteration": statistics.median(off_iteration),
              "off_cpu_ms_per_iteration": statistics.median(off_cpu),
              "schedule_host_ms": {mode: statistics.median(r["schedule_host"] for r in runs[mode]) for mode in modes},
              "collector": _collector_by_rank(runs)}
    for mode in modes[1:]:
        def relative(kind, reference, mode=mode):
            return summary(ratios([statistics.mean(r[kind]) for r in runs[mode]], reference))
        figures = round_ratios(runs, mode)
        result[mode] = {"interval": summary(figures["interval"]),
                        "traced_iterations": summary(figures["traced"]),
                        "untraced_iterations": summary(figures["untraced"]) if "untraced" in figures else None,
                        "traced_cpu": relative("traced_cpu", off_cpu),
                        "untraced_cpu": relative("untraced_cpu", off_cpu) if "untraced" in kinds else None,
                        "writer_drain_ms": statistics.median(r["drain"] for r in runs[mode]),
                        "records_per_traced_iteration": statistics.median(r["records"] for r in runs[mode]),
                        "added_cpu_us_per_record": statistics.median(
                            (statistics.mean(r["traced_cpu"]) - off) * 1000 / r["records"]
                            for r, off in zip(runs[mode], off_cpu)),
                        "pooled_iteration_percent": {
                            statistic: {kind: (pooled([t for r in runs[mode] for t in r[kind]]) / pooled(off_pooled)
                                               - 1) * 100 for kind in kinds}
                            for statistic, pooled in _POOLED.items()}}
    megascan.PLUGIN.on_train_end(job.context, runner.iteration)
    report(args, result, f"megascan overhead {result['layout']} (interval {args.trace_interval}, "
                         f"{args.continuous_trace_iterations} traced): off {result['off_ms_per_iteration']:.1f} "
                         f"ms/iter (schedule issued in {result['schedule_host_ms']['off']:.1f} ms on the host, "
                         f"training thread on CPU {result['off_cpu_ms_per_iteration']:.1f} ms); "
                         + "; ".join(_mode_summary(mode, result[mode]) for mode in modes[1:])
                         + "; " + _collector_summary(result["collector"]))
    shutdown(job.trainer.model)


if __name__ == "__main__":
    main()
