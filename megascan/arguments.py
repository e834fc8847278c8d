"""MegaScan's launch flags and their checks (run on every rank before any process group exists)."""

import glob
import os

from megatron.training.compiled_layers import refuse_compiled_layers
from megatron.training.cuda_graphs import graphs_give_way
from megatron.training.errors import ArgumentError

TRACE_FILE_PATTERN = "benchmark-data-*-pipeline-*-tensor-*.json"


def add_arguments(parser):
    group = parser.add_argument_group("MegaScan tracing")
    group.add_argument("--trace", action="store_true",
                       help="trace every rank's compute and communication (megascan)")
    group.add_argument("--trace-dir", default="trace_output",
                       help="where each rank writes benchmark-data-{dp}-pipeline-{pp}-tensor-{tp}.json")
    group.add_argument("--trace-interval", type=int, default=5,
                       help="trace a window of iterations out of every this many")
    group.add_argument("--continuous-trace-iterations", type=int, default=2,
                       help="consecutive iterations per trace window (the last ones of each interval)")
    group.add_argument("--trace-granularity", choices=("base", "full"), default="full",
                       help="base: iterations, microbatches, optimizer, communication; "
                            "full: also every layer's attention and MLP")
    group.add_argument("--trace-tp-microbatches", type=int, default=None, metavar="N",
                       help="record the tensor-parallel collectives of the forward passes of the last N "
                            "microbatches of each traced iteration and count the rest (each recorded one costs the "
                            "host 10-20 us on a GPU, and TP issues about a hundred per microbatch); 0: record all; "
                            "default: 1 with --device cuda, 0 on CPU")
    group.add_argument("--trace-detect", action="store_true",
                       help="judge each trace window while training runs: rank 0 prints 'MegaScan alert: ...' "
                            "naming a slow or hung rank and why")
    group.add_argument("--trace-detect-exit", action="store_true",
                       help="with --trace-detect: stop training (saving with --save, exit code 0) after the window "
                            "that raised an alert")
    group.add_argument("--trace-detect-hook", default=None, metavar="MODULE:FUNCTION",
                       help="with --trace-detect: call this function on rank 0 with each alert "
                            "(megascan.online_detection.DetectionAlert)")
    group.add_argument("--inject-slowdown-rank", type=int, default=None,
                       help="(testing) make this global rank's layer compute slower, --device cpu only")
    group.add_argument("--inject-slowdown-factor", type=float, default=2.0,
                       help="(testing) how many times slower --inject-slowdown-rank computes")
    group.add_argument("--inject-host-delay-rank", type=int, default=None,
                       help="(testing) this global rank's host sleeps before each microbatch's forward, as slow "
                            "data loading would (its GPU, if any, waits for it: a host-bound rank)")
    group.add_argument("--inject-host-delay-ms", type=float, default=20.0,
                       help="(testing) how long --inject-host-delay-rank sleeps before each microbatch (ms)")
    group.add_argument("--inject-hang-rank", type=int, default=None,
                       help="(testing) this global rank stops itself (SIGSTOP) in --inject-hang-iteration")
    group.add_argument("--inject-hang-iteration", type=int, default=None,
                       help="(testing) the iteration in which --inject-hang-rank stops")


def _require(condition, message):
    if not condition:
        raise ArgumentError(message)


def validate_trace_args(args):
    interval, continuous = args.trace_interval, args.continuous_trace_iterations
    _require(interval >= 1, f"--trace-interval must be at least 1, got {interval}")
    _require(1 <= continuous <= interval,
             f"--continuous-trace-iterations must be between 1 and --trace-interval ({interval}), "
             f"got {continuous}")
    _require(args.trace_tp_microbatches is None or args.trace_tp_microbatches >= 0,
             f"--trace-tp-microbatches must be 0 (record all) or more, got {args.trace_tp_microbatches}")
    _require(interval <= args.train_iters,
             f"--trace-interval {interval} is larger than --train-iters {args.train_iters}: "
             f"no iteration would be traced; lower --trace-interval")
    trace_dir = args.trace_dir
    if os.path.exists(trace_dir):
        _require(os.path.isdir(trace_dir), f"--trace-dir {trace_dir} exists and is not a directory")
        _require(os.access(trace_dir, os.W_OK | os.X_OK), f"--trace-dir {trace_dir} is not writable")
        existing = sorted(glob.glob(os.path.join(trace_dir, TRACE_FILE_PATTERN)))
        _require(not existing,
                 f"--trace-dir {trace_dir} already holds traces of another run "
                 f"({os.path.basename(existing[0]) if existing else ''}); choose an empty directory "
                 f"or move those files away")
    else:
        parent = os.path.dirname(os.path.abspath(trace_dir))
        _require(os.access(_existing_ancestor(parent), os.W_OK),
                 f"--trace-dir {trace_dir} cannot be created (no write access above it)")


