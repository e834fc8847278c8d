"""MegaDPP's launch flags and their checks (run on every rank before any process group exists)."""

import ipaddress

from megadpp.nodes import launch_spans_nodes
from megadpp.policy import POLICIES
from megatron.training.cuda_graphs import graphs_give_way
from megatron.training.errors import ArgumentError
from megatron.training.save_dir.writable import check_new_file_writable


def add_arguments(parser):
    group = parser.add_argument_group("MegaDPP dynamic pipeline schedule")
    group.add_argument("--use-dpp", action="store_true",
                       help="run each pipeline stage's next ready (microbatch, chunk) task instead of a static "
                            "1F1B order (megadpp); needs --pipeline-model-parallel-size 2 or more")
    group.add_argument("--dpp-policy", choices=POLICIES, default="depth-first",
                       help="which ready task runs first: depth-first pushes a microbatch through later chunks "
                            "(less activation memory), breadth-first runs more microbatches on one chunk")
    group.add_argument("--dpp-max-inflight", type=int, default=None,
                       help="most activations a pipeline rank holds for backwards (default: what 1F1B holds there)")
    group.add_argument("--dpp-log-schedule", default=None, metavar="PATH",
                       help="write the actions each rank ran, per iteration, as JSON (torch.distributed.pipelining "
                            "action strings such as '3F0')")
    group.add_argument("--dpp-timeout", type=float, default=None, metavar="SECONDS",
                       help="a pipeline rank that waits this long for a neighbour's message (or for its own send "
                            "to go out) stops the job naming that neighbour and the transfer (default: "
                            "--distributed-timeout-minutes)")
    group.add_argument("--workload", type=int, default=None, metavar="BYTES",
                       help="bytes one copy thread of the shared-memory transport handles (copy parallelism)")
    group.add_argument("--multi-node", action="store_true",
                       help="accepted for compatibility: nodes are told apart from torchrun's environment")
    group.add_argument("--node-ips", default=None,
                       help="accepted for compatibility (comma-separated addresses): derived from torchrun")
    group.add_argument("--dpp-delay-stage", type=int, default=None,
                       help="(testing) pipeline stage whose forwards sleep --dpp-delay-ms, per microbatch "
                            "(any schedule, --device cpu)")
    group.add_argument("--dpp-delay-link", type=int, default=None,
                       help="(testing) transfers sent by this pipeline stage take --dpp-delay-ms longer (any schedule: "
                            "DPP's receiver holds them back, a static schedule's sender waits)")
    group.add_argument("--dpp-delay-ms", type=float, default=30.0,
                       help="(testing) the delay of --dpp-delay-stage / --dpp-delay-link, in milliseconds")
    group.add_argument("--dpp-delay-probability", type=float, default=1.0,
                       help="(testing) share of microbatches that --dpp-delay-stage / --dpp-delay-link delay "
                            "(random, from --seed)")
    group.add_argument("--dpp-jitter-ms", type=float, default=0.0,
                       help="(testing) every DPP transfer arrives late by a random 0..this many milliseconds")


def _require(condition, message):
    if not condition:
        raise ArgumentError(message)


def delays_requested(args):
    return args.dpp_delay_stage is not None or args.dpp_delay_link is not None or args.dpp_jitter_ms > 0


def any_flag_given(args):
    """Whether the plugin has something to do or check: --use-dpp, a delay, or a DPP option to refuse."""
    return (args.use_dpp or delays_requested(args) or args.dpp_max_inflight is not None
            or args.dpp_log_schedule is not None or args.dpp_timeout is not None)


def validate_args(args):
    stages = args.pipeline_model_parallel_size
    if args.use_dpp:
        _require(stages > 1, f"--use-dpp needs --pipeline-model-parallel-size 2 or more (got {stages}): "
                             f"it orders work between pipeline stages")
    else:
        for flag, value in (("--dpp-max-inflight", args.dpp_max_inflight),
                            ("--dpp-log-schedule", args.dpp_log_schedule),
                            ("--dpp-jitter-ms", args.dpp_jitter_ms or None), ("--dpp-timeout", args.dpp_timeout)):
            _require(value is None, f"{flag} acts on the dynamic pipeline schedule: add --use-dpp")
    if args.dpp_log_schedule:
        check_new_file_writable(args.dpp_log_schedule, "--dpp-log-schedule")  # not only at the end of the run
    _require(args.dpp_max_inflight is None or args.dpp_max_inflight >= 1,
             f"--dpp-max-inflight must be at least 1, got {args.dpp_max_inflight}")
    _require(args.dpp_timeout is None or args.dpp_timeout > 0,
             f"--dpp-timeout must be a positive number of seconds, got {args.dpp_timeout}")
    _require(args.workload is None or args.workload > 0,
             f"--workload must be a positive byte count, got {args.workload}")
    if args.node_ips:
        for address in args.node_ips.split(","):
            try:
                ipaddress.ip_address(address.strip())
            except ValueError:
                raise ArgumentError(f"--node-ips: {address.strip()!r} is not an IP address "
                                    f"(expected a comma-separated list such as 10.0.0.1,10.0.0.2)") from None
    # megatron-core makes the pipeline rank the outermost, so on several nodes every pipeline crosses nodes.
    _require(not (args.use_dpp and args.device == "cuda" and launch_spans_nodes(args.node_ips)),
             "--use-dpp on GPUs runs within one node: this launch spans several nodes, and DPP between the GPUs of "
             "different nodes has no transport yet (docs/megadpp.md, \"Across nodes\"); launch the job on one "
             "node, or drop --use-dpp (or use --device cpu)")
    for flag, stage in (("--dpp-delay-stage", args.dpp_delay_stage), ("--dpp-delay-link", args.dpp_delay_link)):
        _require(stage is None or 0 <= stage < stages,
                 f"{flag} {stage} is not a pipeline stage of this job (0..{stages - 1})")
    _require(args.dpp_delay_stage is None or args.device == "cpu",
             "--dpp-delay-stage sleeps on the host and works with --device cpu only")
    _require(args.dpp_delay_ms >= 0 and args.dpp_jitter_ms >= 0,
             "--dpp-delay-ms and --dpp-jitter-ms must not be negative")
    _require(0.0 < args.dpp_delay_probability <= 1.0,
             f"--dpp-delay-probability must be in (0, 1], got {args.dpp_delay_probability}")
    if args.use_dpp:
        # megatron-core's graphed layers replay one graph per microbatch in the order they were captured in;
        # the dynamic schedule runs microbatches in the order they become ready.
        return graphs_give_way(args, "off with --use-dpp",
                               f"--use-dpp runs microbatches in a changing order, which the per-microbatch CUDA "
                               f"graphs of --cuda-graph-impl {args.cuda_graph_impl} cannot follow; drop it")
    return None


def stall_timeout(args):
    """Seconds a DPP wait may last before the awaited neighbour counts as stalled: --dpp-timeout, or the
    job's collective timeout (a static schedule's blocked exchange would fail after that long too)."""
    return args.dpp_timeout if args.dpp_timeout is not None else args.distributed_timeout_minutes * 60.0