def validate_detect_args(args):
    """--trace-detect and its companions (checked whether or not --trace is on: they need it)."""
    for flag, value in (("--trace-detect-exit", args.trace_detect_exit),
                        ("--trace-detect-hook", args.trace_detect_hook)):
        _require(not value or args.trace_detect, f"{flag} needs --trace-detect")
    if not args.trace_detect:
        return
    _require(args.trace, "--trace-detect judges the trace windows: add --trace")
    _require(not getattr(args, "forward_backward_disaggregating", False),
             "--trace-detect judges one torch.distributed world and a MegaFBD run is two; judge its traces "
             "offline with tools/aggregate.py -d")
    if args.trace_detect_hook:
        from megascan.online_detection import load_hook

        try:
            load_hook(args.trace_detect_hook)
        except ValueError as error:
            raise ArgumentError(f"--trace-detect-hook {args.trace_detect_hook}: {error}") from None


def compose_with_cuda_graphs(args):
    """Granularity ``full`` times each layer's halves from Python; a CUDA-graphed layer replays as one
    launch that no Python hook sees. Graphs that were only the default give way (the start-up log says
    so): the values validation normalises, else None; graphs the user asked for with full tracing are
    refused in one line."""
    if not (args.trace and args.trace_granularity == "full"):
        return None
    refuse_compiled_layers(args, "--trace-granularity full times every layer's halves from Python")
    return graphs_give_way(args, "off: MegaScan --trace-granularity full times every layer from Python",
                           f"--trace-granularity full times every layer, which --cuda-graph-impl "
                           f"{args.cuda_graph_impl} replays as one launch; use --trace-granularity base or drop the "
                           f"CUDA graphs")


def _existing_ancestor(path):
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def fault_injection_requested(args):
    return any(rank is not None for rank in (args.inject_slowdown_rank, args.inject_host_delay_rank,
                                             args.inject_hang_rank))


def validate_fault_injection_args(args):
    for flag, rank in (("--inject-slowdown-rank", args.inject_slowdown_rank),
                       ("--inject-hang-rank", args.inject_hang_rank)):
        if rank is not None:
            _require(0 <= rank < args.world_size,
                     f"{flag} {rank} is not a rank of this job (0..{args.world_size - 1})")
            _require(args.device == "cpu",
                     f"{flag} acts on the host and works with --device cpu only; "
                     f"on GPUs slow one down with scripts/gpu_load.py")
            refuse_compiled_layers(args, f"{flag} acts from hooks inside the layers")
    rank = args.inject_host_delay_rank
    if rank is not None:  # a real host delay on a GPU job too: the host is what it slows
        _require(0 <= rank < args.world_size,
                 f"--inject-host-delay-rank {rank} is not a rank of this job (0..{args.world_size - 1})")
    factor = args.inject_slowdown_factor
    _require(factor >= 1.0, f"--inject-slowdown-factor must be at least 1, got {factor}")
    delay = args.inject_host_delay_ms
    _require(delay > 0, f"--inject-host-delay-ms must be positive, got {delay}")
    if args.inject_hang_rank is not None:
        iteration = args.inject_hang_iteration
        _require(iteration is not None and 1 <= iteration <= args.train_iters,
                 f"--inject-hang-rank needs --inject-hang-iteration between 1 and --train-iters "
                 f"({args.train_iters}), got {iteration}")
